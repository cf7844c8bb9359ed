"""model.exact.gram: the co-rating tables built from ratings equal the shrunk adjusted cosine, dense or
sparse, whole or line by line, and a gram costs the cheaper of its two builds."""

from __future__ import annotations

import numpy as np
import pytest

from model import exact
from model.ratings import LineIndex, Ratings


def adjusted_cosine(rows, cols, values, n, m, power, shrink=10.0):  # type: ignore[no-untyped-def]
    """w(j, j') = max(0, rho)^power item pair by item pair, straight from the definition."""
    ratings = {(i, j): v for i, j, v in zip(rows, cols, values, strict=True)}
    mean = {i: np.mean([v for (u, _), v in ratings.items() if u == i]) for i in set(rows)}
    w = np.zeros((m, m))
    for j in range(m):
        for k in range(m):
            users_j = {i for (i, c) in ratings if c == j}
            users_k = {i for (i, c) in ratings if c == k}
            num = sum((ratings[i, j] - mean[i]) * (ratings[i, k] - mean[i]) for i in users_j & users_k)
            norm_j = np.sqrt(sum((ratings[i, j] - mean[i]) ** 2 for i in users_j))
            norm_k = np.sqrt(sum((ratings[i, k] - mean[i]) ** 2 for i in users_k))
            if norm_j > 0 and norm_k > 0:
                both = len(users_j & users_k)
                rho = num / (norm_j * norm_k) * both / (both + shrink)
                w[j, k] = max(0.0, rho) ** power
    return w


def test_co_rating_affinity_is_the_shrunkadjusted_cosine() -> None:
    rng = np.random.default_rng(14)
    n, m = 9, 6
    rows, cols = np.nonzero(rng.random((n, m)) < 0.6)
    values = rng.integers(1, 6, len(rows)).astype(float)
    rows, cols, values = rows[cols != 5], cols[cols != 5], values[cols != 5]  # item 5: nobody rated it
    for power, shrink in ((1.0, 10.0), (3.0, 10.0), (3.0, 0.5)):
        got = exact.co_rating_affinity(rows, cols, values, n, m, power, shrink).toarray()
        want = adjusted_cosine(rows, cols, values, n, m, power, shrink)
        np.testing.assert_allclose(got, want, atol=1e-12)
    assert (got >= 0).all() and not got[5].any() and got[np.triu_indices(5, 1)].any()


