"""The co-rating tables w(j, j') and w_u(i, i') of the kernel's co-rating terms: dense up to DENSE_TABLE_MAX
lines, else sparse (each line's strongest neighbours); built from the known ratings (`CoRatingGram`) or
line by line (`co_rating_rows`) as ratings arrive.

The maths: the package docstring (model/exact/__init__.py) and docs/model.md."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse as sp
from scipy.linalg import blas

from model.engine import in_order
from model.ratings import LineIndex, Ratings, ranges
from model.types import FloatArray, IntArray

DENSE_TABLE_MAX = 8192
"""Up to this many items (or users) a co-rating table is a dense array holding every positive pair
(0.5 GB of float64 at this size); above, a sparse one holding each line's strongest neighbours."""


CO_RATING_NEIGHBOURS = 100
"""The neighbours a line keeps in a sparse co-rating table: its CO_RATING_NEIGHBOURS pairs of largest
max(0, rho) at the default shrinkage (the search's start), and every pair that keeps it (symmetric)."""


GRAM_PAIR_BUDGET = 2_000_000_000
"""Most co-rated pairs (or their equivalent in dense products) a sparse co-rating table may cost to build
(`gram_cost`). The synthetic Epinions tables cost 0.5 G (items) and 0.8 G (users) pairs and build in
minutes here; the synthetic ml-10m ones 7.6 G and 122 G pairs on all its ratings, its item table 0.8 G as
dense products (`GRAM_BLAS_LINES`). Above it the search and the untuned start leave that term off
(`co_rating_affordable`, training/tune.py)."""


GRAM_BLAS_LINES = 16384
"""Up to this many lines a sparse table's gram may instead be built from dense products of the pivot
lines, chunk by chunk (`CoRatingGram._products`: two float32 m x m accumulators, 2 GB at this size), which
costs n m^2 whatever the density: on a dense matrix far less than its co-rated pairs (the synthetic
ml-10m's item table: 4.3 G pairs, about 14 minutes at the sparse product's rate; as products 209 s)."""


PRODUCT_UNITS_PER_PAIR = 20_000
"""What one co-rated pair of the sparse gram costs in n m^2 units of the dense products' time, measured
here: the sparse product visits 5.3 M pairs a second, a float32 syrk 1e11 n m^2 (each with a training run
beside it). It converts the products' cost to pairs, so that one budget bounds both (`gram_cost`)."""


GRAM_CHUNK_PAIRS = 20_000_000
"""Co-rated (line, line) pairs per chunk of a sparse gram's product: bounds its temporaries."""


PRODUCT_CHUNK_CELLS = 1 << 24
"""Cells of a dense chunk of the gram's products (64 MB of float32) and of its ranking."""


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


