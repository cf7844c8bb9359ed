"""The item catalogue: what is known about each item besides its ratings (categories, attributes, a hidden
flag, a title), as the trainer reads it (`read_items`, `read_movielens_items`), the artifact stores it
(`CATALOGUE`, one JSON record per line) and the service filters by it (service/catalogue.py).

A record is keyed by the external item id. An item may be in the catalogue before anyone rated it (it has
no embedding then, so it is never recommended), and rated before it is in the catalogue (it then has no
categories or attributes: a filter on them does not match it, and it is not hidden).
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StringConstraints,
    ValidationError,
    field_validator,
)

from model.stream import MAX_ID_LENGTH

CATALOGUE = "items.jsonl"
"""The artifact's catalogue file: one JSON object per line, `{"item": id, ...ItemRecord}`."""

MAX_CATEGORIES = 64
"""Most categories one item may have."""

MAX_ATTRIBUTES = 64
"""Most attributes one item may have."""

MAX_NAME_LENGTH = 64
"""Longest category or attribute name, and longest string in an attribute's list."""

MAX_STRING_LENGTH = 1024
"""Longest string attribute value and title."""

ATTRIBUTE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")
"""What an attribute name looks like (a letter or underscore first): names are read in filters."""

Name = Annotated[str, StringConstraints(strict=True, min_length=1, max_length=MAX_NAME_LENGTH)]
Scalar = (
    StrictBool
    | StrictInt
    | Annotated[StrictFloat, Field(allow_inf_nan=False)]
    | Annotated[str, StringConstraints(strict=True, max_length=MAX_STRING_LENGTH)]
)
"""A bool, an integer, a finite float or a string: what an attribute holds and a filter compares with."""
AttributeValue = Scalar | Annotated[list[Name], Field(max_length=MAX_CATEGORIES)]
"""A scalar or a list of short strings (tags)."""


class ItemRecord(BaseModel):
    """One item of the catalogue (the whole record: what PUT /items/{id} takes)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    categories: list[Name] = Field(default_factory=list, max_length=MAX_CATEGORIES)
    """Category names, e.g. genres; order kept, duplicates dropped."""
    attributes: dict[str, AttributeValue] = Field(default_factory=dict, max_length=MAX_ATTRIBUTES)
    """Named values: a string, a number, a bool or a list of strings."""
    hidden: bool = False
    """A hidden item is never recommended (it is still predicted when asked for by id)."""
    title: Annotated[str, StringConstraints(max_length=MAX_STRING_LENGTH)] | None = None

    @field_validator("categories")
    @classmethod
    def _once(cls, categories: list[str]) -> list[str]:
        return list(dict.fromkeys(categories))

    @field_validator("attributes")
    @classmethod
    def _names(cls, attributes: dict[str, Any]) -> dict[str, Any]:
        for name in attributes:
            if not ATTRIBUTE_NAME.match(name) or len(name) > MAX_NAME_LENGTH:
                raise ValueError(
                    f"attribute name {name!r}: 1 to {MAX_NAME_LENGTH} letters, digits, '_', '.' or '-', "
                    "a letter or '_' first"
                )
        return attributes

    def to_json(self) -> dict[str, Any]:
        """The record as JSON (defaults left out)."""
        return self.model_dump(exclude_defaults=True)


class ItemPatch(BaseModel):
    """A change to part of a record (PATCH /items/{id}): each field given replaces the record's, and null
    resets it to its default (no categories, not hidden, no title); `attributes` merge name by name, a
    null value removing that attribute (JSON merge patch, RFC 7396; to drop every attribute, PUT the
    record)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    categories: list[Name] | None = Field(default=None, max_length=MAX_CATEGORIES)
    attributes: dict[str, AttributeValue | None] | None = Field(default=None, max_length=MAX_ATTRIBUTES)
    hidden: bool | None = None
    title: Annotated[str, StringConstraints(max_length=MAX_STRING_LENGTH)] | None = None

    @field_validator("attributes")
    @classmethod
    def _names(cls, attributes: dict[str, Any] | None) -> dict[str, Any]:
        if attributes is None:
            raise ValueError("attributes is an object of changes (a null value removes one attribute)")
        return ItemRecord._names(attributes)

    def to_json(self) -> dict[str, Any]:
        """The fields given, as given (null included)."""
        return self.model_dump(include=self.model_fields_set)


