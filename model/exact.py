"""Exact mean-field messages over every known entry in linear time (numpy).

With unit embeddings, the scaled cosine is an inner product of lifted vectors:
(1 + u_i . u_i') / 2 = a_i . a_i' with a_i = [1, u_i] / sqrt(2) (D = d + 1 numbers), and likewise
s_c(j, j') = b_j . b_j'. So for nodes k = (i, j) and l = (i', j'),

    s(k, l) = (a_i . a_i') (b_j . b_j')   and   m_k[u] = sum_l s(k, l) Q'_l[u] = a_i^T G_u b_j,

with G_u = sum_l Q'_l[u] a_{i_l} b_{j_l}^T, a D x D matrix per level. Building every G_u costs
O(K D p + n D^2 p) and reading one message O(D^2 p) per distinct user plus O(D p) per entry, instead of the
O(K^2 p) of the dense similarity matrix. Nothing is approximated: the sums run over every node. (One
user's whole catalogue reads the item side in float32, `engine.catalogue_products`: to about 1e-6.)

A sharper kernel keeps both properties. The scaled cosine never drops far below 1/4, so the product kernel
weighs every known entry almost alike. Two optional terms concentrate the weight on the entries that share
the query's user or item:

    s'(k, l) = s_r(i, i') s_c(j, j') + lambda_u [i = i'] s_c(j, j') + lambda_i [j = j'] s_r(i, i').

Both are sums over one user's row or one item's column (`LineIndex`), so a message still costs
O(|entries on the touched rows and columns| D p), and nothing is approximated.

The product of scaled cosines stays a similarity of embeddings the decoder already reads. A third term
brings in what it does not use, the co-rating of items (item-based kNN inside the CRF):

    + lambda_r [i = i'] w(j, j'),   w(j, j') = max(0, rho(j, j'))^q,

rho the adjusted cosine of the two items' training rating columns (each user's mean removed), shrunk by
n_jj' / (n_jj' + s) with n_jj' the users who rated both (`co_rating_affinity`; s = 10 by default). It
is again a sum over the query's row, with the m x m table of w computed once per model. Its mirror, user-based
kNN on the query's column,

    + lambda_c [j = j'] w_u(i, i'),   w_u(i, i') = max(0, rho_u(i, i'))^q,

weighs the other users' ratings of the query's item by the adjusted cosine of the users' rating rows
(each item's mean removed, the same shrinkage), from an n x n table.

With normalized messages a pseudo-count c adds (lambda_r + lambda_c) c to the normaliser alone (an absent
neighbour that sends nothing): a query whose co-rated neighbours weigh W in all keeps about W / (W + c) of
their pull, so a user with few or weakly similar rated items stays closer to the base network.

A bias baseline can join the CRF's output (`baseline_mixture`): the final distribution of a query is
(1 - w) Q + w B, with B the two-level distribution whose expectation is the prediction mu + b_i + c_j of
ridge-regularised user and item biases fitted to the known ratings (`bias_baseline`). It is not a kernel
term: the known field does not depend on it. On the two sparsest matrices (Flixster, YahooMusic) such a
baseline predicts about as well as the network alone or better, and the mixture beats both (see
benchmarks/results/validation.md).

Many levels (YahooMusic has 69) make reading the p matrices G_u the main cost of a request. When the
compatibility is not truncated, C[u, v] = (L_u - L_v)^2 = L_u^2 - 2 L_u L_v + L_v^2, so every
G_u = sum_l (sum_v Q_l[v] C[u, v]) a b^T is a quadratic polynomial in L_u: three levels determine all p
(`LevelInterpolation`), and a query reads 3 matrices instead of p, still exactly.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp
from scipy.linalg import blas

from model.artifact import StoredBiases, StoredField, save_known_field
from model.config import Crf, KernelSettings, OutputSettings
from model.engine import (
    Network,
    bilinear_forms,
    catalogue_products,
    compatibility_matrix,
    in_order,
    last_axis,
    log_softmax,
    nearest_level,
    one_row,
    row_forms,
    row_products,
    softmax,
    softmax_inplace,
)
from model.ratings import LineIndex, Ratings, ranges, stable_order
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

CLAMPED_CHUNK_ROWS = 4096
"""Rows per chunk of `clamped_sums`: its (rows, p + 1, D) temporaries stay tens of megabytes."""

FRESH_CHUNK_CELLS = 1 << 22
"""Cells of a chunk of fresh co-rating lines (`with_lines`): a replay or a restore that changes tens of
thousands of users' lines computes them this many at a time (32 MB of float64), never all at once."""

FreshLines = FloatArray | Callable[[int, int], FloatArray]
"""New co-rating lines for `with_lines(lines, fresh)`: the (len(lines), size) array, or a function of
(lo, hi) giving the rows of lines[lo:hi]."""

PAIR_CHUNK = 1 << 21
"""(query, line member) pairs per pass of the co-rating term: bounds its temporaries."""

FEW_USERS = 16
"""Up to this many distinct lines (a request's user), the co-rating term reads its table line by line."""


Products = Callable[[FloatArray, IntArray], FloatArray]
"""(vectors (q, D), cols (K,)) -> b_{cols[k]} . vectors[u]: (K, q), the item rows' read of `_messages`,
followed by any other columns its caller reads in the same pass: (K, q + r)."""


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
    a: np.ndarray, b: np.ndarray, rows: IntArray, cols: IntArray, labels: IntArray, compat: FloatArray
) -> FloatArray:
    """`FactorizedGraph.aggregate` of a few entries clamped to their labels (weights compat[labels]),
    then their `total`: sum_l compat[label_l, u] a_{i_l} b_{j_l}^T for every level u, then
    sum_l a_{i_l} b_{j_l}^T: (p + 1, D, D). One sparse product sums each row's item vectors per label
    (rows x p, D), the compatibility mixes them per level, one matrix product takes them to D x D:
    O(K D + rows p D^2), what an online batch's changed rows cost."""
    users, inverse = np.unique(rows, return_inverse=True)
    if len(users) > CLAMPED_CHUNK_ROWS:  # a restore's tens of thousands of rows: bounded temporaries
        total = np.zeros((len(compat) + 1, a.shape[1], b.shape[1]))
        for lo in range(0, len(users), CLAMPED_CHUNK_ROWS):
            pick = (inverse >= lo) & (inverse < lo + CLAMPED_CHUNK_ROWS)
            total += clamped_sums(a, b, rows[pick], cols[pick], labels[pick], compat)
        return total
    p, d = len(compat), b.shape[1]
    by_label = sp.csr_matrix(
        (np.ones(len(rows)), (inverse * p + labels, cols)), shape=(len(users) * p, len(b))
    )
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


class DenseAffinity:
    """A co-rating table held whole: (size, size) float64."""

    def __init__(self, table: FloatArray) -> None:
        self.table = table

    def __len__(self) -> int:
        return len(self.table)

    def pairs(self, a: IntArray, b: IntArray) -> FloatArray:
        """w(a[k], b[k]) for each k."""
        out: FloatArray = self.table[a, b]
        return out

    def block(self, a: IntArray, b: IntArray) -> FloatArray:
        """w(a[i], b[j]): (len(a), len(b))."""
        out: FloatArray = self.table[np.ix_(a, b)]
        return out

    def rows(self, a: IntArray) -> FloatArray:
        """Whole lines: (len(a), size)."""
        out: FloatArray = np.take(self.table, a, axis=0)
        return out

    def weighted_lines(self, lines: IntArray, weights: FloatArray) -> FloatArray:
        """table[lines]^T weights: (size, q) for weights (len(lines), q)."""
        out: FloatArray = np.take(self.table, lines, axis=0).T @ weights
        return out

    def add_weighted_lines(self, out: FloatArray, lines: IntArray, weights: FloatArray) -> None:
        """out += table[lines]^T weights over out's lines (size or fewer, q)."""
        out += self.weighted_lines(lines, weights)[: len(out)]

    def add_line(self, out: FloatArray, line: int, weight: float) -> None:
        """out += weight table[line, :len(out)] (a table grown past `out`'s lines reads their first)."""
        out += weight * self.table[line, : len(out)]

    def grown(self, size: int) -> Affinity:
        """The table padded with zero lines (no neighbours) up to `size`; past DENSE_TABLE_MAX lines (new
        users arriving online) a sparse one of each line's strongest pairs (`SparseAffinity.from_dense`):
        a dense table of size^2 float64 would grow quadratically with them."""
        if size <= len(self.table):
            return self
        if size > DENSE_TABLE_MAX:
            return SparseAffinity.from_dense(self.table, size)
        out = np.zeros((size, size))
        out[: len(self.table), : len(self.table)] = self.table
        return DenseAffinity(out)

    def with_lines(self, lines: IntArray, fresh: FreshLines) -> DenseAffinity:
        """The table with the given lines (and, symmetric, columns) replaced by `fresh` (len(lines), size),
        given whole or chunk by chunk (`FreshLines`)."""
        table = self.table.copy()
        for lo, hi, rows in _fresh_chunks(lines, fresh, len(table)):
            table[lines[lo:hi], :] = rows
            table[:, lines[lo:hi]] = rows.T
        block = table[np.ix_(lines, lines)]  # exactly symmetric, as the table is: reads may take rows for
        table[np.ix_(lines, lines)] = (block + block.T) / 2  # columns
        return DenseAffinity(table)

    def toarray(self) -> FloatArray:
        """The whole table as a dense array."""
        return self.table


