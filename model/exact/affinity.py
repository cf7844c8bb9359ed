"""The co-rating tables w(j, j') and w_u(i, i') of the kernel's co-rating terms: dense up to DENSE_TABLE_MAX
lines, else sparse (each line's strongest neighbours), and how they take replaced lines as ratings arrive.
model/exact/gram.py builds them from the known ratings.

The maths: the package docstring (model/exact/__init__.py) and docs/model.md."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import scipy.sparse as sp

from model.engine import in_order
from model.ratings import ranges
from model.types import FloatArray, IntArray

DENSE_TABLE_MAX = 8192
"""Up to this many items (or users) a co-rating table is a dense array holding every positive pair
(0.5 GB of float64 at this size); above, a sparse one holding each line's strongest neighbours."""


CO_RATING_NEIGHBOURS = 100
"""The neighbours a line keeps in a sparse co-rating table: its CO_RATING_NEIGHBOURS pairs of largest
max(0, rho) at the default shrinkage (the search's start), and every pair that keeps it (symmetric)."""


FRESH_CHUNK_CELLS = 1 << 22
"""Cells of a chunk of fresh co-rating lines (`with_lines`): a replay or a restore that changes tens of
thousands of users' lines computes them this many at a time (32 MB of float64), never all at once."""


FreshLines = FloatArray | Callable[[int, int], FloatArray]
"""New co-rating lines for `with_lines(lines, fresh)`: the (len(lines), size) array, or a function of
(lo, hi) giving the rows of lines[lo:hi]."""


PATCHED_LINES_MAX = 256
"""Replaced lines a dense table keeps beside its shared array (`DenseAffinity`) before it folds them in:
one size^2 copy per this many changed lines, not one per applied batch."""


