"""Messages over the known entries: the factorized product kernel (`FactorizedGraph`: G_u = sum_l Q'_l[u]
a_{i_l} b_{j_l}^T), the line terms over one user's row or one item's column, and the co-rating terms read
from their tables.

The maths: the package docstring (model/exact/__init__.py) and docs/model.md."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse as sp

from model.engine import (
    bilinear_forms,
    in_order,
    one_row,
    row_forms,
)
from model.exact.affinity import Affinity
from model.ratings import LineIndex, Ratings, index_dtype, ranges, stable_order
from model.types import FloatArray, IntArray

CLAMPED_CHUNK_ROWS = 4096
"""Rows per chunk of `clamped_sums`: its (rows, p + 1, D) temporaries stay tens of megabytes."""


PAIR_CHUNK = 1 << 21
"""(query, line member) pairs per pass of the co-rating term: bounds its temporaries."""


FEW_USERS = 16
"""Up to this many distinct lines (a request's user), the co-rating term reads its table line by line."""


Products = Callable[[FloatArray, IntArray], FloatArray]
"""(vectors (q, D), cols (K,)) -> b_{cols[k]} . vectors[u]: (K, q), the item rows' read of
`KnownField.messages`, followed by any other columns its caller reads in the same pass: (K, q + r)."""


class FactorizedGraph:
    """A fully connected CRF over the nodes (rows[k], cols[k]) with s(k, l) = (a_i . a_i') (b_j . b_j')."""

    def __init__(self, a: np.ndarray, b: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> None:
        self.a, self.b = a, b  # (n, D), (m, D)
        self.rows, self.cols = rows, cols
        # Nodes sorted by user, so a sum over each user's nodes is one np.add.reduceat.
        self.order = np.argsort(rows, kind="stable")
        sorted_rows = rows[self.order]
        self.starts: IntArray = (
            np.flatnonzero(np.r_[True, sorted_rows[1:] != sorted_rows[:-1]])
            if len(rows)
            else np.empty(0, dtype=np.int64)
        )
        self.users = sorted_rows[self.starts] if len(rows) else np.empty(0, dtype=np.int64)
        self.node_cols = cols[self.order]  # the nodes' items, in user order
        # Chunks of whole users of about NODE_CHUNK nodes: a chunk's item rows (nodes x D) are gathered
        # at a time, not all K of them (7.5 M x 129 float64 would be 7.7 GB on ml-10m).
        ends = np.r_[self.starts[1:], len(rows)]
        cuts = np.searchsorted(ends, np.arange(NODE_CHUNK, len(rows), NODE_CHUNK), side="left") + 1
        self.user_chunks = np.unique(np.r_[0, cuts[cuts < len(self.users)], len(self.users)])

    def aggregate(self, weights: Distributions) -> np.ndarray:
        """G_u = sum_l weights[l, u] a_{i_l} b_{j_l}^T for every column u of weights (K, p): (p, D, D)."""
        out = np.zeros((weights.shape[1], self.a.shape[1], self.b.shape[1]))
        if len(self.rows) == 0:
            return out
        w = weights[self.order]
        first = np.r_[self.starts, len(self.rows)]  # each user's first node, and the end
        for lo, hi in zip(self.user_chunks[:-1], self.user_chunks[1:], strict=True):
            nodes = slice(first[lo], first[hi])
            b_nodes = np.take(self.b, self.node_cols[nodes], axis=0)  # (chunk nodes, D)
            a_users, starts = self.a[self.users[lo:hi]], self.starts[lo:hi] - first[lo]
            for u in range(weights.shape[1]):
                per_user = np.add.reduceat(w[nodes, u, None] * b_nodes, starts, axis=0)  # (users, D)
                out[u] += a_users.T @ per_user
        return out

    def total(self) -> np.ndarray:
        """H = sum_l a_{i_l} b_{j_l}^T, so that sum_l s(k, l) = a_i^T H b_j: (D, D)."""
        out: FloatArray = self.aggregate(np.ones((len(self.rows), 1)))[0]
        return out


def clamped_sums(
    a: np.ndarray,
    b: np.ndarray,
    rows: IntArray,
    cols: IntArray,
    labels: IntArray,
    compat: FloatArray,
    weights: FloatArray | None = None,
) -> FloatArray:
    """`FactorizedGraph.aggregate` of a few entries clamped to their labels (weights compat[labels]),
    then their `total`: sum_l compat[label_l, u] a_{i_l} b_{j_l}^T for every level u, then
    sum_l a_{i_l} b_{j_l}^T: (p + 1, D, D); `weights` (K,) scale each entry's term (-1 takes it out). One
    sparse product sums each row's item vectors per label (rows x p, D), the compatibility mixes them per
    level, one matrix product takes them to D x D: O(K D + rows p D^2), what an online batch's changed
    rows cost."""
    users, inverse = np.unique(rows, return_inverse=True)
    if len(users) > CLAMPED_CHUNK_ROWS:  # a restore's tens of thousands of rows: bounded temporaries
        total = np.zeros((len(compat) + 1, a.shape[1], b.shape[1]))
        for lo in range(0, len(users), CLAMPED_CHUNK_ROWS):
            pick = (inverse >= lo) & (inverse < lo + CLAMPED_CHUNK_ROWS)
            part = None if weights is None else weights[pick]
            total += clamped_sums(a, b, rows[pick], cols[pick], labels[pick], compat, part)
        return total
    p, d = len(compat), b.shape[1]
    data = np.ones(len(rows)) if weights is None else np.asarray(weights, dtype=np.float64)
    by_label = sp.csr_matrix((data, (inverse * p + labels, cols)), shape=(len(users) * p, len(b)))
    sums = np.asarray(by_label @ b).reshape(len(users), p, d)  # [r, v]: row r's items labelled v
    per_row = np.empty((len(users), p + 1, d))
    per_row[:, :p] = np.einsum("rvd,vu->rud", sums, compat)
    per_row[:, p] = sums.sum(axis=1)
    out = (a[users].T @ per_row.reshape(len(users), (p + 1) * d)).reshape(a.shape[1], p + 1, d)
    return np.ascontiguousarray(out.transpose(1, 0, 2))


NODE_CHUNK = 1 << 18
"""Known entries per chunk of `FactorizedGraph.aggregate` (whole users: a chunk ends at a user's end)."""


def read_messages(
    g: np.ndarray, a: np.ndarray, b: np.ndarray, rows: np.ndarray, cols: np.ndarray
) -> np.ndarray:
    """m[k, u] = a_{rows[k]}^T G_u b_{cols[k]}: (K, p). Many queries (a test split) are read QUERY_CHUNK at
    a time: a chunk's (queries, p, D) temporary, not all K of them."""
    row = one_row(rows)
    if row is not None:
        return row_forms(a, g, row, b, cols)
    if len(rows) <= QUERY_CHUNK:
        return bilinear_forms(a, g, rows, b[cols])
    out = np.empty((len(rows), len(g)))
    for lo in range(0, len(rows), QUERY_CHUNK):
        hi = lo + QUERY_CHUNK
        out[lo:hi] = bilinear_forms(a, g, rows[lo:hi], b[cols[lo:hi]])
    return out


QUERY_CHUNK = 1 << 16
"""Queries per chunk of `read_messages`."""


def dense_similarity(a: np.ndarray, b: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """The K x K similarity matrix the factorisation avoids (tests and small graphs only)."""
    out: FloatArray = (a[rows] @ a[rows].T) * (b[cols] @ b[cols].T)
    return out


def _segment_sums(x: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Sums of consecutive segments of x (axis 0) of the given lengths, zeros allowed: (len(counts), ...).
    Each sum adds its own segment only (np.add.reduceat), so a small sum after large ones stays exact to
    rounding, unlike differences of a running total."""
    out = np.zeros((len(counts), *x.shape[1:]))
    filled = counts > 0
    if filled.any():
        out[filled] = np.add.reduceat(x, (np.cumsum(counts) - counts)[filled], axis=0)
    return out


def member_weights(weights: Distributions, members: IntArray, with_total: bool) -> FloatArray:
    """The known entries' weights (len(members), p), with a column of ones after them when `with_total`
    (what sums the similarities alone: the normaliser's share)."""
    w: FloatArray = weights[members]
    if with_total:
        w = np.hstack([w, np.ones((len(w), 1))])
    return w


def line_messages(
    index: LineIndex,
    table: np.ndarray,
    other: np.ndarray,
    weights: Distributions,
    query_line: np.ndarray,
    query_vec: np.ndarray,
    with_total: bool = False,
) -> np.ndarray:
    """m[k] = sum over known l on the query's line of (query_vec[k] . table[other[l]]) weights[l]: (K, p).

    other: (N,) each known entry's other coordinate (its item for a row line), table: (., D) their lifted
    embeddings; weights: (N, p). `with_total` appends the sum of the similarities alone as column p.
    Two exact ways, whichever costs less: per (query, member) pair, one dot product each (a request's
    items, one per column); or line by line, the aggregate sum_l vec_l w_l^T (D, p) read by each of the
    line's queries, two matrix products per line (a user's many queries sharing one row, a validation
    set's queries sharing rows and columns). Lines with more than MEMBER_CHUNK known entries in all are
    taken in groups of about that many (their members' embeddings are gathered group by group)."""
    lines, inverse = np.unique(query_line, return_inverse=True)
    counts = index.counts(lines)
    # Consecutive lines, about MEMBER_CHUNK members each (a group's lines all start within one window of
    # MEMBER_CHUNK, so a group read again is one group: the recursion ends).
    group = (np.cumsum(counts) - counts) // MEMBER_CHUNK
    if len(group) and group[-1] > 0:
        out = np.empty((len(query_line), weights.shape[1] + int(with_total)))
        of_query = group[inverse]
        for g in np.unique(group):
            ours = np.flatnonzero(of_query == g)
            out[ours] = line_messages(
                index, table, other, weights, query_line[ours], query_vec[ours], with_total
            )
        return out
    members, counts = index.members(lines)
    # np.take: a row gather several times faster than fancy indexing, on the request path
    vec, w = np.take(table, other[members], axis=0), member_weights(weights, members, with_total)
    k, (m, p), d = len(query_line), w.shape, table.shape[1]
    per_query = counts[inverse]
    if m == 0:
        return np.zeros((k, p))
    pairs = int(per_query.sum())
    # Gathers and elementwise products per pair, against BLAS products (several times faster per
    # multiply-add) plus a fixed cost per line of the Python loop.
    if pairs * (d + p) <= (m + k) * d * p // LINE_BLAS_SPEEDUP + len(lines) * LINE_LOOP_COST:
        # The members of query q's line, query by query: (pairs,) positions into `members`.
        _, pos = ranges((np.cumsum(counts) - counts)[inverse], per_query)
        dots = np.einsum("qd,qd->q", np.repeat(query_vec, per_query, axis=0), vec[pos])
        return _segment_sums(dots[:, None] * w[pos], per_query)
    out = np.zeros((k, p))
    by_line = np.argsort(inverse, kind="stable")
    query_starts = np.r_[0, np.cumsum(np.bincount(inverse, minlength=len(lines)))]
    member_starts = np.r_[0, np.cumsum(counts)]
    for i in np.flatnonzero(counts):
        mine = slice(member_starts[i], member_starts[i + 1])
        agg = vec[mine].T @ w[mine]  # (D, p)
        queries = by_line[query_starts[i] : query_starts[i + 1]]
        out[queries] = query_vec[queries] @ agg
    return out


MEMBER_CHUNK = 1 << 19
"""Known entries whose embeddings `line_messages` gathers at a time (a group of lines)."""


LINE_BLAS_SPEEDUP = 8
"""How much faster a multiply-add runs inside a matrix product than in numpy's gathers and elementwise
products (measured order of magnitude on 2-core x86): weighs the two ways of `line_messages`."""


LINE_LOOP_COST = 2000
"""The Python overhead of one line in `line_messages`' line-by-line way, in elementwise multiply-adds."""


def affinity_messages(
    index: LineIndex,
    affinity: Affinity,
    known_other: np.ndarray,
    weights: Distributions,
    rows: np.ndarray,
    cols: np.ndarray,
    with_total: bool = False,
    out: FloatArray | None = None,
    weight: float = 1.0,
) -> np.ndarray:
    """m[k] = sum over known l on line rows[k] of affinity[cols[k], known_other[l]] weights[l]: (K, p);
    `with_total` appends the sum of the affinities as column p. `index` groups the known entries by line:
    by row for the item table (rows = the queries' users, cols their items, known_other the known items),
    by column for the user table (the roles swapped). Up to FEW_USERS distinct lines (a request's user)
    one matrix product per line over its block of the table, else one (query, member) pair at a time.

    With `out` (K, p), weight m is added into it and it is returned: one line's queries over every column
    in order (a top-N over the catalogue) then add only the table lines of the line's known entries
    (`add_weighted_lines`), with no (K, p) array of their own."""
    one = one_row(rows)
    if out is not None:
        if one is not None and in_order(cols, len(cols)):
            members = index.of(one)
            vals = weight * member_weights(weights, members, with_total)
            affinity.add_weighted_lines(out, known_other[members], vals)
        else:
            out += weight * affinity_messages(index, affinity, known_other, weights, rows, cols, with_total)
        return out
    p = weights.shape[1] + int(with_total)
    if one is not None and 4 * len(rows) > len(affinity):  # one user's catalogue: no scatter
        members = index.of(one)
        vals = member_weights(weights, members, with_total)
        whole: np.ndarray = affinity.weighted_lines(known_other[members], vals)[cols]
        return whole
    out = np.zeros((len(rows), p))
    users, inverse = np.unique(rows, return_inverse=True)
    if len(users) <= FEW_USERS:
        for i, user in enumerate(users):
            mine = np.flatnonzero(inverse == i)
            members = index.of(user)
            vals = member_weights(weights, members, with_total)
            if 4 * len(mine) > len(affinity):
                # Most of the table's columns asked for (a top-N over the catalogue): whole rows of the
                # (symmetric) table, a contiguous gather, instead of a scattered (queries, members) block.
                out[mine] = affinity.weighted_lines(known_other[members], vals)[cols[mine]]
            else:
                out[mine] = affinity.block(cols[mine], known_other[members]) @ vals
        return out
    per_query = index.counts(rows)
    ends = np.cumsum(per_query)
    lo = 0
    while lo < len(rows):  # queries in chunks of about PAIR_CHUNK pairs
        hi = max(lo + 1, int(np.searchsorted(ends, ends[lo] - per_query[lo] + PAIR_CHUNK, side="right")))
        count = per_query[lo:hi]
        owner, members = index.gather(rows[lo:hi])
        w = affinity.pairs(cols[lo:hi][owner], known_other[members])
        vals = member_weights(weights, members, with_total)
        out[lo:hi] = _segment_sums(w[:, None] * vals, count)
        lo = hi
    return out


@dataclass(frozen=True)
class ColumnMajor:
    """The known entries' transformed distributions in item order, what `column_pass` reads, built once
    per known field. Either p sparse (m, n) matrices S_u[j, i_l] = t_l[u] of the entries l on column j and
    the matrix of ones after them (their indices shared: `levels`), or, for entries clamped to their labels
    (t_l = C[label_l]), one (m p, n) matrix of ones whose row j p + v holds the entries of column j labelled
    v (`by_label`, with C): one pass over the N entries gives every column's per-label sums."""

    levels: list[sp.csr_matrix]
    by_label: sp.csr_matrix | None = None
    compat: FloatArray | None = None
    changes: tuple[sp.csr_matrix, ...] = ()
    """Online changes to `by_label` since it was built: signed matrices of ones (+1 an entry that joined,
    -1 one that left), a few of geometrically growing size (`changed`), read beside it."""
    rows: int = 0
    """The rows of the by_label form now, m p (more than by_label's once items were added)."""

    @classmethod
    def _of_sorted(cls, t_sorted: FloatArray, known: Ratings) -> ColumnMajor:
        """From t (p, N) of the entries in the column index's order."""
        order = known.by_col.order
        indices = known.rows[order].astype(index_dtype(known.n_users))
        ptr = known.by_col.indptr.astype(indices.dtype)
        shape = (known.n_items, known.n_users)
        data = [*t_sorted, np.ones(len(order))]
        return cls([sp.csr_matrix((d, indices, ptr), shape=shape, copy=False) for d in data])

    @classmethod
    def of(cls, t: Distributions, known: Ratings) -> ColumnMajor:
        """The entries of `known` (with distributions t (positions, p) by position) sorted by item."""
        return cls._of_sorted(np.ascontiguousarray(t[known.by_col.order].T), known)

    @classmethod
    def clamped(
        cls, known: Ratings, labels: IntArray, compat: FloatArray, matrix: sp.csr_matrix | None = None
    ) -> ColumnMajor:
        """Entries clamped to their labels, t = compat[labels]: the `by_label` form (`matrix`: their
        `label_matrix`, when the caller has it; it does not depend on compat)."""
        by_label = cls.label_matrix(known, labels, len(compat)) if matrix is None else matrix
        return cls([], by_label, np.asarray(compat, dtype=np.float64), (), by_label.shape[0])

    @staticmethod
    def label_matrix(known: Ratings, labels: IntArray, p: int) -> sp.csr_matrix:
        """The (m p, n) matrix of ones whose row j p + v holds the users of column j's entries labelled v."""
        live = known.by_col.order  # the ratings' positions, by column
        keys = known.cols[live] * p + labels[live]
        order = live[stable_order(keys, known.n_items * p)]
        index_type = index_dtype(max(known.n_users, known.n_items * p + 1, len(known)))
        counts = np.bincount(keys, minlength=known.n_items * p)
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(index_type)
        indices = known.rows[order].astype(index_type)
        shape = (known.n_items * p, known.n_users)
        return sp.csr_matrix((np.ones(len(order)), indices, indptr), shape=shape, copy=False)

    def changed(
        self,
        left: tuple[IntArray, IntArray, IntArray],
        joined: tuple[IntArray, IntArray, IntArray],
        known: Ratings,
        labels: IntArray,
    ) -> ColumnMajor:
        """The `by_label` form once the entries `left` (rows, cols, labels) left and `joined` joined the
        known ratings, now `known` (labels `labels`, by position): a signed matrix of the change beside
        the others, the two last merged while the last is at least half the one before (so a change joins
        O(log) merges, amortized), and `by_label` built anew from `known` once the changes hold more than
        CHANGES_REBUILT of its entries (O(N), amortized O(1) a change)."""
        assert self.by_label is not None and self.compat is not None
        p = len(self.compat)
        shape = (known.n_items * p, known.n_users)
        rows = np.concatenate([left[0], joined[0]])
        keys = np.concatenate([left[1] * p + left[2], joined[1] * p + joined[2]])
        signs = np.concatenate([-np.ones(len(left[0])), np.ones(len(joined[0]))])
        change = sp.csr_matrix((signs, (keys, rows)), shape=shape)  # duplicates summed
        change.eliminate_zeros()  # entries that left and joined unchanged
        changes = [*self.changes, change] if change.nnz else list(self.changes)
        while len(changes) > 1 and 2 * changes[-1].nnz >= changes[-2].nnz:
            last = changes.pop()
            merged = _resized(changes.pop(), shape) + _resized(last, shape)
            merged.eliminate_zeros()
            changes.append(merged)
        if sum(c.nnz for c in changes) > CHANGES_REBUILT * max(len(known), 1):
            return ColumnMajor.clamped(known, labels, self.compat)
        return ColumnMajor([], self.by_label, self.compat, tuple(changes), shape[0])


CHANGES_REBUILT = 0.25
"""`ColumnMajor.changed` builds `by_label` anew once its changes hold this share of the known entries."""


def _resized(matrix: sp.csr_matrix, shape: tuple[int, int]) -> sp.csr_matrix:
    """A csr matrix grown to `shape` with empty rows and columns (it shares the data)."""
    if matrix.shape == shape:
        return matrix
    indptr = np.concatenate([matrix.indptr, np.full(shape[0] - matrix.shape[0], matrix.indptr[-1])])
    return sp.csr_matrix((matrix.data, matrix.indices, indptr), shape=shape)


def _product(matrix: sp.csr_matrix, e: FloatArray) -> FloatArray:
    """matrix @ e over the columns it has (users past them added since it was built have no entries in it);
    its rows as many as it has (the caller's longer result padded)."""
    out: FloatArray = matrix @ e[: matrix.shape[1]]
    return out


@dataclass(frozen=True)
class ClampedRows:
    """t of known entries clamped to their labels, t = compat[labels] (N, p), without the array: the
    rows a term reads are gathered when read (`t[index]`). N x p float64 is 640 MB on ml-10m,
    held by every worker and every search trial; the labels are the ratings themselves."""

    labels: IntArray
    compat: FloatArray

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.labels), self.compat.shape[1]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: Any) -> FloatArray:
        out: FloatArray = self.compat[self.labels[index]]
        return out


Distributions = FloatArray | ClampedRows
"""The known entries' compatibility-transformed distributions t (N, p): an array, or the clamped ones'
labels (`ClampedRows`)."""


def column_pass(columns: ColumnMajor, e_other: FloatArray, with_total: bool) -> FloatArray:
    """m[j] = sum over known l on column j of e_other[i_l] t_l, for every column j: (m, p), with the sums
    of e_other alone as column p when `with_total`. One pass over all N entries: what one user's messages
    from the same-item and user co-rating terms to the whole catalogue cost, instead of a gather per
    (query, entry) pair. Each level is a sparse matrix-vector product (`ColumnMajor`): one compiled loop
    over the N entries, several times faster than gathering and reducing them in numpy; clamped entries
    take one such product for all levels (their per-label sums, times C)."""
    if columns.by_label is not None and columns.compat is not None:
        p = len(columns.compat)
        by_label = columns.by_label
        if columns.rows > by_label.shape[0] or columns.changes:
            sums = np.zeros(columns.rows)
            for matrix in (by_label, *columns.changes):  # with the online changes since it was built
                sums[: matrix.shape[0]] += _product(matrix, e_other)
        else:
            sums = _product(by_label, e_other)
        per_label = sums.reshape(-1, p)  # (m, p): per column, per label
        # t_l[u] = C[label_l, u], and the total is each column's sum over the labels: one product with
        # [C | 1] (a strided write of sums @ C and a level-by-level total cost three times as long).
        compat = np.hstack([columns.compat, np.ones((p, 1))]) if with_total else columns.compat
        # Level-major (Fortran order): what adds to it and reads it does so column by column (a catalogue).
        out: FloatArray = (compat.T @ per_label.T).T
        return out
    levels = columns.levels if with_total else columns.levels[:-1]
    out = np.empty((levels[0].shape[0], len(levels)))
    for u, level in enumerate(levels):
        out[:, u] = level @ e_other
    return out
