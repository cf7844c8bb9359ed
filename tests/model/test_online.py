"""Ratings folded in online (model/online.py): the exact field's incremental update equals a field computed
from scratch over the same ratings and embeddings; new users, re-ratings and the row branch."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from model.artifact import Artifact, load_artifact
from model.config import InferenceConfig
from model.engine import OnnxNetwork
from model.exact import ExactScorer
from model.exact.scorer import PARTS_RESUM_STEPS
from model.online import FoldIn
from model.paper import PaperScorer
from model.ratings import Ratings
from model.refine import refine_embedding
from model.scorers import build_scorer


@pytest.fixture(scope="module")
def artifact(tiny_artifact: Path) -> Artifact:
    return load_artifact(tiny_artifact)


def _fold(artifact: Artifact, overrides: dict[str, object]) -> tuple[FoldIn, OnnxNetwork]:
    onnx = OnnxNetwork(artifact.path)
    inference = artifact.inference.with_overrides(overrides)
    return FoldIn(artifact, inference, onnx.embed_users, onnx.embed_items), onnx


EXACT = {"mode": "exact", "kernel.known": "clamped", "crf.gamma": 1.0, "kernel.same_user": 2.0}


def _batch(artifact: Artifact) -> list[tuple[str, str, float]]:
    """A re-rating of a trained rating, a new item for a known user, and a new user's three ratings."""
    train = artifact.train
    u0, i0 = int(train.rows[0]), int(train.cols[0])
    old = train.values[0]
    rated = set(train.cols[train.by_row.of(u0)].tolist())
    fresh = next(j for j in range(train.n_items) if j not in rated)
    item = artifact.items.external
    return [
        (artifact.users.external(u0), item(i0), 1.0 if old != 1.0 else 5.0),
        (artifact.users.external(u0), item(fresh), 4.0),
        ("newcomer", item(3), 5.0),
        ("newcomer", item(7), 1.0),
        ("newcomer", item(3), 2.0),  # a later rating of the same pair replaces the earlier one
    ]