class DenseAffinity:
    """A co-rating table held whole: a shared (base, base) float64 array, never written, and the lines
    replaced since (`with_lines`) as rows of their own, which take precedence over it (and, the table
    being symmetric, their columns too); lines past the array (added by `grown`) are empty until
    replaced. An online batch so costs its lines, not a copy of the table; the replaced lines are folded
    into a new array once there are PATCHED_LINES_MAX of them."""

    def __init__(
        self,
        table: FloatArray,
        size: int | None = None,
        patched: IntArray | None = None,
        rows: FloatArray | None = None,
    ) -> None:
        self.table = table
        self.size = len(table) if size is None else size
        self.patched = np.empty(0, dtype=np.int64) if patched is None else patched  # sorted line ids
        self.patch_rows = np.empty((0, self.size)) if rows is None else rows  # (len(patched), size)
        self._slot = np.full(self.size, -1, dtype=np.int64)  # line -> its row in patch_rows, or -1
        self._slot[self.patched] = np.arange(len(self.patched))

    def __len__(self) -> int:
        return self.size

    def _base_block(self, a: IntArray, b: IntArray) -> FloatArray:
        """The shared array's w(a[i], b[j]), 0 past its lines: (len(a), len(b))."""
        n = len(self.table)
        out = np.zeros((len(a), len(b)))
        ia, ib = np.flatnonzero(a < n), np.flatnonzero(b < n)
        out[np.ix_(ia, ib)] = self.table[np.ix_(a[ia], b[ib])]
        return out

    def pairs(self, a: IntArray, b: IntArray) -> FloatArray:
        """w(a[k], b[k]) for each k."""
        a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
        n = len(self.table)
        inside = (a < n) & (b < n)
        out = np.zeros(len(a))
        out[inside] = self.table[a[inside], b[inside]]
        sa, sb = self._slot[a], self._slot[b]
        cols, rows = np.flatnonzero(sb >= 0), np.flatnonzero(sa >= 0)
        out[cols] = self.patch_rows[sb[cols], a[cols]]  # a replaced line's column
        out[rows] = self.patch_rows[sa[rows], b[rows]]  # a replaced line's row
        return out

    def block(self, a: IntArray, b: IntArray) -> FloatArray:
        """w(a[i], b[j]): (len(a), len(b))."""
        a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
        if not len(self.patched) and self.size == len(self.table):
            if in_order(b, self.size):  # whole lines: a row gather, no 2-D index
                out: FloatArray = np.take(self.table, a, axis=0)
                return out
            out = self.table[np.ix_(a, b)]
            return out
        out = self._base_block(a, b)
        sa, sb = self._slot[a], self._slot[b]
        cols = np.flatnonzero(sb >= 0)
        out[:, cols] = self.patch_rows[np.ix_(sb[cols], a)].T
        rows = np.flatnonzero(sa >= 0)
        out[rows] = self.patch_rows[np.ix_(sa[rows], b)]
        return out

    def rows(self, a: IntArray) -> FloatArray:
        """Whole lines: (len(a), size)."""
        return self.block(np.asarray(a, dtype=np.int64), np.arange(self.size))

    def weighted_lines(self, lines: IntArray, weights: FloatArray) -> FloatArray:
        """table[lines]^T weights: (size, q) for weights (len(lines), q)."""
        out: FloatArray = self.rows(lines).T @ weights
        return out

    def add_weighted_lines(self, out: FloatArray, lines: IntArray, weights: FloatArray) -> None:
        """out += table[lines]^T weights over out's lines (size or fewer, q)."""
        out += self.weighted_lines(lines, weights)[: len(out)]

    def add_line(self, out: FloatArray, line: int, weight: float) -> None:
        """out += weight table[line, :len(out)] (a table grown past `out`'s lines reads their first)."""
        slot = self._slot[line]
        if slot >= 0:
            out += weight * self.patch_rows[slot, : len(out)]
            return
        row = np.zeros(len(out))
        n = min(len(self.table), len(out))
        if line < len(self.table):
            row[:n] = self.table[line, :n]
        inside = self.patched[self.patched < len(out)]
        row[inside] = self.patch_rows[self._slot[inside], line]  # the replaced lines' entries
        out += weight * row

    def grown(self, size: int) -> Affinity:
        """The table with empty lines (no neighbours) up to `size`; past DENSE_TABLE_MAX lines (new users
        arriving online) a sparse one of each line's strongest pairs (`SparseAffinity.from_dense`): a
        dense table of size^2 float64 would grow quadratically with them. The shared array is kept."""
        if size <= self.size:
            return self
        if size > DENSE_TABLE_MAX:
            return SparseAffinity.from_dense(self.toarray(), size)
        rows = np.zeros((len(self.patched), size))
        rows[:, : self.size] = self.patch_rows
        return DenseAffinity(self.table, size, self.patched, rows)

    def with_lines(self, lines: IntArray, fresh: FreshLines) -> DenseAffinity:
        """The table with the given lines (and, symmetric, columns) replaced by `fresh` (len(lines), size),
        given whole or chunk by chunk (`FreshLines`): kept as replaced lines, or folded into a new array
        when there would be more than PATCHED_LINES_MAX."""
        lines = np.asarray(lines, dtype=np.int64)
        if len(np.union1d(self.patched, lines)) > PATCHED_LINES_MAX:
            table = self.toarray().copy()
            for lo, hi, rows in _fresh_chunks(lines, fresh, self.size):
                table[lines[lo:hi], :] = rows
                table[:, lines[lo:hi]] = rows.T
            block = table[np.ix_(lines, lines)]  # exactly symmetric, as the table is: reads may take rows
            table[np.ix_(lines, lines)] = (block + block.T) / 2  # for columns
            return DenseAffinity(table)
        new = np.concatenate([rows for _, _, rows in _fresh_chunks(lines, fresh, self.size)])
        block = new[:, lines]
        new[:, lines] = (block + block.T) / 2
        keep = ~np.isin(self.patched, lines)
        old = self.patch_rows[keep].copy()
        old[:, lines] = new[:, self.patched[keep]].T  # the older replaced lines' entries at the new ones
        patched = np.concatenate([self.patched[keep], lines])
        order = np.argsort(patched, kind="stable")
        return DenseAffinity(self.table, self.size, patched[order], np.vstack([old, new])[order])

    def toarray(self) -> FloatArray:
        """The whole table as a dense array (the shared one itself while no line was replaced)."""
        if not len(self.patched) and self.size == len(self.table):
            return self.table
        out = np.zeros((self.size, self.size))
        n = len(self.table)
        out[:n, :n] = self.table
        out[self.patched, :] = self.patch_rows
        out[:, self.patched] = self.patch_rows.T
        return out