class SparseAffinity:
    """A symmetric co-rating table holding each line's strongest neighbours (scipy CSR, sorted indices):
    what a line's neighbours cost, not size^2."""

    def __init__(self, matrix: sp.csr_matrix) -> None:
        self.matrix = matrix

    def __len__(self) -> int:
        return int(self.matrix.shape[0])

    def pairs(self, a: IntArray, b: IntArray) -> FloatArray:
        """w(a[k], b[k]) for each k (0 where b[k] is not among a[k]'s neighbours)."""
        return np.asarray(self.matrix[a, b], dtype=np.float64).reshape(-1)

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
        m = self.matrix
        starts = m.indptr[lines].astype(np.int64)
        owner, pos = ranges(starts, m.indptr[lines + 1].astype(np.int64) - starts)
        neighbours = m.indices[pos]
        distinct, inverse = np.unique(others, return_inverse=True)
        at = np.minimum(np.searchsorted(distinct, neighbours), max(len(distinct) - 1, 0))
        hit = distinct[at] == neighbours if len(distinct) else np.zeros(len(neighbours), dtype=bool)
        out: FloatArray = np.zeros((len(lines), len(distinct)))
        out[owner[hit], at[hit]] = m.data[pos[hit]]
        return out[:, inverse.reshape(-1)]

    def rows(self, a: IntArray) -> FloatArray:
        """Whole lines: (len(a), size)."""
        out: FloatArray = self.matrix[a].toarray()
        return out

    def weighted_lines(self, lines: IntArray, weights: FloatArray) -> FloatArray:
        """table[lines]^T weights: (size, q) for weights (len(lines), q), without densifying the lines (a
        user with thousands of ratings over a large catalogue)."""
        out: FloatArray = np.asarray(self.matrix[lines].T @ weights)
        return out

    def add_weighted_lines(self, out: FloatArray, lines: IntArray, weights: FloatArray) -> None:
        """out += table[lines]^T weights over out's lines (size or fewer, q), from the lines' stored
        neighbours: one bincount per column (a user's items over a catalogue of 1e5 reach 2e4 to 7e4
        neighbour entries on the synthetic Epinions; sorting them to sum by neighbour took 2-7 times as
        long), no (size, q) product of the sparse lines."""
        m = self.matrix
        starts = m.indptr[lines].astype(np.int64)
        owner, pos = ranges(starts, m.indptr[lines + 1].astype(np.int64) - starts)
        neighbours = m.indices[pos]
        inside = neighbours < len(out)
        if not inside.all():
            owner, pos, neighbours = owner[inside], pos[inside], neighbours[inside]
        if len(pos) == 0:
            return
        values = m.data[pos]
        for u in range(weights.shape[1]):
            out[:, u] += np.bincount(neighbours, weights=values * weights[owner, u], minlength=len(out))

    def add_line(self, out: FloatArray, line: int, weight: float) -> None:
        """out += weight table[line, :len(out)] (a table grown past `out`'s lines reads their first)."""
        m = self.matrix
        lo, hi = m.indptr[line], m.indptr[line + 1]
        neighbours, values = m.indices[lo:hi], m.data[lo:hi]
        inside = neighbours < len(out)
        out[neighbours[inside]] += weight * values[inside]  # a line's neighbours are distinct

    def grown(self, size: int) -> SparseAffinity:
        """The table with empty lines (no neighbours) up to `size`."""
        if size <= len(self):
            return self
        m = self.matrix
        indptr = np.concatenate([m.indptr, np.full(size - len(self), m.indptr[-1])])
        return SparseAffinity(sp.csr_matrix((m.data, m.indices, indptr), shape=(size, size)))

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
        strongest pairs: memory for the kept pairs, not len(lines) x size."""
        size, lines = len(self), np.asarray(lines, dtype=np.int64)
        keep = np.ones(size)
        keep[lines] = 0.0
        mask = sp.diags(keep)
        rest = mask @ self.matrix @ mask  # the other lines' pairs among themselves
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
        k, j = k.astype(np.int64), j.astype(np.int64)
        where = np.full(size, -1, dtype=np.int64)
        where[lines] = np.arange(len(lines))
        inner = where[j] >= 0  # the fresh lines among themselves: made symmetric, (w + w^T) / 2
        among = sp.csr_matrix((v[inner], (k[inner], where[j[inner]])), shape=(len(lines), len(lines)))
        among = ((among + among.T) / 2).tocoo()
        outer = ~inner  # pairs with the other lines, and their mirror images
        fresh_pairs = sp.csr_matrix(
            (np.concatenate([v[outer], v[outer], among.data]),
             (np.concatenate([lines[k[outer]], j[outer], lines[among.row]]),
              np.concatenate([j[outer], lines[k[outer]], lines[among.col]]))),
            shape=(size, size),
        )  # fmt: skip
        out = (rest + fresh_pairs).tocsr()
        out.eliminate_zeros()
        out.sort_indices()
        return SparseAffinity(out)

    def toarray(self) -> FloatArray:
        """The whole table as a dense array."""
        out: FloatArray = self.matrix.toarray()
        return out


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
) -> FloatArray:
    """The rows `targets` of `co_rating_affinity(rows, cols, values, n, m, power, shrink)`, without the
    rest of the table: (len(targets), m). Sparse: a target's row costs the ratings on the rows its column
    touches, plus O(m), not O(n m). `mean` (n,) replaces the means that centre the ratings (the table's
    own, for rows that must not depend on other ratings); `by_row`, `by_col`: the ratings' line indexes,
    when the caller has them."""
    if mean is None:
        mean = np.bincount(rows, weights=values, minlength=n) / np.maximum(np.bincount(rows, minlength=n), 1)
    centred = values - mean[rows]
    norms = np.sqrt(np.bincount(cols, weights=centred * centred, minlength=m))
    by_row = LineIndex(rows, n) if by_row is None else by_row
    by_col = LineIndex(cols, m) if by_col is None else by_col
    targets = np.asarray(targets, dtype=np.int64)
    index_type = _index_type(max(n, m, len(rows)))
    # The targets' columns as rows of the (m, n) transpose, times the (n, m) matrix: their products with
    # every column (the cosine's numerators), then the same of ones (the co-rating counts). Sparse: a
    # target's row costs the ratings on the rows its column touches.
    mine, counts = by_col.members(targets)
    ptr = np.r_[0, np.cumsum(counts)].astype(index_type)
    picked = rows[mine].astype(index_type)
    whole = (centred[by_row.order], cols[by_row.order].astype(index_type), by_row.indptr.astype(index_type))
    ones = np.ones(len(rows))
    num = (
        sp.csr_matrix((centred[mine], picked, ptr), shape=(len(targets), n))
        @ sp.csr_matrix(whole, shape=(n, m))
    ).toarray()
    co = (
        sp.csr_matrix((ones[: len(mine)], picked, ptr), shape=(len(targets), n))
        @ sp.csr_matrix((ones, whole[1], whole[2]), shape=(n, m))
    ).toarray()
    rho = num / np.maximum(norms[targets, None] * norms[None, :], 1e-12) * (co / (co + shrink))
    out: FloatArray = np.maximum(rho, 0.0) ** power
    return out


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
            members = index.order[index.indptr[one] : index.indptr[one + 1]]
            vals = weight * member_weights(weights, members, with_total)
            affinity.add_weighted_lines(out, known_other[members], vals)
        else:
            out += weight * affinity_messages(index, affinity, known_other, weights, rows, cols, with_total)
        return out
    p = weights.shape[1] + int(with_total)
    if one is not None and 4 * len(rows) > len(affinity):  # one user's catalogue: no scatter
        members = index.order[index.indptr[one] : index.indptr[one + 1]]
        vals = member_weights(weights, members, with_total)
        whole: np.ndarray = affinity.weighted_lines(known_other[members], vals)[cols]
        return whole
    out = np.zeros((len(rows), p))
    users, inverse = np.unique(rows, return_inverse=True)
    if len(users) <= FEW_USERS:
        for i, user in enumerate(users):
            mine = np.flatnonzero(inverse == i)
            members = index.order[index.indptr[user] : index.indptr[user + 1]]
            vals = member_weights(weights, members, with_total)
            if 4 * len(mine) > len(affinity):
                # Most of the table's columns asked for (a top-N over the catalogue): whole rows of the
                # (symmetric) table, a contiguous gather, instead of a scattered (queries, members) block.
                out[mine] = affinity.weighted_lines(known_other[members], vals)[cols[mine]]
            else:
                out[mine] = affinity.block(cols[mine], known_other[members]) @ vals
        return out
    per_query = index.indptr[rows + 1] - index.indptr[rows]
    ends = np.cumsum(per_query)
    lo = 0
    while lo < len(rows):  # queries in chunks of about PAIR_CHUNK pairs
        hi = max(lo + 1, int(np.searchsorted(ends, ends[lo] - per_query[lo] + PAIR_CHUNK, side="right")))
        count = per_query[lo:hi]
        owner, pos = ranges(index.indptr[rows[lo:hi]], count)
        members = index.order[pos]
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

    @classmethod
    def _of_sorted(cls, t_sorted: FloatArray, known: Ratings) -> ColumnMajor:
        """From t (p, N) of the entries in the column index's order."""
        order = known.by_col.order
        indices = known.rows[order].astype(_index_type(known.n_users))
        ptr = known.by_col.indptr.astype(indices.dtype)
        shape = (known.n_items, known.n_users)
        data = [*t_sorted, np.ones(len(order))]
        return cls([sp.csr_matrix((d, indices, ptr), shape=shape, copy=False) for d in data])

    @classmethod
    def of(cls, t: Distributions, known: Ratings) -> ColumnMajor:
        """The entries of `known` (with distributions t (N, p) in its order) sorted by item."""
        return cls._of_sorted(np.ascontiguousarray(t[known.by_col.order].T), known)

    @classmethod
    def clamped(
        cls, known: Ratings, labels: IntArray, compat: FloatArray, matrix: sp.csr_matrix | None = None
    ) -> ColumnMajor:
        """Entries clamped to their labels, t = compat[labels]: the `by_label` form (`matrix`: their
        `label_matrix`, when the caller has it; it does not depend on compat)."""
        by_label = cls.label_matrix(known, labels, len(compat)) if matrix is None else matrix
        return cls([], by_label, np.asarray(compat, dtype=np.float64))

    @staticmethod
    def label_matrix(known: Ratings, labels: IntArray, p: int) -> sp.csr_matrix:
        """The (m p, n) matrix of ones whose row j p + v holds the users of column j's entries labelled v."""
        keys = known.cols * p + labels
        order = stable_order(keys, known.n_items * p)
        index_type = _index_type(max(known.n_users, known.n_items * p + 1, len(known)))
        counts = np.bincount(keys, minlength=known.n_items * p)
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(index_type)
        indices = known.rows[order].astype(index_type)
        shape = (known.n_items * p, known.n_users)
        return sp.csr_matrix((np.ones(len(order)), indices, indptr), shape=shape, copy=False)


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


