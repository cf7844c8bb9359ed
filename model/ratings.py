"""The known ratings, indexed once by row and by column (torch-free).

One structure serves every reader: the trainer's input rows and columns, the service's ONNX branches
and the `exact` CRF's sums over a user's row or an item's column. Entries keep the order they were given
in, so arrays aligned with that order (the known entries' distributions) stay aligned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from model.engine import nearest_level
from model.types import FloatArray, IntArray


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


class LineIndex:
    """The entries grouped by one coordinate (a row or a column): `order[indptr[i]:indptr[i + 1]]` are the
    positions of line i's entries, in their original order."""

    def __init__(self, line: IntArray, n_lines: int) -> None:
        self.order: IntArray = stable_order(line, n_lines)
        self.indptr: IntArray = np.zeros(n_lines + 1, dtype=np.int64)
        np.cumsum(np.bincount(line, minlength=n_lines), out=self.indptr[1:])

    def of(self, line: int) -> IntArray:
        """Positions of the entries on one line."""
        return self.order[self.indptr[line] : self.indptr[line + 1]]

    def counts(self, lines: IntArray) -> IntArray:
        """Number of entries on each of `lines`."""
        return self.indptr[lines + 1] - self.indptr[lines]

    def appended(self, line: IntArray, first: int, n_lines: int) -> LineIndex:
        """The index once entries on `line` (k,) were appended at positions first, first + 1, ...: each
        goes after its line's existing entries, as a rebuild would put it, in O(N + k log k), no sort of
        the N entries."""
        grown = np.full(n_lines + 1, self.indptr[-1], dtype=np.int64)
        grown[: len(self.indptr)] = self.indptr
        out = LineIndex.__new__(LineIndex)
        fresh = np.argsort(line, kind="stable")  # the appended entries by line, in position order
        out.order = np.insert(self.order, grown[line[fresh] + 1], fresh + first)
        counts = np.bincount(line, minlength=n_lines)
        out.indptr = grown
        out.indptr[1:] += np.cumsum(counts)
        return out

    def members(self, lines: IntArray) -> tuple[IntArray, IntArray]:
        """Entries on each of the distinct `lines` (grouped, in line order) and their counts."""
        starts, counts = self.indptr[lines], self.counts(lines)
        return self.order[ranges(starts, counts)[1]], counts


@dataclass(frozen=True, eq=False)
class Ratings:
    """Ratings (rows[k], cols[k], values[k]) of an n_users x n_items matrix, indexed by row and column."""

    rows: IntArray  # (N,) int64
    cols: IntArray  # (N,) int64
    values: FloatArray  # (N,) float64
    n_users: int
    n_items: int
    by_row: LineIndex = field(init=False, repr=False)
    by_col: LineIndex = field(init=False, repr=False)
    _labels: tuple[FloatArray, IntArray] | None = field(default=None, init=False, repr=False)
    """(levels, `labels(levels)`) once asked for: `changed` carries it forward for what it changed."""

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
        return len(self.rows)

    def labels(self, levels: FloatArray) -> IntArray:
        """The index of the level nearest to each value (`nearest_level`): (N,) int64, read-only, computed
        once per levels; ratings made by `changed` compute only their changed and appended values'."""
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
    ) -> Ratings:
        """These ratings with the values at positions `at` replaced by `values`, then (rows, cols, added)
        appended (pairs not among them), in an n_users x n_items matrix at least as large: the same
        entries in the same order as `Ratings` of the concatenated arrays, its indexes extended rather
        than rebuilt (O(N) copies, no sort of the N ratings)."""
        if n_users < self.n_users or n_items < self.n_items:
            raise ValueError("the matrix can only grow")
        rows, cols = np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= n_users or cols.min() < 0 or cols.max() >= n_items):
            raise ValueError(f"rating indices outside the {n_users} x {n_items} matrix")
        new_values = self.values.copy()
        new_values[np.asarray(at, dtype=np.int64)] = values
        out = Ratings.__new__(Ratings)
        first = len(self)
        fields = {
            "rows": np.concatenate([self.rows, rows]),
            "cols": np.concatenate([self.cols, cols]),
            "values": np.concatenate([new_values, np.asarray(added, dtype=np.float64)]),
            "n_users": n_users,
            "n_items": n_items,
            "by_row": self.by_row.appended(rows, first, n_users),
            "by_col": self.by_col.appended(cols, first, n_items),
        }
        if self._labels is not None:  # the labels carried forward: only those of the changed values anew
            levels, old = self._labels
            labels = np.concatenate([old, nearest_level(np.asarray(added, dtype=np.float64), levels)])
            at = np.asarray(at, dtype=np.int64)
            labels[at] = nearest_level(np.asarray(values, dtype=np.float64), levels)
            labels.flags.writeable = False
            fields["_labels"] = (levels, labels)
        else:
            fields["_labels"] = None
        for name, value in fields.items():
            object.__setattr__(out, name, value)
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
        return self.values[index.order], minor[index.order], index.indptr


def _dense(index: LineIndex, minor: IntArray, values: FloatArray, lines: IntArray, width: int) -> np.ndarray:
    lines = np.asarray(lines, dtype=np.int64)
    out = np.zeros((len(lines), width), dtype=np.float32)
    owner, pos = ranges(index.indptr[lines], index.counts(lines))
    members = index.order[pos]
    out[owner, minor[members]] = values[members]
    return out
