"""The known ratings, indexed once by row and by column (torch-free).

One structure serves every reader: the trainer's input rows and columns, the service's ONNX branches
and the `exact` CRF's sums over a user's row or an item's column. Entries keep the order they were given
in, so arrays aligned with that order (the known entries' distributions) stay aligned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from model.engine import nearest_level
from model.types import FloatArray, IntArray


def index_dtype(size: int) -> type[np.signedinteger[Any]]:
    """The narrowest index type scipy's sparse matrices take for `size` entries or lines."""
    return np.int32 if size < 2**31 else np.int64


def ranges(starts: IntArray, counts: IntArray) -> tuple[IntArray, IntArray]:
    """Concatenated aranges: (owner of each element, starts[owner] + offset inside its range)."""
    owner = np.repeat(np.arange(len(counts)), counts)
    offset = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
    return owner, starts[owner] + offset


def stable_order(line: IntArray, n_lines: int) -> IntArray:
    """np.argsort(line, kind="stable") for line ids in [0, n_lines), by radix sort on 16-bit digits
    (numpy's stable sort of 64-bit integers is a merge sort, about ten times slower on 100k entries)."""
    if n_lines <= 1 << 16:
        out: IntArray = np.argsort(line.astype(np.uint16), kind="stable")
        return out
    if n_lines <= 1 << 32:  # least significant digit first: the second stable pass keeps the first's order
        low = np.argsort((line & 0xFFFF).astype(np.uint16), kind="stable")
        high = np.argsort((line[low] >> 16).astype(np.uint16), kind="stable")
        out = low[high]
        return out
    out = np.argsort(line, kind="stable")
    return out


class _Store:
    """Append-only storage behind the arrays of a chain of indexes or ratings, each made from the last by
    `changed`: each holds a view of the part filled when it was made, so an append (into spare capacity,
    or into a larger copy, the old array left to the views that hold it) never changes what an earlier
    one reads. One writer at a time (the fold-in's lock)."""

    __slots__ = ("array", "fill", "last")

    def __init__(self, array: np.ndarray, fill: int) -> None:
        self.array, self.fill = array, fill
        self.last: object = None  # what the chain's last member says it is (`LineIndex`)


def _extended(view: np.ndarray, store: _Store | None, more: np.ndarray) -> tuple[np.ndarray, _Store]:
    """np.concatenate([view, more]) and the store it is a view of: in O(len(more)) when `view` is the
    store's filled part (amortized: the capacity doubles when it runs out), else (the first change of
    arrays built whole, or a change of an older one of the chain) copied into a new store."""
    n, k = len(view), len(more)
    if store is None or store.fill != n or view.base is not store.array:
        array = np.empty(max(2 * (n + k), 1024), dtype=view.dtype)
        array[:n] = view
        store = _Store(array, n)
    elif n + k > len(store.array):
        array = np.empty(2 * (n + k), dtype=view.dtype)
        array[:n] = view
        store.array = array  # the views already made keep the old array
    store.array[n : n + k] = more
    store.fill = n + k
    return store.array[: n + k], store


COMPACT_WASTE = 2
"""A changed index is laid out anew once its buffer holds more than this many slots per live entry (lines
written anew leave their old copies behind), and changed ratings renumbered once their positions outnumber
their ratings as much (re-rated and taken back ones leave theirs): amortized O(1) a change, memory at most
twice a compact layout's."""

COMPACT_SLACK = 4096
"""Positions a chain may hold beyond COMPACT_WASTE times its entries before that (small ones never)."""


def _room(count: IntArray) -> IntArray:
    """The slots a line of `count` entries gets when written anew: a quarter more, and 4 (entries appended
    later go there in place; a line is written anew after a quarter of its length was appended to it)."""
    out: IntArray = count + count // 4 + 4
    return out


