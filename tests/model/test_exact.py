"""Exact factorised messages equal the dense S @ Q' they replace, for every scaling."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from model import engine, exact
from model.config import InferenceConfig, ModelConfig
from model.engine import Network
from model.exact import messages
from model.ratings import LineIndex, Ratings
from model.scorers import build_scorer, predict_distributions
from tests.model.test_gram import adjusted_cosine


def _graph(seed: int = 0, n: int = 9, m: int = 7, k: int = 25, d: int = 4, p: int = 3):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    a = engine.lift(engine.normalize_rows(rng.normal(size=(n, d))))
    b = engine.lift(engine.normalize_rows(rng.normal(size=(m, d))))
    pairs = rng.choice(n * m, size=k, replace=False)
    rows, cols = pairs // m, pairs % m
    q_prime = rng.random((k, p))
    return a, b, rows, cols, q_prime


def _random_network(rng, cfg):  # type: ignore[no-untyped-def]
    """A Network with random embeddings and decoder."""
    d = cfg.embedding_dim
    return Network(
        cfg,
        rng.normal(size=(cfg.n_users, d)),
        rng.normal(size=(cfg.n_items, d)),
        rng.normal(size=(cfg.n_levels, d, d)),
    )


def _exact(**kernel: Any) -> InferenceConfig:
    """`exact` with the given kernel settings and the CRF weights (`tau`, `gamma`) of the model unless set."""
    crf = {k: kernel.pop(k) for k in ("gamma", "tau", "layers") if k in kernel}
    return InferenceConfig.from_dict({"mode": "exact", "crf": crf, "kernel": kernel})


def _predict(network: Network, known: Ratings, rows, cols, inference: InferenceConfig):  # type: ignore[no-untyped-def]
    return predict_distributions(network, build_scorer(network, known, inference), rows, cols)


def _lines(same_user: float, same_item: float, rows, cols, n: int, m: int) -> exact.Lines:  # type: ignore[no-untyped-def]
    """Line terms over known entries (rows, cols) of an n x m matrix (their values play no part)."""
    return exact.Lines(same_user, same_item, Ratings(rows, cols, np.ones(len(rows)), n, m))


def test_lifted_inner_product_is_the_scaled_cosine() -> None:
    rng = np.random.default_rng(3)
    unit = engine.normalize_rows(rng.normal(size=(6, 5)))
    a = engine.lift(unit)
    np.testing.assert_allclose(a @ a.T, (1 + unit @ unit.T) / 2, atol=1e-14)


@pytest.mark.parametrize("node_chunk", [exact.NODE_CHUNK, 1, 5])
@pytest.mark.parametrize("scaling", ["sum", "scaled", "normalized"])
def test_factorised_messages_equal_dense(
    scaling: str, node_chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # node_chunk: the aggregates summed over chunks of whole users (ml-10m's 7.5 M known entries)
    monkeypatch.setattr(exact.messages, "NODE_CHUNK", node_chunk)
    a, b, rows, cols, q_prime = _graph()
    graph = exact.FactorizedGraph(a, b, rows, cols)
    g, h = graph.aggregate(q_prime), graph.total()
    got = exact.scaled_messages(g, h, scaling, 0.3, a, b, rows, cols)
    want = _dense_messages(exact.dense_similarity(a, b, rows, cols), q_prime, scaling, 0.3)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_clamped_sums_equal_the_graphs_aggregate_and_total(monkeypatch: pytest.MonkeyPatch) -> None:
    # What an online batch adds to and takes from the field: its entries' sums, clamped to their labels.
    a, b, rows, cols, _ = _graph(seed=4)
    rng = np.random.default_rng(4)
    labels = rng.integers(0, 3, len(rows))
    compat = rng.random((3, 3))
    graph = exact.FactorizedGraph(a, b, rows, cols)
    sums = exact.clamped_sums(a, b, rows, cols, labels, compat)
    np.testing.assert_allclose(sums[:-1], graph.aggregate(compat[labels]), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(sums[-1], graph.total(), rtol=1e-12, atol=1e-12)
    # Weighted entries (a batch's old terms at -1 beside its new ones), also taken a few rows at a time.
    weights = rng.choice([-1.0, 1.0, 0.5], len(rows))
    weighted = exact.FactorizedGraph(a, b, rows, cols).aggregate(weights[:, None] * compat[labels])
    for chunk in (4096, 2):
        monkeypatch.setattr(messages, "CLAMPED_CHUNK_ROWS", chunk)
        got = exact.clamped_sums(a, b, rows, cols, labels, compat, weights)
        np.testing.assert_allclose(got[:-1], weighted, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(got[-1], (a[rows] * weights[:, None]).T @ b[cols], rtol=1e-12, atol=1e-12)


def _dense_messages(s: np.ndarray, q_prime: np.ndarray, scaling: str, scale: float) -> np.ndarray:
    """The messages of a dense similarity matrix s under a scaling (`exact.scaled_messages`' definition)."""
    want: np.ndarray = s @ q_prime
    if scaling == "scaled":
        return want * scale
    if scaling == "normalized":
        return want / s.sum(axis=1, keepdims=True)
    return want


def test_messages_to_entries_outside_the_graph_equal_dense() -> None:
    a, b, rows, cols, q_prime = _graph(seed=1)
    g = exact.FactorizedGraph(a, b, rows, cols).aggregate(q_prime)
    qr, qc = np.array([0, 8, 3]), np.array([6, 0, 3])
    got = exact.read_messages(g, a, b, qr, qc)
    s = (a[qr] @ a[rows].T) * (b[qc] @ b[cols].T)  # (3, K)
    np.testing.assert_allclose(got, s @ q_prime, rtol=1e-12)


def test_known_field_iterations_match_dense_mean_field() -> None:
    a, b, rows, cols, _ = _graph(seed=2)
    rng = np.random.default_rng(2)
    levels = np.array([1.0, 2.0, 3.0])
    compat = engine.compatibility_matrix(levels, 12.0)
    probs = rng.dirichlet(np.ones(3), size=len(rows))
    s = exact.dense_similarity(a, b, rows, cols)
    for scaling, dense_s in (("sum", s), ("normalized", s / s.sum(axis=1, keepdims=True))):
        field = exact.known_field(
            a, b, rows, cols, probs, np.zeros(len(rows), int), compat, 0.1, 4, scaling, 1.0, "predicted"
        )
        q_dense = engine.mean_field(probs, dense_s, compat, 0.1, 4)
        g_dense = exact.FactorizedGraph(a, b, rows, cols).aggregate(q_dense @ compat.T)
        np.testing.assert_allclose(field.g, g_dense, rtol=1e-10, atol=1e-12)


def test_clamped_known_entries_send_their_observed_labels() -> None:
    a, b, rows, cols, _ = _graph(seed=4)
    compat = engine.compatibility_matrix(np.array([1.0, 2.0, 3.0]), 12.0)
    labels = np.arange(len(rows)) % 3
    field = exact.known_field(
        a, b, rows, cols, np.full((len(rows), 3), 1 / 3), labels, compat, 0.1, 5, "normalized", 1.0, "clamped"
    )
    qr, qc = np.array([1]), np.array([2])
    s = (a[qr] @ a[rows].T) * (b[qc] @ b[cols].T)
    want = (s @ compat[labels]) / s.sum()
    np.testing.assert_allclose(
        exact.scaled_messages(field.g, field.h, "normalized", 1.0, a, b, qr, qc), want, rtol=1e-12
    )


def test_torch_factorised_messages_agree_with_numpy_and_dense() -> None:
    import torch

    from model.network import factorized_messages, lift

    rng = np.random.default_rng(5)
    u, v = rng.normal(size=(20, 6)), rng.normal(size=(20, 6))
    q_prime = rng.random((20, 4))
    got = factorized_messages(lift(torch.tensor(u)), lift(torch.tensor(v)), torch.tensor(q_prime)).numpy()
    a, b = engine.lift(engine.normalize_rows(u)), engine.lift(engine.normalize_rows(v))
    k = np.arange(20)
    np.testing.assert_allclose(got, exact.dense_similarity(a, b, k, k) @ q_prime, rtol=1e-10)
    g = exact.FactorizedGraph(a, b, k, k).aggregate(q_prime)
    np.testing.assert_allclose(got, exact.read_messages(g, a, b, k, k), rtol=1e-10)


def test_normalized_training_messages_match_numpy() -> None:
    import torch

    from model.network import mean_field

    rng = np.random.default_rng(6)
    probs = rng.dirichlet(np.ones(3), size=8)
    unit = engine.normalize_rows(rng.normal(size=(8, 3)))
    sim = (1 + unit @ unit.T) / 2
    compat = engine.compatibility_matrix(np.array([1.0, 2.0, 3.0]), 12.0)
    want = engine.mean_field(probs, sim / sim.sum(axis=1, keepdims=True), compat, 0.5, 3)
    got = mean_field(
        torch.tensor(np.log(probs)), torch.tensor(sim), torch.tensor(compat), 0.5, 3, normalized=True
    )
    np.testing.assert_allclose(got.exp().numpy(), want, atol=1e-12)


def test_exact_inference_tau_override_equals_a_dense_clamped_update() -> None:
    # A query attached to clamped known entries: Q = softmax(log P - gamma * sum_l s C[y_l] / sum_l s),
    # with C truncated at the overriding tau, not at the model's.
    rng = np.random.default_rng(3)
    n, m, d = 6, 7, 4
    levels = np.arange(1.0, 11.0)
    cfg = ModelConfig(n_users=n, n_items=m, levels=tuple(levels), hidden=(8, d), tau=4.0, gamma=0.2)
    rows, cols = np.nonzero(rng.random((n, m)) < 0.5)
    values = rng.integers(1, 11, len(rows)).astype(float)
    network, known = _random_network(rng, cfg), Ratings(rows, cols, values, n, m)
    q_rows, q_cols = np.array([0, 3, 5]), np.array([1, 2, 6])
    a, b = engine.lift(network.user_unit), engine.lift(network.item_unit)
    for tau in (None, 50.0, 1e9):  # 1e9: untruncated, the anchor levels' interpolation
        inference = _exact(scaling="normalized", known="clamped", tau=tau)
        got = _predict(network, known, q_rows, q_cols, inference)
        compat = engine.compatibility_matrix(levels, cfg.tau if tau is None else tau)
        s = (a[q_rows] @ a[rows].T) * (b[q_cols] @ b[cols].T)
        msg = (s @ compat[engine.nearest_level(values, levels)]) / s.sum(axis=1, keepdims=True)
        want = engine.softmax(np.log(network.probabilities(q_rows, q_cols)) - cfg.gamma * msg)
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    default = _exact(scaling="normalized", known="clamped")
    untruncated = _exact(scaling="normalized", known="clamped", tau=1e9)
    assert not np.allclose(
        _predict(network, known, q_rows, q_cols, default),
        _predict(network, known, q_rows, q_cols, untruncated),
    )


def test_three_levels_determine_every_level_of_an_untruncated_field() -> None:
    # Irregular levels, like YahooMusic's 69 of 1..100: with C[u, v] = (L_u - L_v)^2, G_u is quadratic in L_u.
    rng = np.random.default_rng(8)
    levels = np.sort(rng.choice(np.arange(1, 101), 12, replace=False)).astype(float)
    compat = engine.compatibility_matrix(levels, 1e9)
    a, b, rows, cols, _ = _graph(seed=8)
    probs = rng.dirichlet(np.ones(12), size=len(rows))
    lines = _lines(2.0, 0.5, rows, cols, len(a), len(b))
    labels = np.zeros(len(rows), dtype=np.int64)
    field = exact.known_field(
        a, b, rows, cols, probs, labels, compat, 0.01, 3, "normalized", 1.0, "predicted", lines
    )
    interp = field.interp
    assert interp is not None and len(interp.anchors) == 3
    rebuilt = np.einsum("us,sde->ude", interp.weights, field.g[interp.anchors])
    np.testing.assert_allclose(rebuilt, field.g, rtol=1e-10, atol=1e-10 * np.abs(field.g).max())
    full = exact.KnownField(g=field.g, h=field.h, scaling=field.scaling, scale=field.scale, t=field.t)
    q_rows, q_cols = np.array([0, 0, 4, 8]), np.array([1, 5, 2, 6])
    q_probs = rng.dirichlet(np.ones(12), size=4)
    np.testing.assert_allclose(
        exact.query_distributions(field, a, b, q_rows, q_cols, q_probs, 0.01, lines),
        exact.query_distributions(full, a, b, q_rows, q_cols, q_probs, 0.01, lines),
        rtol=1e-10,
        atol=1e-14,
    )
    # A truncated compatibility, or three levels or fewer, reads every level.
    assert exact.LevelInterpolation.of(engine.compatibility_matrix(levels, 100.0)) is None
    assert exact.LevelInterpolation.of(engine.compatibility_matrix(levels[:3], 1e9)) is None


def _line_kernel(a, b, rows, cols, q_rows, q_cols, same_user, same_item):  # type: ignore[no-untyped-def]
    """s'(k, l) = s_r s_c + lambda_u [i = i'] s_c + lambda_i [j = j'] s_r, queries x nodes, densely."""
    s_r, s_c = a[q_rows] @ a[rows].T, b[q_cols] @ b[cols].T
    same_row, same_col = q_rows[:, None] == rows[None, :], q_cols[:, None] == cols[None, :]
    return s_r * s_c + same_user * same_row * s_c + same_item * same_col * s_r


@pytest.mark.parametrize("scaling", ["sum", "scaled", "normalized"])
def test_same_user_and_same_item_terms_equal_the_dense_kernel(scaling: str) -> None:
    # 6 x 5 matrix, 14 known entries: rows and columns hold several entries each; user 5 and item 4 none.
    a, b, rows, cols, q_prime = _graph(seed=7, n=6, m=5, k=14)
    rows, cols = np.where(rows == 5, 0, rows), np.where(cols == 4, 1, cols)
    lines = _lines(2.0, 0.5, rows, cols, 6, 5)
    graph = exact.FactorizedGraph(a, b, rows, cols)
    g, h = graph.aggregate(q_prime), graph.total()
    # Several users' queries, and one user's (the same-user term read with the field's vectors).
    for q_rows, q_cols in [
        (np.array([0, 5, 2, 0, 3]), np.array([1, 4, 3, 2, 4])),
        (np.zeros(5, int), np.arange(5)),
    ]:
        got = exact.scaled_messages(g, h, scaling, 0.3, a, b, q_rows, q_cols, lines, q_prime)
        s = _line_kernel(a, b, rows, cols, q_rows, q_cols, 2.0, 0.5)
        np.testing.assert_allclose(got, _dense_messages(s, q_prime, scaling, 0.3), rtol=1e-12, atol=1e-12)
    # Without weights the terms vanish: the model's own kernel.
    off = exact.Lines(0.0, 0.0, lines.known)
    np.testing.assert_allclose(
        exact.scaled_messages(g, h, scaling, 0.3, a, b, q_rows, q_cols, off, q_prime),
        exact.scaled_messages(g, h, scaling, 0.3, a, b, q_rows, q_cols),
        rtol=1e-12,
    )


@pytest.mark.parametrize("known", ["predicted", "clamped"])
@pytest.mark.parametrize(
    ("co_rating", "co_user", "prior"),
    [(0.0, 0.0, 0.0), (2.0, 0.0, 0.0), (2.0, 0.0, 0.7), (0.0, 1.5, 0.0), (2.0, 1.5, 0.7)],
)
@pytest.mark.parametrize("few_users", [exact.FEW_USERS, 0])
@pytest.mark.parametrize("queries", ["entries", "catalogue", "catalogue in order"])
def test_exact_inference_with_line_terms_equals_dense_mean_field(
    known: str,
    co_rating: float,
    co_user: float,
    prior: float,
    few_users: int,
    queries: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # few_users 0: every read takes the batched path, and the co-rating sums go pair by pair over several
    # chunks of queries; otherwise user by user. `catalogue`: one user's queries over every item (a
    # top-N), which read whole tables: the column terms in one pass over the known entries (an item
    # without ratings among them), the item table by rows, the decoder and field over every item.
    # The batched path also takes its other chunks here (as on ml-10m's millions of entries): the field's
    # nodes, the queries' reads and the line terms' members a few at a time; and sparse co-rating tables
    # (holding every neighbour: the dense tables' values). "catalogue in order": every item, in order,
    # whose arrays over the catalogue are the answer without a gather.
    catalogue = queries != "entries"
    monkeypatch.setattr(exact.messages, "FEW_USERS", few_users)
    monkeypatch.setattr(exact.messages, "PAIR_CHUNK", 5)
    if few_users == 0:
        monkeypatch.setattr(exact.messages, "NODE_CHUNK", 4)
        monkeypatch.setattr(exact.messages, "QUERY_CHUNK", 2)
        monkeypatch.setattr(exact.messages, "MEMBER_CHUNK", 5)
        monkeypatch.setattr(exact.affinity, "DENSE_TABLE_MAX", 2)
        monkeypatch.setattr(exact.gram, "GRAM_BLAS_LINES", 0)
        monkeypatch.setattr(exact.affinity, "CO_RATING_NEIGHBOURS", 10)
    rng = np.random.default_rng(11)
    n, m, d = 7, 6, 3
    levels = np.array([1.0, 2.0, 3.0, 4.0])
    cfg = ModelConfig(n_users=n, n_items=m, levels=tuple(levels), hidden=(8, d), gamma=0.3, mf_layers=3)
    rows, cols = np.nonzero(rng.random((n, m)) < 0.5)
    values = rng.integers(1, 5, len(rows)).astype(float)
    if catalogue:
        rows, cols, values = rows[cols != 4], cols[cols != 4], values[cols != 4]
    network, ratings = _random_network(rng, cfg), Ratings(rows, cols, values, n, m)
    inference = _exact(
        scaling="normalized",
        known=known,
        same_user=3.0,
        same_item=1.5,
        co_rating=co_rating,
        co_rating_user=co_user,
        co_rating_prior=prior,
        co_rating_shrink=3.0,
    )
    q_rows, q_cols = np.array([0, 6, 2]), np.array([5, 0, 2])
    if queries == "catalogue":
        q_rows, q_cols = np.full(m + 1, 2), np.array([3, *range(m)])
    elif queries == "catalogue in order":
        q_rows, q_cols = np.full(m, 2), np.arange(m)
    elif few_users:  # one user's item with more known entries than a quarter of the users: the column
        q_rows, q_cols = np.array([2]), np.array([5])  # terms gather a weight per entry (`Lines.messages`)
        assert 4 * (cols == 5).sum() > n and 4 * (cols == 5).sum() <= len(rows)
    scorer = build_scorer(network, ratings, inference)
    assert isinstance(scorer, exact.ExactScorer)
    got = predict_distributions(network, scorer, q_rows, q_cols)
    # Without the network's probabilities the scorer takes its own; one user's (the catalogue) are read
    # in the same pass as the messages, from the unit embeddings and their norms, over the whole
    # catalogue in float32 (`engine.catalogue_products`): equal to about 1e-6.
    tol = {"rtol": 2e-5, "atol": 1e-7} if catalogue else {"rtol": 1e-10, "atol": 1e-13}
    np.testing.assert_allclose(scorer.predict(q_rows, q_cols), got, **tol)
    a, b, compat = scorer.user_lifted, scorer.item_lifted, scorer.compat
    np.testing.assert_allclose(a, engine.lift(network.user_unit))
    np.testing.assert_array_equal(compat, engine.compatibility_matrix(levels, cfg.tau))
    q, shrink = inference.kernel.co_rating_power, inference.kernel.co_rating_shrink
    w = adjusted_cosine(rows, cols, values, n, m, q, shrink)
    w_users = adjusted_cosine(cols, rows, values, m, n, q, shrink)  # the roles swapped
    z_prior = (co_rating + co_user) * prior

    def kernel(k_rows, k_cols):  # type: ignore[no-untyped-def]
        same_row = k_rows[:, None] == rows[None, :]
        same_col = k_cols[:, None] == cols[None, :]
        co = co_rating * same_row * w[k_cols][:, cols] + co_user * same_col * w_users[k_rows][:, rows]
        return _line_kernel(a, b, rows, cols, k_rows, k_cols, 3.0, 1.5) + co

    if known == "clamped":
        q_known = np.eye(len(levels))[engine.nearest_level(values, levels)]
    else:
        # The pseudo-count joins the normaliser alone: c x lambda_r more weight that sends nothing.
        s_known = kernel(rows, cols)
        z_known = s_known.sum(axis=1, keepdims=True) + z_prior
        known_probs = network.probabilities(rows, cols)
        q_known = engine.mean_field(known_probs, s_known / z_known, compat, 0.3, 3)
    s = kernel(q_rows, q_cols)
    msg = (s @ (q_known @ compat.T)) / (s.sum(axis=1, keepdims=True) + z_prior)
    want = engine.softmax(np.log(network.probabilities(q_rows, q_cols)) - 0.3 * msg)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    offs = [{"same_user": 0.0}, {"co_rating": 0.0 if co_rating else 1.0}]
    offs += [{"co_rating_user": 0.0 if co_user else 1.0}] + ([{"co_rating_prior": 0.0}] if prior else [])
    offs += [{"co_rating_shrink": 10.0}] if co_rating or co_user else []
    for off in offs if catalogue or not few_users else ():  # (one query moves too little for allclose)
        changed = inference.with_overrides({f"kernel.{k}": v for k, v in off.items()})
        assert not np.allclose(got, _predict(network, ratings, q_rows, q_cols, changed))


@pytest.mark.parametrize("queries_per_line", [1, 40])
@pytest.mark.parametrize("way", ["pairs", "lines"])
def test_line_sums_equal_dense_by_pairs_and_by_line_aggregates(
    queries_per_line: int, way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Per (query, member) pair or line by line through per-line aggregates, whichever the costs pick:
    # both ways forced here, for one query per line (a request's items) and many sharing a line (one
    # user's test entries). Each must equal the dense sum.
    monkeypatch.setattr(exact.messages, "LINE_LOOP_COST", 10**12 if way == "pairs" else 0)
    monkeypatch.setattr(exact.messages, "LINE_BLAS_SPEEDUP", 1 if way == "pairs" else 10**12)
    rng = np.random.default_rng(12)
    n, m, d = 5, 60, 4
    table = engine.lift(engine.normalize_rows(rng.normal(size=(m, d))))
    rows = np.repeat(np.arange(n), [30, 0, 12, 5, 13])
    cols = np.concatenate([rng.choice(m, c, replace=False) for c in (30, 0, 12, 5, 13)])
    weights = rng.random((len(rows), 3))
    q_rows = np.repeat([0, 1, 2, 4], queries_per_line)
    q_cols = rng.integers(0, m, len(q_rows))
    index = LineIndex(rows, n)
    got = exact.line_messages(index, table, cols, weights, q_rows, table[q_cols], with_total=True)
    s = (q_rows[:, None] == rows[None, :]) * (table[q_cols] @ table[cols].T)
    np.testing.assert_allclose(got[:, :3], s @ weights, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got[:, 3], s.sum(axis=1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n_users", [1, 3, exact.FEW_USERS + 20])
def test_per_level_reads_agree_user_by_user_and_batched(n_users: int) -> None:
    # Up to FEW_USERS distinct users the reads go user by user, beyond through one batched einsum; one
    # user's 60 queries over 30 items read the whole table, a few of them its rows.
    rng = np.random.default_rng(13)
    d, p, k = 5, 4, 60
    user_emb, item_emb = rng.normal(size=(n_users, d)), rng.normal(size=(30, d))
    bilinear, g = rng.normal(size=(p, d, d)), rng.normal(size=(p, d + 1, d + 1))
    rows, cols = rng.integers(0, n_users, k), rng.integers(0, 30, k)
    scores = np.einsum("kd,pde,ke->kp", user_emb[rows], bilinear, item_emb[cols])
    np.testing.assert_allclose(
        engine.label_probabilities(user_emb, item_emb, bilinear, rows, cols),
        engine.softmax(scores),
        rtol=1e-12,
    )
    a, b = engine.lift(engine.normalize_rows(user_emb)), engine.lift(engine.normalize_rows(item_emb))
    want = np.einsum("ki,uij,kj->ku", a[rows], g, b[cols])
    np.testing.assert_allclose(exact.read_messages(g, a, b, rows, cols), want, rtol=1e-12, atol=1e-12)
    few = slice(0, 5)
    np.testing.assert_allclose(
        exact.read_messages(g, a, b, rows[few], cols[few]), want[few], rtol=1e-12, atol=1e-12
    )
    np.testing.assert_allclose(
        engine.label_probabilities(user_emb, item_emb, bilinear, rows[few], cols[few]),
        engine.softmax(scores[few]),
        rtol=1e-12,
    )


def test_segment_sums_allow_empty_segments_and_keep_small_sums_exact() -> None:
    # A running total would lose the 1 + 3 behind 1e17 (float spacing 16 there).
    x = np.array([[1e17, 1.0], [1.0, 0.0], [3.0, 0.5], [2.0, 0.25]])
    got = exact.messages._segment_sums(x, np.array([1, 0, 2, 1, 0]))
    np.testing.assert_array_equal(got, [[1e17, 1.0], [0.0, 0.0], [4.0, 0.5], [2.0, 0.25], [0.0, 0.0]])


@pytest.mark.parametrize("p", [1, 5, 10])
def test_softmax_and_log_softmax_of_rows_of_few_levels_equal_the_reduction_along_the_axis(p: int) -> None:
    logits = np.random.default_rng(p).normal(scale=20.0, size=(1000, p))
    z = logits - logits.max(axis=-1, keepdims=True)
    want = np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(engine.softmax(logits), want, rtol=1e-13, atol=0)
    np.testing.assert_allclose(engine.log_softmax(logits), np.log(want), rtol=1e-12, atol=1e-12)
    batched = np.random.default_rng(0).normal(size=(3, 4, p))  # (B, K, p): along the last axis
    np.testing.assert_allclose(engine.softmax(batched).sum(axis=-1), 1.0)
    np.testing.assert_allclose(np.exp(engine.log_softmax(batched)), engine.softmax(batched), rtol=1e-12)
    written = logits.copy()
    assert engine.softmax_inplace(written) is written
    np.testing.assert_allclose(written, want, rtol=1e-13, atol=0)


def test_the_posterior_of_decoder_scores_floors_the_levels_far_below_the_others() -> None:
    # Rows whose scores span less than the floor skip the log-softmax (a shift the softmax ignores); rows
    # with a level far below the others take the floor, and the messages can lift that level again.
    rng = np.random.default_rng(3)
    scores = rng.normal(scale=3.0, size=(200, 5))
    msg = rng.random((200, 5))
    scores[:20, 0] -= 200.0
    msg[:20, 0] = -100.0  # 0.7 x 100 = 70 nats back: the floor decides that level's weight
    want = engine.softmax(np.maximum(engine.log_softmax(scores), np.log(1e-30)) - 0.7 * msg)
    got = exact.posterior(scores.copy(), msg, 0.7)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-300)
    assert got[:20, 0].min() > 0.01  # without the floor e^-200 would leave that level nothing


def test_the_catalogue_posterior_equals_the_posterior_to_float32_exponentials() -> None:
    # One user's whole catalogue: level by level, from read-only (and here strided) inputs, exponentials in
    # float32; the floored rows as `posterior` writes them.
    rng = np.random.default_rng(4)
    read = rng.normal(scale=3.0, size=(500, 8))
    scores, msg = read[:, 3:], rng.random((500, 5))
    scores[:20, 0] -= 200.0
    msg[:20, 0] = -100.0
    before = read.copy()
    want = exact.posterior(np.array(scores), msg, 0.7)
    got = exact.catalogue_posterior(scores, msg, 0.7, np.arange(500))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(got.sum(axis=1), 1.0, rtol=1e-12)
    np.testing.assert_array_equal(read, before)  # the inputs are not written
    assert got[:20, 0].min() > 0.01
    # Only the candidates are checked for the floor: one left out keeps its unfloored level.
    unfloored = exact.catalogue_posterior(scores, msg, 0.7, np.arange(1, 500))
    assert unfloored[0, 0] < 1e-40 < got[0, 0]


def test_in_order_is_every_index_once_in_order() -> None:
    assert engine.in_order(np.arange(5), 5) and engine.in_order(np.arange(0), 0)
    assert not engine.in_order(np.arange(5), 6)
    assert not engine.in_order(np.array([0, 2, 1, 3, 4]), 5)
    assert not engine.in_order(np.array([0, 1, 1, 3, 4]), 5)
    assert not engine.in_order(np.array([1, 2, 3, 4, 5]), 5)


def test_scorers_from_shared_parts_share_the_clamped_entries_item_ordered_copy() -> None:
    # A search builds one scorer per trial from the same parts: the clamped entries' per-label matrix of
    # the catalogue read is built once, and the scorers' answers equal those of a scorer without parts.
    rng = np.random.default_rng(5)
    n, m, d = 9, 7, 3
    levels = np.array([1.0, 2.0, 3.0, 4.0])
    cfg = ModelConfig(n_users=n, n_items=m, levels=tuple(levels), hidden=(8, d), gamma=0.3, mf_layers=3)
    rows, cols = np.nonzero(rng.random((n, m)) < 0.6)
    network = _random_network(rng, cfg)
    ratings = Ratings(rows, cols, rng.integers(1, 5, len(rows)).astype(float), n, m)
    parts = exact.ExactParts(network, ratings)
    q_rows, q_cols = np.full(m, 2), np.arange(m)  # one user's catalogue: the column pass
    scorers = []
    for tau in (1.0, 4.0):
        inference = _exact(scaling="normalized", known="clamped", same_item=1.5, tau=tau)
        shared = build_scorer(network, ratings, inference, parts=parts)
        alone = build_scorer(network, ratings, inference)
        assert isinstance(shared, exact.ExactScorer) and isinstance(alone, exact.ExactScorer)
        np.testing.assert_allclose(shared.predict(q_rows, q_cols), alone.predict(q_rows, q_cols), rtol=1e-12)
        scorers.append(shared)
    first, second = (s.field.columns for s in scorers)
    assert first is not None and second is not None and first.by_label is second.by_label


@pytest.mark.parametrize("scale", [1.0, 40.0])
def test_one_users_catalogue_floors_the_levels_the_network_all_but_rules_out(scale: float) -> None:
    # Item embeddings scaled up spread a query's decoder scores over more than the floor's 69 nats: those
    # items' levels far below the others are floored (1e-30), as when the network's probabilities are
    # given, and the rest skip the log-softmax. scale 1: nothing floored, the same answer either way.
    rng = np.random.default_rng(8)
    n, m = 6, 40
    levels = (1.0, 2.0, 3.0, 4.0, 5.0)
    cfg = ModelConfig(n_users=n, n_items=m, levels=levels, hidden=(8, 4), gamma=0.5, mf_layers=2)
    base = _random_network(rng, cfg)
    items = base.item_emb * np.where(np.arange(m) % 3 == 0, scale, 1.0)[:, None]
    network = Network(cfg, base.user_emb, items, base.bilinear)
    rows, cols = np.nonzero(rng.random((n, m)) < 0.3)
    ratings = Ratings(rows, cols, rng.integers(1, 6, len(rows)).astype(float), n, m)
    scorer = build_scorer(network, ratings, _exact(scaling="normalized", known="clamped", same_item=2.0))
    q_rows, q_cols = np.full(m, 1), np.arange(m)
    probs = network.probabilities(q_rows, q_cols)
    assert (probs < 1e-30).any() == (scale > 1)
    want = predict_distributions(network, scorer, q_rows, q_cols)  # log(max(probs, 1e-30))
    # Relative to each level's own size, the floored ones included (float32 products: about 1e-6 a nat).
    np.testing.assert_allclose(scorer.predict(q_rows, q_cols), want, rtol=1e-4, atol=0)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_user_similarities_are_the_lifted_rows_products(dtype: type) -> None:
    rng = np.random.default_rng(12)
    cfg = ModelConfig(n_users=30, n_items=5, levels=(1.0, 2.0, 3.0), hidden=(8, 6))
    base = _random_network(rng, cfg)
    network = Network(
        cfg, (base.user_emb * rng.uniform(0.1, 10.0, (30, 1))).astype(dtype), base.item_emb, base.bilinear
    )
    a = network.user_lifted
    tol = 1e-12 if dtype == np.float64 else 1e-6
    for user in (0, 17):
        np.testing.assert_allclose(network.user_similarities(user), a @ a[user], rtol=0, atol=tol)


def test_a_dense_table_grown_past_the_limit_becomes_sparse(monkeypatch: pytest.MonkeyPatch) -> None:
    # New users arriving online grow the user table: past DENSE_TABLE_MAX lines it keeps each line's
    # strongest pairs (and their mirror images) instead of size^2 numbers.
    monkeypatch.setattr(exact.affinity, "DENSE_TABLE_MAX", 12)
    monkeypatch.setattr(exact.affinity, "CO_RATING_NEIGHBOURS", 3)
    rng = np.random.default_rng(2)
    w = rng.random((10, 10)) - 0.3
    table = np.maximum((w + w.T) / 2, 0.0)
    dense = exact.DenseAffinity(table)
    assert isinstance(dense.grown(12), exact.DenseAffinity)  # within the limit: still dense
    sparse = dense.grown(14)
    assert isinstance(sparse, exact.SparseAffinity) and len(sparse) == 14
    got = sparse.toarray()
    np.testing.assert_array_equal(got, got.T)
    assert not got[10:].any()  # the new lines have no neighbours yet
    for line in range(10):
        strongest = np.sort(table[line])[-3:]
        kept = got[line][got[line] > 0]
        assert set(strongest[strongest > 0]) <= set(kept)  # its own strongest, plus mirrored ones
        np.testing.assert_array_equal(got[line, :10][got[line, :10] > 0], table[line][got[line, :10] > 0])
    # and it takes fresh lines as any sparse table does
    fresh = np.zeros((1, 14))
    fresh[0, [1, 2]] = [0.9, 0.4]
    again = sparse.with_lines(np.array([12]), fresh).toarray()
    assert again[12, 1] == again[1, 12] == 0.9


def test_column_major_changes_equal_a_rebuilt_by_label_form(monkeypatch: pytest.MonkeyPatch) -> None:
    # The clamped column-major form follows the known ratings by signed change matrices (merged as they
    # grow, rebuilt past CHANGES_REBUILT): every column's per-label sums equal those of one built afresh.
    monkeypatch.setattr("model.ratings.COMPACT_SLACK", 0)
    rng = np.random.default_rng(5)
    n, m, levels = 25, 12, np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    compat = rng.random((5, 5))
    rows, cols = np.nonzero(rng.random((n, m)) < 0.3)
    known = Ratings(rows, cols, rng.integers(1, 6, len(rows)).astype(float), n, m)
    columns = messages.ColumnMajor.clamped(known, known.labels(levels), compat)
    rebuilt_once = False
    for step in range(60):
        grow_n, grow_m = n + step // 20, m + step // 30  # users and items added now and then
        users = np.unique(rng.integers(0, grow_n, 3))
        pairs = {
            (int(u), int(j)): float(rng.integers(1, 6)) for u in users for j in rng.integers(0, grow_m, 2)
        }
        at, values, new_rows, new_cols, added = [], [], [], [], []
        for (u, j), v in pairs.items():
            hit = known.find(u, j)
            if len(hit):
                at.append(int(hit[0]))
                values.append(v)
            else:
                new_rows.append(u)
                new_cols.append(j)
                added.append(v)
        removed = known.by_row.of(int(users[0]))[:1] if step % 5 == 0 else np.empty(0, dtype=np.int64)
        removed = np.setdiff1d(removed, at)

        def entries(r: Ratings, users: np.ndarray = users) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            pos, _ = r.by_row.members(users[users < r.n_users])
            return r.rows[pos], r.cols[pos], r.labels(levels)[pos]

        left = entries(known)
        known = known.changed(
            np.array(at, dtype=np.int64), np.array(values), np.array(new_rows, dtype=np.int64),
            np.array(new_cols, dtype=np.int64), np.array(added), grow_n, grow_m, removed,
        )  # fmt: skip
        columns = columns.changed(left, entries(known), known, known.labels(levels))
        rebuilt_once |= not columns.changes
        fresh = messages.ColumnMajor.clamped(known.compact(), known.compact().labels(levels), compat)
        e = rng.random(known.n_users)
        for with_total in (False, True):
            np.testing.assert_allclose(
                messages.column_pass(columns, e, with_total),
                messages.column_pass(fresh, e, with_total),
                rtol=1e-12,
                atol=1e-12,
            )
    assert rebuilt_once
