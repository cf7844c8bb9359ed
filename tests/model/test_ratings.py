"""The one index of known ratings (model/ratings.py) and the numpy base network (model/engine.Network)."""

from __future__ import annotations

import numpy as np
import pytest

from model.config import ModelConfig
from model.engine import Network, label_probabilities, nearest_level
from model.ratings import LineIndex, Ratings, ranges, stable_order


def _ratings(seed: int = 0, n: int = 7, m: int = 5) -> Ratings:
    """Ratings in a shuffled order, user 6 and item 4 without any."""
    rng = np.random.default_rng(seed)
    rows, cols = np.nonzero(rng.random((n - 1, m - 1)) < 0.6)
    order = rng.permutation(len(rows))
    return Ratings(rows[order], cols[order], rng.integers(1, 6, len(rows)).astype(float), n, m)


def test_ranges_concatenates_aranges() -> None:
    owner, pos = ranges(np.array([10, 0, 5]), np.array([2, 0, 3]))
    assert owner.tolist() == [0, 0, 2, 2, 2]
    assert pos.tolist() == [10, 11, 5, 6, 7]
    owner, pos = ranges(np.array([], dtype=np.int64), np.array([], dtype=np.int64))
    assert len(owner) == len(pos) == 0


def test_line_index_groups_entries_keeping_their_order() -> None:
    line = np.array([2, 0, 2, 3, 0, 2])
    index = LineIndex(line, 5)
    assert index.of(0).tolist() == [1, 4]
    assert index.of(1).tolist() == []
    assert index.of(2).tolist() == [0, 2, 5]
    assert index.of(4).tolist() == []
    assert index.counts(np.array([0, 1, 2, 3, 4])).tolist() == [2, 0, 3, 1, 0]
    members, counts = index.members(np.array([3, 0, 1]))
    assert members.tolist() == [3, 1, 4] and counts.tolist() == [1, 2, 0]


@pytest.mark.parametrize("n_lines", [7, 70_000, 1 << 40])
def test_stable_order_is_a_stable_argsort(n_lines: int) -> None:
    # One 16-bit radix pass, two (ids past 65,536: digits that tie in the high half), numpy's sort beyond.
    rng = np.random.default_rng(3)
    line = rng.integers(0, min(n_lines, 1 << 34), 5_000)
    line[::7] = line[0]  # many ties: their original order must survive
    line[1::11] = (line[1] & ~0xFFFF) | 3  # the same high digit, different low digits
    np.testing.assert_array_equal(stable_order(line, n_lines), np.argsort(line, kind="stable"))


def test_ratings_index_rows_and_columns() -> None:
    r = _ratings()
    assert r.rows.dtype == r.cols.dtype == np.int64 and r.values.dtype == np.float64
    dense = np.zeros((7, 5))
    dense[r.rows, r.cols] = r.values
    for i in range(7):
        assert sorted(r.cols[r.by_row.of(i)].tolist()) == np.flatnonzero(dense[i]).tolist()
        assert (np.diff(r.by_row.of(i)) > 0).all()  # in the order given
    for j in range(5):
        assert sorted(r.rows[r.by_col.of(j)].tolist()) == np.flatnonzero(dense[:, j]).tolist()
    users, items = np.array([6, 0, 3, 0]), np.array([4, 1, 2])
    got_rows, got_cols = r.dense_rows(users), r.dense_cols(items)
    assert got_rows.dtype == got_cols.dtype == np.float32
    np.testing.assert_array_equal(got_rows, dense[users])
    np.testing.assert_array_equal(got_cols, dense.T[items])
    assert not got_rows[0].any() and not got_cols[0].any()  # nobody rated: zeros
    for by, matrix in (("row", dense), ("col", dense.T)):
        data, indices, indptr = r.csr_arrays(by)
        rebuilt = np.zeros_like(matrix)
        for line in range(len(indptr) - 1):
            rebuilt[line, indices[indptr[line] : indptr[line + 1]]] = data[indptr[line] : indptr[line + 1]]
        np.testing.assert_array_equal(rebuilt, matrix)
    no_index = np.empty(0, dtype=np.int64)
    empty = Ratings(no_index, no_index, np.empty(0), 3, 2)
    assert len(empty) == 0 and not empty.dense_rows(np.arange(3)).any()