class LineIndex:
    """The entries grouped by one coordinate (a row or a column): line i's entries are the positions
    `buffer[start[i] : start[i] + count[i]]`, in increasing order (their original order).

    Built compact (the lines back to back in line order: `order`, `indptr`). `changed` writes each line it
    changes anew at the end of an append-only buffer shared along the chain of indexes (`_Store`) and
    copies the (n_lines,) start and count arrays: a change costs the entries of the lines it touches plus
    a copy of those arrays, not a pass over all N entries."""

    def __init__(self, line: IntArray, n_lines: int) -> None:
        order = stable_order(line, n_lines)
        indptr = np.zeros(n_lines + 1, dtype=np.int64)
        np.cumsum(np.bincount(line, minlength=n_lines), out=indptr[1:])
        self._set(order, indptr[:-1], np.diff(indptr), None, (order, indptr))

    def _set(
        self,
        buffer: IntArray,
        start: IntArray,
        count: IntArray,
        store: _Store | None,
        layout: tuple[IntArray, IntArray] | None,
        room: IntArray | None = None,
        size: int | None = None,
    ) -> None:
        self.buffer, self.start, self.count, self._store = buffer, start, count, store
        self.room = count if room is None else room
        """(n_lines,) the slots each line has from its start (its entries, then room for more)."""
        self.size = int(count.sum()) if size is None else size
        """How many entries the lines hold."""
        self._layout = layout  # (order, indptr) once made: one attribute, set whole (readers share it)
        self._token = object()
        if store is not None:
            store.last = self._token  # the last index of the chain: the one that may append in place

    def _laid_out(self) -> LineIndex:
        """The same lines in a new buffer of their own, each with room after it (`_room`), the old
        copies of changed lines left behind: O(N)."""
        space = _room(self.count)
        start = np.cumsum(space) - space
        size = int(space.sum())
        array = np.empty(2 * size + 1024, dtype=np.int64)  # the next changes append here
        buffer = array[:size]
        buffer[:] = -1
        owner, pos = ranges(self.start, self.count)
        rank = np.arange(len(owner)) - np.repeat(np.cumsum(self.count) - self.count, self.count)
        buffer[start[owner] + rank] = self.buffer[pos]
        out = LineIndex.__new__(LineIndex)
        out._set(buffer, start, self.count.copy(), _Store(array, size), None, space, self.size)
        return out

    @property
    def n_lines(self) -> int:
        return len(self.start)

    @property
    def order(self) -> IntArray:
        """Every line's positions, line after line: (size,), the compressed layout (made on first use
        after a change, O(N), then kept)."""
        return self._compressed()[0]

    @property
    def indptr(self) -> IntArray:
        """(n_lines + 1,): line i's positions are order[indptr[i]:indptr[i + 1]]."""
        return self._compressed()[1]

    def _compressed(self) -> tuple[IntArray, IntArray]:
        layout = self._layout
        if layout is None:
            indptr = np.zeros(self.n_lines + 1, dtype=np.int64)
            np.cumsum(self.count, out=indptr[1:])
            layout = self._layout = (self.members(np.arange(self.n_lines))[0], indptr)
        return layout

    def of(self, line: int) -> IntArray:
        """Positions of the entries on one line."""
        start = self.start[line]
        return self.buffer[start : start + self.count[line]]

    def counts(self, lines: IntArray) -> IntArray:
        """Number of entries on each of `lines`."""
        return self.count[lines]

    def gather(self, lines: IntArray) -> tuple[IntArray, IntArray]:
        """(owner, positions): the entries on each of `lines` (any, repeats allowed), line after line, each
        with the index in `lines` of its line."""
        owner, pos = ranges(self.start[lines], self.count[lines])
        return owner, self.buffer[pos]

    def members(self, lines: IntArray) -> tuple[IntArray, IntArray]:
        """Entries on each of `lines` (line after line) and their counts."""
        counts = self.count[lines]
        return self.buffer[ranges(self.start[lines], counts)[1]], counts

    def changed(
        self, dropped: IntArray, dropped_lines: IntArray, lines: IntArray, first: int, n_lines: int
    ) -> LineIndex:
        """The index once the entries at positions `dropped` (on `dropped_lines`) are gone and entries on
        `lines` (k,) are appended at positions first, first + 1, ... (past every existing one), in as many
        lines as `n_lines` (at least as many as now). A line written anew gets as much room again after
        its entries: the next entries appended to it go there, in place (an index made earlier reads
        only its own count of them), as long as this index is the last of its chain; a line that loses
        entries, or has no room left, is written anew. The rest is shared."""
        if n_lines < self.n_lines:
            raise ValueError("an index can only grow")
        dropped = np.asarray(dropped, dtype=np.int64)
        lines = np.asarray(lines, dtype=np.int64)
        dropped_lines = np.unique(np.asarray(dropped_lines, dtype=np.int64))
        start, count, room = (np.zeros(n_lines, dtype=np.int64) for _ in range(3))
        start[: self.n_lines], count[: self.n_lines], room[: self.n_lines] = self.start, self.count, self.room
        fresh = np.argsort(lines, kind="stable")  # the appended entries by line, in position order
        by_line = lines[fresh]
        targets, first_of, per_line = np.unique(by_line, return_index=True, return_counts=True)
        rank = np.arange(len(fresh)) - np.repeat(first_of, per_line)
        store = self._store
        last = store is not None and store.last is self._token and store.fill == len(self.buffer)
        fits = (count[targets] + per_line <= room[targets]) & ~np.isin(targets, dropped_lines) & last
        if fits.any():  # into the lines' room, past what earlier indexes read
            where = np.repeat(fits, per_line)
            line_of = np.repeat(np.arange(len(targets)), per_line)[where]
            self.buffer[start[targets][line_of] + count[targets][line_of] + rank[where]] = (
                fresh[where] + first
            )
            count[targets[fits]] += per_line[fits]
        touched = np.union1d(dropped_lines, targets[~fits])
        appended = np.isin(by_line, touched)
        owner, pos = ranges(start[touched], count[touched])
        kept = self.buffer[pos]
        if len(dropped):
            stay = ~np.isin(kept, dropped)
            owner, kept = owner[stay], kept[stay]
        old = np.bincount(owner, minlength=len(touched))
        new_owner = np.searchsorted(touched, by_line[appended])
        new = np.bincount(new_owner, minlength=len(touched))
        total = old + new
        space = _room(total)  # each line written anew: its entries, then room for more
        offset = np.cumsum(space) - space  # each touched line's place in the segment written now
        segment = np.full(int(space.sum()), -1, dtype=np.int64)
        segment[offset[owner] + np.arange(len(kept)) - np.repeat(np.cumsum(old) - old, old)] = kept
        new_rank = np.arange(len(new_owner)) - np.repeat(np.cumsum(new) - new, new)
        segment[offset[new_owner] + old[new_owner] + new_rank] = fresh[appended] + first
        start[touched], count[touched], room[touched] = len(self.buffer) + offset, total, space
        buffer, store = _extended(self.buffer, store, segment)
        out = LineIndex.__new__(LineIndex)
        out._set(buffer, start, count, store, None, room, self.size - len(dropped) + len(lines))
        if (
            len(buffer) > COMPACT_WASTE * out.size + 4 * n_lines + COMPACT_SLACK
        ):  # old copies of lines dropped
            return out._laid_out()
        return out


