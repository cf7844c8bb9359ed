"""The catalogue as the service reads it: typed filters over the items' categories and attributes (pydantic
validates them; no string is ever evaluated as code), and the boolean masks they select.

A filter is a tree of clauses, each an object with an `op`:

    {"op": "category", "any_of": ["Comedy", "Drama"]}     the item has one of these categories
    {"op": "eq", "attribute": "in_stock", "value": true}    equal (a list attribute: holds the value)
    {"op": "in", "attribute": "lang", "values": ["en", "fr"]}  equal to one of them
    {"op": "range", "attribute": "year", "gte": 1990, "lt": 2000}  a number within the bounds
    {"op": "exists", "attribute": "price"}                  the item has the attribute
    {"op": "all", "of": [...]}, {"op": "any", "of": [...]}, {"op": "not", "filter": {...}}

An item without a record matches no category or attribute clause. Hidden items are never recommended,
whatever the filter (`CatalogueIndex.visible`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Literal

import numpy as np
from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, ValidationError

from model.catalogue import ItemRecord, Name, Scalar

MAX_CLAUSES = 64
"""Most clauses (every node of the tree counts) one filter may have."""

MAX_DEPTH = 8
"""Deepest nesting of all / any / not."""

SELECTED_KEPT = 256
"""Filters whose items a catalogue index keeps (the most recently used)."""

MAX_VALUES = 256
"""Most values of one `category` or `in` clause."""

_Name = Name
_Value = Scalar
_Number = StrictInt | Annotated[StrictFloat, Field(allow_inf_nan=False)]
_STRICT = ConfigDict(extra="forbid")


class Category(BaseModel):
    """The item has at least one of `any_of`'s categories."""

    model_config = _STRICT
    op: Literal["category"]
    any_of: list[_Name] = Field(min_length=1, max_length=MAX_VALUES)


class Equals(BaseModel):
    """The attribute equals `value` (a list attribute: holds it). Numbers compare as numbers; a bool is
    not a number."""

    model_config = _STRICT
    op: Literal["eq"]
    attribute: _Name
    value: _Value


class OneOf(BaseModel):
    """The attribute equals one of `values` (a list attribute: holds one of them)."""

    model_config = _STRICT
    op: Literal["in"]
    attribute: _Name
    values: list[_Value] = Field(min_length=1, max_length=MAX_VALUES)


class Range(BaseModel):
    """A number attribute within the bounds given (at least one of gt, gte, lt, lte)."""

    model_config = _STRICT
    op: Literal["range"]
    attribute: _Name
    gt: _Number | None = None
    gte: _Number | None = None
    lt: _Number | None = None
    lte: _Number | None = None


class Exists(BaseModel):
    """The item has the attribute."""

    model_config = _STRICT
    op: Literal["exists"]
    attribute: _Name


class All(BaseModel):
    """Every clause of `of` holds."""

    model_config = _STRICT
    op: Literal["all"]
    of: list[Filter] = Field(min_length=1, max_length=MAX_CLAUSES)


class AnyOf(BaseModel):
    """At least one clause of `of` holds."""

    model_config = _STRICT
    op: Literal["any"]
    of: list[Filter] = Field(min_length=1, max_length=MAX_CLAUSES)


class Not(BaseModel):
    """`filter` does not hold."""

    model_config = _STRICT
    op: Literal["not"]
    filter: Filter


Filter = Annotated[Category | Equals | OneOf | Range | Exists | All | AnyOf | Not, Field(discriminator="op")]
"""One clause (a tree of them)."""

All.model_rebuild()
AnyOf.model_rebuild()
Not.model_rebuild()


def _children(clause: BaseModel) -> list[tuple[list[str | int], BaseModel]]:
    if isinstance(clause, All | AnyOf):
        return [(["of", k], c) for k, c in enumerate(clause.of)]
    if isinstance(clause, Not):
        return [(["filter"], clause.filter)]
    return []