def _index_type(size: int) -> type[np.signedinteger[Any]]:
    return np.int32 if size < 2**31 else np.int64


def column_pass(columns: ColumnMajor, e_other: FloatArray, with_total: bool) -> FloatArray:
    """m[j] = sum over known l on column j of e_other[i_l] t_l, for every column j: (m, p), with the sums
    of e_other alone as column p when `with_total`. One pass over all N entries: what one user's messages
    from the same-item and user co-rating terms to the whole catalogue cost, instead of a gather per
    (query, entry) pair. Each level is a sparse matrix-vector product (`ColumnMajor`): one compiled loop
    over the N entries, several times faster than gathering and reducing them in numpy; clamped entries
    take one such product for all levels (their per-label sums, times C)."""
    if columns.by_label is not None and columns.compat is not None:
        p = len(columns.compat)
        sums = (columns.by_label @ e_other).reshape(-1, p)  # (m, p): per column, per label
        # t_l[u] = C[label_l, u], and the total is each column's sum over the labels: one product with
        # [C | 1] (a strided write of sums @ C and a level-by-level total cost three times as long).
        compat = np.hstack([columns.compat, np.ones((p, 1))]) if with_total else columns.compat
        # Level-major (Fortran order): what adds to it and reads it does so column by column (a catalogue).
        out: FloatArray = (compat.T @ sums.T).T
        return out
    levels = columns.levels if with_total else columns.levels[:-1]
    out = np.empty((levels[0].shape[0], len(levels)))
    for u, level in enumerate(levels):
        out[:, u] = level @ e_other
    return out


@dataclass(frozen=True)
class Lines:
    """The kernel's same-user, same-item and co-rating terms over the known entries (module docstring)."""

    same_user: float
    same_item: float
    known: Ratings
    co_rating: float = 0.0
    affinity: Affinity | None = None  # (m, m) co-rating weights w(j, j'); needed when co_rating > 0
    co_rating_prior: float = 0.0  # pseudo-count c: the normaliser gains (lambda_r + lambda_c) c
    co_rating_user: float = 0.0  # lambda_c, the user-based term's weight
    user_affinity: Affinity | None = None  # (n, n) user co-rating weights; needed when co_rating_user > 0

    @property
    def active(self) -> bool:
        """Whether any term has a weight."""
        return self.same_user > 0 or self.same_item > 0 or self.co_rating > 0 or self.co_rating_user > 0

    @property
    def column_terms(self) -> bool:
        """Whether a term sums over the query's column (same-item, user co-rating)."""
        return self.same_item > 0 or (self.co_rating_user > 0 and self.user_affinity is not None)

    @property
    def prior_weight(self) -> float:
        """What the co-rating pseudo-count adds to the normaliser: (lambda_r + lambda_c) c."""
        return (self.co_rating + self.co_rating_user) * self.co_rating_prior

    def user_sums(
        self, user: int, weights: Distributions, b: FloatArray, with_total: bool = False
    ) -> FloatArray:
        """sum over the user's known l of w_l b_{j_l}: (p, D), with the sum of b_{j_l} alone as row p when
        `with_total`. The same-user term of a query (user, j) is lambda_u b_j . (row u), a read like the
        field's."""
        members = self.known.by_row.of(user)
        w = member_weights(weights, members, with_total)
        out: FloatArray = w.T @ np.take(b, self.known.cols[members], axis=0)
        return out

    def column_weights(
        self, user: int, a: FloatArray, similar: Callable[[int], FloatArray] | None = None
    ) -> FloatArray:
        """e = lambda_i s_r(user, .) + lambda_c w_u(user, .) over the known users: the weight of each known
        entry's user in both column terms of one user's queries (`similar(user)`: s_r, when the caller
        reads it for less than a . a_user)."""
        n = self.known.n_users
        e = np.zeros(n)
        if self.same_item > 0:
            e += self.same_item * (similar(user)[:n] if similar is not None else a[:n] @ a[user])
        if self.co_rating_user > 0 and self.user_affinity is not None:
            self.user_affinity.add_line(e, user, self.co_rating_user)
        return e

    def messages(
        self,
        weights: Distributions,
        a: FloatArray,
        b: FloatArray,
        rows: IntArray,
        cols: IntArray,
        with_total: bool = False,
        columns: ColumnMajor | None = None,
        same_user: bool = True,
        similar: Callable[[int], FloatArray] | None = None,
    ) -> FloatArray:
        """lambda_u sum_{l on row i} s_c(j, j_l) w_l + lambda_i sum_{l on col j} s_r(i, i_l) w_l
        + lambda_r sum_{l on row i} w(j, j_l) w_l + lambda_c sum_{l on col j} w_u(i, i_l) w_l: (K, p);
        `with_total` appends the same sums of the similarities alone (the normaliser's share).

        `columns`: `weights` in item order. When one user's queries reach most of the known entries
        through their columns (a top-N over the catalogue), both column terms are then one `column_pass`
        with the per-user weights lambda_i s_r(i, .) + lambda_c w_u(i, .). `same_user=False` leaves the
        first term out (the caller read it with the field: `user_sums`). `similar(i)`: s_r(i, .) over the
        users, when the caller reads it for less than a . a_i (`Network.user_similarities`)."""
        known = self.known
        out = np.zeros((len(rows), weights.shape[1] + int(with_total)))
        column_terms = self.column_terms
        one = one_row(rows)
        user = one if column_terms else None
        # One user's queries over every item in order (a top-N): arrays over the catalogue are the answer
        # as they are (the item co-rating term adds only the user's items' neighbours: affinity_messages).
        catalogue = one is not None and in_order(cols, known.n_items)
        # One user's queries: both column terms weigh the entry l by e[i_l] = lambda_i s_r(i, i_l) +
        # lambda_c w_u(i, i_l), one vector over the users. Read with it when the queries' columns hold
        # many known entries (a dense matrix's items): for most of the entries, one pass over all of them;
        # else the columns' members gathered, a number each, not an embedding each (`line_messages`).
        reached = 0 if user is None else len(known) if catalogue else int(known.by_col.counts(cols).sum())
        whole = columns is not None and 4 * reached > len(known)
        if user is not None and (whole or 4 * reached > known.n_users):
            e = self.column_weights(user, a, similar)
            if whole and catalogue:
                assert columns is not None
                out = column_pass(columns, e, with_total)  # every column, in order: the sums themselves
            elif whole:
                assert columns is not None
                out += column_pass(columns, e, with_total)[cols]
            else:
                members, counts = known.by_col.members(cols)
                vals = member_weights(weights, members, with_total)
                out += _segment_sums(e[known.rows[members]][:, None] * vals, counts)
            column_terms = False
        if self.same_user > 0 and same_user:
            user_term = line_messages(known.by_row, b, known.cols, weights, rows, b[cols], with_total)
            out += self.same_user * user_term
        if self.same_item > 0 and column_terms:
            item = line_messages(known.by_col, a, known.rows, weights, cols, a[rows], with_total)
            out += self.same_item * item
        if self.co_rating > 0 and self.affinity is not None:
            affinity_messages(
                known.by_row, self.affinity, known.cols, weights, rows, cols, with_total, out, self.co_rating
            )
        if self.co_rating_user > 0 and self.user_affinity is not None and column_terms:
            affinity_messages(
                known.by_col, self.user_affinity, known.rows, weights, cols, rows, with_total, out,
                self.co_rating_user,
            )  # fmt: skip
        return out


