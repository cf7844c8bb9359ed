"""The co-rating tables' build from ratings: the gram of every positive pair's cosine and co-rating count
(`CoRatingGram`), what it costs (`gram_cost`), and single lines of a table (`co_rating_rows`) for ratings
that arrive. The tables themselves: model/exact/affinity.py.

The table sizes (`affinity.DENSE_TABLE_MAX`, `affinity.CO_RATING_NEIGHBOURS`) are read through the module at
call time, so that one setting governs both files.

The maths: the package docstring (model/exact/__init__.py) and docs/model.md."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from scipy.linalg import blas

from model.exact import affinity
from model.exact.affinity import Affinity, DenseAffinity, SparseAffinity
from model.ratings import LineIndex, Ratings, index_dtype
from model.types import FloatArray, IntArray

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
        return self.m <= affinity.DENSE_TABLE_MAX

    @classmethod
    def of(
        cls, rows: IntArray, cols: IntArray, values: FloatArray, n: int, m: int, what: str = "items"
    ) -> CoRatingGram:
        """The gram of the columns of the n x m matrix (rows, cols, values), each row's mean removed."""
        mean = np.bincount(rows, weights=values, minlength=n) / np.maximum(np.bincount(rows, minlength=n), 1)
        if m > affinity.DENSE_TABLE_MAX:
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
            top = rank < affinity.CO_RATING_NEIGHBOURS
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
            top = np.argsort(-score, axis=1, kind="stable")[:, : affinity.CO_RATING_NEIGHBOURS]
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
    return lines <= affinity.DENSE_TABLE_MAX or gram_cost(known, what) <= GRAM_PAIR_BUDGET


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
    index_type = index_dtype(max(n, m, len(rows)))
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