def shape_problem(clause: BaseModel, loc: list[str | int]) -> tuple[list[str | int], str, str] | None:
    """(where, kind, message) of the first part of the filter at `loc` that is too deep, over
    MAX_CLAUSES, or a range without bounds; None when its shape is fine."""
    count = 0
    stack: list[tuple[list[str | int], BaseModel, int]] = [(loc, clause, 1)]
    while stack:
        where, node, depth = stack.pop()
        count += 1
        if depth > MAX_DEPTH:
            return where, "too_deep", f"the filter nests deeper than {MAX_DEPTH} levels here"
        if count > MAX_CLAUSES:
            return loc, "too_long", f"the filter has more than {MAX_CLAUSES} clauses"
        if isinstance(node, Range) and all(b is None for b in (node.gt, node.gte, node.lt, node.lte)):
            return where, "missing", "a range needs at least one of gt, gte, lt, lte"
        stack.extend((where + sub, child, depth + 1) for sub, child in _children(node))
    return None


def check_shape(clause: BaseModel, loc: list[str | int]) -> None:
    """422 naming the part of the filter that `shape_problem` finds."""
    problem = shape_problem(clause, loc)
    if problem is not None:
        raise _bad(*problem)


def _bad(loc: list[str | int], kind: str, msg: str) -> HTTPException:
    return HTTPException(status_code=422, detail=[{"loc": loc, "type": kind, "msg": msg}])


class Boost(BaseModel):
    """A business rule: `amount` added to the ranking score of the items `filter` holds for (the
    predicted rating shown stays the model's)."""

    model_config = _STRICT
    name: _Name
    filter: Filter
    amount: Annotated[float, Field(ge=-10, le=10, allow_inf_nan=False)]


def both(first: Filter | None, second: Filter | None) -> Filter | None:
    """The filter that holds where both do (either may be None)."""
    if first is None or second is None:
        return first if second is None else second
    return All(op="all", of=[first, second])


def _key(value: object) -> tuple[str, object]:
    """How a value is looked up: bools, numbers (as floats) and strings apart."""
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int | float):
        return ("number", float(value))
    return ("string", value)