@pytest.mark.parametrize("scaling", ["normalized", "sum"])
def test_incremental_field_equals_a_field_computed_from_scratch(artifact: Artifact, scaling: str) -> None:
    fold, _ = _fold(artifact, {**EXACT, "kernel.scaling": scaling, "output.baseline": 0.3})
    fold.apply(_batch(artifact)[:2])
    fold.apply(_batch(artifact)[2:])
    state = fold.state
    assert isinstance(state.scorer, ExactScorer) and state.scorer.field_source == "online"
    fresh = build_scorer(state.network, state.known, fold_inference(fold))
    assert isinstance(fresh, ExactScorer)
    np.testing.assert_allclose(state.scorer.field.g, fresh.field.g, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(state.scorer.field.h, fresh.field.h, rtol=1e-10, atol=1e-10)
    assert state.scorer.field.t is not None and fresh.field.t is not None
    # the re-rated pairs' old positions hold no rating: the rest, in order, are the fresh scorer's
    live = np.sort(state.known.by_row.order)
    assert len(live) < len(state.known.rows) and len(fresh.known.rows) == len(live)
    np.testing.assert_array_equal(state.scorer.field.t[live], fresh.field.t[np.arange(len(live))])
    # Without co-rating tables (the artifact's, kept until the next training) answers equal a fresh scorer's
    # but for the baseline's item biases, which stay the artifact's: compare the CRF alone.
    rows = np.full(10, fold.user_index("newcomer"))
    cols = np.arange(10)
    probs = state.network.probabilities(rows, cols)
    crf_only = fold_inference(fold).with_overrides({"output.baseline": 0.0})
    online = state.scorer.updated(state.network, state.known, np.empty(0, np.int64))
    online.biases = None
    np.testing.assert_allclose(
        online.predict(rows, cols, probs),
        build_scorer(state.network, state.known, crf_only).predict(rows, cols, probs),
        rtol=0,
        atol=1e-10,
    )


def fold_inference(fold: FoldIn) -> InferenceConfig:
    scorer = fold.state.scorer
    assert isinstance(scorer, ExactScorer)
    return InferenceConfig.from_dict(
        {
            "mode": "exact",
            "crf": {"gamma": scorer.crf.gamma, "tau": scorer.crf.tau, "layers": scorer.crf.layers},
            "kernel": scorer.kernel.model_dump(),
            "output": scorer.output.model_dump(),
        }
    )


def test_new_users_rerating_and_the_row_branch(artifact: Artifact) -> None:
    fold, onnx = _fold(artifact, EXACT)
    before = fold.state
    batch = _batch(artifact)
    fold.apply(batch)
    state = fold.state
    n = artifact.config.n_users
    assert fold.user_index("newcomer") == n and fold.user_id(n) == "newcomer" and fold.n_users == n + 1
    assert state.network.n_users == n + 1 and state.known.n_users == n + 1 and state.applied == len(batch)
    # The newcomer's embedding is the row branch's on its rating row (the later 3 -> 2.0 replaced 5.0),
    # refined by the decoder's likelihood of those ratings.
    row = np.zeros((1, artifact.config.n_items), dtype=np.float32)
    row[0, 3], row[0, 7] = 2.0, 1.0
    u0 = onnx.embed_users(row)[0].astype(np.float32).astype(np.float64)
    net = state.network
    expected = refine_embedding(u0, net.item_emb[[3, 7]], net.bilinear, np.array([1, 0]))
    np.testing.assert_allclose(net.user_emb[n], expected, rtol=1e-12, atol=1e-12)
    mine = state.known.by_row.of(n)
    pairs = zip(state.known.cols[mine].tolist(), state.known.values[mine].tolist(), strict=True)
    assert sorted(pairs) == [(3, 2.0), (7, 1.0)]
    # The re-rated pair is known once, with its new value; the user's embedding moved, others' did not.
    u0, i0, value = int(artifact.train.rows[0]), int(artifact.train.cols[0]), batch[0][2]
    pos = state.known.by_row.of(u0)
    assert state.known.values[pos][state.known.cols[pos] == i0].tolist() == [value]
    assert len(pos) == len(before.known.by_row.of(u0)) + 1
    assert not np.array_equal(state.network.user_emb[u0], before.network.user_emb[u0])
    others = np.setdiff1d(np.arange(n), [u0])
    np.testing.assert_array_equal(state.network.user_emb[others], before.network.user_emb[others])
    assert len(state.known) == len(before.known) + 3  # one re-rating, one new pair, two newcomer pairs


def test_paper_mode_draws_its_partitions_over_the_grown_matrix(artifact: Artifact) -> None:
    fold, _ = _fold(artifact, {"mode": "paper"})
    fold.apply(_batch(artifact))
    scorer = fold.state.scorer
    assert isinstance(scorer, PaperScorer) and scorer.parts.row_group.shape[1] == artifact.config.n_users + 1
    rows = np.full(5, fold.user_index("newcomer"))
    cols = np.arange(5)
    dist = scorer.predict(rows, cols, fold.state.network.probabilities(rows, cols))
    np.testing.assert_allclose(dist.sum(axis=1), 1.0)


def test_the_baseline_refits_the_changed_users_biases(artifact: Artifact) -> None:
    from model.exact import bias_baseline
    from model.online import ITEM_SHRINK, USER_SHRINK

    fold, _ = _fold(artifact, {**EXACT, "output.baseline": 0.5})
    # The new items' baseline is the scorer's own fit (same ratings, same penalties), not a second one.
    known = artifact.known()
    fitted = bias_baseline(
        known.rows, known.cols, known.values, known.n_users, known.n_items, USER_SHRINK, ITEM_SHRINK
    )
    start = fold.state.scorer
    assert isinstance(start, ExactScorer) and start.biases is not None
    assert fold.state.biases is start.biases
    held = fold.state.biases
    for x, y in zip((held.mu, held.users, held.items), fitted, strict=True):
        np.testing.assert_array_equal(x, y)
    fold.apply(_batch(artifact))
    scorer = fold.state.scorer
    assert isinstance(scorer, ExactScorer) and scorer.biases is not None
    mu, b, c = scorer.biases.mu, scorer.biases.users, scorer.biases.items
    n = fold.user_index("newcomer")
    assert n is not None
    # b_i = sum (r - mu - c_j) / (n_i + user_shrink) over the newcomer's ratings 3 -> 2.0 and 7 -> 1.0
    expected = ((2.0 - mu - c[3]) + (1.0 - mu - c[7])) / (2 + scorer.output.baseline_user_shrink)
    assert b[n] == pytest.approx(expected, rel=1e-12)


def test_a_new_item_joins_the_field_once_a_trained_user_rates_it(artifact: Artifact) -> None:
    fold, onnx = _fold(artifact, {**EXACT, "kernel.scaling": "normalized"})
    m, n = artifact.config.n_items, artifact.config.n_users
    fold.apply([("stranger", "gadget", 5.0)])  # no trained user: no embedding, not in the CRF
    j = fold.item_index("gadget")
    assert j == m and not fold.state.embedded[j]
    assert fold.state.known.n_items == m + 1 and len(fold.state.known.by_col.of(m)) == 0
    assert np.isfinite(fold.state.baseline(0, np.array([j]))[0])  # its predictions come from the baseline
    fold.apply([(artifact.users.external(2), "gadget", 4.0), (artifact.users.external(9), "gadget", 2.0)])
    assert fold.state.embedded[j]
    column = np.zeros((1, n), dtype=np.float32)
    column[0, 2], column[0, 9] = 4.0, 2.0  # the stranger is not a trained user: not in the branch's input
    np.testing.assert_array_equal(
        fold.state.network.item_emb[j], onnx.embed_items(column)[0].astype(np.float64)
    )
    assert sorted(fold.state.known.rows[fold.state.known.by_col.of(j)].tolist()) == [2, 9, n]
    state = fold.state
    fresh = build_scorer(state.network, state.known, fold_inference(fold))
    assert isinstance(fresh, ExactScorer) and isinstance(state.scorer, ExactScorer)
    np.testing.assert_allclose(state.scorer.field.g, fresh.field.g, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(state.scorer.field.h, fresh.field.h, rtol=1e-10, atol=1e-10)


def test_the_float32_catalogue_follows_the_item_embeddings(artifact: Artifact) -> None:
    # Whole-catalogue reads take the float32 item table: the artifact's map, kept while no item changes.
    fold, _ = _fold(artifact, EXACT)
    table = fold.state.network.catalogue
    assert table.dtype == np.float32 and np.shares_memory(table, artifact.item_embeddings)
    fold.apply([(artifact.users.external(3), artifact.items.external(1), 5.0)])
    assert fold.state.network.catalogue is table
    fold.apply([("stranger", "gadget", 5.0), (artifact.users.external(2), "gadget", 4.0)])  # embedded
    network = fold.state.network
    assert len(network.catalogue) == network.n_items == artifact.config.n_items + 1
    np.testing.assert_array_equal(network.catalogue, network.item_emb.astype(np.float32))


def test_the_changed_users_rows_of_the_user_table_follow_their_ratings(artifact: Artifact) -> None:
    from model.exact import co_rating_rows

    fold, _ = _fold(artifact, {**EXACT, "kernel.co_rating_user": 5.0, "kernel.co_rating_power": 2.0})
    fold.apply(_batch(artifact))
    scorer = fold.state.scorer
    assert isinstance(scorer, ExactScorer) and scorer.lines is not None
    table = None if scorer.lines.user_affinity is None else scorer.lines.user_affinity.toarray()
    assert table is not None
    known, k = fold.state.known.compact(), scorer.kernel
    base = artifact.known()
    means = np.bincount(base.cols, base.values, base.n_items) / np.maximum(np.bincount(base.cols), 1)
    changed = np.array([int(artifact.train.rows[0]), fold.user_index("newcomer")])
    # The rows over the current ratings, centred by the item means the table was built with.
    expected = co_rating_rows(
        known.cols, known.rows, known.values, known.n_items, known.n_users, changed, k.co_rating_power,
        k.co_rating_shrink, mean=means,
    )  # fmt: skip
    np.testing.assert_allclose(table[changed], expected, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(table[:, changed], expected.T, rtol=1e-12, atol=1e-15)
    np.testing.assert_array_equal(table, table.T)  # exactly: a catalogue read takes its rows for columns


def test_the_state_depends_on_the_ratings_not_on_their_batches(artifact: Artifact) -> None:
    overrides = {**EXACT, "kernel.co_rating_user": 5.0, "kernel.co_rating": 3.0, "output.baseline": 0.3}
    whole, _ = _fold(artifact, overrides)
    one_by_one, _ = _fold(artifact, overrides)
    batch = [*_batch(artifact), ("stranger", "gadget", 5.0), (artifact.users.external(4), "gadget", 2.0)]
    whole.apply(batch)
    for rating in batch:
        one_by_one.apply([rating])
    a, b = whole.state, one_by_one.state
    np.testing.assert_allclose(a.network.user_emb, b.network.user_emb, rtol=0, atol=1e-10)
    rows = np.repeat(np.arange(a.network.n_users), 4)
    cols = np.tile(np.arange(4), a.network.n_users)
    pa = a.scorer.predict(rows, cols, a.network.probabilities(rows, cols))
    pb = b.scorer.predict(rows, cols, b.network.probabilities(rows, cols))
    np.testing.assert_allclose(pa, pb, rtol=0, atol=1e-10)


def test_the_known_ratings_are_the_artifacts_less_the_rerated_then_the_online_ones(
    artifact: Artifact,
) -> None:
    # Extended batch by batch (Ratings.changed), never rebuilt: the same ratings as the rule, and indexes
    # equal to a rebuild's.
    fold, _ = _fold(artifact, EXACT)
    batch = [*_batch(artifact), ("stranger", "gadget", 5.0), (artifact.users.external(4), "gadget", 2.0)]
    for part in (batch[:2], batch[2:5], batch[5:6], batch[6:]):
        fold.apply(part)
    known = fold.state.known
    assert not known.whole  # the re-rated pairs' old positions
    expected = {
        (int(i), int(j)): float(v)
        for i, j, v in zip(artifact.known().rows, artifact.known().cols, artifact.known().values, strict=True)
    }
    for user, item, value in batch:
        expected[fold.user_index(user), int(fold.item_indices([item])[0])] = value
    whole = known.compact()
    got = {(int(i), int(j)): float(v) for i, j, v in zip(whole.rows, whole.cols, whole.values, strict=True)}
    assert len(got) == len(known) == len(whole.rows) and got == expected  # "gadget": embedded once user 4
    rebuilt = Ratings(whole.rows, whole.cols, whole.values, known.n_users, known.n_items)
    for by in ("row", "col"):  # the lines hold the same ratings in the same order as a rebuild's
        for got_part, want_part in zip(known.csr_arrays(by), rebuilt.csr_arrays(by), strict=True):
            np.testing.assert_array_equal(got_part, want_part)


def test_a_top_n_read_of_the_updated_field_equals_the_general_path(artifact: Artifact) -> None:
    # One user's queries over the catalogue read the column terms from the field's item-ordered copy of
    # the known entries, which the online update builds from their labels.
    import dataclasses

    overrides = {**EXACT, "kernel.same_item": 1.5, "kernel.co_rating_user": 5.0, "kernel.co_rating": 3.0}
    fold, _ = _fold(artifact, overrides)
    fold.apply([*_batch(artifact), ("stranger", artifact.items.external(1), 5.0)])
    state = fold.state
    scorer = state.scorer
    assert isinstance(scorer, ExactScorer) and scorer.field.columns is not None
    field = scorer.field
    for user in (0, fold.user_index("stranger")):
        assert user is not None
        cols = np.arange(state.network.n_items)
        rows = np.full(len(cols), user)
        probs = state.network.probabilities(rows, cols)
        fast = scorer.predict(rows, cols, probs)
        scorer.field = dataclasses.replace(field, columns=None)
        try:
            slow = scorer.predict(rows, cols, probs)
        finally:
            scorer.field = field
        np.testing.assert_allclose(fast, slow, rtol=0, atol=1e-12)


def test_the_refined_embedding_is_the_penalised_likelihoods_minimiser() -> None:
    from model.engine import softmax

    rng = np.random.default_rng(4)
    d, p, k = 6, 5, 12
    items, bilinear = rng.normal(size=(k, d)), rng.normal(size=(p, d, d)) / 3
    labels, u0 = rng.integers(0, p, size=k), rng.normal(size=d)

    def objective(u: np.ndarray, prior: float) -> float:
        logits = np.einsum("d,lde,ke->kl", u, bilinear, items)
        return float(-np.log(softmax(logits)[np.arange(k), labels]).sum() + prior * ((u - u0) ** 2).sum())

    for prior in (0.3, 3.0):
        u = refine_embedding(u0, items, bilinear, labels, prior=prior, steps=20)
        assert objective(u, prior) < objective(u0, prior)
        for _ in range(20):  # no small step improves on it
            step = rng.normal(size=d) * 1e-3
            assert objective(u + step, prior) >= objective(u, prior) - 1e-12
    # A prior far stronger than the ratings keeps the row branch's embedding.
    np.testing.assert_allclose(refine_embedding(u0, items, bilinear, labels, prior=1e9), u0, atol=1e-6)


def test_a_user_or_item_being_folded_in_is_unknown_until_its_state_is_published(artifact: Artifact) -> None:
    import threading

    onnx = OnnxNetwork(artifact.path)
    inside, release = threading.Event(), threading.Event()

    def slow_rows(rows: np.ndarray) -> np.ndarray:  # the row branch, held until the test has looked
        inside.set()
        release.wait(10)
        return onnx.embed_users(rows)

    fold = FoldIn(artifact, artifact.inference.with_overrides(EXACT), slow_rows, onnx.embed_items)
    worker = threading.Thread(target=fold.apply, args=([("late", "gizmo", 4.0), ("u2", "gizmo", 3.0)],))
    worker.start()
    assert inside.wait(10)
    # Mid-apply: the maps know the ids, the published state does not hold them yet: lookups say unknown.
    assert fold.user_index("late") is None and fold.item_index("gizmo") is None
    assert fold.state.network.n_users == artifact.config.n_users
    release.set()
    worker.join(10)
    assert (
        fold.user_index("late") == artifact.config.n_users
        and fold.item_index("gizmo") == artifact.config.n_items
    )
    assert fold.state.embedded[artifact.config.n_items]


def test_refining_new_users_only_leaves_a_trained_user_with_its_row_branch_embedding(
    artifact: Artifact,
) -> None:
    onnx = OnnxNetwork(artifact.path)
    inference = artifact.inference.with_overrides(EXACT)
    both = {
        refine: FoldIn(artifact, inference, onnx.embed_users, onnx.embed_items, refine_trained=refine)
        for refine in (True, False)
    }
    train = artifact.train
    user = int(train.rows[0])
    rated = set(train.cols[train.by_row.of(user)].tolist())
    item = next(j for j in range(train.n_items) if j not in rated)
    batch = [(artifact.users.external(user), artifact.items.external(item), 5.0), ("newcomer", "i3", 4.0)]
    for fold in both.values():
        fold.apply(batch)
    row = train.dense_rows(np.array([user]))
    row[0, item] = 5.0
    plain = onnx.embed_users(row)[0].astype(np.float64)
    np.testing.assert_allclose(both[False].state.network.user_emb[user], plain, rtol=0, atol=1e-12)
    assert np.abs(both[True].state.network.user_emb[user] - plain).max() > 1e-4  # refined: moved
    new = both[True].user_index("newcomer")
    assert new is not None and new == both[False].user_index("newcomer")
    np.testing.assert_array_equal(  # a new user is refined either way
        both[True].state.network.user_emb[new], both[False].state.network.user_emb[new]
    )


def test_a_user_without_training_ratings_is_refined_whatever_the_policy(artifact: Artifact) -> None:
    # A user of the artifact's vocabulary whose training ratings are all gone (held out, say) is embedded
    # from a row the network never trained on: refined like a new user even when trained users are not.
    train = artifact.train
    user = int(train.rows[0])
    keep = train.rows != user
    stripped = dataclasses.replace(
        artifact,
        train=Ratings(train.rows[keep], train.cols[keep], train.values[keep], train.n_users, train.n_items),
        known_field=None,
    )
    onnx = OnnxNetwork(artifact.path)
    inference = artifact.inference.with_overrides(EXACT)
    batch = [(artifact.users.external(user), artifact.items.external(j), float(1 + j % 5)) for j in (1, 4, 7)]
    embedded = []
    for refine in (True, False):
        fold = FoldIn(stripped, inference, onnx.embed_users, onnx.embed_items, refine_trained=refine)
        fold.apply(batch)
        embedded.append(fold.state.network.user_emb[user])
    np.testing.assert_array_equal(embedded[0], embedded[1])
    row = np.zeros((1, train.n_items), dtype=np.float32)
    row[0, [1, 4, 7]] = [2.0, 5.0, 3.0]
    plain = onnx.embed_users(row)[0].astype(np.float64)
    assert np.abs(embedded[1] - plain).max() > 1e-4  # refined, not the row branch's alone


@pytest.mark.parametrize("scaling", ["normalized", "sum", "scaled"])
def test_an_untouched_users_row_parts_answer_in_every_later_state(artifact: Artifact, scaling: str) -> None:
    # ExactScorer.row_parts holds what depends on the user's own ratings and embedding: taken before
    # other users' ratings arrive, it answers as the new state's scorer does (the field and the column
    # terms read anew), as long as the user's version says it is unchanged.
    overrides = {
        **EXACT,
        "kernel.scaling": scaling,
        "kernel.same_item": 1.5,
        "kernel.co_rating": 3.0,
        "kernel.co_rating_user": 5.0,
        "output.baseline": 0.3,
    }
    fold, _ = _fold(artifact, overrides)
    batch = _batch(artifact)  # user 0 (trained) and a newcomer rate
    watched = [3, 5, 9]
    before = fold.state
    assert isinstance(before.scorer, ExactScorer)
    parts = {u: before.scorer.row_parts(u) for u in watched}
    versions = {u: before.user_version(u) for u in watched}
    fold.apply(batch[:1])
    fold.apply(batch[2:])
    state = fold.state
    assert isinstance(state.scorer, ExactScorer)
    cols = np.array([0, 2, 5, 7, 11])  # few of the catalogue: the general path reads them in float64
    for user in watched:
        assert state.user_version(user) == versions[user]
        part = parts[user]
        assert part is not None
        got, got_base = state.scorer.from_parts(part, cols)
        want, want_base = state.scorer.unmixed(np.full(len(cols), user), cols)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)
        assert got_base is not None and want_base is not None
        np.testing.assert_allclose(got_base, want_base, rtol=0, atol=1e-12)
        stale, _ = before.scorer.from_parts(part, cols)  # the old state's answer did move
        assert np.abs(stale - got).max() > 1e-9 or scaling != "normalized"  # (unnormalized: saturated)
    rater = int(artifact.train.rows[0])
    assert state.user_version(rater) != before.user_version(rater)  # its parts must be computed again
    fresh = state.scorer.row_parts(rater)
    assert fresh is not None
    np.testing.assert_allclose(
        state.scorer.from_parts(fresh, cols)[0],
        state.scorer.unmixed(np.full(len(cols), rater), cols)[0],
        rtol=0,
        atol=1e-10,
    )
    predicted, _ = _fold(artifact, {**overrides, "kernel.known": "predicted"})
    assert isinstance(predicted.state.scorer, ExactScorer) and predicted.state.scorer.row_parts(3) is None


@pytest.mark.parametrize("scaling", ["normalized", "sum"])
def test_a_raters_row_parts_updated_by_its_changed_ratings_equal_parts_summed_whole(
    artifact: Artifact, scaling: str
) -> None:
    # row_parts(previous=) adds the changed ratings' row terms to the earlier sums (a new rating, a
    # re-rating at another label, a retraction); the result equals the parts summed over every rating, and
    # after PARTS_RESUM_STEPS updates the parts are summed whole again.
    overrides = {**EXACT, "kernel.scaling": scaling, "kernel.co_rating": 3.0, "kernel.same_user": 2.0}
    fold, _ = _fold(artifact, overrides)
    train, item = artifact.train, artifact.items.external
    user = int(train.rows[0])
    uid = artifact.users.external(user)
    rated = train.cols[train.by_row.of(user)]
    unrated = [j for j in range(train.n_items) if j not in set(rated.tolist())]
    scorer = fold.state.scorer
    assert isinstance(scorer, ExactScorer)
    parts = scorer.row_parts(user)
    assert parts is not None and parts.own is not None and parts.steps == 0
    old_label = int(train.values[train.by_row.of(user)[0]])
    steps = [
        [(uid, item(unrated[0]), 4.0)],  # a new rating
        [(uid, item(int(rated[0])), 1.0 if old_label != 1 else 5.0)],  # a re-rating at another label
        [(uid, item(int(rated[1])), None)],  # a retraction
        [(uid, item(unrated[1]), 2.0), (uid, item(unrated[0]), None)],  # one in, the first new one out
    ]
    for batch in steps:
        fold.apply(batch)
        scorer = fold.state.scorer
        assert isinstance(scorer, ExactScorer)
        updated = scorer.row_parts(user, previous=parts)
        whole = scorer.row_parts(user)
        assert updated is not None and whole is not None and updated.own is not None and whole.own is not None
        assert updated.steps == parts.steps + 1 and whole.steps == 0
        assert np.abs(updated.own - parts.own).max() > 1e-6  # the terms did move
        np.testing.assert_allclose(updated.own, whole.own, rtol=0, atol=1e-12)
        np.testing.assert_array_equal(updated.scores, whole.scores)
        parts = updated
    stale = dataclasses.replace(parts, steps=PARTS_RESUM_STEPS)
    again = scorer.row_parts(user, previous=stale)
    assert again is not None and again.steps == 0
    np.testing.assert_array_equal(again.own, scorer.row_parts(user).own)  # type: ignore[union-attr]


def test_a_retraction_takes_an_online_or_an_artifact_rating_back(artifact: Artifact) -> None:
    train = artifact.train
    u0 = int(train.rows[0])
    mine = train.by_row.of(u0)
    j0, v0 = int(train.cols[mine[0]]), float(train.values[mine[0]])  # an artifact (training) rating
    j1, v1 = int(train.cols[mine[1]]), float(train.values[mine[1]])  # another, re-rated as it is
    rated = set(train.cols[mine].tolist())
    fresh = next(j for j in range(train.n_items) if j not in rated)
    user, item = artifact.users.external(u0), artifact.items.external
    fold, _ = _fold(artifact, {**EXACT, "kernel.co_rating_user": 5.0})
    fold.apply([(user, item(fresh), 4.0), ("newcomer", item(3), 5.0)])
    fold.apply([(user, item(fresh), None), (user, item(j0), None), ("nobody", item(3), None)])
    state = fold.state
    pos = state.known.by_row.of(u0)
    assert fresh not in state.known.cols[pos] and j0 not in state.known.cols[pos]
    assert fold.user_index("nobody") is None and state.online[u0] == {}
    # The same as a model whose artifact never had (u0, j0), touched by a rating that changes nothing.
    keep = ~((train.rows == u0) & (train.cols == j0))
    stripped = dataclasses.replace(
        artifact,
        train=Ratings(train.rows[keep], train.cols[keep], train.values[keep], train.n_users, train.n_items),
        known_field=None,
    )
    other, _ = _fold(stripped, {**EXACT, "kernel.co_rating_user": 5.0})
    other.apply([(user, item(j1), v1), ("newcomer", item(3), 5.0)])
    np.testing.assert_allclose(
        state.network.user_emb[u0], other.state.network.user_emb[u0], rtol=0, atol=1e-10
    )
    # The field, taken from the changed rows' terms, equals one computed over the known ratings left.
    fresh_scorer = build_scorer(state.network, state.known, fold_inference(fold))
    assert isinstance(fresh_scorer, ExactScorer) and isinstance(state.scorer, ExactScorer)
    np.testing.assert_allclose(state.scorer.field.g, fresh_scorer.field.g, rtol=1e-10, atol=1e-10)
    # A later rating of the pair brings it back.
    fold.apply([(user, item(j0), 5.0 if v0 != 5.0 else 1.0)])
    pos = fold.state.known.by_row.of(u0)
    assert (fold.state.known.cols[pos] == j0).sum() == 1


def test_forgetting_a_user_takes_every_rating_back_until_they_rate_again(artifact: Artifact) -> None:
    from model.stream import FORGET

    train = artifact.train
    u0 = int(train.rows[0])
    user, item = artifact.users.external(u0), artifact.items.external
    fold, _ = _fold(artifact, {**EXACT, "kernel.co_rating_user": 5.0})
    fold.apply([(user, item(40), 4.0), ("newcomer", item(3), 5.0)])
    fold.apply([(user, FORGET, None), ("newcomer", item(4), 2.0), ("nobody", FORGET, None)])
    state = fold.state
    assert fold.user_index(user) is None and u0 in state.forgotten  # unknown to queries
    assert len(state.known.by_row.of(u0)) == 0 and state.online[u0] == {}
    assert fold.user_index("newcomer") is not None and fold.user_index("nobody") is None
    fresh = build_scorer(state.network, state.known, fold_inference(fold))
    assert isinstance(fresh, ExactScorer) and isinstance(state.scorer, ExactScorer)
    np.testing.assert_allclose(state.scorer.field.g, fresh.field.g, rtol=1e-10, atol=1e-10)
    fold.apply([(user, item(7), 3.0)])  # a new history
    assert fold.user_index(user) == u0
    pos = fold.state.known.by_row.of(u0)
    assert fold.state.known.cols[pos].tolist() == [7] and u0 not in fold.state.forgotten


def test_the_fold_in_baseline_is_the_one_fitted_at_export(artifact: Artifact) -> None:
    from model.exact import bias_baseline
    from model.online import ITEM_SHRINK, USER_SHRINK

    # Written by the trainer (model.artifact.BASELINE), so a worker's start-up does not refit it.
    assert artifact.baseline is not None
    assert (artifact.baseline.user_shrink, artifact.baseline.item_shrink) == (USER_SHRINK, ITEM_SHRINK)
    known = artifact.known()
    mu, b, c = bias_baseline(
        known.rows, known.cols, known.values, known.n_users, known.n_items, USER_SHRINK, ITEM_SHRINK
    )
    stored, _ = _fold(artifact, EXACT)
    refitted, _ = _fold(dataclasses.replace(artifact, baseline=None), EXACT)  # an artifact without one
    for fold in (stored, refitted):
        got = fold.state.biases
        got_mu, got_b, got_c = got.mu, got.users, got.items
        assert got_mu == mu
        np.testing.assert_array_equal(got_b, b)
        np.testing.assert_array_equal(got_c, c)


@pytest.mark.parametrize(
    ("overrides", "blocking", "parts"),
    [
        ({"mode": "none"}, False, False),
        ({"mode": "paper"}, True, False),
        ({**EXACT, "output.baseline": 0.3}, False, True),
    ],
)
def test_every_modes_scorer_answers_the_same_calls(
    artifact: Artifact, overrides: dict[str, object], blocking: bool, parts: bool
) -> None:
    from model.exact import baseline_mixture
    from model.scorers import artifact_scorer

    network, scorer = artifact_scorer(artifact, artifact.inference.with_overrides(overrides))
    rows, cols = np.full(12, 3, dtype=np.int64), np.arange(12, dtype=np.int64)
    given = scorer.predict(rows, cols, network.probabilities(rows, cols))
    np.testing.assert_allclose(scorer.predict(rows, cols), given, rtol=0, atol=1e-12)  # reads them itself
    dist, baseline = scorer.unmixed(rows, cols)
    mixed = (
        dist if baseline is None else baseline_mixture(dist, baseline, network.levels, scorer.baseline_weight)
    )
    np.testing.assert_allclose(mixed, given, rtol=0, atol=1e-12)
    assert scorer.blocking is blocking and (scorer.row_parts(3) is not None) is parts
    assert (baseline is not None) is (scorer.baseline_weight > 0)


@pytest.mark.parametrize("scaling", ["normalized", "scaled"])
def test_the_state_holds_the_known_ratings_its_scorer_answers_from(artifact: Artifact, scaling: str) -> None:
    # A scorer that recomputes its field (scaled messages) takes the ratings compacted: the state must hold
    # that copy, so that the positions an explanation names are positions of the state's known ratings.
    fold, _ = _fold(artifact, {**EXACT, "kernel.scaling": scaling})
    fold.apply(_batch(artifact))
    state = fold.state
    assert isinstance(state.scorer, ExactScorer) and state.scorer.known is state.known
    user = fold.user_index("newcomer")
    assert user is not None
    (top,) = state.scorer.explain(user, np.array([5]), 3)
    assert len(top.known) and np.isin(top.known, state.known.by_row.order).all()  # each holds a rating


def test_a_batch_that_fails_half_way_changes_nothing(artifact: Artifact) -> None:
    """Issue 56, defect 7: `apply` changed its bookkeeping (ids, online ratings, re-rated positions) before
    the steps that can fail and never rolled back; a batch is now applied wholly or not at all."""
    overrides = {**EXACT, "kernel.co_rating_user": 5.0, "output.baseline": 0.3}
    fold, onnx = _fold(artifact, overrides)
    clean, _ = _fold(artifact, overrides)
    fold.apply(_batch(artifact)[:1])
    clean.apply(_batch(artifact)[:1])
    before, users, items = fold.state, fold.n_users, fold.new_items
    calls = []

    def failing(rows: np.ndarray) -> np.ndarray:
        calls.append(len(rows))
        raise MemoryError("a test's fault")

    fold._embed_rows = failing  # type: ignore[method-assign]
    batch = [*_batch(artifact)[1:], ("stranger", "gadget", 5.0), (artifact.users.external(4), "gadget", 2.0)]
    with pytest.raises(MemoryError):
        fold.apply(batch)
    assert calls and fold.state is before  # nothing published
    assert (fold.n_users, fold.new_items) == (users, items) and fold.user_index("newcomer") is None
    assert fold.unseen(["newcomer"], ["gadget"]) == ({"newcomer"}, {"gadget"})  # the ids went back
    fold._embed_rows = onnx.embed_users  # type: ignore[method-assign]
    fold.apply(batch)  # the same batch again, now that it passes
    clean.apply(batch)
    a, b = fold.state, clean.state
    assert fold.user_index("newcomer") == clean.user_index("newcomer")
    np.testing.assert_allclose(a.network.user_emb, b.network.user_emb, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(a.known.compact().values, b.known.compact().values)
    rows = np.repeat(np.arange(a.network.n_users), 4)
    cols = np.tile(np.arange(4), a.network.n_users)
    pa = a.scorer.predict(rows, cols, a.network.probabilities(rows, cols))
    pb = b.scorer.predict(rows, cols, b.network.probabilities(rows, cols))
    np.testing.assert_allclose(pa, pb, rtol=0, atol=1e-12)


def test_a_new_item_whose_trained_raters_are_gone_loses_its_embedding(artifact: Artifact) -> None:
    """Issue 56, defect 8: a new item kept the embedding made from its only trained rater's rating after
    that rating was taken back (or the rater forgotten)."""
    from model.stream import FORGET

    fold, _ = _fold(artifact, {**EXACT, "kernel.scaling": "normalized"})
    rater = artifact.users.external(2)
    fold.apply([("stranger", "gadget", 5.0), (rater, "gadget", 4.0)])
    j = fold.item_index("gadget")
    assert j is not None and fold.state.embedded[j] and len(fold.state.known.by_col.of(j)) == 2
    fold.apply([(rater, "gadget", None)])  # its only trained rater takes the rating back
    state = fold.state
    assert not state.embedded[j] and len(state.known.by_col.of(j)) == 0  # the stranger's rating leaves too
    assert not state.network.item_emb[j].any()
    assert state.online[fold.user_index("stranger")] == {j: 5.0}  # still the stranger's rating
    fresh = build_scorer(state.network, state.known, fold_inference(fold))
    assert isinstance(fresh, ExactScorer) and isinstance(state.scorer, ExactScorer)
    np.testing.assert_allclose(state.scorer.field.g, fresh.field.g, rtol=1e-10, atol=1e-10)
    fold.apply([(rater, "gadget", 3.0)])  # rated again: embedded again
    assert fold.state.embedded[j]
    fold.apply([(rater, FORGET, None)])  # forgetting the rater does the same
    assert not fold.state.embedded[j] and not fold.state.network.item_emb[j].any()


def test_a_new_user_who_takes_every_rating_back_is_unknown(artifact: Artifact) -> None:
    """Issue 56, fault seed 25: a user who arrived online and took their only rating back is unknown, as
    they are to a worker that replays the compacted head (which holds no rating of theirs); a trained user
    who takes a rating back stays known."""
    fold, _ = _fold(artifact, EXACT)
    item = artifact.items.external(3)
    fold.apply([("newcomer", item, 4.0)])
    assert fold.user_index("newcomer") is not None
    fold.apply([("newcomer", item, None)])
    assert fold.user_index("newcomer") is None
    trained = artifact.users.external(2)
    fold.apply([(trained, item, None)])
    assert fold.user_index(trained) == 2
    fold.apply([("newcomer", item, 5.0)])  # rated again: known again
    assert fold.user_index("newcomer") is not None


def test_users_the_artifact_records_as_forgotten_stay_unknown(artifact: Artifact) -> None:
    """Issue 56, defect 6: the retrain that consumed a forget records the user (`forgotten_users`), so that
    a fold-in of the new artifact never knows them again (until they rate anew)."""
    meta = dict(artifact.meta)
    user = artifact.users.external(5)
    meta["dataset"] = {**(meta.get("dataset") or {}), "online_ratings": {"forgotten_users": [user]}}
    recorded = dataclasses.replace(artifact, meta=meta)
    onnx = OnnxNetwork(artifact.path)
    fold = FoldIn(recorded, recorded.inference.with_overrides(EXACT), onnx.embed_users, onnx.embed_items)
    assert fold.user_index(user) is None and 5 in fold.state.forgotten
    fold.apply([(user, artifact.items.external(3), 4.0)])  # a new history
    assert fold.user_index(user) == 5