@dataclass(frozen=True)
class CoRatingGram:
    """What every co-rating table of one set of ratings is made of, whatever its exponent and shrinkage:
    where the adjusted cosine of two columns is positive (the only pairs a table can weigh: max(0, .)),
    that cosine and the count of rows that rated both. A table then costs its positive pairs (3% of
    Flixster's item pairs, 18% of Douban's), not m^2 powers. Above DENSE_TABLE_MAX columns the gram keeps
    each column's CO_RATING_NEIGHBOURS strongest pairs only (and their mirror images), built from a sparse
    product chunk by chunk, and its tables are sparse."""

    m: int
    index: IntArray
    """Flat positions (j * m + j') of the pairs kept, ascending."""
    cosine: FloatArray
    co: FloatArray

    @property
    def dense(self) -> bool:
        """Whether the tables are dense arrays (every positive pair)."""
        return self.m <= DENSE_TABLE_MAX

    @classmethod
    def of(
        cls, rows: IntArray, cols: IntArray, values: FloatArray, n: int, m: int, what: str = "items"
    ) -> CoRatingGram:
        """The gram of the columns of the n x m matrix (rows, cols, values), each row's mean removed."""
        mean = np.bincount(rows, weights=values, minlength=n) / np.maximum(np.bincount(rows, minlength=n), 1)
        if m > DENSE_TABLE_MAX:
            pairs, products = _gram_costs(np.bincount(rows, minlength=n), m)
            if products is not None and products < pairs:
                return cls._products(rows, cols, values - mean[rows], n, m)
            return cls._sparse(rows, cols, values - mean[rows], n, m)
        centred = np.zeros((n, m))
        centred[rows, cols] = values - mean[rows]
        norms = np.sqrt(np.einsum("ij,ij->j", centred, centred))
        cosine = centred.T @ centred
        del centred
        cosine /= np.maximum(np.outer(norms, norms), 1e-12)
        index = np.flatnonzero(cosine > 0)
        positive = cosine.ravel()[index]
        del cosine
        rated = np.zeros((n, m))
        rated[rows, cols] = 1.0
        co = (rated.T @ rated).ravel()[index]  # rows that rated both
        return cls(m, index, positive, co)

    @classmethod
    def _sparse(cls, rows: IntArray, cols: IntArray, centred: FloatArray, n: int, m: int) -> CoRatingGram:
        """Each column's strongest positive pairs from a sparse product, GRAM_CHUNK_PAIRS at a time."""
        by_col = sp.csr_matrix((centred, (cols, rows)), shape=(m, n))  # (m, n): a column's ratings
        rated = sp.csr_matrix((np.ones(len(rows)), (cols, rows)), shape=(m, n))
        by_row, rated_by_row = by_col.T.tocsr(), rated.T.tocsr()
        norms = np.sqrt(np.asarray(by_col.multiply(by_col).sum(axis=1)).reshape(-1))
        # A column's pairs cost the ratings on the rows it touches: cut the columns into chunks by that.
        work = np.cumsum(rated @ np.diff(rated_by_row.indptr).astype(np.float64))
        keys, cosines, cos = [], [], []
        lo = 0
        while lo < m:
            hi = max(lo + 1, int(np.searchsorted(work, (work[lo - 1] if lo else 0.0) + GRAM_CHUNK_PAIRS)))
            num, both = by_col[lo:hi] @ by_row, rated[lo:hi] @ rated_by_row
            num.sort_indices()
            both.sort_indices()  # its pairs include num's (a zero product drops a pair from num only)
            r = np.repeat(np.arange(hi - lo), np.diff(num.indptr))
            cosine = num.data / np.maximum(norms[lo + r] * norms[num.indices], 1e-12)
            pos = cosine > 0
            r, c, cosine = r[pos], num.indices[pos].astype(np.int64), cosine[pos]
            both_keys = np.repeat(np.arange(hi - lo), np.diff(both.indptr)) * m + both.indices
            co = both.data[np.searchsorted(both_keys, r * m + c)]
            score = cosine * co / (co + 10.0)  # the default shrinkage ranks the neighbours
            order = np.lexsort((-score, r))
            r, c, cosine, co = r[order], c[order], cosine[order], co[order]
            rank = np.arange(len(r)) - np.searchsorted(r, r, side="left")
            top = rank < CO_RATING_NEIGHBOURS
            r, c = r[top] + lo, c[top]
            keys += [r * m + c, c * m + r]  # and the mirror image: the table stays symmetric
            cosines += [cosine[top]] * 2
            cos += [co[top]] * 2
            lo = hi
        flat, first = np.unique(np.concatenate(keys), return_index=True)
        return cls(m, flat, np.concatenate(cosines)[first], np.concatenate(cos)[first])

    @classmethod
    def _products(cls, rows: IntArray, cols: IntArray, centred: FloatArray, n: int, m: int) -> CoRatingGram:
        """Each column's strongest positive pairs, as `_sparse` keeps them, from the whole gram: float32
        syrk products of dense chunks of rows accumulate the centred columns' inner products and the
        co-rating counts (exact: integers below 2^24) in two m x m arrays, whose rows are then ranked."""
        by_row = sp.csr_matrix((centred, (rows, cols)), shape=(n, m))
        by_row.sum_duplicates()
        num = np.zeros((m, m), dtype=np.float32, order="F")
        both = np.zeros((m, m), dtype=np.float32, order="F")
        step = max(1, PRODUCT_CHUNK_CELLS // m)
        for lo in range(0, n, step):
            chunk = by_row[lo : lo + step]
            x = chunk.astype(np.float32).toarray(order="F")
            num = blas.ssyrk(1.0, x, beta=1.0, c=num, trans=1, overwrite_c=1)  # upper triangle of x^T x
            x[...] = 0.0
            x[np.repeat(np.arange(chunk.shape[0]), np.diff(chunk.indptr)), chunk.indices] = 1.0
            both = blas.ssyrk(1.0, x, beta=1.0, c=both, trans=1, overwrite_c=1)
            del x
        norms = np.sqrt(np.diagonal(num).astype(np.float64))
        keys, cosines, cos = [], [], []
        for lo in range(0, m, step):
            hi = min(m, lo + step)
            below = np.arange(m)[None, :] < np.arange(lo, hi)[:, None]  # the lower triangle: mirror it
            dot = np.where(below, num[:, lo:hi].T, num[lo:hi]).astype(np.float64)
            co = np.where(below, both[:, lo:hi].T, both[lo:hi]).astype(np.float64)
            cosine = dot / np.maximum(norms[lo:hi, None] * norms[None, :], 1e-12)
            score = np.where(cosine > 0, cosine * co / (co + 10.0), -1.0)  # the default shrinkage ranks
            top = np.argsort(-score, axis=1, kind="stable")[:, :CO_RATING_NEIGHBOURS]
            r = np.repeat(np.arange(hi - lo), top.shape[1])
            c = top.reshape(-1)
            keep = score[r, c] > 0
            r, c = r[keep], c[keep]
            keys += [(r + lo) * m + c, c * m + r + lo]  # and the mirror image: the table stays symmetric
            cosines += [cosine[r, c]] * 2
            cos += [co[r, c]] * 2
        flat, first = np.unique(np.concatenate(keys), return_index=True)
        return cls(m, flat, np.concatenate(cosines)[first], np.concatenate(cos)[first])

    def table(self, power: float, shrink: float) -> Affinity:
        """w = max(0, cosine x co / (co + shrink))^power: (m, m), dense or sparse."""
        w = self.co / (self.co + shrink)
        w *= self.cosine
        np.power(w, power, out=w)
        if not self.dense:
            line = self.index // self.m
            indptr = np.searchsorted(line, np.arange(self.m + 1))
            return SparseAffinity(sp.csr_matrix((w, self.index % self.m, indptr), shape=(self.m, self.m)))
        out = np.zeros(self.m * self.m)
        out[self.index] = w
        return DenseAffinity(out.reshape(self.m, self.m))


def _gram_costs(pivot_counts: IntArray, m: int) -> tuple[int, int | None]:
    """(co-rated pairs of the sparse gram, its dense products' cost in pairs or None above
    GRAM_BLAS_LINES) of the gram of m lines whose pivot lines hold `pivot_counts` ratings each."""
    counts = np.asarray(pivot_counts, dtype=np.float64)
    products = 2 * len(counts) * m * m // PRODUCT_UNITS_PER_PAIR if m <= GRAM_BLAS_LINES else None
    return int(counts @ counts), products


def gram_cost(known: Ratings, what: str) -> int:
    """What the sparse gram of the item table (`items`) or the user table (`users`) costs, in co-rated
    pairs: those its sparse product visits (every pair of items one user rated, summed over the users, or
    of users who rated one item: the sum of the pivot lines' rating counts squared), or the equivalent of
    its dense products (`GRAM_BLAS_LINES`) when they cost less."""
    pivots, m = (known.rows, known.n_items) if what == "items" else (known.cols, known.n_users)
    pairs, products = _gram_costs(np.bincount(pivots), m)
    return pairs if products is None else min(pairs, products)


def co_rating_affordable(known: Ratings, what: str) -> bool:
    """Whether the co-rating table of the items or the users is worth building: a dense one (up to
    DENSE_TABLE_MAX lines) always is, a sparse one when `gram_cost` is within GRAM_PAIR_BUDGET."""
    lines = known.n_items if what == "items" else known.n_users
    return lines <= DENSE_TABLE_MAX or gram_cost(known, what) <= GRAM_PAIR_BUDGET


def co_rating_affinity(
    rows: np.ndarray,
    cols: np.ndarray,
    values: np.ndarray,
    n: int,
    m: int,
    power: float,
    shrink: float = 10.0,
    what: str = "items",
) -> Affinity:
    """w(j, j') = max(0, rho(j, j'))^power for every item pair: (m, m), dense (or sparse above
    DENSE_TABLE_MAX items: each item's strongest neighbours).

    rho is the cosine of the items' rating columns after removing each user's mean rating (the adjusted
    cosine of item-based kNN), times n_jj' / (n_jj' + shrink) for n_jj' users who rated both (shrink > 0).
    With rows and columns swapped (cols, rows, values, m, n) the same gives the user table of the
    user-based term: users' rating rows with each item's mean removed."""
    return CoRatingGram.of(rows, cols, values, n, m, what).table(power, shrink)


def centred_norms(
    by_line: LineIndex, other: IntArray, values: FloatArray, mean: FloatArray, lines: IntArray
) -> FloatArray:
    """The norm of each of `lines`' ratings, each centred by the mean of its other coordinate (`other`,
    `mean[other]`): (len(lines),), summed over the ratings the index holds."""
    pos, counts = by_line.members(lines)
    squares = (values[pos] - mean[other[pos]]) ** 2
    out: FloatArray = np.sqrt(np.bincount(np.repeat(np.arange(len(lines)), counts), squares, len(lines)))
    return out


def co_rating_rows(
    rows: IntArray,
    cols: IntArray,
    values: FloatArray,
    n: int,
    m: int,
    targets: IntArray,
    power: float,
    shrink: float = 10.0,
    mean: FloatArray | None = None,
    by_row: LineIndex | None = None,
    by_col: LineIndex | None = None,
    norms: FloatArray | None = None,
) -> FloatArray:
    """The rows `targets` of `co_rating_affinity(rows, cols, values, n, m, power, shrink)`, without the
    rest of the table: (len(targets), m). Sparse: a target's row costs the ratings on the rows its column
    touches, plus O(m), not O(n m). `mean` (n,) replaces the means that centre the ratings (the table's
    own, for rows that must not depend on other ratings); `by_row`, `by_col`: the ratings' line indexes,
    when the caller has them (positions in no line hold no rating); `norms` (m,): the columns' norms of
    the centred ratings, when the caller keeps them (else summed over all the ratings)."""
    by_row = LineIndex(rows, n) if by_row is None else by_row
    by_col = LineIndex(cols, m) if by_col is None else by_col
    if mean is None:
        live = by_row.order
        sums = np.bincount(rows[live], weights=values[live], minlength=n)
        mean = sums / np.maximum(np.bincount(rows[live], minlength=n), 1)
    if norms is None:
        norms = centred_norms(by_col, rows, values, mean, np.arange(m))
    targets = np.asarray(targets, dtype=np.int64)
    index_type = _index_type(max(n, m, len(rows)))
    # The targets' columns as rows of the (m, n) transpose, times the rows of the (n, m) matrix they
    # touch: their products with every column (the cosine's numerators), then the same of ones (the
    # co-rating counts). A target's row costs the ratings on the rows its column touches.
    mine, counts = by_col.members(targets)
    ptr = np.r_[0, np.cumsum(counts)].astype(index_type)
    touched, picked = np.unique(rows[mine], return_inverse=True)
    on_touched, per_row = by_row.members(touched)
    centred = values[on_touched] - mean[rows[on_touched]]
    lines = (cols[on_touched].astype(index_type), np.r_[0, np.cumsum(per_row)].astype(index_type))
    shape, picked = (len(targets), len(touched)), picked.astype(index_type)
    num = (
        sp.csr_matrix((values[mine] - mean[rows[mine]], picked, ptr), shape=shape)
        @ sp.csr_matrix((centred, *lines), shape=(len(touched), m))
    ).toarray()
    co = (
        sp.csr_matrix((np.ones(len(mine)), picked, ptr), shape=shape)
        @ sp.csr_matrix((np.ones(len(on_touched)), *lines), shape=(len(touched), m))
    ).toarray()
    rho = num / np.maximum(norms[targets, None] * norms[None, :], 1e-12) * (co / (co + shrink))
    out: FloatArray = np.maximum(rho, 0.0) ** power
    return out


def _index_type(size: int) -> type[np.signedinteger[Any]]:
    return np.int32 if size < 2**31 else np.int64