def _ratings(n: int, m: int, density: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    rows, cols = np.nonzero(rng.random((n, m)) < density)
    return rows, cols, rng.integers(1, 6, len(rows)).astype(float)


def test_a_sparse_table_holding_every_neighbour_is_the_dense_table(monkeypatch: pytest.MonkeyPatch) -> None:
    # Above DENSE_TABLE_MAX lines the gram is a chunked sparse product; with as many neighbours kept as
    # there are lines it holds every positive pair, so its tables equal the dense ones.
    rows, cols, values = _ratings(40, 30, 0.3, 3)
    dense = exact.co_rating_affinity(rows, cols, values, 40, 30, 2.0, 5.0)
    users = exact.co_rating_affinity(cols, rows, values, 30, 40, 2.0, 5.0, what="users")
    assert isinstance(dense, exact.DenseAffinity)
    monkeypatch.setattr(exact.affinity, "DENSE_TABLE_MAX", 10)
    monkeypatch.setattr(exact.gram, "GRAM_BLAS_LINES", 0)  # the sparse product, not dense products
    monkeypatch.setattr(exact.affinity, "CO_RATING_NEIGHBOURS", 40)
    monkeypatch.setattr(exact.gram, "GRAM_CHUNK_PAIRS", 50)  # many chunks
    sparse = exact.co_rating_affinity(rows, cols, values, 40, 30, 2.0, 5.0)
    assert isinstance(sparse, exact.SparseAffinity)
    np.testing.assert_allclose(sparse.toarray(), dense.toarray(), atol=1e-12)
    sparse_users = exact.co_rating_affinity(cols, rows, values, 30, 40, 2.0, 5.0, what="users")
    np.testing.assert_allclose(sparse_users.toarray(), users.toarray(), atol=1e-12)
    a, b = np.array([0, 3, 7, 29]), np.array([5, 3, 0, 1])
    np.testing.assert_allclose(sparse.pairs(a, b), dense.pairs(a, b), atol=1e-12)
    np.testing.assert_allclose(sparse.block(a, b), dense.block(a, b), atol=1e-12)
    # A block is read from the lines b's stored neighbours (the table is symmetric), an item asked twice
    # included, also when each line keeps only its strongest few (below).
    twice = np.array([3, 0, 3, 29, 7, 12])
    np.testing.assert_allclose(sparse.block(twice, b), dense.block(twice, b), atol=1e-12)
    np.testing.assert_allclose(sparse.rows(a), dense.rows(a), atol=1e-12)
    w = np.random.default_rng(5).normal(size=(4, 3))
    np.testing.assert_allclose(sparse.weighted_lines(a, w), dense.weighted_lines(a, w), atol=1e-12)
    # Added into an array in place: a line given twice counts twice; an array shorter than the table
    # takes its first lines (a table grown for items the array does not cover).
    for size in (30, 26):
        for lines in (a, np.array([3, 3, 29, 0])):
            start = np.random.default_rng(2).normal(size=(size, 3))
            want = start + dense.weighted_lines(lines, w)[:size]
            for table in (sparse, dense):
                got = start.copy()
                table.add_weighted_lines(got, lines, w)
                np.testing.assert_allclose(got, want, atol=1e-12)
        for table in (sparse, dense):
            got = np.ones(size)
            table.add_line(got, 7, 2.5)
            np.testing.assert_allclose(got, 1.0 + 2.5 * dense.rows(np.array([7]))[0, :size], atol=1e-12)
    # The item term's three ways (a user's whole catalogue, a user's few items, many users) agree.
    index, weights = LineIndex(rows, 40), np.random.default_rng(6).random((len(rows), 5))
    for q_rows, q_cols in (
        (np.full(30, 3), np.arange(30)),
        (np.full(4, 3), np.array([1, 5, 9, 2])),
        (np.arange(40), np.arange(40) % 30),
    ):
        got = exact.affinity_messages(index, sparse, cols, weights, q_rows, q_cols, with_total=True)
        want = exact.affinity_messages(index, dense, cols, weights, q_rows, q_cols, with_total=True)
        np.testing.assert_allclose(got, want, atol=1e-12)
    np.testing.assert_allclose(sparse.grown(33).toarray(), dense.grown(33).toarray(), atol=1e-12)
    fresh = np.abs(np.random.default_rng(1).normal(size=(2, 30)))
    lines = np.array([4, 11])
    np.testing.assert_allclose(
        sparse.with_lines(lines, fresh).toarray(), dense.with_lines(lines, fresh).toarray(), atol=1e-12
    )
    monkeypatch.setattr(exact.affinity, "CO_RATING_NEIGHBOURS", 4)
    few = exact.co_rating_affinity(rows, cols, values, 40, 30, 2.0, 5.0)
    assert isinstance(few, exact.SparseAffinity) and few.matrix.nnz < sparse.matrix.nnz
    wide = np.arange(30)
    np.testing.assert_array_equal(few.block(wide, wide), few.matrix.toarray())
    np.testing.assert_array_equal(few.block(twice, b), few.matrix[twice][:, b].toarray())
    assert few.block(twice, b[:0]).shape == (6, 0) and few.block(twice[:0], b).shape == (0, 4)
    moved = few.with_lines(lines, fresh)  # lines replaced online stay symmetric
    np.testing.assert_array_equal(moved.block(wide, wide), moved.toarray())


def test_the_gram_of_dense_products_keeps_what_the_sparse_product_keeps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Up to GRAM_BLAS_LINES lines, a sparse table whose dense products cost less than its co-rated pairs
    # is built from float32 syrk products of dense chunks of rows: the same pairs, to float32 precision.
    rng = np.random.default_rng(7)
    rows, cols = np.nonzero(rng.random((50, 40)) < 0.3)
    values = rng.normal(3.0, 1.0, len(rows))  # no ties among the scores
    monkeypatch.setattr(exact.affinity, "DENSE_TABLE_MAX", 10)
    monkeypatch.setattr(exact.gram, "PRODUCT_CHUNK_CELLS", 7 * 40)  # chunks of 7 rows
    for neighbours in (40, 3):
        monkeypatch.setattr(exact.affinity, "CO_RATING_NEIGHBOURS", neighbours)
        monkeypatch.setattr(exact.gram, "GRAM_BLAS_LINES", 0)
        sparse = exact.co_rating_affinity(rows, cols, values, 50, 40, 1.5, 5.0)
        users = exact.co_rating_affinity(cols, rows, values, 40, 50, 1.5, 5.0, what="users")
        monkeypatch.setattr(exact.gram, "GRAM_BLAS_LINES", 100)

        def refused(*args: object) -> None:
            raise AssertionError("the sparse product ran")

        with monkeypatch.context() as m:
            m.setattr(exact.CoRatingGram, "_sparse", classmethod(refused))
            products = exact.co_rating_affinity(rows, cols, values, 50, 40, 1.5, 5.0)
            products_users = exact.co_rating_affinity(cols, rows, values, 40, 50, 1.5, 5.0, what="users")
        assert isinstance(products, exact.SparseAffinity)
        for got, want in ((products, sparse), (products_users, users)):
            table = got.toarray()
            np.testing.assert_array_equal(table > 0, want.toarray() > 0)  # the same pairs kept
            np.testing.assert_allclose(table, want.toarray(), atol=1e-6)
            np.testing.assert_array_equal(table, table.T)


def test_a_grams_cost_is_the_cheaper_of_its_pairs_and_its_dense_products(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = np.random.default_rng(0)
    known = Ratings(rng.integers(0, 40, 900), rng.integers(0, 70, 900), rng.integers(1, 6, 900), 40, 70)
    counts = np.bincount(known.rows).astype(np.float64)
    pairs = int(counts @ counts)
    monkeypatch.setattr(exact.gram, "GRAM_BLAS_LINES", 0)
    assert exact.gram_cost(known, "items") == pairs
    monkeypatch.setattr(exact.gram, "GRAM_BLAS_LINES", 70)
    monkeypatch.setattr(exact.gram, "PRODUCT_UNITS_PER_PAIR", 1)
    assert exact.gram_cost(known, "items") == pairs  # 2 x 40 x 70^2 units: dearer than the pairs
    monkeypatch.setattr(exact.gram, "PRODUCT_UNITS_PER_PAIR", 1000)
    assert exact.gram_cost(known, "items") == 2 * 40 * 70 * 70 // 1000
    monkeypatch.setattr(exact.affinity, "DENSE_TABLE_MAX", 50)
    monkeypatch.setattr(exact.gram, "GRAM_PAIR_BUDGET", 2 * 40 * 70 * 70 // 1000)
    assert exact.co_rating_affordable(known, "items")
    monkeypatch.setattr(exact.gram, "GRAM_BLAS_LINES", 69)
    assert not exact.co_rating_affordable(known, "items")


def test_a_sparse_table_keeps_each_lines_strongest_neighbours_and_stays_symmetric(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rows, cols, values = _ratings(60, 40, 0.4, 4)
    full = exact.co_rating_affinity(rows, cols, values, 60, 40, 1.0, 10.0).toarray()
    monkeypatch.setattr(exact.affinity, "DENSE_TABLE_MAX", 10)
    monkeypatch.setattr(exact.gram, "GRAM_BLAS_LINES", 0)
    monkeypatch.setattr(exact.affinity, "CO_RATING_NEIGHBOURS", 3)
    cut = exact.co_rating_affinity(rows, cols, values, 60, 40, 1.0, 10.0).toarray()
    np.testing.assert_array_equal(cut, cut.T)
    kept = cut > 0
    np.testing.assert_allclose(cut[kept], full[kept], atol=1e-12)  # kept pairs keep their values
    for j in range(40):  # (power 1, shrink 10: the table is the ranking score itself)
        strongest = np.sort(full[j])[::-1][:3]
        np.testing.assert_allclose(np.sort(cut[j])[::-1][:3], strongest[strongest > 0].tolist()
                                   + [0.0] * (3 - int((strongest > 0).sum())), atol=1e-12)  # fmt: skip
    assert kept.sum() < (full > 0).sum()  # fewer pairs than the full table
    fresh = np.abs(np.random.default_rng(2).normal(size=(1, 40)))
    updated = exact.co_rating_affinity(rows, cols, values, 60, 40, 1.0, 10.0).with_lines(np.array([7]), fresh)
    table = updated.toarray()
    np.testing.assert_array_equal(table, table.T)
    assert (table[7] > 0).sum() == 3 and np.isclose(table[7].max(), fresh.max())


def test_co_rating_rows_are_rows_of_the_table() -> None:
    rng = np.random.default_rng(15)
    n, m = 11, 8
    rows, cols = np.nonzero(rng.random((n, m)) < 0.5)
    values = rng.integers(1, 6, len(rows)).astype(float)
    keep = cols != 6  # column 6: nobody rated it
    rows, cols, values = rows[keep], cols[keep], values[keep]
    targets = np.array([3, 6, 0, 3])
    table = exact.co_rating_affinity(rows, cols, values, n, m, 3.0, 2.0).toarray()
    got = exact.co_rating_rows(rows, cols, values, n, m, targets, 3.0, 2.0)
    np.testing.assert_allclose(got, table[targets], rtol=1e-12, atol=1e-15)
    # Centred by given means instead of each row's own: the same definition with those means.
    mean = rng.random(n) * 4 + 1
    centred = np.zeros((n, m))
    centred[rows, cols] = values - mean[rows]
    rated = np.zeros((n, m))
    rated[rows, cols] = 1.0
    norms = np.linalg.norm(centred, axis=0)
    co = rated.T @ rated
    rho = (centred.T @ centred) / np.maximum(np.outer(norms, norms), 1e-12) * co / (co + 2.0)
    want = np.maximum(rho, 0.0) ** 3.0
    got = exact.co_rating_rows(rows, cols, values, n, m, targets, 3.0, 2.0, mean=mean)
    np.testing.assert_allclose(got, want[targets], rtol=1e-12, atol=1e-15)