@dataclass(frozen=True, eq=False)
class Ratings:
    """Ratings (rows[k], cols[k], values[k]) of an n_users x n_items matrix, indexed by row and column.

    Built whole, every position holds a rating. `changed` never writes to a position: a re-rated pair
    gets a new one (appended) and its old position leaves both indexes, as a retracted one does; such
    positions stay in the arrays, out of every line. So `len` counts the ratings (the indexes' entries),
    `len(rows)` the positions; what reads positions through the indexes reads the ratings alone, what
    reads the whole arrays takes `compact()`."""

    rows: IntArray  # (positions,) int64
    cols: IntArray  # (positions,) int64
    values: FloatArray  # (positions,) float64
    n_users: int
    n_items: int
    by_row: LineIndex = field(init=False, repr=False)
    by_col: LineIndex = field(init=False, repr=False)
    _labels: tuple[FloatArray, IntArray] | None = field(default=None, init=False, repr=False)
    """(levels, `labels(levels)`) once asked for: `changed` carries it forward for what it changed."""
    _stores: tuple[_Store | None, ...] = field(default=(None,) * 4, init=False, repr=False)
    """The append-only stores of rows, cols, values and labels (`_Store`), once `changed` made them."""
    _compact: list[Ratings] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("rows", "cols"):
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=np.int64))
        object.__setattr__(self, "values", np.asarray(self.values, dtype=np.float64))
        if not len(self.rows) == len(self.cols) == len(self.values):
            raise ValueError("rows, cols and values differ in length")
        if len(self.rows) and (
            self.rows.min() < 0
            or self.rows.max() >= self.n_users
            or self.cols.min() < 0
            or self.cols.max() >= self.n_items
        ):
            raise ValueError(f"rating indices outside the {self.n_users} x {self.n_items} matrix")
        object.__setattr__(self, "by_row", LineIndex(self.rows, self.n_users))
        object.__setattr__(self, "by_col", LineIndex(self.cols, self.n_items))

    def __len__(self) -> int:
        return self.by_row.size

    @property
    def whole(self) -> bool:
        """Whether every position holds a rating (built whole, or changed by appending alone)."""
        return self.by_row.size == len(self.rows)

    def held(self) -> np.ndarray:
        """(positions,) bool: which positions hold a rating (O(N))."""
        out = np.zeros(len(self.rows), dtype=bool)
        out[self.by_row.order] = True
        return out

    def find(self, user: int, item: int) -> IntArray:
        """The position of the user's rating of the item: (1,), or (0,) where there is none."""
        if user >= self.n_users:
            return np.empty(0, dtype=np.int64)
        pos = self.by_row.of(user)
        out: IntArray = pos[self.cols[pos] == item]
        return out

    def compact(self) -> Ratings:
        """These ratings with a position each, in the order of their positions: itself when `whole`, else
        built (O(N), kept)."""
        if self.whole:
            return self
        if not self._compact:
            live = np.flatnonzero(self.held())  # the positions that hold a rating, in order
            out = Ratings(self.rows[live], self.cols[live], self.values[live], self.n_users, self.n_items)
            if self._labels is not None:
                labels = self._labels[1][live]
                labels.flags.writeable = False
                object.__setattr__(out, "_labels", (self._labels[0], labels))
            self._compact.append(out)
        return self._compact[0]

    def labels(self, levels: FloatArray) -> IntArray:
        """The index of the level nearest to each value (`nearest_level`): (positions,) int64, read-only,
        computed once per levels; ratings made by `changed` compute only their new positions'."""
        held = self._labels
        if held is not None and np.array_equal(held[0], levels):
            return held[1]
        labels = nearest_level(self.values, levels)
        labels.flags.writeable = False
        object.__setattr__(self, "_labels", (np.array(levels, dtype=np.float64), labels))
        return labels

    def changed(
        self,
        at: IntArray,
        values: FloatArray,
        rows: IntArray,
        cols: IntArray,
        added: FloatArray,
        n_users: int,
        n_items: int,
        removed: IntArray | None = None,
    ) -> Ratings:
        """These ratings with the pairs at positions `at` re-rated `values` and those at `removed` taken
        back, then (rows, cols, added) added (pairs not among them), in an n_users x n_items matrix at
        least as large. Positions are only appended (re-rated pairs at new ones, after the added ones'
        order), the arrays and indexes shared along the chain (`_Store`, `LineIndex.changed`): the cost is
        the batch's and its lines' entries, amortized, not the N ratings'. `compact()` of the result equals
        `Ratings` of its ratings in that order."""
        if n_users < self.n_users or n_items < self.n_items:
            raise ValueError("the matrix can only grow")
        rows, cols = np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= n_users or cols.min() < 0 or cols.max() >= n_items):
            raise ValueError(f"rating indices outside the {n_users} x {n_items} matrix")
        at = np.asarray(at, dtype=np.int64)
        removed = np.empty(0, dtype=np.int64) if removed is None else np.asarray(removed, dtype=np.int64)
        dropped = np.concatenate([at, removed])
        new_rows = np.concatenate([rows, self.rows[at]])
        new_cols = np.concatenate([cols, self.cols[at]])
        new_values = np.concatenate(
            [np.asarray(added, dtype=np.float64), np.asarray(values, dtype=np.float64)]
        )
        first = len(self.rows)
        stores = list(self._stores)
        arrays = []
        for k, (array, more) in enumerate(
            zip((self.rows, self.cols, self.values), (new_rows, new_cols, new_values), strict=True)
        ):
            grown, stores[k] = _extended(array, stores[k], more)
            arrays.append(grown)
        out = Ratings.__new__(Ratings)
        fields: dict[str, object] = {
            "rows": arrays[0],
            "cols": arrays[1],
            "values": arrays[2],
            "n_users": n_users,
            "n_items": n_items,
            "by_row": self.by_row.changed(dropped, self.rows[dropped], new_rows, first, n_users),
            "by_col": self.by_col.changed(dropped, self.cols[dropped], new_cols, first, n_items),
            "_labels": None,
            "_compact": [],
        }
        if self._labels is not None:  # the labels carried forward: the new positions' alone computed
            levels, old = self._labels
            labels, stores[3] = _extended(old, stores[3], nearest_level(new_values, levels))
            labels.flags.writeable = False
            fields["_labels"] = (levels, labels)
        fields["_stores"] = tuple(stores)
        for name, value in fields.items():
            object.__setattr__(out, name, value)
        if (
            len(out.rows) > COMPACT_WASTE * len(out) + COMPACT_SLACK
        ):  # positions renumbered: the dead ones dropped
            return out.compact()
        return out

    def dense_rows(self, users: IntArray) -> np.ndarray:
        """Dense rating rows (0 = not rated) of `users`: (b, n_items) float32, the row branch's input."""
        return _dense(self.by_row, self.cols, self.values, users, self.n_items)

    def dense_cols(self, items: IntArray) -> np.ndarray:
        """Dense rating columns of `items`: (b, n_users) float32, the column branch's input."""
        return _dense(self.by_col, self.rows, self.values, items, self.n_users)

    def csr_arrays(self, by: str = "row") -> tuple[FloatArray, IntArray, IntArray]:
        """(data, indices, indptr) of the matrix compressed by row (or, `by="col"`, of its transpose)."""
        index, minor = (self.by_row, self.cols) if by == "row" else (self.by_col, self.rows)
        order = index.order
        return self.values[order], minor[order], index.indptr


def _dense(index: LineIndex, minor: IntArray, values: FloatArray, lines: IntArray, width: int) -> np.ndarray:
    lines = np.asarray(lines, dtype=np.int64)
    out = np.zeros((len(lines), width), dtype=np.float32)
    owner, members = index.gather(lines)
    out[owner, minor[members]] = values[members]
    return out