@dataclass(frozen=True)
class ItemChange:
    """One online change of an item's record, as the stream holds it: the whole record (`replace`, PUT)
    or a merge patch (PATCH). Changes compose (`then`), so a run of them is kept as one; applied to the
    record before them (`applied_to`) it gives the record after them."""

    replace: bool
    patch: ItemPatch

    @classmethod
    def whole(cls, record: ItemRecord) -> ItemChange:
        """PUT: the record as it is to be, whatever it was."""
        fields = record.model_dump()
        return cls(True, ItemPatch.model_validate(fields))

    def applied_to(self, record: ItemRecord | None) -> ItemRecord:
        """The record after this change (ValueError where the result breaks a limit, e.g. more than
        MAX_ATTRIBUTES after a merge)."""
        before = ItemRecord() if self.replace or record is None else record
        given = self.patch.model_fields_set
        fields: dict[str, Any] = before.model_dump()
        for name, default in (("categories", []), ("hidden", False), ("title", None)):
            if name in given:
                value = getattr(self.patch, name)
                fields[name] = default if value is None else value
        if self.patch.attributes is not None:
            merged = dict(fields["attributes"])
            for name, value in self.patch.attributes.items():
                if value is None:
                    merged.pop(name, None)
                else:
                    merged[name] = value
            fields["attributes"] = merged
        try:
            return ItemRecord.model_validate(fields)
        except ValidationError as exc:
            raise ValueError(_problems(exc)) from None

    def then(self, later: ItemChange) -> ItemChange:
        """This change followed by `later`, as one (for any record r: `a.then(b).applied_to(r)` is
        `b.applied_to(a.applied_to(r))`); ValueError where a whole record would break a limit."""
        if later.replace:
            return later
        if self.replace:
            return ItemChange.whole(later.applied_to(self.applied_to(None)))
        mine, theirs = self.patch.to_json(), later.patch.to_json()
        fields = {**mine, **theirs}
        if "attributes" in mine and "attributes" in theirs:
            fields["attributes"] = {**mine["attributes"], **theirs["attributes"]}
        return ItemChange(False, ItemPatch.model_validate(fields))

    def to_json(self) -> dict[str, Any]:
        """As the compacted head and a fold-in snapshot hold it: {"record": {...}} or {"patch": {...}}."""
        if self.replace:
            return {"record": self.applied_to(None).to_json()}
        return {"patch": self.patch.to_json()}

    @classmethod
    def from_json(cls, value: Any) -> ItemChange:
        """Inverse of `to_json` (and of a stream entry's `record` or `patch` field, parsed); ValueError for
        anything else."""
        if not isinstance(value, dict) or len(value) != 1 or not ({"record", "patch"} & value.keys()):
            raise ValueError('an item change is {"record": {...}} or {"patch": {...}}')
        try:
            if "record" in value:
                return cls.whole(ItemRecord.model_validate(value["record"]))
            return cls(False, ItemPatch.model_validate(value["patch"]))
        except ValidationError as exc:
            raise ValueError(_problems(exc)) from None


def _problems(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'record'}: {e['msg']}" for e in exc.errors())


class CatalogueError(ValueError):
    """A catalogue file that cannot be read: says which file, which line and what is wrong."""


def _check_id(item: object, where: str) -> str:
    if not isinstance(item, str) or not 1 <= len(item) <= MAX_ID_LENGTH:
        raise CatalogueError(
            f"{where}: `item` must be an id of 1 to {MAX_ID_LENGTH} characters, got {item!r}"
        )
    return item


def _record(fields: dict[str, Any], where: str) -> ItemRecord:
    try:
        return ItemRecord.model_validate(fields)
    except ValidationError as exc:
        raise CatalogueError(f"{where}: {_problems(exc)}") from None


def _add(out: dict[str, ItemRecord], item: str, record: ItemRecord, where: str) -> None:
    if item in out:
        raise CatalogueError(f"{where}: item {item!r} appears twice")
    out[item] = record


def read_items(path: str | Path) -> dict[str, ItemRecord]:
    """A catalogue file: JSON lines (`.jsonl`/`.json`: `{"item": id, "title": ..., "categories": [...],
    "attributes": {...}, "hidden": false}` per line) or CSV (`.csv`: a header naming `item`, optionally
    `title`, `categories` (`|`-separated), `hidden` (true/false/1/0), every other column an attribute:
    a number where it reads as one, true/false as a bool, else a string; an empty cell is no value).
    CatalogueError names the line of the first problem."""
    path = Path(path)
    if not path.is_file():
        raise CatalogueError(f"{path}: no such catalogue file")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return _read_jsonl(path)
    if suffix == ".csv":
        return _read_csv(path)
    raise CatalogueError(f"{path}: a catalogue is a .csv or .jsonl file, not {suffix or 'no suffix'}")


