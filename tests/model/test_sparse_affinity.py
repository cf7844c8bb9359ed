"""model.exact.affinity.SparseAffinity: replaced lines kept beside the shared CSR read exactly as the table
rebuilt whole per batch (what `with_lines` did before it kept them apart), through every read, as lines
are replaced, the table grows and the lines fold in; the shared CSR is never copied by a batch."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from model.exact import affinity
from model.exact.affinity import SparseAffinity


def _rebuilt(matrix: sp.csr_matrix, lines: np.ndarray, fresh: np.ndarray) -> sp.csr_matrix:
    """The table with the fresh lines cut to their strongest pairs written in as a new CSR: the former
    `SparseAffinity.with_lines`, kept here as the reference."""
    size = matrix.shape[0]
    keep = np.ones(size)
    keep[lines] = 0.0
    rest = sp.diags(keep) @ matrix @ sp.diags(keep)
    kth = min(affinity.CO_RATING_NEIGHBOURS, size - 1)
    top = np.argpartition(-fresh, kth, axis=1)[:, : affinity.CO_RATING_NEIGHBOURS]
    k = np.repeat(np.arange(len(lines)), top.shape[1])
    j = top.reshape(-1)
    v = fresh[k, j]
    k, j, v = k[v != 0], j[v != 0], v[v != 0]
    where = np.full(size, -1)
    where[lines] = np.arange(len(lines))
    inner = where[j] >= 0
    among = sp.csr_matrix((v[inner], (k[inner], where[j[inner]])), shape=(len(lines), len(lines)))
    among = ((among + among.T) / 2).tocoo()
    outer = ~inner
    rows = np.concatenate([lines[k[outer]], j[outer], lines[among.row]])
    cols = np.concatenate([j[outer], lines[k[outer]], lines[among.col]])
    data = np.concatenate([v[outer], v[outer], among.data])
    out = (rest + sp.csr_matrix((data, (rows, cols)), shape=(size, size))).tocsr()
    out.eliminate_zeros()
    out.sort_indices()
    return out


def _check(table: SparseAffinity, want: np.ndarray, rng: np.random.Generator) -> None:
    n = len(want)
    assert len(table) == n
    np.testing.assert_array_equal(table.toarray(), want)
    a, b = rng.integers(0, n, 40), rng.integers(0, n, 30)
    pa, pb = rng.integers(0, n, 50), rng.integers(0, n, 50)
    pa[:10] = (
        table.patched[rng.integers(0, max(len(table.patched), 1), 10)] if len(table.patched) else pa[:10]
    )
    np.testing.assert_array_equal(table.pairs(pa, pb), want[pa, pb])
    np.testing.assert_array_equal(table.block(a, b), want[np.ix_(a, b)])
    np.testing.assert_array_equal(table.block(a[:3], b), want[np.ix_(a[:3], b)])
    np.testing.assert_array_equal(table.rows(a[:5]), want[a[:5]])
    w = rng.random((5, 3))
    np.testing.assert_allclose(table.weighted_lines(a[:5], w), want[a[:5]].T @ w, rtol=1e-12)
    out = np.zeros((n - 2, 3))
    table.add_weighted_lines(out, a[:5], w)
    np.testing.assert_allclose(out, (want[a[:5]].T @ w)[: n - 2], rtol=1e-12)
    for line in [*rng.integers(0, n, 4).tolist(), *table.patched[:2].tolist()]:
        row = np.zeros(n - 2)
        table.add_line(row, line, 0.5)
        np.testing.assert_array_equal(row, 0.5 * want[line, : n - 2])


def test_replaced_lines_read_as_the_table_rebuilt_per_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(affinity, "PATCHED_LINES_MAX", 14)  # fold in after a few batches
    monkeypatch.setattr(affinity, "CO_RATING_NEIGHBOURS", 6)  # fresh lines are cut
    rng = np.random.default_rng(0)
    dense = np.maximum(rng.random((40, 40)) - 0.6, 0)
    base = sp.csr_matrix((dense + dense.T) / 2)
    base.sort_indices()
    shared = base.copy()
    table, want = SparseAffinity(base), base
    folded = 0
    for step in range(14):
        if step % 5 == 4:  # new users arrive: empty lines
            table = table.grown(want.shape[0] + 3)
            want = sp.csr_matrix(
                (want.data, want.indices, np.r_[want.indptr, [want.nnz] * 3]), shape=(len(table),) * 2
            )
        lines = np.sort(rng.choice(len(table), int(rng.integers(1, 5)), replace=False))
        fresh = np.maximum(rng.random((len(lines), len(table))) - 0.3, 0)
        before = table.matrix
        table, want = table.with_lines(lines, fresh), _rebuilt(want, lines, fresh)
        if table.matrix is not before:
            folded += 1
            assert not len(table.patched)
        else:  # a batch shares the CSR: it costs its lines
            assert set(lines) <= set(table.patched)
        _check(table, want.toarray(), rng)
        csr = table.csr()
        assert (csr != want).nnz == 0 and csr.has_sorted_indices
    assert folded >= 1
    assert (base != shared).nnz == 0 and np.array_equal(base.indptr, shared.indptr)  # never written


def test_a_chunked_fresh_function_gives_the_same_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(affinity, "FRESH_CHUNK_CELLS", 40)  # two lines a chunk
    rng = np.random.default_rng(1)
    base = SparseAffinity(sp.csr_matrix(np.zeros((20, 20))))
    lines, fresh = np.array([2, 5, 11, 13, 17]), rng.random((5, 20))
    whole = base.with_lines(lines, fresh)
    chunked = base.with_lines(lines, lambda lo, hi: fresh[lo:hi])
    np.testing.assert_array_equal(whole.toarray(), chunked.toarray())