class SparseAffinity:
    """A symmetric co-rating table holding each line's strongest neighbours: what a line's neighbours cost,
    not size^2. A shared scipy CSR (sorted indices), never written, and the lines replaced since
    (`with_lines`) as sparse rows of their own (`patch`, with its transpose `patch_t`), which take
    precedence over it and, the table being symmetric, over its columns too: a replaced line's row is the
    table's whole row. An online batch so costs its lines' pairs, not a copy of the table; the replaced
    lines are folded into a new CSR once there are PATCHED_LINES_MAX of them."""

    def __init__(
        self, matrix: sp.csr_matrix, patched: IntArray | None = None, patch: sp.csr_matrix | None = None
    ) -> None:
        self.matrix = matrix
        size = int(matrix.shape[0])
        self.patched = np.empty(0, dtype=np.int64) if patched is None else patched  # sorted line ids
        self.patch = sp.csr_matrix((len(self.patched), size)) if patch is None else patch
        self.patch.sort_indices()
        self.patch_t = self.patch.T.tocsr()  # (size, len(patched)): each line's pairs with replaced lines
        self.patch_t.sort_indices()
        self._slot = np.full(size, -1, dtype=np.int64)  # line -> its row in patch, or -1
        self._slot[self.patched] = np.arange(len(self.patched))

    def __len__(self) -> int:
        return int(self.matrix.shape[0])

    def _entries(self, lines: IntArray) -> tuple[IntArray, IntArray, FloatArray]:
        """(owner, neighbour, weight) of every stored pair of `lines` (owner: the index into `lines`)."""
        owner, neighbours, values = _csr_rows(self.matrix, lines)
        if not len(self.patched):
            return owner, neighbours, values
        slot = self._slot[lines]
        keep = (slot[owner] < 0) & (self._slot[neighbours] < 0)  # the shared array's, of lines not replaced
        mine = np.flatnonzero(slot >= 0)  # replaced lines: their rows
        o1, j1, v1 = _csr_rows(self.patch, slot[mine])
        rest = np.flatnonzero(slot < 0)  # other lines: their pairs with the replaced lines
        o2, j2, v2 = _csr_rows(self.patch_t, lines[rest])
        return (
            np.concatenate([owner[keep], mine[o1], rest[o2]]),
            np.concatenate([neighbours[keep], j1, self.patched[j2]]),
            np.concatenate([values[keep], v1, v2]),
        )

    def pairs(self, a: IntArray, b: IntArray) -> FloatArray:
        """w(a[k], b[k]) for each k (0 where b[k] is not among a[k]'s neighbours)."""
        a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
        if not len(self.patched):
            return np.asarray(self.matrix[a, b], dtype=np.float64).reshape(-1)
        sa, sb = self._slot[a], self._slot[b]
        out = np.zeros(len(a))
        base, rows, cols = (sa < 0) & (sb < 0), sa >= 0, (sa < 0) & (sb >= 0)
        for where, table, x, y in (
            (base, self.matrix, a, b),
            (rows, self.patch, sa, b),
            (cols, self.patch, sb, a),
        ):
            if where.any():
                out[where] = np.asarray(table[x[where], y[where]], dtype=np.float64).reshape(-1)
        return out

    def block(self, a: IntArray, b: IntArray) -> FloatArray:
        """w(a[i], b[j]): (len(a), len(b)), read from the stored neighbours of whichever side's lines hold
        fewer (the table is symmetric: w(a_i, b_j) = w(b_j, a_i)), each looked up among the other side's
        sorted distinct lines. A request's 100 items against its user's rated items: tens of microseconds
        where scipy's fancy indexing of the sparse table took 0.3-0.8 ms."""
        a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
        held = self.matrix.indptr
        if int((held[a + 1] - held[a]).sum()) < int((held[b + 1] - held[b]).sum()):
            return self._lookup(a, b)
        out: FloatArray = self._lookup(b, a).T
        return out

    def _lookup(self, lines: IntArray, others: IntArray) -> FloatArray:
        """w(lines[i], others[j]) from the stored neighbours of `lines`: (len(lines), len(others))."""
        owner, neighbours, values = self._entries(lines)
        distinct, inverse = np.unique(others, return_inverse=True)
        at = np.minimum(np.searchsorted(distinct, neighbours), max(len(distinct) - 1, 0))
        hit = distinct[at] == neighbours if len(distinct) else np.zeros(len(neighbours), dtype=bool)
        out: FloatArray = np.zeros((len(lines), len(distinct)))
        out[owner[hit], at[hit]] = values[hit]
        return out[:, inverse.reshape(-1)]

    def rows(self, a: IntArray) -> FloatArray:
        """Whole lines: (len(a), size)."""
        a = np.asarray(a, dtype=np.int64)
        if not len(self.patched):
            out: FloatArray = self.matrix[a].toarray()
            return out
        owner, neighbours, values = self._entries(a)
        out = np.zeros((len(a), len(self)))
        out[owner, neighbours] = values  # a line's neighbours are distinct
        return out

    def weighted_lines(self, lines: IntArray, weights: FloatArray) -> FloatArray:
        """table[lines]^T weights: (size, q) for weights (len(lines), q), without densifying the lines (a
        user with thousands of ratings over a large catalogue)."""
        lines = np.asarray(lines, dtype=np.int64)
        if not len(self.patched):
            out: FloatArray = np.asarray(self.matrix[lines].T @ weights)
            return out
        owner, neighbours, values = self._entries(lines)
        picked = sp.csr_matrix((values, (neighbours, owner)), shape=(len(self), len(lines)))
        return np.asarray(picked @ weights)

    def add_weighted_lines(self, out: FloatArray, lines: IntArray, weights: FloatArray) -> None:
        """out += table[lines]^T weights over out's lines (size or fewer, q), from the lines' stored
        neighbours: one bincount per column (a user's items over a catalogue of 1e5 reach 2e4 to 7e4
        neighbour entries on the synthetic Epinions; sorting them to sum by neighbour took 2-7 times as
        long), no (size, q) product of the sparse lines."""
        owner, neighbours, values = self._entries(np.asarray(lines, dtype=np.int64))
        inside = neighbours < len(out)
        if not inside.all():
            owner, neighbours, values = owner[inside], neighbours[inside], values[inside]
        if len(values) == 0:
            return
        for u in range(weights.shape[1]):
            out[:, u] += np.bincount(neighbours, weights=values * weights[owner, u], minlength=len(out))

    def add_line(self, out: FloatArray, line: int, weight: float) -> None:
        """out += weight table[line, :len(out)] (a table grown past `out`'s lines reads their first)."""
        _, neighbours, values = self._entries(np.array([line], dtype=np.int64))
        inside = neighbours < len(out)
        out[neighbours[inside]] += weight * values[inside]  # a line's neighbours are distinct

    def grown(self, size: int) -> SparseAffinity:
        """The table with empty lines (no neighbours) up to `size`."""
        if size <= len(self):
            return self
        m, p = self.matrix, self.patch
        indptr = np.concatenate([m.indptr, np.full(size - len(self), m.indptr[-1])])
        matrix = sp.csr_matrix((m.data, m.indices, indptr), shape=(size, size))
        patch = sp.csr_matrix((p.data, p.indices, p.indptr), shape=(len(self.patched), size))
        return SparseAffinity(matrix, self.patched, patch)

    @classmethod
    def from_dense(cls, table: FloatArray, size: int) -> SparseAffinity:
        """A dense symmetric table cut to each line's CO_RATING_NEIGHBOURS largest positive weights and
        their mirror images (as `with_lines` cuts a fresh line), with empty lines up to `size`. Chunks of
        lines at a time: no second size^2 array."""
        n = len(table)
        k = min(CO_RATING_NEIGHBOURS, n)
        keys = []
        for lo in range(0, n, 1024):
            chunk = table[lo : lo + 1024]
            top = np.argpartition(chunk, n - k, axis=1)[:, n - k :]
            r = np.repeat(np.arange(lo, lo + len(chunk)), k)
            c = top.reshape(-1)
            keep = table[r, c] > 0
            keys += [r[keep] * n + c[keep], c[keep] * n + r[keep]]
        flat = np.unique(np.concatenate(keys)) if keys else np.empty(0, dtype=np.int64)
        rows, cols = flat // n, flat % n
        matrix = sp.csr_matrix((table[rows, cols], (rows, cols)), shape=(size, size))
        matrix.sort_indices()
        return cls(matrix)

    def with_lines(self, lines: IntArray, fresh: FreshLines) -> SparseAffinity:
        """The table with the given lines (and, symmetric, columns) replaced by `fresh` (len(lines), size),
        given whole or chunk by chunk (`FreshLines`), each fresh line cut to its CO_RATING_NEIGHBOURS
        strongest pairs (the fresh lines' pairs among themselves made symmetric, (w + w^T) / 2): kept as
        replaced lines, or folded into a new CSR when there would be more than PATCHED_LINES_MAX.
        Memory for the kept pairs, not len(lines) x size; time for the replaced lines' pairs."""
        size, lines = len(self), np.asarray(lines, dtype=np.int64)
        k, j, v = _strongest(lines, fresh, size)
        where = np.full(size, -1, dtype=np.int64)
        where[lines] = np.arange(len(lines))
        inner = where[j] >= 0  # the fresh lines among themselves: made symmetric, (w + w^T) / 2
        among = sp.csr_matrix((v[inner], (k[inner], where[j[inner]])), shape=(len(lines), len(lines)))
        among = ((among + among.T) / 2).tocoo()
        outer = ~inner
        new = sp.csr_matrix(  # the fresh lines' rows
            (np.concatenate([v[outer], among.data]),
             (np.concatenate([k[outer], among.row]), np.concatenate([j[outer], lines[among.col]]))),
            shape=(len(lines), size),
        )  # fmt: skip
        # The lines replaced earlier and not now: their rows, with their pairs with the fresh lines taken
        # from the fresh rows (the table stays symmetric).
        kept = np.flatnonzero(where[self.patched] < 0)
        old = self.patch[kept].tocoo()
        stays = where[old.col] < 0
        mirror = sp.csr_matrix(new.T)[self.patched[kept]].tocoo()  # (kept, fresh) pairs as the fresh give
        older = sp.csr_matrix(
            (np.concatenate([old.data[stays], mirror.data]),
             (np.concatenate([old.row[stays], mirror.row]),
              np.concatenate([old.col[stays], lines[mirror.col]]))),
            shape=(len(kept), size),
        )  # fmt: skip
        patched = np.concatenate([self.patched[kept], lines])
        order = np.argsort(patched, kind="stable")
        patch = sp.vstack([older, new], format="csr")[order]
        patch.eliminate_zeros()
        out = SparseAffinity(self.matrix, patched[order], patch)
        return out if len(patched) <= PATCHED_LINES_MAX else SparseAffinity(out.csr())

    def csr(self) -> sp.csr_matrix:
        """The whole table as one CSR (sorted indices): the shared one itself while no line was replaced."""
        if not len(self.patched):
            return self.matrix
        keep = np.ones(len(self))
        keep[self.patched] = 0.0
        mask = sp.diags(keep)
        rest = mask @ self.matrix @ mask  # the other lines' pairs among themselves
        p = self.patch.tocoo()
        outside = self._slot[p.col] < 0  # pairs with other lines, and their mirror images
        pairs = sp.csr_matrix(
            (np.concatenate([p.data, p.data[outside]]),
             (np.concatenate([self.patched[p.row], p.col[outside]]),
              np.concatenate([p.col, self.patched[p.row[outside]]]))),
            shape=rest.shape,
        )  # fmt: skip
        out = (rest + pairs).tocsr()
        out.eliminate_zeros()
        out.sort_indices()
        return out

    def toarray(self) -> FloatArray:
        """The whole table as a dense array."""
        out: FloatArray = self.csr().toarray()
        return out


