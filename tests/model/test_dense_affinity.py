"""model.exact.affinity.DenseAffinity: replaced lines kept beside the shared array read exactly as a table
with them written in, through every read, as lines are replaced, the table grows and the lines fold in."""

from __future__ import annotations

import numpy as np
import pytest

from model.exact import affinity
from model.exact.affinity import DenseAffinity, SparseAffinity


def _reference(table: np.ndarray, lines: np.ndarray, fresh: np.ndarray) -> np.ndarray:
    """The table with the lines written in as a copy (what `with_lines` did before it kept them apart)."""
    out = table.copy()
    out[lines, :] = fresh
    out[:, lines] = fresh.T
    block = out[np.ix_(lines, lines)]
    out[np.ix_(lines, lines)] = (block + block.T) / 2
    return out


def _symmetric(rng: np.random.Generator, n: int) -> np.ndarray:
    x = rng.random((n, n))
    return (x + x.T) / 2


def _check(table: DenseAffinity, want: np.ndarray, rng: np.random.Generator) -> None:
    n = len(want)
    assert len(table) == n
    np.testing.assert_array_equal(table.toarray(), want)
    a, b = rng.integers(0, n, 40), rng.integers(0, n, 30)
    pa, pb = rng.integers(0, n, 50), rng.integers(0, n, 50)
    np.testing.assert_array_equal(table.pairs(pa, pb), want[pa, pb])
    np.testing.assert_array_equal(table.block(a, b), want[np.ix_(a, b)])
    np.testing.assert_array_equal(table.rows(a[:5]), want[a[:5]])
    w = rng.random((5, 3))
    np.testing.assert_allclose(table.weighted_lines(a[:5], w), want[a[:5]].T @ w, rtol=1e-12)
    for line in rng.integers(0, n, 6).tolist():
        out = np.zeros(n - 2)
        table.add_line(out, line, 0.5)
        np.testing.assert_array_equal(out, 0.5 * want[line, : n - 2])


def test_replaced_lines_read_as_a_table_with_them_written_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(affinity, "PATCHED_LINES_MAX", 12)  # fold in after a few batches
    rng = np.random.default_rng(0)
    base = _symmetric(rng, 30)
    table, want = DenseAffinity(base), base.copy()
    shared = base.copy()
    folded = 0
    for step in range(12):
        if step % 4 == 3:  # new users arrive: empty lines
            table, want = table.grown(len(want) + 3), np.pad(want, ((0, 3), (0, 3)))
        lines = np.sort(rng.choice(len(want), int(rng.integers(1, 5)), replace=False))
        fresh = rng.random((len(lines), len(want)))
        before = table.table
        table, want = table.with_lines(lines, fresh), _reference(want, lines, fresh)
        folded += table.table is not before
        _check(table, want, rng)
    assert folded >= 1  # the replaced lines were folded into a new array at least once
    np.testing.assert_array_equal(base, shared)  # the shared array is never written


def test_a_chunked_fresh_function_gives_the_same_table() -> None:
    rng = np.random.default_rng(1)
    base = _symmetric(rng, 20)
    lines, fresh = np.array([2, 5, 11]), rng.random((3, 20))
    whole = DenseAffinity(base).with_lines(lines, fresh)
    chunked = DenseAffinity(base).with_lines(lines, lambda lo, hi: fresh[lo:hi])
    np.testing.assert_array_equal(whole.toarray(), chunked.toarray())


def test_growing_past_the_dense_limit_gives_a_sparse_table_of_the_replaced_lines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(affinity, "DENSE_TABLE_MAX", 24)
    rng = np.random.default_rng(2)
    table = DenseAffinity(_symmetric(rng, 20)).with_lines(np.array([3]), rng.random((1, 20)))
    sparse = table.grown(30)
    assert isinstance(sparse, SparseAffinity) and len(sparse) == 30
    want = SparseAffinity.from_dense(table.toarray(), 30)
    np.testing.assert_array_equal(sparse.matrix.toarray(), want.matrix.toarray())