def _read_jsonl(path: Path) -> dict[str, ItemRecord]:
    out: dict[str, ItemRecord] = {}
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                fields = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CatalogueError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(fields, dict):
                raise CatalogueError(f"{where}: a line must be a JSON object")
            item = _check_id(fields.pop("item", None), where)
            _add(out, item, _record(fields, where), where)
    return out


_BOOLS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}


def csv_value(cell: str) -> bool | int | float | str:
    """A CSV cell as an attribute value: an int or a finite float where it reads as one, true/false as a
    bool, else the string."""
    text = cell.strip()
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        number = float(text)
    except ValueError:
        return cell
    return number if math.isfinite(number) else cell


def _read_csv(path: Path) -> dict[str, ItemRecord]:
    out: dict[str, ItemRecord] = {}
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or "item" not in reader.fieldnames:
            raise CatalogueError(f"{path}:1: the header must name an `item` column")
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if None in row:
                raise CatalogueError(f"{where}: more cells than the header names")
            item = _check_id(row.pop("item", ""), where)
            fields: dict[str, Any] = {}
            title = row.pop("title", None)
            if title:
                fields["title"] = title
            categories = row.pop("categories", None)
            if categories:
                fields["categories"] = [c.strip() for c in categories.split("|") if c.strip()]
            hidden = row.pop("hidden", None)
            if hidden:
                if hidden.strip().lower() not in _BOOLS:
                    raise CatalogueError(f"{where}: hidden must be true or false, got {hidden!r}")
                fields["hidden"] = _BOOLS[hidden.strip().lower()]
            fields["attributes"] = {
                name: csv_value(v) for name, v in row.items() if v is not None and v != ""
            }
            _add(out, item, _record(fields, where), where)
    return out


def read_movielens_items(data_dir: str | Path) -> dict[str, ItemRecord] | None:
    """MovieLens-100K's `u.item` (Latin-1, `|`-separated: id, title, release date, video date, IMDb URL,
    19 genre flags named by `u.genre`) as a catalogue: the title, the genres as categories, `year` from
    the release date where it has one; None when the directory holds no `u.item`."""
    data_dir = Path(data_dir)
    path = next((p for p in (data_dir / "u.item", data_dir / "ml-100k" / "u.item") if p.is_file()), None)
    if path is None:
        return None
    genre_file = path.parent / "u.genre"
    if genre_file.is_file():
        genres = [
            line.split("|")[0]
            for line in genre_file.read_text(encoding="latin-1").splitlines()
            if line.strip()
        ]
    else:
        genres = list(MOVIELENS_GENRES)
    out: dict[str, ItemRecord] = {}
    with path.open(encoding="latin-1") as f:
        for n, line in enumerate(f, start=1):
            parts = line.rstrip("\n").split("|")
            where = f"{path}:{n}"
            if len(parts) != 5 + len(genres):
                raise CatalogueError(f"{where}: {len(parts)} fields, u.item has {5 + len(genres)}")
            flags = parts[5:]
            fields: dict[str, Any] = {
                "title": parts[1],
                "categories": [g for g, flag in zip(genres, flags, strict=True) if flag == "1"],
            }
            year = re.search(r"(\d{4})$", parts[2].strip())
            if year:
                fields["attributes"] = {"year": int(year.group(1))}
            _add(out, _check_id(parts[0], where), _record(fields, where), where)
    return out


MOVIELENS_GENRES = (
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama",
    "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western",
)  # fmt: skip
"""u.genre's names, in flag order (used where the file is missing)."""


def write_catalogue(directory: Path, records: dict[str, ItemRecord]) -> None:
    """The artifact's `CATALOGUE` file."""
    with (directory / CATALOGUE).open("w", encoding="utf-8") as f:
        for item, record in records.items():
            f.write(json.dumps({"item": item, **record.to_json()}, ensure_ascii=False) + "\n")


def load_catalogue(path: Path) -> dict[str, ItemRecord]:
    """An artifact's `CATALOGUE` file (as `read_items` reads JSON lines)."""
    return _read_jsonl(path)
