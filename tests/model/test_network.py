"""The DCMC network and the numpy engine: mean-field maths, similarities, gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model import engine
from model.config import ModelConfig
from model.network import DCMC, compatibility_matrix, mean_field, scaled_cosine


def test_mean_field_matches_hand_computed_example() -> None:
    # Two nodes, two levels {1, 2}, tau large: C = [[0, 1], [1, 0]].
    p = np.array([[0.8, 0.2], [0.4, 0.6]])
    s = np.array([[1.0, 0.5], [0.5, 1.0]])
    gamma = 0.5
    c = np.array([[0.0, 1.0], [1.0, 0.0]])
    # One iteration by hand: Q' = Q C^T swaps the columns; messages = S Q'.
    q_prime = np.array([[0.2, 0.8], [0.6, 0.4]])
    messages = np.array([[0.2 + 0.5 * 0.6, 0.8 + 0.5 * 0.4], [0.5 * 0.2 + 0.6, 0.5 * 0.8 + 0.4]])
    assert np.allclose(s @ q_prime, messages)
    logits = np.log(p) - gamma * messages
    expected = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)

    got_np = engine.mean_field(p, s, c, gamma, layers=1)
    got_torch = mean_field(torch.tensor(np.log(p)), torch.tensor(s), torch.tensor(c), gamma, layers=1).exp()
    assert np.allclose(got_np, expected, atol=1e-12)
    assert np.allclose(got_torch.numpy(), expected, atol=1e-12)
    # The pairwise term costs level u the expected disagreement gamma * sum_l s(k,l) E_l[mu(u, .)].
    assert np.allclose(expected, [[0.837030, 0.162970], [0.412058, 0.587942]], atol=1e-6)


def test_mean_field_torch_and_numpy_agree_over_layers() -> None:
    rng = np.random.default_rng(1)
    k, levels = 7, np.array([1.0, 2, 3, 4, 5])
    probs = rng.dirichlet(np.ones(5), size=k)
    emb = rng.normal(size=(k, 4))
    unit = engine.normalize_rows(emb)
    sim = (1 + unit @ unit.T) / 2
    c_np = engine.compatibility_matrix(levels, 12.0)
    c_t = compatibility_matrix(torch.tensor(levels), 12.0)
    assert np.allclose(c_np, c_t.numpy())
    a = engine.mean_field(probs, sim, c_np, 0.05, layers=5)
    b = mean_field(torch.tensor(np.log(probs)), torch.tensor(sim), c_t, 0.05, layers=5).exp().numpy()
    assert np.allclose(a, b, atol=1e-10)
    assert np.allclose(a.sum(axis=1), 1.0)
    # Zero layers leave the base probabilities untouched; more layers move them.
    assert np.allclose(engine.mean_field(probs, sim, c_np, 0.05, layers=0), probs)
    assert not np.allclose(a, probs)


def test_compatibility_is_truncated_quadratic() -> None:
    c = engine.compatibility_matrix(np.array([1.0, 2.0, 5.0]), tau=9.0)
    assert c.tolist() == [[0, 1, 9], [1, 0, 9], [9, 9, 0]]


def test_similarities_lie_in_unit_interval() -> None:
    torch.manual_seed(0)
    x = torch.randn(50, 8)
    x[3] = -x[2]  # opposite vectors: cosine -1 -> similarity 0
    s = scaled_cosine(x, x)
    assert float(s.min()) >= 0.0 and float(s.max()) <= 1.0 + 1e-6
    assert torch.allclose(torch.diagonal(s), torch.ones(50), atol=1e-6)
    assert float(s[2, 3]) == pytest.approx(0.0, abs=1e-6)


def _tiny_model(**kw: object) -> DCMC:
    cfg = ModelConfig(n_users=12, n_items=10, levels=(1.0, 2.0, 3.0), hidden=(8, 4), **kw)  # type: ignore[arg-type]
    return DCMC(cfg)


def test_gradients_reach_both_branches_through_mean_field() -> None:
    torch.manual_seed(0)
    model = _tiny_model(gamma=0.5, mf_layers=3, dropout=0.0)
    rows, cols = torch.rand(6, 10) * 3, torch.rand(5, 12) * 3
    node_rows = torch.tensor([0, 1, 2, 3, 4, 5, 0])
    node_cols = torch.tensor([0, 1, 2, 3, 4, 0, 4])
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 0])
    _, log_q, _ = model(rows, cols, node_rows, node_cols)
    torch.nn.functional.nll_loss(log_q, labels).backward()
    first_row = model.row_branch[0].weight.grad
    first_col = model.col_branch[0].weight.grad
    assert first_row is not None and float(first_row.abs().sum()) > 0
    assert first_col is not None and float(first_col.abs().sum()) > 0

    # The mean-field path itself carries gradient: with the base log-probabilities detached, the
    # loss still reaches the branches through the similarity matrix.
    model.zero_grad()
    log_p, _, sim = model(rows, cols, node_rows, node_cols)
    out = mean_field(log_p.detach(), sim, model.compat, model.config.gamma, 3)
    torch.nn.functional.nll_loss(out, labels).backward()
    assert float(model.row_branch[0].weight.grad.abs().sum()) > 0
    assert float(model.col_branch[0].weight.grad.abs().sum()) > 0


def test_forward_shapes_and_probabilities() -> None:
    model = _tiny_model().eval()
    log_p, log_q, sim = model(
        torch.rand(4, 10), torch.rand(3, 12), torch.tensor([0, 3]), torch.tensor([2, 1])
    )
    assert log_p.shape == (2, 3) and log_q.shape == (2, 3) and sim.shape == (2, 2)
    assert torch.allclose(log_q.exp().sum(-1), torch.ones(2))


def test_numpy_probabilities_match_torch_decoder() -> None:
    model = _tiny_model().eval()
    rng = np.random.default_rng(0)
    u, v = rng.normal(size=(12, 4)), rng.normal(size=(10, 4))
    rows, cols = np.array([0, 5, 11]), np.array([9, 0, 3])
    b = model.bilinear.detach().double().numpy()
    got = engine.label_probabilities(u, v, b, rows, cols)
    with torch.no_grad():
        ref = torch.softmax(
            torch.einsum("kd,pde,ke->kp", torch.tensor(u[rows]), torch.tensor(b), torch.tensor(v[cols])), -1
        )
    assert np.allclose(got, ref.numpy(), atol=1e-12)


def test_compressed_rows_give_the_dense_rows_output_and_a_sparse_gradient_of_the_rated_lines() -> None:
    from model.network import RatingInput, SparseRows

    torch.manual_seed(0)
    layer = RatingInput(50, 8)
    rng = np.random.default_rng(1)
    dense = np.where(rng.random((6, 50)) < 0.2, rng.integers(1, 6, (6, 50)), 0).astype(np.float32)
    dense[2] = 0.0  # a row with no ratings
    rows, cols = np.nonzero(dense)
    indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=6))]).astype(np.int64)
    order = rng.permutation(len(rows))  # within a row the ratings come in any order
    order = order[np.argsort(rows[order], kind="stable")]
    batch = SparseRows(
        indptr, cols[order].astype(np.int64), torch.from_numpy(dense[rows[order], cols[order]]), 50
    )
    np.testing.assert_array_equal(batch.dense().numpy(), dense)
    out_sparse = layer(batch)
    grad_out = torch.randn(6, 8)
    (out_sparse * grad_out).sum().backward()
    sparse_grad = layer.weight.grad
    assert sparse_grad.is_sparse
    assert sorted(sparse_grad._indices()[0].tolist()) == sorted(
        set(cols.tolist())
    )  # the rated lines, once each
    layer.weight.grad = None
    out_dense = layer(torch.from_numpy(dense))
    (out_dense * grad_out).sum().backward()
    torch.testing.assert_close(out_sparse, out_dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sparse_grad.to_dense(), layer.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_dense, torch.from_numpy(dense) @ layer.weight + layer.bias)


@pytest.mark.parametrize("scaling", ["none", "sqrt", "mean"])
@pytest.mark.parametrize("center", [0.0, 3.25])
def test_a_centred_or_normalised_input_reads_the_same_compressed_and_dense(
    scaling: str, center: float
) -> None:
    from model.network import RatingInput, SparseRows

    torch.manual_seed(0)
    layer = RatingInput(40, 5, center, scaling)
    rng = np.random.default_rng(2)
    dense = np.where(rng.random((7, 40)) < 0.3, rng.integers(1, 6, (7, 40)), 0).astype(np.float32)
    dense[3] = 0.0  # a line with no ratings
    rows, cols = np.nonzero(dense)
    indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=7))]).astype(np.int64)
    batch = SparseRows(indptr, cols.astype(np.int64), torch.from_numpy(dense[rows, cols]), 40)
    # By hand: the known ratings minus the centre, over n ** power for a line of n ratings.
    known = dense != 0
    n = np.maximum(known.sum(1, keepdims=True), 1)
    power = {"none": 0.0, "sqrt": 0.5, "mean": 1.0}[scaling]
    x = np.where(known, dense - center, 0.0) / n**power
    expected = x.astype(np.float32) @ layer.weight.detach().numpy() + layer.bias.detach().numpy()
    with torch.no_grad():
        np.testing.assert_allclose(layer(batch).numpy(), expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(layer(torch.from_numpy(dense)).numpy(), expected, rtol=1e-5, atol=1e-5)
        # A rating zeroed in the compressed form (an input dropout's) is missing, as in the dense.
        dropped = SparseRows(indptr, batch.indices, batch.values * (torch.arange(len(rows)) % 3 != 0), 40)
        np.testing.assert_allclose(
            layer(dropped).numpy(), layer(dropped.dense()).numpy(), rtol=1e-5, atol=1e-5
        )
        if center or scaling != "none":
            assert not np.allclose(layer(dropped).numpy(), layer(batch).numpy())
    assert layer(torch.zeros(2, 40)).isfinite().all()  # the export's dummy input: lines of no rating


def test_unscaled_dropout_zeroes_ratings_without_touching_the_others() -> None:
    from model.network import SparseRows

    indptr = np.array([0, 3, 5], dtype=np.int64)
    indices = np.array([0, 2, 4, 2, 3], dtype=np.int64)
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    rows = SparseRows(indptr, indices, values, 6)
    torch.manual_seed(0)
    kept = rows.dropout(0.5, rescale=False).values
    assert set(kept.tolist()) - {0.0} <= set(values.tolist()) and (kept == 0).any()
    torch.manual_seed(0)
    scaled = rows.dropout(0.5).values
    assert set(scaled.tolist()) - {0.0} <= {2 * v for v in values.tolist()}


def test_weights_saved_in_the_linear_layout_load_transposed() -> None:
    from model.network import RatingInput

    layer = RatingInput(7, 3)
    old = {"weight": torch.randn(3, 7), "bias": torch.randn(3)}  # nn.Linear's (out, in)
    layer.load_state_dict(old)
    torch.testing.assert_close(layer.weight, old["weight"].t())
    x = torch.randn(2, 7)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, old["weight"], old["bias"]))


@pytest.mark.parametrize(
    ("n_rows", "n_cols", "k"),
    [(30, 6, 200), (6, 30, 200), (30, 40, 20)],
    ids=["through-columns", "through-rows", "paired"],
)
def test_block_scores_equal_the_paired_scores_and_their_gradients(n_rows: int, n_cols: int, k: int) -> None:
    torch.manual_seed(0)
    model = DCMC(ModelConfig(n_users=5, n_items=4, levels=(1.0, 2.0, 3.0), hidden=(8, 16)))
    u = torch.randn(n_rows, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(n_cols, 16, dtype=torch.float64, requires_grad=True)
    bilinear = model.bilinear.detach().double().requires_grad_(True)
    model.bilinear = torch.nn.Parameter(bilinear)
    rows, cols = torch.randint(n_rows, (k,)), torch.randint(n_cols, (k,))
    weights = torch.randn(k, 3, dtype=torch.float64)
    results = []
    for scores in (model.scores(u[rows], v[cols]), model.block_scores(u, v, rows, cols)):
        grads = torch.autograd.grad((scores * weights).sum(), [u, v, model.bilinear])
        results.append((scores, grads))
    (paired, paired_grads), (block, block_grads) = results
    assert torch.allclose(block, paired, atol=1e-12)
    for a, b in zip(block_grads, paired_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-12)


def _trained_like(cfg: ModelConfig, seed: int) -> DCMC:
    """A network with random weights and BatchNorm statistics (eval mode), as training leaves one."""
    torch.manual_seed(seed)
    net = DCMC(cfg)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm1d):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2.0)
                m.weight.normal_()
                m.bias.normal_()
    return net.eval()


def test_fused_networks_concatenate_embeddings_and_average_scores() -> None:
    from model.network import fuse

    cfg = ModelConfig(n_users=9, n_items=11, levels=(1.0, 2.0, 3.0), hidden=(8, 4), input_scaling="sqrt",
                      input_center=2.0)  # fmt: skip
    members = [_trained_like(cfg, s) for s in range(3)]
    wide = fuse(members)
    assert wide.config.hidden == (24, 12) and not wide.training
    rng = np.random.default_rng(0)
    rows = torch.tensor(rng.integers(0, 4, size=(5, 11)), dtype=torch.float32)
    cols = torch.tensor(rng.integers(0, 4, size=(6, 9)), dtype=torch.float32)
    u, v = wide.embed_rows(rows), wide.embed_cols(cols)
    assert torch.allclose(u, torch.cat([m.embed_rows(rows) for m in members], dim=1), atol=1e-5)
    assert torch.allclose(v, torch.cat([m.embed_cols(cols) for m in members], dim=1), atol=1e-5)
    paired = [(m.embed_rows(rows)[:5], m.embed_cols(cols)[:5]) for m in members]
    mean_scores = torch.stack([m.scores(a, b) for m, (a, b) in zip(members, paired, strict=True)]).mean(0)
    assert torch.allclose(wide.scores(u[:5], v[:5]), mean_scores, atol=1e-5)
    # The softmax of the averaged scores is the members' geometric mean distribution, renormalised.
    logp = torch.stack(
        [torch.log_softmax(m.scores(a, b), -1) for m, (a, b) in zip(members, paired, strict=True)]
    )
    geo = torch.softmax(logp.mean(0), -1)
    assert torch.allclose(torch.softmax(wide.scores(u[:5], v[:5]), -1), geo, atol=1e-5)
    assert fuse(members[:1]) is members[0]
    with pytest.raises(ValueError, match="share one ModelConfig"):
        fuse([members[0], _trained_like(ModelConfig(n_users=9, n_items=11, levels=(1.0, 2.0, 3.0)), 0)])