@dataclass
class _Attribute:
    present: list[int] = field(default_factory=list)
    numbers: dict[int, float] = field(default_factory=dict)
    values: dict[tuple[str, object], list[int]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    """How many items hold a value of each kind (bool, number, string, list)."""

    @property
    def kinds(self) -> set[str]:
        return {kind for kind, count in self.counts.items() if count}

    def copy(self) -> _Attribute:
        return _Attribute(
            list(self.present),
            dict(self.numbers),
            {key: list(v) for key, v in self.values.items()},
            dict(self.counts),
        )


def _value_keys(value: object) -> tuple[str, list[tuple[str, object]]]:
    """(kind, the keys it is looked up by) of an attribute value."""
    if isinstance(value, list):
        return "list", [("string", v) for v in value]
    key = _key(value)
    return key[0], [key]


class CatalogueView(Mapping[str, ItemRecord]):
    """The records as one state has them: those changed online (`online`) over the artifact's (`base`),
    in the artifact's order, then the items only online changes know, in the order of their first
    change."""

    def __init__(self, base: Mapping[str, ItemRecord], online: Mapping[str, ItemRecord]) -> None:
        self.base, self.online = base, online

    def __getitem__(self, item: str) -> ItemRecord:
        return self.online[item] if item in self.online else self.base[item]

    def __contains__(self, item: object) -> bool:
        return item in self.online or item in self.base

    def __iter__(self) -> Iterator[str]:
        yield from self.base
        yield from (item for item in self.online if item not in self.base)

    def __len__(self) -> int:
        return len(self.base) + sum(1 for item in self.online if item not in self.base)


class CatalogueIndex:
    """The catalogue over the served item indices 0..n-1 (`ids(j)`: an index's external id): each
    category's and attribute value's items, each number attribute's values, and who is hidden, so a
    filter is a few boolean array operations. `base`: the index over fewer items or an older version of
    the records (states only grow), taken as it is but for its items in `changed` (indices whose record
    changed since): only those and the new items are read. `version`: how many online catalogue changes
    `records` includes."""

    _categories: dict[str, list[int]]
    _attributes: dict[str, _Attribute]

    def __init__(
        self,
        records: Mapping[str, ItemRecord],
        n_items: int,
        ids: Callable[[int], str],
        base: CatalogueIndex | None = None,
        changed: Sequence[int] = (),
        version: int = 0,
    ) -> None:
        self.n_items, self.records, self.version = n_items, records, version
        self.hidden = np.zeros(n_items, dtype=bool)
        self.has_record = np.zeros(n_items, dtype=bool)
        start = 0
        categories: dict[str, list[int]] = {}
        attributes: dict[str, _Attribute] = {}
        again: list[int] = []
        if base is not None and base.n_items <= n_items:
            start = base.n_items
            self.hidden[:start], self.has_record[:start] = base.hidden, base.has_record
            again = sorted({j for j in changed if j < start})
            categories, attributes = base._without(again, ids)
        for j in [*again, *range(start, n_items)]:
            record = records.get(ids(j))
            self.has_record[j] = record is not None
            self.hidden[j] = record is not None and record.hidden
            if record is None:
                continue
            for c in record.categories:
                categories.setdefault(c, []).append(j)
            for name, value in record.attributes.items():
                a = attributes.setdefault(name, _Attribute())
                a.present.append(j)
                kind, keys = _value_keys(value)
                a.counts[kind] = a.counts.get(kind, 0) + 1
                for key in keys:
                    a.values.setdefault(key, []).append(j)
                if kind == "number":
                    a.numbers[j] = float(value)  # type: ignore[arg-type]
        self._categories = categories
        self.categories = {c: np.array(v, dtype=np.int64) for c, v in categories.items() if v}
        self._attributes = attributes
        self._numbers: dict[str, np.ndarray] = {}
        self.visible = ~self.hidden
        self._selected: OrderedDict[str, tuple[np.ndarray, tuple[str, ...]]] = OrderedDict()
        self._lock = threading.Lock()

    def _without(
        self, items: list[int], ids: Callable[[int], str]
    ) -> tuple[dict[str, list[int]], dict[str, _Attribute]]:
        """Copies of this index's category and attribute lists without `items` (read from the records it
        was built from): each list that held one of them is filtered once."""
        categories = {c: list(v) for c, v in self._categories.items()}
        attributes = {name: a.copy() for name, a in self._attributes.items()}
        gone = set(items)
        lists: dict[int, list[int]] = {}  # by id(): each list filtered once
        for j in items:
            record = self.records.get(ids(j))
            if record is None:
                continue
            for c in record.categories:
                lists[id(categories[c])] = categories[c]
            for name, value in record.attributes.items():
                a = attributes[name]
                lists[id(a.present)] = a.present
                kind, keys = _value_keys(value)
                a.counts[kind] -= 1
                a.numbers.pop(j, None)
                for key in keys:
                    lists[id(a.values[key])] = a.values[key]
        for held in lists.values():
            held[:] = [j for j in held if j not in gone]
        return categories, attributes

    def _mask(self, indices: list[int] | np.ndarray) -> np.ndarray:
        out = np.zeros(self.n_items, dtype=bool)
        out[np.asarray(indices, dtype=np.int64)] = True
        return out

    def numbers(self, name: str) -> np.ndarray:
        """(n,) float64: the attribute's value where it is a number, NaN elsewhere."""
        if name not in self._numbers:
            out = np.full(self.n_items, np.nan)
            a = self._attributes.get(name)
            if a is not None and a.numbers:
                out[np.fromiter(a.numbers, dtype=np.int64)] = np.fromiter(
                    a.numbers.values(), dtype=np.float64
                )
            self._numbers[name] = out
        return self._numbers[name]

    def select(self, clause: BaseModel, loc: list[str | int]) -> tuple[np.ndarray, list[str]]:
        """The items (n,) bool that `clause` holds for, and notes on clauses that match nothing because no
        item has what they name; 422 naming `loc`'s part for a clause the catalogue's types rule out (a
        range on an attribute that is never a number, an eq of a string to a number attribute)."""
        key = clause.model_dump_json()
        with self._lock:
            held = self._selected.get(key)
            if held is not None:
                self._selected.move_to_end(key)
        if held is None:  # a filter repeated across requests is evaluated once per catalogue
            notes: list[str] = []
            mask = self._select(clause, loc, notes)
            mask.flags.writeable = False
            held = (mask, tuple(notes))
            with self._lock:
                self._selected[key] = held
                while len(self._selected) > SELECTED_KEPT:
                    self._selected.popitem(last=False)
        return held[0], list(held[1])

    def _select(self, clause: BaseModel, loc: list[str | int], notes: list[str]) -> np.ndarray:
        if isinstance(clause, All):
            out = np.ones(self.n_items, dtype=bool)
            for k, c in enumerate(clause.of):
                out &= self._select(c, [*loc, "of", k], notes)
            return out
        if isinstance(clause, AnyOf):
            out = np.zeros(self.n_items, dtype=bool)
            for k, c in enumerate(clause.of):
                out |= self._select(c, [*loc, "of", k], notes)
            return out
        if isinstance(clause, Not):
            return ~self._select(clause.filter, [*loc, "filter"], notes)
        if isinstance(clause, Category):
            unknown = [c for c in clause.any_of if c not in self.categories]
            if unknown:
                notes.append(
                    f"no item has the categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}"
                )
            found = [self.categories[c] for c in clause.any_of if c in self.categories]
            return self._mask(np.concatenate(found)) if found else np.zeros(self.n_items, dtype=bool)
        assert isinstance(clause, Equals | OneOf | Range | Exists)
        a = self._attributes.get(clause.attribute)
        if a is None or not a.present:  # none has it, or those that had it changed
            notes.append(f"no item has the attribute {clause.attribute!r}")
            return np.zeros(self.n_items, dtype=bool)
        if isinstance(clause, Exists):
            return self._mask(a.present)
        if isinstance(clause, Range):
            if "number" not in a.kinds:
                kinds = " or ".join(sorted(a.kinds))
                msg = f"a range needs a number attribute; {clause.attribute!r} is a {kinds} on every item"
                raise _bad(loc, "range_on_non_number", msg)
            x = self.numbers(clause.attribute)
            with np.errstate(invalid="ignore"):  # NaN (no number) compares False
                inside: np.ndarray = ~np.isnan(x)
                if clause.gt is not None:
                    inside &= x > clause.gt
                if clause.gte is not None:
                    inside &= x >= clause.gte
                if clause.lt is not None:
                    inside &= x < clause.lt
                if clause.lte is not None:
                    inside &= x <= clause.lte
            return inside
        values = [clause.value] if isinstance(clause, Equals) else clause.values
        out = np.zeros(self.n_items, dtype=bool)
        for k, v in enumerate(values):
            key = _key(v)
            held = a.kinds | ({"string"} if "list" in a.kinds else set())
            if key[0] not in held:
                where = [*loc, "value"] if isinstance(clause, Equals) else [*loc, "values", k]
                kinds = " or ".join(sorted(a.kinds))
                msg = f"{clause.attribute!r} is a {kinds} on every item; {v!r} is a {key[0]}"
                raise _bad(where, "type_mismatch", msg)
            indices = a.values.get(key)
            if indices:
                out[np.asarray(indices, dtype=np.int64)] = True
        return out


def short_filter(category: list[str] | None, exclude_category: list[str] | None) -> Filter | None:
    """The GET routes' short form (`category=Drama,Comedy&exclude_category=Horror`) as a filter."""
    clauses: list[BaseModel] = []
    for name, given in (("category", category), ("exclude_category", exclude_category)):
        if not given:
            continue
        try:
            clause: BaseModel = Category(op="category", any_of=given)
        except ValidationError as exc:  # too many, or a name too long: a 422 naming the parameter
            problem = exc.errors()[0]
            raise _bad(["query", name], problem["type"], f"{name}: {problem['msg']}") from None
        clauses.append(clause if name == "category" else Not(op="not", filter=clause))
    if not clauses:
        return None
    if len(clauses) == 1:
        return clauses[0]  # type: ignore[return-value]
    return All(op="all", of=clauses)