@dataclass(frozen=True)
class LevelInterpolation:
    """G_u of every level from three anchor levels: G_u = sum_s weights[u, s] G_{anchors[s]}.

    Exact (Lagrange interpolation of a quadratic) when the compatibility is the untruncated square
    C[u, v] = (L_u - L_v)^2; `of` returns None for any other compatibility.
    """

    anchors: np.ndarray  # (3,) level indices: the first, the middle and the last
    weights: np.ndarray  # (p, 3)

    @classmethod
    def of(cls, compat: np.ndarray) -> LevelInterpolation | None:
        """The interpolation for a compatibility matrix, if it is an untruncated square with p > 3."""
        p = len(compat)
        if p <= 3:
            return None
        x = np.sqrt(compat[:, 0])  # L_u - L_1 (the levels increase), if C is an untruncated square
        if not np.allclose(compat, (x[:, None] - x[None, :]) ** 2, rtol=1e-12, atol=0.0):
            return None
        anchors = np.array([0, p // 2, p - 1])
        nodes = x[anchors]
        weights = np.ones((p, 3))
        for s in range(3):
            for t in range(3):
                if t != s:
                    weights[:, s] *= (x - nodes[t]) / (nodes[s] - nodes[t])
        return cls(anchors, weights)

    def read(
        self, g_anchors: np.ndarray, a: np.ndarray, b: np.ndarray, rows: np.ndarray, cols: np.ndarray
    ) -> np.ndarray:
        """m[k, u] = a_{rows[k]}^T G_u b_{cols[k]} for all p levels from the anchors' G (3, D, D): (K, p)."""
        out: FloatArray = read_messages(g_anchors, a, b, rows, cols) @ self.weights.T
        return out


@dataclass(frozen=True)
class KnownField:
    """The converged messages of the known entries: what a query needs, precomputable per model version.

    g: (p, D, D) per-level aggregates of the known entries' compatibility-transformed distributions;
    h: (D, D) aggregate of ones (the normaliser); scale: the constant factor of the `scaled` mode;
    t: (N, p) the known entries' compatibility-transformed distributions, needed by the same-user and
    same-item terms (None when the kernel has none; `ClampedRows` for entries clamped to their labels);
    interp: set when the compatibility lets three levels' G determine the others (`LevelInterpolation`),
    so a query reads only g_anchors; columns: t in item order, for the column terms' one-user pass
    (`with_columns`).
    """

    g: np.ndarray
    h: np.ndarray
    scaling: str
    scale: float
    t: Distributions | None = None
    interp: LevelInterpolation | None = None
    columns: ColumnMajor | None = None
    g_anchors: np.ndarray | None = field(init=False, default=None, repr=False)
    _stacked: np.ndarray | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        if self.interp is not None:
            object.__setattr__(self, "g_anchors", np.ascontiguousarray(self.g[self.interp.anchors]))

    def messages(
        self,
        a: FloatArray,
        b: FloatArray,
        rows: IntArray,
        cols: IntArray,
        lines: Lines | None = None,
        products: Products | None = None,
        similar: Callable[[int], FloatArray] | None = None,
    ) -> tuple[FloatArray, FloatArray | None]:
        """The messages of this field to the queries (rows[k], cols[k]) (`_messages`, from the anchor
        levels when it has them), and, for one user's queries, what else `products` read in the same pass
        over the item rows (`_messages`; `similar`: `Lines.messages`)."""
        g = self.g if self.interp is None or self.g_anchors is None else self.g_anchors
        return _messages(
            g,
            self.h,
            self.scaling,
            self.scale,
            a,
            b,
            rows,
            cols,
            lines,
            self.t,
            self.interp,
            self.columns,
            products,
            similar,
        )

    def stacked(self, with_total: bool) -> FloatArray:
        """g, then h after it when `with_total`: (p [+ 1], D, D), made once per field."""
        if not with_total:
            return self.g
        if self._stacked is None:
            object.__setattr__(self, "_stacked", np.concatenate([self.g, self.h[None]]))
        out = self._stacked
        assert out is not None
        return out

    def with_columns(
        self,
        lines: Lines | None,
        labels: IntArray | None = None,
        compat: FloatArray | None = None,
        matrix: sp.csr_matrix | None = None,
    ) -> KnownField:
        """This field with `columns` set when the kernel has a column term (else as it is); `labels` and
        `compat` for known entries clamped to their labels (t = compat[labels]: `ColumnMajor.clamped`,
        from `matrix` when given)."""
        if self.t is None or lines is None or not lines.column_terms:
            return self
        if labels is not None and compat is not None:
            columns = ColumnMajor.clamped(lines.known, labels, compat, matrix)
            return dataclasses.replace(self, columns=columns)
        return dataclasses.replace(self, columns=ColumnMajor.of(self.t, lines.known))


def scaled_messages(
    g: np.ndarray,
    h: np.ndarray,
    scaling: str,
    scale: float,
    a: np.ndarray,
    b: np.ndarray,
    rows: np.ndarray,
    cols: np.ndarray,
    lines: Lines | None = None,
    t: Distributions | None = None,
    interp: LevelInterpolation | None = None,
    columns: ColumnMajor | None = None,
) -> np.ndarray:
    """Messages to (rows, cols) under a scaling: `sum` as is, `scaled` times `scale`, `normalized` divided
    by sum_l s(k, l): (K, p). With active `lines`, the kernel's same-user and same-item terms over the
    known entries' transformed distributions `t` (N, p) join both the messages and the normaliser, and
    the co-rating pseudo-count adds (lambda_r + lambda_c) c to the normaliser alone. With `interp`, g holds
    only the anchor levels' matrices and the others follow from them."""
    msg, _ = _messages(g, h, scaling, scale, a, b, rows, cols, lines, t, interp, columns)
    return msg


def _messages(
    g: np.ndarray,
    h: np.ndarray,
    scaling: str,
    scale: float,
    a: np.ndarray,
    b: np.ndarray,
    rows: np.ndarray,
    cols: np.ndarray,
    lines: Lines | None = None,
    t: Distributions | None = None,
    interp: LevelInterpolation | None = None,
    columns: ColumnMajor | None = None,
    products: Products | None = None,
    similar: Callable[[int], FloatArray] | None = None,
) -> tuple[FloatArray, FloatArray | None]:
    """`scaled_messages`, and, for queries of one user, the columns that `products` read after the
    field's (None for other queries, or when it read none). `products(vectors, cols)` reads
    b_{cols[k]} . vectors[u] for one user's queries, and may append more columns of the same pass over the
    item rows (`user_distributions`: the decoder's scores); `row_products` of b by default."""
    normalized = scaling == "normalized"
    if lines is not None and lines.active and t is None:
        raise ValueError("the kernel's line terms need the known entries' distributions")
    # The field's levels and the normaliser read the same (query, known) similarities, and for one user's
    # queries so does the same-user term (b_j . sum over the user's l of b_{j_l} t_l): one pass over the
    # queries' item embeddings for all of them (a whole-catalogue query reads the item table once).
    stacked = np.concatenate([g, h[None]]) if normalized else g
    row = one_row(rows)
    own = False  # whether the same-user term was read with the field
    probed: FloatArray | None = None
    if row is not None:
        vectors = np.matmul(a[row], stacked)  # (levels [+ total], D): forms[k] = b_{cols[k]} . vectors
        if lines is not None and lines.same_user > 0 and t is not None:
            # The same-user term is b_j . (lambda_u sum over the user's l of t_l b_{j_l}): read as part
            # of the field's vectors, it costs no column of its own. Under `interp` its levels follow
            # from the anchors' like the field's do (t is quadratic in L_u alike).
            sums = lines.user_sums(row, t, b, normalized)  # (p [+ total], D)
            if interp is not None:
                sums = np.concatenate([sums[interp.anchors], sums[len(interp.weights) :]])
            vectors = vectors + lines.same_user * sums
            own = True
        read = products(vectors, cols) if products is not None else row_products(b, vectors, cols)
        forms = read[:, : len(vectors)]
        probed = read[:, len(vectors) :] if read.shape[1] > len(vectors) else None
    else:
        forms = read_messages(stacked, a, b, rows, cols)
    total: FloatArray | None = None
    msg = forms
    if normalized:
        msg, total = forms[:, :-1], forms[:, -1]
    if interp is not None:
        msg = msg @ interp.weights.T
    owned = False  # whether msg is a float64 array of this call's own (divided in place)
    if lines is not None and lines.active and t is not None:
        # `extra` is a new array of the line terms' (and with `normalized`, the normaliser's) sums: the
        # field's messages join it in place (a catalogue's (m, p) arrays are 1e6 numbers: each pass counts).
        extra = lines.messages(t, a, b, rows, cols, normalized, columns, not own, similar)
        p = t.shape[1]
        for u in range(p):  # level by level: numpy's loops over rows of p numbers cost per row
            extra[:, u] += msg[:, u]
        msg, owned = extra[:, :p], True
        if normalized:
            assert total is not None
            denom = extra[:, p]
            denom += total
            denom += lines.prior_weight
            total = denom
    if scaling == "scaled":
        return msg * scale, probed
    if total is not None:
        norm = np.maximum(total, 1e-12)
        if owned:
            for u in range(msg.shape[1]):  # level by level, as above
                msg[:, u] /= norm
            return msg, probed
        return msg / norm[:, None], probed
    return msg, probed


def known_field(
    a: np.ndarray,
    b: np.ndarray,
    known_rows: np.ndarray,
    known_cols: np.ndarray,
    known_probs: FloatArray | None,
    known_labels: IntArray,
    compat: np.ndarray,
    gamma: float,
    layers: int,
    scaling: str,
    scale: float,
    known: str,
    lines: Lines | None = None,
) -> KnownField:
    """Run the mean-field layers over all known entries and return their converged field.

    `predicted`: the known entries start from the base network's distributions and are updated T times
    with exact messages from every known entry. `clamped`: the known entries are fixed to their observed
    labels (a CRF conditioned on the observations), so no iteration is needed. `lines`: the kernel's
    same-user and same-item terms (none by default).
    """
    graph = FactorizedGraph(a, b, known_rows, known_cols)
    h = graph.total()
    if known == "clamped":
        q = np.zeros((len(known_labels), len(compat)))
        q[np.arange(len(known_labels)), known_labels] = 1.0
    else:
        if known_probs is None:
            raise ValueError("`predicted` known entries need the base network's distributions")
        q = known_probs
        unary = np.log(np.maximum(known_probs, 1e-30))
        for _ in range(layers):
            t = q @ compat.T
            g = graph.aggregate(t)
            msg = scaled_messages(g, h, scaling, scale, a, b, known_rows, known_cols, lines, t)
            q = softmax(unary - gamma * msg)
    t = q @ compat.T
    keep: Distributions | None = None
    if lines is not None and lines.active:
        keep = ClampedRows(known_labels, compat) if known == "clamped" else t
    interp = LevelInterpolation.of(compat)
    field = KnownField(g=graph.aggregate(t), h=h, scaling=scaling, scale=scale, t=keep, interp=interp)
    if known == "clamped":
        return field.with_columns(lines, known_labels, compat)
    return field.with_columns(lines)


def query_distributions(
    field: KnownField,
    a: np.ndarray,
    b: np.ndarray,
    rows: np.ndarray,
    cols: np.ndarray,
    probs: np.ndarray,
    gamma: float,
    lines: Lines | None = None,
) -> np.ndarray:
    """Final distributions of queried entries attached to the known entries' field: (K, p).

    A query receives messages from every known entry and sends none back, so its update is a fixed point
    after one layer. `lines`: the same-user and same-item terms the field was computed with.
    """
    msg, _ = field.messages(a, b, rows, cols, lines)
    return softmax(np.log(np.maximum(probs, 1e-30)) - gamma * msg)


def user_distributions(
    field: KnownField,
    network: Network,
    a: np.ndarray,
    b: np.ndarray,
    user: int,
    cols: np.ndarray,
    gamma: float,
    lines: Lines | None = None,
) -> np.ndarray:
    """`query_distributions` of one user's queries (user, cols[k]) with the base network's probabilities
    read in the same pass over the item embeddings as the messages (a top-N over the catalogue reads them
    once): item_emb_j . v = |item_emb_j| sqrt(2) (b_j . [0, v]), b_j = [1, unit_j] / sqrt(2). (K, p)."""
    decoder = np.matmul(network.user_emb[user], network.bilinear)  # (p, d): scores_j = item_emb_j . decoder
    rows = np.full(len(cols), user, dtype=np.int64)
    products: Products
    similar = None
    if 4 * len(cols) > len(b):  # most of the catalogue (a top-N): one float32 product over the item table
        products = lambda v, c: catalogue_products(network, v, c, decoder)  # noqa: E731
        similar = network.user_similarities  # and the users' in float32 (the same-item term's weights)
    else:
        probe = np.sqrt(2.0) * np.hstack([np.zeros((len(decoder), 1)), decoder])  # b_j . probe = unit_j . dec

        def products(v: FloatArray, c: IntArray) -> FloatArray:
            read = row_products(b, np.vstack([v, probe]), c)
            read[:, len(v) :] *= network.item_norms[c][:, None]
            return read

    msg, scores = field.messages(a, b, rows, cols, lines, products, similar)
    assert scores is not None  # one user's queries
    # |s_u - s_v| = |e_j . (dec_u - dec_v)| <= |e_j| max |dec_u - dec_v|: only the items whose norm lets
    # two levels' scores lie further apart than the floor can have a level floored (one nat to spare for
    # the float32 products).
    spread = max(np.linalg.norm(decoder[:, None] - decoder[None], axis=-1).max(), 1e-300)
    norms = network.item_norms if in_order(cols, len(network.item_norms)) else network.item_norms[cols]
    reach = -LOG_FLOOR - np.log(len(decoder)) - 1.0
    candidates = np.flatnonzero(norms * spread >= reach)
    if similar is not None:  # a whole catalogue: level by level, the exponentials in float32
        return catalogue_posterior(scores, msg, gamma, candidates)
    # A copy of its own for the posterior to write over: the distributions a row keeps, contiguous.
    return posterior(np.array(scores, dtype=np.float64, order="C"), msg, gamma, candidates)


LOG_FLOOR = np.log(1e-30)
"""The least log-probability of the base network's that the mean-field update reads (`query_distributions`
floors the probabilities at 1e-30)."""


def posterior(
    scores: FloatArray, msg: FloatArray, gamma: float, candidates: IntArray | None = None
) -> FloatArray:
    """softmax(max(log_softmax(scores), LOG_FLOOR) - gamma msg): `query_distributions` from the decoder's
    scores (K, p). Where no level's log-probability falls below the floor (min - max of a row's scores at
    least LOG_FLOOR + log p: log_softmax >= min - max - log p), the log-softmax only shifts the row, which
    the softmax ignores: softmax(scores - gamma msg), without the exp, sum and log of the log-softmax. The
    other rows take the floor. `candidates`: the only rows that may have a level so far below (all when
    None). `scores` is overwritten (the caller's new array)."""
    floored = _floored(scores, np.arange(len(scores)) if candidates is None else candidates)
    kept = scores[floored] if len(floored) else None
    scores -= gamma * msg
    out = softmax_inplace(scores)
    if kept is not None:
        out[floored] = _at_floor(kept, msg[floored], gamma)
    return out


def _floored(scores: FloatArray, rows: IntArray) -> IntArray:
    """The `rows` of `scores` (K, p) with a level's log-probability below the floor (`posterior`)."""
    some = scores[rows]
    low = last_axis(some, np.minimum)[:, 0] - last_axis(some, np.maximum)[:, 0]
    out: IntArray = rows[low < LOG_FLOOR + np.log(scores.shape[1])]
    return out


def _at_floor(scores: FloatArray, msg: FloatArray, gamma: float) -> FloatArray:
    """The posterior of rows reaching the floor: softmax(max(log_softmax(scores), LOG_FLOOR) - gamma msg)."""
    return softmax(np.maximum(log_softmax(scores), LOG_FLOOR) - gamma * msg)


def catalogue_posterior(
    scores: FloatArray, msg: FloatArray, gamma: float, candidates: IntArray
) -> FloatArray:
    """`posterior` of one user's whole catalogue (K, p), read-only inputs, computed level by level: a (p, K)
    array whose rows are one level each, returned as its (K, p) transpose (Fortran order). Along a short
    last axis numpy's loops cost per row, and float64 exponentials several times float32's: a catalogue's
    K x p = 7e5 entries (the synthetic Epinions) took 14 ms that way. Here the p rows are contiguous, the
    exponentials of the shifted scores (all <= 0) are taken in float32 and normalised in float64: equal to
    `posterior` to about 1e-7 of each probability, as the catalogue's float32 products are to 1e-6."""
    p = scores.shape[1]
    z = np.empty((p, len(scores)))
    for u in range(p):
        np.multiply(msg[:, u], -gamma, out=z[u])
        z[u] += scores[:, u]
    z -= z.max(axis=0)
    e = z.astype(np.float32)
    np.exp(e, out=e)
    z[...] = e
    z /= z.sum(axis=0)
    out: FloatArray = z.T
    floored = _floored(scores, candidates)
    if len(floored):  # rows with a level below the floor: as `posterior` writes them
        out[floored] = _at_floor(scores[floored], msg[floored], gamma)
    return out


BIAS_SWEEPS = 500
"""Most alternating sweeps of `bias_baseline` (it stops earlier once the biases settle)."""


def bias_baseline(
    rows: np.ndarray,
    cols: np.ndarray,
    values: np.ndarray,
    n_users: int,
    n_items: int,
    user_shrink: float,
    item_shrink: float,
    tol: float = 1e-10,
) -> tuple[float, np.ndarray, np.ndarray]:
    """Ridge-regularised biases of the known ratings: (mu, b (n,), c (m,)).

    mu is the mean rating; b and c minimise sum_k (M_k - mu - b_i - c_j)^2 + user_shrink |b|^2 +
    item_shrink |c|^2. Alternating exact updates (b given c, then c given b) converge to the unique
    minimiser; they stop when no bias moves by more than `tol`. A user or item without known ratings
    gets bias 0.
    """
    values = np.asarray(values, dtype=np.float64)
    mu = float(values.mean()) if len(values) else 0.0
    user_count = np.bincount(rows, minlength=n_users) + user_shrink
    item_count = np.bincount(cols, minlength=n_items) + item_shrink
    b, c = np.zeros(n_users), np.zeros(n_items)
    residual = values - mu
    for _ in range(BIAS_SWEEPS):
        b_new = np.bincount(rows, residual - c[cols], n_users) / user_count
        c_new = np.bincount(cols, residual - b_new[rows], n_items) / item_count
        moved = max(np.abs(b_new - b).max(initial=0.0), np.abs(c_new - c).max(initial=0.0))
        b, c = b_new, c_new
        if moved < tol:
            break
    return mu, b, c


def _level_split(values: np.ndarray, levels: np.ndarray) -> tuple[IntArray, FloatArray]:
    """For `level_distribution`: each value's lower level (its weight 1 - frac; the next level's frac)."""
    v = np.clip(np.asarray(values, dtype=np.float64), levels[0], levels[-1])
    step = levels[1] - levels[0] if len(levels) > 1 else 0.0
    if step > 0 and np.array_equal(np.diff(levels), np.full(len(levels) - 1, step)):
        # Evenly spaced levels (most scales): arithmetic instead of a search and gathers over the levels,
        # several times as fast over a catalogue's 1e5 values.
        x = (v - levels[0]) / step
        lower_even = np.minimum(x.astype(np.intp), len(levels) - 2)  # x >= 0: truncation is floor
        return lower_even, x - lower_even
    upper = np.clip(np.searchsorted(levels, v, side="right"), 1, len(levels) - 1)
    lower = upper - 1
    frac: FloatArray = (v - levels[lower]) / (levels[upper] - levels[lower])
    return lower, frac


def level_distribution(values: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Distributions over the levels whose expectations are `values` clipped to [L_1, L_p]: each value's
    weight sits on the two levels around it, split linearly: (K, p)."""
    lower, frac = _level_split(values, levels)
    out = np.zeros((len(lower), len(levels)))
    k = np.arange(len(lower))
    out[k, lower] = 1.0 - frac
    out[k, lower + 1] += frac
    return out


def baseline_mixture(
    dist: np.ndarray, prediction: np.ndarray, levels: np.ndarray, weight: float
) -> np.ndarray:
    """(1 - weight) dist + weight B, with B the level distribution of the baseline's prediction: (K, p),
    written over `dist` (the caller's new array). B's two non-zero levels per row are added where they
    fall (a catalogue's rows: no (K, p) B)."""
    lower, frac = _level_split(prediction, levels)
    out: np.ndarray = dist
    out *= 1.0 - weight
    if not out.flags.c_contiguous:  # (a flat view would be a copy)
        k = np.arange(len(lower))
        out[k, lower] += weight * (1.0 - frac)
        out[k, lower + 1] += weight * frac
        return out
    flat = out.reshape(-1)
    at = np.arange(len(lower)) * len(levels) + lower
    flat[at] += weight * (1.0 - frac)
    flat[at + 1] += weight * frac
    return out


@dataclass(frozen=True)
class FieldKey:
    """What a known field depends on beyond the network and the known ratings. Stored as JSON beside the
    field, so a field computed for other settings is recomputed rather than reused; settings that cannot
    change the field (the co-rating exponent without a co-rating term, the scale unless `scaled`) are 0."""

    scaling: str
    known: str
    gamma: float
    layers: int
    tau: float
    scale: float
    same_user: float
    same_item: float
    co_rating: float
    co_rating_user: float
    co_rating_power: float
    co_rating_shrink: float
    co_rating_prior: float
    n_known: int

    @classmethod
    def of(cls, crf: Crf, kernel: KernelSettings, scale: float, n_known: int) -> FieldKey:
        """The key of a field computed under these settings."""
        co_rated = kernel.co_rating > 0 or kernel.co_rating_user > 0
        return cls(
            scaling=kernel.scaling,
            known=kernel.known,
            gamma=float(crf.gamma),
            layers=int(crf.layers),
            tau=float(crf.tau),
            scale=float(scale) if kernel.scaling == "scaled" else 0.0,
            same_user=kernel.same_user,
            same_item=kernel.same_item,
            co_rating=kernel.co_rating,
            co_rating_user=kernel.co_rating_user,
            co_rating_power=kernel.co_rating_power if co_rated else 0.0,
            co_rating_shrink=kernel.co_rating_shrink if co_rated else 0.0,
            co_rating_prior=kernel.co_rating_prior if co_rated else 0.0,
            n_known=n_known,
        )

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FieldKey | None:
        """The key stored with a field; None when it is not a key of this version (then recompute)."""
        names = {f.name for f in fields(cls)}
        if set(d) != names:
            return None
        try:
            return cls(**d)
        except TypeError:
            return None


class ExactParts:
    """What the `exact` scorers of one network and one set of known ratings share whatever their settings:
    the lifted embeddings, the co-rating grams (`CoRatingGram`), the clamped field's per-label aggregates
    and the bias baselines. Each is built on first use, once. A search over the settings
    (training/tune.py) builds one `ExactScorer` per trial from them in milliseconds instead of seconds.

    The clamped field is linear in the compatibility: with A_l = sum over the entries labelled l of
    a_i b_j^T, G_u = sum_l C[u, l] A_l for any C (any tau)."""

    def __init__(self, network: Network, known: Ratings) -> None:
        self.network, self.known = network, known
        self.user_lifted, self.item_lifted = network.user_lifted, network.item_lifted
        self.labels = nearest_level(known.values, network.levels)
        self._grams: dict[str, CoRatingGram] = {}
        self._per_label: tuple[FloatArray, FloatArray] | None = None
        self._label_matrix: sp.csr_matrix | None = None
        self._biases: dict[tuple[float, float], tuple[float, FloatArray, FloatArray]] = {}

    def table(self, what: str, power: float, shrink: float) -> Affinity:
        """The co-rating table of the items (`items`) or of the users (`users`)."""
        gram = self._grams.get(what)
        if gram is None:
            known, net = self.known, self.network
            if what == "items":
                gram = CoRatingGram.of(known.rows, known.cols, known.values, net.n_users, net.n_items)
            else:
                gram = CoRatingGram.of(known.cols, known.rows, known.values, net.n_items, net.n_users, what)
            self._grams[what] = gram
        return gram.table(power, shrink)

    def label_matrix(self, p: int) -> sp.csr_matrix:
        """`ColumnMajor.label_matrix` of the known entries (p levels), built on first use."""
        if self._label_matrix is None or self._label_matrix.shape[0] != self.known.n_items * p:
            self._label_matrix = ColumnMajor.label_matrix(self.known, self.labels, p)
        return self._label_matrix

    def clamped_field(self, compat: FloatArray) -> tuple[FloatArray, FloatArray]:
        """(G, H) of the known entries clamped to their labels, under the compatibility `compat`."""
        if self._per_label is None:
            graph = FactorizedGraph(self.user_lifted, self.item_lifted, self.known.rows, self.known.cols)
            onehot = np.zeros((len(self.labels), len(compat)))
            onehot[np.arange(len(self.labels)), self.labels] = 1.0
            self._per_label = graph.aggregate(onehot), graph.total()
        per_label, h = self._per_label
        g: FloatArray = np.einsum("ul,lde->ude", compat, per_label)
        return g, h

    def biases(self, user_shrink: float, item_shrink: float) -> tuple[float, FloatArray, FloatArray]:
        """`bias_baseline` of the known ratings with these penalties."""
        key = (user_shrink, item_shrink)
        if key not in self._biases:
            known, net = self.known, self.network
            self._biases[key] = bias_baseline(
                known.rows, known.cols, known.values, net.n_users, net.n_items, user_shrink, item_shrink
            )
        return self._biases[key]


@dataclass(frozen=True)
class RowParts:
    """The part of one user's answers that other users' ratings leave as it is (`ExactScorer.row_parts`):
    valid while the user's ratings and embedding and the items stay the same."""

    user: int
    scores: FloatArray
    """(m, p) the decoder's scores u^T B_l v_j of every item."""
    own: FloatArray | None
    """(m, p [+ 1]) the row terms' sums over every item (same-user, item co-rating; with the normaliser's
    share as column p under `normalized`), or None without them."""

    @property
    def nbytes(self) -> int:
        return int(self.scores.nbytes + (0 if self.own is None else self.own.nbytes))


class ExactScorer:
    """The `exact` mode over one network and its known ratings: everything a query needs (the known
    field, the kernel's tables, the bias baseline) is computed at construction, taken from the artifact's
    stored field when its key matches, or (clamped known entries) assembled from shared `parts`."""

    def __init__(
        self,
        network: Network,
        known: Ratings,
        crf: Crf,
        kernel: KernelSettings,
        output: OutputSettings,
        scale: float = 1.0,
        stored: StoredField | None = None,
        parts: ExactParts | None = None,
    ) -> None:
        self.network, self.known, self.crf = network, known, crf
        self.kernel, self.output = kernel, output
        if parts is not None and (parts.network is not network or parts.known is not known):
            raise ValueError("the parts belong to another network or other known ratings")
        self.parts = parts
        if parts is not None:
            self.user_lifted, self.item_lifted = parts.user_lifted, parts.item_lifted
        else:
            self.user_lifted = network.user_lifted  # a_i = [1, u_i] / sqrt(2): s_r = a_i . a_i'
            self.item_lifted = network.item_lifted
        self.compat = compatibility_matrix(network.levels, crf.tau)
        counts = np.bincount(known.cols, minlength=network.n_items)
        sums = np.bincount(known.cols, weights=known.values, minlength=network.n_items)
        self._item_means = sums / np.maximum(counts, 1)  # what centres the user table's ratings
        self.key = FieldKey.of(crf, kernel, scale, len(known))
        stored_key = FieldKey.from_json(stored.key) if stored is not None else None
        matches = stored is not None and stored_key == self.key
        self.lines = self._lines(stored=stored.tables if stored is not None and matches else None)
        needs_t = self.lines is not None and self.lines.active
        clamped = kernel.known == "clamped"
        labels = parts.labels if parts is not None else nearest_level(known.values, network.levels)
        # The item-ordered copy of the clamped entries that one user's catalogue read takes: built once
        # per `parts` (a search's trials share it), not once per trial.
        matrix = None
        if clamped and parts is not None and self.lines is not None and self.lines.column_terms:
            matrix = parts.label_matrix(len(self.compat))
        by_label = (labels, self.compat, matrix) if clamped else (None, None, None)
        # Clamped entries' t follows from their labels (`ClampedRows`): never stored, never an array.
        clamped_t = ClampedRows(labels, self.compat) if clamped and needs_t else None
        if matches and stored is not None and (clamped or (stored.t is not None) == needs_t):
            self.field = KnownField(
                g=stored.g,
                h=stored.h,
                scaling=kernel.scaling,
                scale=scale,
                t=clamped_t if clamped else stored.t,
                interp=LevelInterpolation.of(self.compat),
            ).with_columns(self.lines, *by_label)
            self.field_source = "artifact"
        elif parts is not None and kernel.known == "clamped":
            g, h = parts.clamped_field(self.compat)
            self.field = KnownField(
                g=g,
                h=h,
                scaling=kernel.scaling,
                scale=scale,
                t=clamped_t,
                interp=LevelInterpolation.of(self.compat),
            ).with_columns(self.lines, *by_label)
            self.field_source = "parts"
        else:
            self.field = self._known_field(scale)
            self.field_source = "computed"
        self.biases: tuple[float, FloatArray, FloatArray] | None = None
        same_known = stored_key is not None and stored_key.n_known == len(known)
        kept = stored.biases if stored is not None and same_known else None
        penalties = (output.baseline_user_shrink, output.baseline_item_shrink)
        if output.baseline > 0 and parts is not None:
            self.biases = parts.biases(*penalties)
        elif output.baseline > 0 and kept is not None and (kept.user_shrink, kept.item_shrink) == penalties:
            self.biases = (kept.mu, kept.users, kept.items)  # the artifact's fit to these ratings
        elif output.baseline > 0:
            self.biases = bias_baseline(
                known.rows,
                known.cols,
                known.values,
                network.n_users,
                network.n_items,
                output.baseline_user_shrink,
                output.baseline_item_shrink,
            )

    def updated(
        self,
        network: Network,
        known: Ratings,
        users: IntArray,
        items: IntArray | None = None,
        tables: Mapping[str, np.ndarray] | None = None,
    ) -> ExactScorer:
        """The scorer once ratings arrived online: `network` and `known` include them (users and items may
        have been added at the end); `users` are those whose ratings or embeddings changed, `items` those
        whose embeddings changed; `tables`: what `online_tables` of the scorer that took them returned
        (a restored snapshot), used instead of recomputing it.

        With clamped known entries and normalized or summed messages the field changes by the terms of the
        entries on those rows and columns alone: their old terms out, their new ones (new ratings, new
        embeddings) in, in O(|those entries| D p + |users| D^2 p). It is never rebuilt. Otherwise (known
        entries updated by the network, or messages scaled by n x m) it is recomputed. The co-rating tables
        stay those of the artifact's ratings until the next training (new users and items have no
        neighbours in them); the bias baseline refits the changed users' biases against the item biases."""
        items = np.empty(0, dtype=np.int64) if items is None else np.asarray(items, dtype=np.int64)
        users = np.asarray(users, dtype=np.int64)
        new = copy.copy(self)
        new.network, new.known, new.parts = network, known, None
        new.user_lifted, new.item_lifted = network.user_lifted, network.item_lifted
        new.lines = new._lines(self.lines)
        stored = dict(tables or {})
        if new.lines is not None and new.lines.user_affinity is not None and "user_table_data" in stored:
            n = network.n_users
            matrix = sp.csr_matrix(
                (stored["user_table_data"], stored["user_table_indices"], stored["user_table_indptr"]),
                shape=(n, n),
            )
            new.lines = dataclasses.replace(new.lines, user_affinity=SparseAffinity(matrix))
        elif new.lines is not None and new.lines.user_affinity is not None and len(users):
            # The changed users' rows of the user table follow their new ratings. The ratings are centred
            # by the item means the table was built with, so an entry depends on its two users' ratings
            # alone, and a dense table on the ratings, not on how they arrived (a sparse one keeps each
            # line's strongest pairs as of its last change).
            k = self.kernel
            means = np.full(network.n_items, self._item_means.mean() if len(self._item_means) else 0.0)
            means[: len(self._item_means)] = self._item_means

            def fresh(lo: int, hi: int) -> FloatArray:
                return co_rating_rows(
                    known.cols, known.rows, known.values, network.n_items, network.n_users, users[lo:hi],
                    k.co_rating_power, k.co_rating_shrink, mean=means, by_row=known.by_col,
                    by_col=known.by_row,
                )  # fmt: skip

            table = new.lines.user_affinity.with_lines(users, fresh)
            new.lines = dataclasses.replace(new.lines, user_affinity=table)
        scale = (
            self.field.scale
            * self.network.n_users
            * self.network.n_items
            / (network.n_users * network.n_items)
        )
        if self.kernel.known == "clamped" and self.kernel.scaling != "scaled":
            old_g, old_h = self._terms(users, items)
            new_g, new_h = new._terms(users, items)
            lines_on = new.lines is not None and new.lines.active
            labels = nearest_level(known.values, network.levels)
            t_all = ClampedRows(labels, self.compat) if lines_on else None
            columns = (
                ColumnMajor.clamped(known, labels, self.compat)
                if new.lines is not None and new.lines.column_terms
                else None
            )
            new.field = KnownField(
                g=self.field.g - old_g + new_g,
                h=self.field.h - old_h + new_h,
                scaling=self.kernel.scaling,
                scale=scale,
                t=t_all,
                interp=self.field.interp,
                columns=columns,
            )
        else:
            new.field = new._known_field(scale)
        new.field_source = "online"
        if self.biases is not None:
            mu, old_b, old_c = self.biases
            b, c = np.zeros(network.n_users), np.zeros(network.n_items)
            b[: len(old_b)], c[: len(old_c)] = old_b, old_c
            for user in users:
                pos = known.by_row.of(int(user))
                residual = known.values[pos] - mu - c[known.cols[pos]]
                b[user] = residual.sum() / (len(pos) + self.output.baseline_user_shrink)
            new.biases = (mu, b, c)
        return new

    def _terms(self, users: IntArray, items: IntArray) -> tuple[FloatArray, FloatArray]:
        """The clamped field's terms (G, H) of the known entries on the rows `users` or the columns `items`:
        sum_l t_l a_{i_l} b_{j_l}^T over them (users and items beyond this scorer's matrix have none)."""
        known = self.known
        on_rows, _ = known.by_row.members(users[users < known.n_users])
        on_cols, _ = known.by_col.members(items[items < known.n_items])
        pos = np.union1d(on_rows, on_cols)
        labels = nearest_level(known.values[pos], self.network.levels)
        sums = clamped_sums(
            self.user_lifted, self.item_lifted, known.rows[pos], known.cols[pos], labels, self.compat
        )
        return sums[:-1], sums[-1]

    def _lines(
        self,
        tables: Lines | None = None,
        stored: dict[str, tuple[FloatArray, IntArray, FloatArray]] | None = None,
    ) -> Lines | None:
        """The kernel's line and co-rating terms (None when every weight is 0), with their tables: those
        of `tables` when given (the user table grows by zero rows and columns for new users), else the
        artifact's `stored` sparse tables where it holds them, else built here."""
        k, known, net = self.kernel, self.known, self.network
        if not any((k.same_user, k.same_item, k.co_rating, k.co_rating_user)):
            return None
        if tables is not None:
            items = None if tables.affinity is None else tables.affinity.grown(net.n_items)
            users = None if tables.user_affinity is None else tables.user_affinity.grown(net.n_users)
        else:
            stored = stored or {}
            items = self._table("items", stored.get("items")) if k.co_rating > 0 else None
            users = self._table("users", stored.get("users")) if k.co_rating_user > 0 else None
        return Lines(
            k.same_user, k.same_item, known, k.co_rating, items, k.co_rating_prior, k.co_rating_user, users
        )

    def _table(self, what: str, stored: tuple[FloatArray, IntArray, FloatArray] | None = None) -> Affinity:
        """The co-rating table of the items or the users (`co_rating_affinity`): the `stored` one (CSR
        arrays), or from `parts` when given, or built."""
        k, known, net = self.kernel, self.known, self.network
        if stored is not None:
            size = net.n_items if what == "items" else net.n_users
            return SparseAffinity(sp.csr_matrix(stored[::-1], shape=(size, size)))
        if self.parts is not None:
            return self.parts.table(what, k.co_rating_power, k.co_rating_shrink)
        if what == "items":
            return co_rating_affinity(
                known.rows, known.cols, known.values, net.n_users, net.n_items,
                k.co_rating_power, k.co_rating_shrink,
            )  # fmt: skip
        return co_rating_affinity(
            known.cols, known.rows, known.values, net.n_items, net.n_users,
            k.co_rating_power, k.co_rating_shrink, what="users",
        )  # fmt: skip

    def save(self, directory: Path) -> None:
        """Write this scorer's field into an artifact directory (`model.artifact.save_known_field`), with
        its sparse co-rating tables and its bias baseline's fit; t only where it is an array (clamped
        entries' follows from their labels)."""
        f = self.field
        t = f.t if isinstance(f.t, np.ndarray) else None
        biases = None
        if self.biases is not None:
            mu, users, items = self.biases
            shrink = (self.output.baseline_user_shrink, self.output.baseline_item_shrink)
            biases = StoredBiases(*shrink, mu, users, items)
        save_known_field(directory, self.key.to_json(), f.g, f.h, t, self.sparse_tables(), biases)

    def online_tables(self) -> dict[str, np.ndarray]:
        """What `updated` built that the ratings alone do not give back (the sparse user table keeps each
        line's strongest pairs as of its last change, so it depends on how ratings were batched): a
        snapshot stores it and a restore passes it back (`updated(..., tables=)`). A dense table follows
        from the ratings and is recomputed instead."""
        table = None if self.lines is None else self.lines.user_affinity
        if not isinstance(table, SparseAffinity):
            return {}
        m = table.matrix
        return {"user_table_indptr": m.indptr, "user_table_indices": m.indices, "user_table_data": m.data}

    def sparse_tables(self) -> dict[str, tuple[IntArray, IntArray, FloatArray]]:
        """The scorer's sparse co-rating tables as CSR arrays (indptr, indices, data), to be stored with
        its field (`model.artifact.save_known_field`); dense ones are quick to rebuild and are not."""
        out = {}
        if self.lines is not None:
            for what, table in (("items", self.lines.affinity), ("users", self.lines.user_affinity)):
                if isinstance(table, SparseAffinity):
                    out[what] = (table.matrix.indptr, table.matrix.indices, table.matrix.data)
        return out

    def _known_field(self, scale: float) -> KnownField:
        known, net = self.known, self.network
        probs = net.probabilities(known.rows, known.cols) if self.kernel.known == "predicted" else None
        return known_field(
            self.user_lifted,
            self.item_lifted,
            known.rows,
            known.cols,
            probs,
            nearest_level(known.values, net.levels),
            self.compat,
            self.crf.gamma,
            self.crf.layers,
            self.kernel.scaling,
            scale,
            self.kernel.known,
            self.lines,
        )

    blocking = False

    @property
    def baseline_weight(self) -> float:
        """Weight of the bias baseline in `predict` (output.baseline)."""
        return float(self.output.baseline)

    def predict(self, rows: IntArray, cols: IntArray, query_probs: FloatArray | None = None) -> FloatArray:
        """Final distributions of the queried entries (rows[k], cols[k]), attached to the known field and
        mixed with the bias baseline when output.baseline > 0: (K, p). `query_probs`: the base network's
        distributions of the entries; without them the network's own, read with the messages when the
        queries are one user's (`user_distributions`)."""
        dist, baseline = self.unmixed(rows, cols, query_probs)
        if baseline is None:
            return dist
        return baseline_mixture(dist, baseline, self.network.levels, self.output.baseline)

    def row_parts(self, user: int) -> RowParts | None:
        """What of the user's answers over the whole catalogue depends on the user's own ratings and
        embedding alone (and on the items'), so that it stays valid while other users' ratings arrive: the
        decoder's scores and the row terms (same-user, item co-rating) over every item, float64. None when
        the known entries are not clamped (their distributions then move with every rating)."""
        if self.kernel.known != "clamped":
            return None
        net, lines = self.network, self.lines
        decoder = np.matmul(net.user_emb[user], net.bilinear)  # (p, d)
        scores = np.asarray(net.item_emb, dtype=np.float64) @ decoder.T  # (m, p)
        own = None
        if lines is not None and self.field.t is not None and (lines.same_user > 0 or lines.co_rating > 0):
            row_terms = dataclasses.replace(lines, same_item=0.0, co_rating_user=0.0)
            cols = np.arange(net.n_items, dtype=np.int64)
            rows = np.full(net.n_items, user, dtype=np.int64)
            normalized = self.kernel.scaling == "normalized"
            own = row_terms.messages(self.field.t, self.user_lifted, self.item_lifted, rows, cols, normalized)
        return RowParts(user, scores, own)

    def from_parts(self, parts: RowParts, cols: IntArray) -> tuple[FloatArray, FloatArray | None]:
        """`unmixed` of the queries (parts.user, cols[k]) from the user's `row_parts` (taken from this
        scorer or from an earlier one whose user and items were the same): the field's messages and the
        column terms (same-item, user co-rating: other users' ratings) read now, the rest from `parts`. The
        same numbers as `unmixed` to rounding, in float64 throughout."""
        user, f, lines = parts.user, self.field, self.lines
        normalized = self.kernel.scaling == "normalized"
        stacked = f.stacked(normalized)
        forms = row_products(self.item_lifted, np.matmul(self.user_lifted[user], stacked), cols)
        p = f.g.shape[0]
        msg, total = forms[:, :p], (forms[:, p] if normalized else None)
        if lines is not None and lines.active and f.t is not None:
            extra = np.zeros((len(cols), p + int(normalized)))
            if parts.own is not None:
                extra += parts.own[cols]
            if lines.column_terms:
                extra += self._column_terms(user, cols, normalized)
            msg = msg + extra[:, :p]
            if total is not None:
                total = total + extra[:, p] + lines.prior_weight
        if self.kernel.scaling == "scaled":
            msg = msg * f.scale
        elif total is not None:
            msg = msg / np.maximum(total, 1e-12)[:, None]
        dist = posterior(np.array(parts.scores[cols], dtype=np.float64, order="C"), msg, self.crf.gamma)
        if self.biases is None:
            return dist, None
        mu, user_bias, item_bias = self.biases
        return dist, item_bias[cols] + (mu + user_bias[user])

    def _column_terms(self, user: int, cols: IntArray, with_total: bool) -> FloatArray:
        """The column terms (same-item, user co-rating) of one user's queries: sum over the known l on
        column j of e(i_l) t_l, e = lambda_i s_r(user, .) + lambda_c w_u(user, .) (`Lines.messages`),
        with the sums of e alone after them when `with_total`: (K, p [+ 1]). For clamped entries
        t_l = C[label_l]: the sums of e per label first (one bincount), then C."""
        lines, t, known = self.lines, self.field.t, self.known
        assert lines is not None and isinstance(t, ClampedRows)  # `row_parts`: clamped entries only
        e = lines.column_weights(user, self.user_lifted)
        members, counts = known.by_col.members(cols)
        p = len(t.compat)
        owner = np.repeat(np.arange(len(cols)), counts)
        per_label = np.bincount(
            owner * p + t.labels[members], weights=e[known.rows[members]], minlength=len(cols) * p
        ).reshape(len(cols), p)
        out = per_label @ t.compat
        if with_total:
            out = np.hstack([out, per_label.sum(axis=1, keepdims=True)])
        result: FloatArray = out
        return result

    def unmixed(
        self, rows: IntArray, cols: IntArray, query_probs: FloatArray | None = None
    ) -> tuple[FloatArray, FloatArray | None]:
        """What `predict` mixes: the CRF's distributions (K, p) and the bias baseline's predictions (K,),
        None without one (output.baseline 0). A catalogue's row is kept unmixed (service.scoring), so a
        top-N reads expected ratings, (1 - w) E[CRF] + w clip(baseline), without a mixed (K, p) array."""
        user = one_row(rows) if query_probs is None else None
        if user is not None:
            dist = user_distributions(
                self.field,
                self.network,
                self.user_lifted,
                self.item_lifted,
                user,
                cols,
                self.crf.gamma,
                self.lines,
            )
        else:
            if query_probs is None:
                query_probs = self.network.probabilities(rows, cols)
            dist = query_distributions(
                self.field,
                self.user_lifted,
                self.item_lifted,
                rows,
                cols,
                query_probs,
                self.crf.gamma,
                self.lines,
            )
        if self.biases is None:
            return dist, None
        mu, user_bias, item_bias = self.biases
        user_part = user_bias[rows] if user is None else user_bias[user]  # one user's: a number
        return dist, item_bias[cols] + (mu + user_part)