@pytest.mark.parametrize(
    ("rows", "cols", "values", "match"),
    [
        ([0, 7], [0, 1], [1.0, 2.0], "outside the 7 x 5 matrix"),
        ([0, 1], [0, 5], [1.0, 2.0], "outside"),
        ([-1, 1], [0, 1], [1.0, 2.0], "outside"),
        ([0, 1], [0], [1.0, 2.0], "differ in length"),
    ],
)
def test_ratings_outside_the_matrix_are_refused(rows, cols, values, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        Ratings(np.array(rows), np.array(cols), np.array(values), 7, 5)


def test_network_reads_float32_embeddings_in_float64() -> None:
    rng = np.random.default_rng(1)
    cfg = ModelConfig(n_users=6, n_items=4, levels=(1, 2, 3), hidden=(3,))
    user, item, bilinear = rng.normal(size=(6, 3)), rng.normal(size=(4, 3)), rng.normal(size=(3, 3, 3))
    user32, item32 = user.astype(np.float32), item.astype(np.float32)
    net = Network(cfg, user32, item32, bilinear.astype(np.float32))
    # The float32 embeddings (an artifact's shared maps) are kept, not copied; what derives from them is
    # float64, and equals, bit for bit, what float64 copies give (a float32 converts exactly).
    assert net.user_emb is user32 and net.item_emb is item32 and net.item_table is item32
    assert net.bilinear.dtype == net.user_unit.dtype == net.item_unit.dtype == np.float64
    copy = Network(cfg, user32.astype(np.float64), item32.astype(np.float64), bilinear.astype(np.float32))
    assert copy.user_emb.dtype == np.float64 and copy.item_table is None
    for name in ("user_unit", "item_unit", "item_norms"):
        np.testing.assert_array_equal(getattr(net, name), getattr(copy, name))
    every = np.repeat(np.arange(6), 4), np.tile(np.arange(4), 6)
    for rows, cols in (every, (np.zeros(4, dtype=np.int64), np.arange(4))):  # many users; one user's row
        np.testing.assert_array_equal(net.probabilities(rows, cols), copy.probabilities(rows, cols))
    np.testing.assert_array_equal(copy.catalogue, item32)  # made on first use
    assert (net.n_users, net.n_items) == (6, 4) and net.levels.tolist() == [1.0, 2.0, 3.0]
    np.testing.assert_allclose(np.linalg.norm(net.user_unit, axis=1), 1.0)
    rows, cols = np.array([0, 5, 2]), np.array([3, 0, 0])
    np.testing.assert_allclose(
        net.probabilities(rows, cols),
        label_probabilities(net.user_emb, net.item_emb, net.bilinear, rows, cols),
        rtol=1e-15,
    )
    sim = net.entry_similarity(rows, cols)
    u, v = net.user_unit, net.item_unit
    assert sim[0, 1] == pytest.approx((1 + u[0] @ u[5]) / 2 * (1 + v[3] @ v[0]) / 2)
    np.testing.assert_allclose(np.diag(sim), 1.0)


def test_a_network_with_changed_rows_equals_one_built_from_its_embeddings() -> None:
    rng = np.random.default_rng(2)
    cfg = ModelConfig(n_users=6, n_items=4, levels=(1, 2, 3), hidden=(3,))
    user, item = rng.normal(size=(6, 3)).astype(np.float32), rng.normal(size=(4, 3)).astype(np.float32)
    net = Network(cfg, user, item, rng.normal(size=(3, 3, 3)))
    new_user = np.vstack([user, rng.normal(size=(2, 3))]).astype(np.float64)  # two users appended
    new_user[[1, 4]] = rng.normal(size=(2, 3))  # two changed
    new_item = np.vstack([item, rng.normal(size=(1, 3))]).astype(np.float64)
    new_item[2] = rng.normal(size=3)
    got = net.with_rows(new_user, new_item, np.array([1, 4, 7]), np.array([2]))
    want = Network(cfg, new_user, new_item, net.bilinear)
    for name in ("user_norms", "user_lifted", "item_norms", "item_lifted", "catalogue_scale", "levels"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert got.item_table is None and got.user_emb is new_user
    np.testing.assert_array_equal(net.user_lifted, Network(cfg, user, item, net.bilinear).user_lifted)
    with pytest.raises(ValueError, match="grow"):
        net.with_rows(new_user[:5], new_item, np.array([1]), np.array([], dtype=np.int64))


def _same_lines(got: Ratings, want: Ratings) -> None:
    """Both hold the same ratings on every line, in the same order."""
    for by in ("row", "col"):
        for got_part, want_part in zip(got.csr_arrays(by), want.csr_arrays(by), strict=True):
            np.testing.assert_array_equal(got_part, want_part)


def test_changed_ratings_equal_ratings_built_from_their_arrays() -> None:
    before = _ratings(3)
    at = np.array([0, 4])
    grown = before.changed(
        at,
        np.array([5.0, 1.0]),
        np.array([6, 0, 7, 6]),
        np.array([4, 4, 1, 0]),
        np.array([2.0, 3.0, 4.0, 5.0]),
        8,
        5,
    )
    # The re-rated pairs move to new positions after the added ones; their old positions hold nothing.
    keep = np.ones(len(before), dtype=bool)
    keep[at] = False
    rebuilt = Ratings(
        np.r_[before.rows[keep], 6, 0, 7, 6, before.rows[at]],
        np.r_[before.cols[keep], 4, 4, 1, 0, before.cols[at]],
        np.r_[before.values[keep], 2.0, 3.0, 4.0, 5.0, 5.0, 1.0],
        8,
        5,
    )
    assert len(grown) == len(rebuilt) == len(before) + 4 and len(grown.rows) == len(before) + 6
    assert not grown.whole and grown.compact().whole
    for name in ("rows", "cols", "values"):
        np.testing.assert_array_equal(getattr(grown.compact(), name), getattr(rebuilt, name))
    _same_lines(grown, rebuilt)
    for index in ("by_row", "by_col"):  # the compressed layout, made from the changed lines
        np.testing.assert_array_equal(getattr(grown.compact(), index).order, getattr(rebuilt, index).order)
        np.testing.assert_array_equal(getattr(grown, index).indptr, getattr(rebuilt, index).indptr)
    # the original is left as it was
    np.testing.assert_array_equal(before.values, _ratings(3).values)
    _same_lines(before, _ratings(3))
    # taken back: out of both indexes
    fewer = grown.changed(at[:0], at[:0], at[:0], at[:0], at[:0], 8, 5, removed=grown.by_row.of(7))
    assert len(fewer) == len(grown) - 1 and fewer.by_row.counts(np.array([7])).tolist() == [0]
    assert 7 not in fewer.rows[fewer.by_col.of(1)].tolist()
    # labels asked for before the change are carried forward: equal to those computed afresh
    levels = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    labelled = _ratings(3)
    first = labelled.labels(levels)
    assert not first.flags.writeable and labelled.labels(levels) is first  # computed once
    carried = labelled.changed(
        at, np.array([5.0, 1.0]), np.array([6, 0, 7, 6]), np.array([4, 4, 1, 0]),
        np.array([2.0, 3.0, 4.0, 5.0]), 8, 5,
    )  # fmt: skip
    live = np.sort(grown.by_row.order)  # the positions that hold a rating, in order
    np.testing.assert_array_equal(carried.labels(levels)[live], nearest_level(rebuilt.values, levels))
    np.testing.assert_array_equal(grown.labels(levels)[live], nearest_level(rebuilt.values, levels))
    np.testing.assert_array_equal(first, nearest_level(_ratings(3).values, levels))  # the original's kept
    halves = np.arange(1.0, 5.5, 0.5)  # other levels: computed for them
    np.testing.assert_array_equal(carried.labels(halves)[live], nearest_level(rebuilt.values, halves))
    with pytest.raises(ValueError, match="outside"):
        before.changed(at[:0], at[:0], np.array([9]), np.array([0]), np.array([1.0]), 8, 5)
    with pytest.raises(ValueError, match="grow"):
        before.changed(at[:0], at[:0], at[:0], at[:0], at[:0], 6, 5)


def test_a_chain_of_changes_keeps_every_earlier_state_and_compacts(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ratings changed batch after batch (re-ratings, new pairs, retractions) share append-only arrays:
    # each state must equal a rebuild of its ratings and stay so while later ones are made, through the
    # stores' growth and the compactions that drop old positions.
    monkeypatch.setattr("model.ratings.COMPACT_SLACK", 0)  # compact as soon as old positions are half
    rng = np.random.default_rng(11)
    n, m = 30, 20
    ratings = Ratings(np.array([0, 1]), np.array([0, 1]), np.array([3.0, 4.0]), n, m)
    truth = {(0, 0): 3.0, (1, 1): 4.0}
    levels = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    ratings.labels(levels)
    states: list[tuple[Ratings, dict[tuple[int, int], float]]] = []
    compacted = 0
    for _ in range(300):
        pairs = {(int(i), int(j)): float(rng.integers(1, 6)) for i, j in rng.integers(0, (n, m), (6, 2))}
        gone = [pair for pair in list(truth)[:: max(1, len(truth) // 2)] if rng.random() < 0.3]
        at, values, rows, cols, added, removed = [], [], [], [], [], []
        for (i, j), value in pairs.items():
            hit = ratings.find(i, j)
            if len(hit):
                at.append(int(hit[0]))
                values.append(value)
            else:
                rows.append(i)
                cols.append(j)
                added.append(value)
        for i, j in gone:
            if (i, j) not in pairs:
                removed += ratings.find(i, j).tolist()
                truth.pop((i, j))
        truth.update(pairs)
        before = len(ratings.rows)
        ratings = ratings.changed(
            np.array(at, dtype=np.int64), np.array(values), np.array(rows, dtype=np.int64),
            np.array(cols, dtype=np.int64), np.array(added), n, m, np.array(removed, dtype=np.int64),
        )  # fmt: skip
        compacted += len(ratings.rows) < before
        states.append((ratings, dict(truth)))
    assert compacted > 0  # the old positions were dropped at least once
    for state, expected in states[::7] + states[-3:]:
        whole = state.compact()
        got = {
            (int(i), int(j)): float(v) for i, j, v in zip(whole.rows, whole.cols, whole.values, strict=True)
        }
        assert got == expected and len(state) == len(expected)
        rebuilt = Ratings(whole.rows, whole.cols, whole.values, n, m)
        _same_lines(state, rebuilt)
        live = np.sort(state.by_row.order)
        np.testing.assert_array_equal(state.labels(levels)[live], nearest_level(whole.values, levels))
        np.testing.assert_array_equal(state.dense_rows(np.arange(n)), rebuilt.dense_rows(np.arange(n)))
        np.testing.assert_array_equal(state.dense_cols(np.arange(m)), rebuilt.dense_cols(np.arange(m)))


def test_an_older_index_is_not_extended_in_place() -> None:
    # A change made from an index that is not the last of its chain copies rather than overwrite what the
    # last one appended.
    index = LineIndex(np.array([0, 1, 0]), 3)
    first = index.changed(np.array([], dtype=np.int64), np.array([], dtype=np.int64), np.array([2]), 3, 3)
    second = first.changed(np.array([0]), np.array([0]), np.array([1]), 4, 3)
    branch = first.changed(np.array([], dtype=np.int64), np.array([], dtype=np.int64), np.array([2]), 4, 3)
    assert second.of(0).tolist() == [2] and second.of(1).tolist() == [1, 4] and second.of(2).tolist() == [3]
    assert branch.of(2).tolist() == [3, 4] and branch.of(1).tolist() == [1]
    assert first.of(0).tolist() == [0, 2] and first.of(2).tolist() == [3]
    assert index.of(2).tolist() == [] and index.order.tolist() == [0, 2, 1]


def test_entries_appended_to_a_line_go_into_its_room_without_touching_earlier_indexes() -> None:
    none = np.array([], dtype=np.int64)
    index = LineIndex(np.array([0, 1, 0]), 3)
    first = index.changed(none, none, np.array([0]), 3, 3)  # line 0 written anew, with room
    second = first.changed(none, none, np.array([0, 0]), 4, 3)  # into that room, in place
    assert len(second.buffer) == len(first.buffer)
    assert first.of(0).tolist() == [0, 2, 3] and second.of(0).tolist() == [0, 2, 3, 4, 5]
    # first is no longer the last of the chain: a change of it writes the line anew elsewhere
    branch = first.changed(none, none, np.array([0]), 9, 3)
    assert branch.of(0).tolist() == [0, 2, 3, 9] and second.of(0).tolist() == [0, 2, 3, 4, 5]
    assert first.of(0).tolist() == [0, 2, 3] and index.of(0).tolist() == [0, 2]
    np.testing.assert_array_equal(second.order, [0, 2, 3, 4, 5, 1])