def _csr_rows(m: sp.csr_matrix, at: IntArray) -> tuple[IntArray, IntArray, FloatArray]:
    """The stored entries of the rows `at` of `m`: (index into `at`, column, value)."""
    starts = m.indptr[at].astype(np.int64)
    owner, pos = ranges(starts, m.indptr[at + 1].astype(np.int64) - starts)
    return owner, m.indices[pos], m.data[pos]


def _strongest(lines: IntArray, fresh: FreshLines, size: int) -> tuple[IntArray, IntArray, FloatArray]:
    """The fresh lines cut to their CO_RATING_NEIGHBOURS strongest pairs: (index into lines, neighbour,
    weight), nonzero weights only, chunk by chunk."""
    k_parts, j_parts, v_parts = [], [], []
    kth = min(CO_RATING_NEIGHBOURS, size - 1)
    for lo, hi, rows in _fresh_chunks(lines, fresh, size):
        top = np.argpartition(-rows, kth, axis=1)[:, :CO_RATING_NEIGHBOURS]
        at = np.repeat(np.arange(hi - lo), top.shape[1])
        values = rows[at, top.reshape(-1)]
        nonzero = values != 0
        k_parts.append(at[nonzero] + lo)
        j_parts.append(top.reshape(-1)[nonzero])
        v_parts.append(values[nonzero])
    k, j, v = (np.concatenate(x) if x else np.empty(0) for x in (k_parts, j_parts, v_parts))
    return k.astype(np.int64), j.astype(np.int64), v.astype(np.float64)


Affinity = DenseAffinity | SparseAffinity


def _fresh_chunks(lines: IntArray, fresh: FreshLines, size: int) -> Iterator[tuple[int, int, FloatArray]]:
    """(lo, hi, the fresh rows of lines[lo:hi]) over `lines`, at most FRESH_CHUNK_CELLS cells a chunk."""
    step = max(1, FRESH_CHUNK_CELLS // max(size, 1))
    for lo in range(0, len(lines), step):
        hi = min(lo + step, len(lines))
        yield lo, hi, fresh(lo, hi) if callable(fresh) else fresh[lo:hi]
