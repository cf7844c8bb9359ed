"""Rating-data readers, splits and external-id maps for the DCMC benchmarks.

Every reader returns a :class:`RatingSplit` whose entries use internal indices; the external ids
(strings as they appear in the files) sit in ``user_ids`` / ``item_ids`` at position = index.
Indices are assigned over every user / item that appears in any part of the split: ids sort
numerically when they are all integers, else lexicographically (the same rule for every reader;
the Monti ``.mat`` files use the 1-based row / column numbers of the full matrix as ids).

Bad input never escapes as a raw exception: it raises :class:`DataError` naming the file, and the
1-based line for text formats.
"""

from __future__ import annotations

import bz2
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

DATASETS = ("ml-100k", "douban", "flixster", "yahoo_music", "epinions", "csv")
ML100K_SPLITS = ("u1", "u2", "u3", "u4", "u5", "random", "resample")
DEFAULT_FRACTIONS = (0.75, 0.05, 0.20)

_ALIASES = {
    "ml100k": "ml-100k",
    "ml_100k": "ml-100k",
    "movielens": "ml-100k",
    "movielens-100k": "ml-100k",
    "yahoo-music": "yahoo_music",
    "yahoomusic": "yahoo_music",
    "yahoo": "yahoo_music",
}
_MONTI_FILES = {
    "douban": "training_test_dataset.mat",
    "flixster": "training_test_dataset_10_NNs.mat",
    "yahoo_music": "training_test_dataset_10_NNs.mat",
}
_ML100K_BLOCK = 20_000
_ML100K_LINES = 100_000
_SNIPPET = 60


class DataError(Exception):
    """Bad or missing input data; the message names the file (and line where relevant)."""


@dataclass(frozen=True)
class Entries:
    """Observed ratings as parallel arrays (user_idx, item_idx, rating)."""

    rows: np.ndarray
    cols: np.ndarray
    values: np.ndarray

    def __post_init__(self) -> None:
        rows = np.ascontiguousarray(self.rows, dtype=np.int64).reshape(-1)
        cols = np.ascontiguousarray(self.cols, dtype=np.int64).reshape(-1)
        values = np.ascontiguousarray(self.values, dtype=np.float64).reshape(-1)
        if not (len(rows) == len(cols) == len(values)):
            raise ValueError(f"Entries arrays differ in length: {len(rows)}, {len(cols)}, {len(values)}")
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "cols", cols)
        object.__setattr__(self, "values", values)

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def take(self, index: np.ndarray) -> Entries:
        """The entries at the given positions (integer array or boolean mask)."""
        return Entries(self.rows[index], self.cols[index], self.values[index])

    @staticmethod
    def concat(parts: Sequence[Entries]) -> Entries:
        """All entries of `parts`, in order."""
        if not parts:
            return Entries(np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.float64))
        return Entries(
            np.concatenate([p.rows for p in parts]),
            np.concatenate([p.cols for p in parts]),
            np.concatenate([p.values for p in parts]),
        )


@dataclass(frozen=True)
class RatingSplit:
    """A dataset split into train / (optional) validation / test entries with its id maps."""

    name: str
    user_ids: list[str]
    item_ids: list[str]
    levels: np.ndarray
    train: Entries
    val: Entries | None
    test: Entries

    @property
    def n_users(self) -> int:
        """Number of users (rows of the rating matrix)."""
        return len(self.user_ids)

    @property
    def n_items(self) -> int:
        """Number of items (columns of the rating matrix)."""
        return len(self.item_ids)


# --------------------------------------------------------------------------------------------
# splits


def _check_fraction(fraction: float, what: str) -> float:
    f = float(fraction)
    if not math.isfinite(f) or f < 0.0 or f > 1.0:
        raise ValueError(f"{what} must lie in [0, 1], got {fraction!r}")
    return f


def carve_validation(entries: Entries, fraction: float, seed: int) -> tuple[Entries, Entries]:
    """Seeded random split of `entries` into (rest, validation)."""
    f = _check_fraction(fraction, "validation fraction")
    n = len(entries)
    n_val = round(f * n)
    perm = np.random.default_rng(seed).permutation(n)
    val_pos = np.sort(perm[:n_val])
    rest_pos = np.sort(perm[n_val:])
    return entries.take(rest_pos), entries.take(val_pos)


def fold_carves(entries: Entries, folds: int, seed: int) -> list[tuple[Entries, Entries]]:
    """`folds` seeded (rest, validation) pairs of `entries`: every entry is a validation entry of
    exactly one fold (the folds' sizes differ by at most one)."""
    if folds < 2:
        raise ValueError(f"folds must be at least 2, got {folds}")
    perm = np.random.default_rng(seed).permutation(len(entries))
    parts = np.array_split(perm, folds)
    return [
        (entries.take(np.sort(np.concatenate(parts[:k] + parts[k + 1 :]))), entries.take(np.sort(part)))
        for k, part in enumerate(parts)
    ]


def random_split(
    entries: Entries, fractions: Sequence[float] = DEFAULT_FRACTIONS, seed: int = 0
) -> tuple[Entries, Entries, Entries]:
    """Seeded random (train, val, test) split of `entries` by `fractions` (summing to 1)."""
    if len(fractions) != 3:
        raise ValueError(f"fractions must be (train, val, test), got {fractions!r}")
    f_train, f_val, f_test = (_check_fraction(f, "split fraction") for f in fractions)
    if abs(f_train + f_val + f_test - 1.0) > 1e-6:
        raise ValueError(f"split fractions must sum to 1, got {fractions!r}")
    n = len(entries)
    n_test = round(f_test * n)
    n_val = round(f_val * n)
    perm = np.random.default_rng(seed).permutation(n)
    test_pos = np.sort(perm[:n_test])
    val_pos = np.sort(perm[n_test : n_test + n_val])
    train_pos = np.sort(perm[n_test + n_val :])
    return entries.take(train_pos), entries.take(val_pos), entries.take(test_pos)


# --------------------------------------------------------------------------------------------
# text parsing


@dataclass
class _Parsed:
    """Raw triples read from one text file, before indexing."""

    path: Path
    users: list[str]
    items: list[str]
    values: np.ndarray
    lines: np.ndarray  # 1-based line number of each entry


def _snippet(line: str) -> str:
    text = line if len(line) <= _SNIPPET else line[:_SNIPPET] + "..."
    return repr(text)


def _read_text(path: Path) -> str:
    """Whole file as text (bz2-decompressed for *.bz2), with read errors turned into DataError."""
    try:
        if path.suffix == ".bz2":
            with bz2.open(path, "rb") as fh:
                raw = fh.read()
        else:
            raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (OSError, EOFError, ValueError) as exc:
        raise DataError(f"{path}: cannot read file: {exc}") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise DataError(f"{path} line {line}: not valid UTF-8 text ({exc.reason})") from None


def _sniff_delimiter(path: Path, text: str) -> str | None:
    """Delimiter of the first non-blank line: tab, comma, semicolon, else None (= whitespace)."""
    for line in text.split("\n", 50)[:50]:
        if line.strip():
            for sep in ("\t", ",", ";"):
                if sep in line:
                    return sep
            return None
    raise DataError(f"{path}: file is empty (no ratings)")


def _describe_sep(sep: str | None) -> str:
    return {"\t": "tab", ",": "comma", ";": "semicolon", None: "whitespace"}[sep] + "-separated"


def _parse_triples(
    path: Path, text: str, sep: str | None, n_fields: tuple[int, ...], *, allow_header: bool
) -> _Parsed:
    """Parse `user item rating [...]` lines; blank lines are skipped, anything odd raises DataError."""
    users: list[str] = []
    items: list[str] = []
    values: list[float] = []
    lines: list[int] = []
    want = " or ".join(str(n) for n in n_fields)
    sep_desc = _describe_sep(sep)
    isfinite = math.isfinite
    for lineno, raw in enumerate(text.split("\n"), start=1):
        line = raw.rstrip("\r")
        if not line.strip():
            continue
        parts = line.split(sep) if sep is not None else line.split()
        if len(parts) not in n_fields:
            raise DataError(
                f"{path} line {lineno}: expected {want} {sep_desc} fields, got {len(parts)}: {_snippet(line)}"
            )
        user = parts[0].strip()
        item = parts[1].strip()
        rating = parts[2].strip()
        try:
            value = float(rating)
        except ValueError:
            if allow_header and lineno == 1:
                logger.debug("%s: skipping header line %r", path, line)
                continue
            raise DataError(
                f"{path} line {lineno}: rating {rating!r} is not a number: {_snippet(line)}"
            ) from None
        if not isfinite(value):
            raise DataError(f"{path} line {lineno}: rating {rating!r} is not finite: {_snippet(line)}")
        if not user or not item:
            raise DataError(f"{path} line {lineno}: empty user or item id: {_snippet(line)}")
        users.append(user)
        items.append(item)
        values.append(value)
        lines.append(lineno)
    if not values:
        raise DataError(f"{path}: file is empty (no ratings)")
    return _Parsed(path, users, items, np.asarray(values, np.float64), np.asarray(lines, np.int64))


def _id_index(ids: list[str]) -> tuple[list[str], np.ndarray]:
    """Vocabulary (sorted numerically if all ids are integers, else lexicographically) and indices."""
    uniq, inverse = np.unique(np.asarray(ids, dtype=str), return_inverse=True)
    uniq_list = [str(u) for u in uniq]
    try:
        numeric = [int(u) for u in uniq_list]
    except ValueError:
        return uniq_list, inverse.reshape(-1).astype(np.int64)
    order = sorted(range(len(uniq_list)), key=lambda k: (numeric[k], uniq_list[k]))
    rank = np.empty(len(order), dtype=np.int64)
    rank[np.asarray(order, dtype=np.int64)] = np.arange(len(order), dtype=np.int64)
    return [uniq_list[k] for k in order], rank[inverse.reshape(-1)]


def _index_parts(parts: Sequence[_Parsed]) -> tuple[list[str], list[str], list[Entries]]:
    """Index the users / items of all parts together and turn each part into Entries."""
    user_ids, user_idx = _id_index([u for p in parts for u in p.users])
    item_ids, item_idx = _id_index([i for p in parts for i in p.items])
    out: list[Entries] = []
    start = 0
    for p in parts:
        stop = start + len(p.values)
        out.append(Entries(user_idx[start:stop], item_idx[start:stop], p.values))
        start = stop
    return user_ids, item_ids, out


def _keys(entries: Entries, n_items: int) -> np.ndarray:
    return entries.rows * np.int64(max(n_items, 1)) + entries.cols


def _check_duplicates(entries: Entries, parsed: _Parsed, n_items: int) -> None:
    """DataError naming the first line that repeats an earlier (user, item) pair of the same file."""
    if len(entries) < 2:
        return
    keys = _keys(entries, n_items)
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    dup = np.flatnonzero(sorted_keys[1:] == sorted_keys[:-1])
    if dup.size == 0:
        return
    later = order[dup + 1]
    j = int(np.argmin(later))
    pos, first = int(later[j]), int(order[dup[j]])
    raise DataError(
        f"{parsed.path} line {int(parsed.lines[pos])}: duplicate rating for user {parsed.users[pos]!r} "
        f"item {parsed.items[pos]!r} (already rated on line {int(parsed.lines[first])}); "
        f"{dup.size} duplicate pair(s) in the file"
    )


def _check_disjoint(
    a: Entries, a_parsed: _Parsed | None, b: Entries, b_name: str, n_items: int, a_name: str | None = None
) -> None:
    """DataError if some (user, item) pair of `a` also occurs in `b`."""
    if len(a) == 0 or len(b) == 0:
        return
    hit = np.flatnonzero(np.isin(_keys(a, n_items), _keys(b, n_items)))
    if hit.size == 0:
        return
    pos = int(hit[0])
    if a_parsed is not None:
        where = f"{a_parsed.path} line {int(a_parsed.lines[pos])}"
        example = f"user {a_parsed.users[pos]!r} item {a_parsed.items[pos]!r}"
    else:
        where = str(a_name)
        example = f"user_idx {int(a.rows[pos])} item_idx {int(a.cols[pos])}"
    raise DataError(f"{where}: {hit.size} (user, item) pair(s) also appear in {b_name}, first: {example}")


def _levels(*parts: Entries | None) -> np.ndarray:
    vals = [p.values for p in parts if p is not None and len(p) > 0]
    if not vals:
        return np.empty(0, np.float64)
    return np.unique(np.concatenate(vals)).astype(np.float64)


def _make_split(
    name: str, user_ids: list[str], item_ids: list[str], train: Entries, val: Entries | None, test: Entries
) -> RatingSplit:
    split = RatingSplit(name, user_ids, item_ids, _levels(train, val), train, val, test)
    logger.info(
        "%s: %d users x %d items, train %d / val %s / test %d, %d rating levels",
        name,
        split.n_users,
        split.n_items,
        len(train),
        "-" if val is None else len(val),
        len(test),
        len(split.levels),
    )
    return split


def resample(train: Entries, test: Entries, seed: int) -> tuple[Entries, Entries]:
    """The pooled ratings of a standard split re-split at random with the same test size: (train, test).
    Seeded; the validation entries are then carved from the new training part as from any other."""
    pooled = Entries.concat([train, test])
    order = np.random.default_rng(seed).permutation(len(pooled))
    in_test = np.zeros(len(pooled), dtype=bool)
    in_test[order[: len(test)]] = True
    return pooled.take(~in_test), pooled.take(in_test)


def _random_from_parsed(name: str, parsed: _Parsed, seed: int) -> RatingSplit:
    user_ids, item_ids, (entries,) = _index_parts([parsed])
    _check_duplicates(entries, parsed, len(item_ids))
    train, val, test = random_split(entries, DEFAULT_FRACTIONS, seed)
    return _make_split(name, user_ids, item_ids, train, val, test)


# --------------------------------------------------------------------------------------------
# path resolution


def _download_hint(name: str) -> str:
    return f"; download it with `dcmc data download {name} --to DIR` and pass DIR as the data directory"


def _find_file(data_dir: Path, candidates: Sequence[str], name: str, hint: bool = True) -> Path:
    """First existing file among `data_dir` itself and `data_dir/<candidate>`."""
    if data_dir.is_file() and any(Path(c).name == data_dir.name for c in candidates):
        return data_dir
    looked = [data_dir / c for c in candidates]
    for p in looked:
        if p.is_file():
            return p
    where = ", ".join(str(p) for p in looked)
    state = "" if data_dir.exists() else f" (directory {data_dir} does not exist)"
    raise DataError(
        f"{name}: no data file found{state}; looked for {where}" + (_download_hint(name) if hint else "")
    )


# --------------------------------------------------------------------------------------------
# readers


def _load_ml100k(data_dir: Path, split: str, seed: int) -> RatingSplit:
    if split not in ML100K_SPLITS:
        raise DataError(f"ml-100k: unknown split {split!r}; valid splits: {', '.join(ML100K_SPLITS)}")
    path = _find_file(data_dir, ["u.data", "ml-100k/u.data"], "ml-100k")
    parsed = _parse_triples(path, _read_text(path), "\t", (4,), allow_header=False)
    if split == "random":
        return _random_from_parsed("ml-100k", parsed, seed)
    n = len(parsed.values)
    if n != _ML100K_LINES:
        raise DataError(
            f"{path}: has {n} ratings; the canonical splits u1..u5 need the full {_ML100K_LINES}-line "
            "u.data (use split='random' for other files)"
        )
    user_ids, item_ids, (entries,) = _index_parts([parsed])
    _check_duplicates(entries, parsed, len(item_ids))
    k = 1 if split == "resample" else int(split[1])
    in_test = np.zeros(n, dtype=bool)
    in_test[(k - 1) * _ML100K_BLOCK : k * _ML100K_BLOCK] = True
    train, test = entries.take(~in_test), entries.take(in_test)
    if split == "resample":
        train, test = resample(train, test, seed)
    return _make_split("ml-100k", user_ids, item_ids, train, None, test)


def _read_mat(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(M, Otraining, Otest) as users x items arrays from a Monti MATLAB v7.3 file."""
    try:
        import h5py
    except ImportError as exc:  # pragma: no cover - h5py is a training dependency
        raise DataError(f"{path}: reading .mat files needs h5py (pip install h5py)") from exc
    out = []
    try:
        with h5py.File(path, "r") as fh:
            for key in ("M", "Otraining", "Otest"):
                if key not in fh or not isinstance(fh[key], h5py.Dataset):
                    raise DataError(
                        f"{path}: missing dataset {key!r} (has: {', '.join(sorted(fh.keys())) or 'nothing'})"
                    )
                arr = np.asarray(fh[key][()])
                if arr.ndim != 2:
                    raise DataError(f"{path}: dataset {key!r} must be 2-D, has shape {arr.shape}")
                out.append(arr.T)
    except DataError:
        raise
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise DataError(f"{path}: not a readable MATLAB v7.3 (HDF5) file: {exc}") from None
    m, o_train, o_test = out
    if not (m.shape == o_train.shape == o_test.shape):
        raise DataError(
            f"{path}: shapes differ: M {m.shape}, Otraining {o_train.shape}, Otest {o_test.shape}"
        )
    if not np.issubdtype(m.dtype, np.number):
        raise DataError(f"{path}: M has non-numeric dtype {m.dtype}")
    return m.astype(np.float64, copy=False), o_train, o_test


def _mask(path: Path, key: str, arr: np.ndarray) -> np.ndarray:
    try:
        as_float = arr.astype(np.float64, copy=False)
    except (TypeError, ValueError):
        raise DataError(f"{path}: {key} is not numeric (dtype {arr.dtype})") from None
    bad = ~((as_float == 0) | (as_float == 1))
    if bad.any():
        r, c = (int(x[0]) for x in np.nonzero(bad))
        raise DataError(f"{path}: {key} must be a 0/1 mask, found {as_float[r, c]!r} at ({r + 1}, {c + 1})")
    return as_float == 1


def _load_monti(name: str, data_dir: Path, split: str, seed: int) -> RatingSplit:
    fname = _MONTI_FILES[name]
    path = _find_file(data_dir, [f"monti/{name}/{fname}", f"{name}/{fname}", fname], name)
    m, o_train, o_test = _read_mat(path)
    train_mask = _mask(path, "Otraining", o_train)
    test_mask = _mask(path, "Otest", o_test)
    both = train_mask & test_mask
    if both.any():
        r, c = (int(x[0]) for x in np.nonzero(both))
        raise DataError(
            f"{path}: {int(both.sum())} entries are in both Otraining and Otest, "
            f"first: user {r + 1} item {c + 1}"
        )
    for key, mask in (("Otraining", train_mask), ("Otest", test_mask)):
        vals = m[mask]
        bad = ~np.isfinite(vals) | (vals == 0)
        if bad.any():
            r, c = (int(x[np.flatnonzero(bad)[0]]) for x in np.nonzero(mask))
            raise DataError(
                f"{path}: {int(bad.sum())} entries marked in {key} have no rating in M "
                f"(0 or non-finite), first: user {r + 1} item {c + 1} = {m[r, c]!r}"
            )
    if not train_mask.any():
        raise DataError(f"{path}: Otraining marks no entries")
    n_users, n_items = m.shape
    user_ids = [str(i) for i in range(1, n_users + 1)]
    item_ids = [str(i) for i in range(1, n_items + 1)]

    def entries(mask: np.ndarray) -> Entries:
        r, c = np.nonzero(mask)
        return Entries(r, c, m[r, c])

    train, test = entries(train_mask), entries(test_mask)
    if split == "random":
        train, val, test = random_split(Entries.concat([train, test]), DEFAULT_FRACTIONS, seed)
        return _make_split(name, user_ids, item_ids, train, val, test)
    if split == "resample":
        train, test = resample(train, test, seed)
        return _make_split(name, user_ids, item_ids, train, None, test)
    _fixed_split_only(name, split)
    return _make_split(name, user_ids, item_ids, train, None, test)


def _fixed_split_only(name: str, split: str) -> None:
    if split not in ("u1", "random"):
        raise DataError(
            f"{name}: unknown split {split!r}; valid splits: u1 (the dataset's standard protocol), random"
            + (", resample" if name in _MONTI_FILES else "")
        )


def _load_epinions(data_dir: Path, split: str, seed: int) -> RatingSplit:
    _fixed_split_only("epinions", split)
    path = _find_file(
        data_dir,
        [
            "ratings_data.txt",
            "ratings_data.txt.bz2",
            "epinions/ratings_data.txt",
            "epinions/ratings_data.txt.bz2",
        ],
        "epinions",
    )
    parsed = _parse_triples(path, _read_text(path), None, (3,), allow_header=False)
    return _random_from_parsed("epinions", parsed, seed)


def _parse_csv(path: Path) -> _Parsed:
    text = _read_text(path)
    sep = _sniff_delimiter(path, text)
    return _parse_triples(path, text, sep, (3, 4), allow_header=True)


def _load_csv(data_dir: Path, split: str, seed: int) -> RatingSplit:
    _fixed_split_only("csv", split)
    if data_dir.is_file():
        return _random_from_parsed("csv", _parse_csv(data_dir), seed)
    if not data_dir.is_dir():
        raise DataError(
            f"csv: {data_dir} does not exist; give a user,item,rating CSV/TSV file or a directory "
            "holding train.csv and test.csv (optional val.csv)"
        )
    train_path, test_path, val_path = (data_dir / f for f in ("train.csv", "test.csv", "val.csv"))
    for p in (train_path, test_path):
        if not p.is_file():
            raise DataError(
                f"csv: {p} not found; a csv data directory must hold train.csv and test.csv "
                "(optional val.csv)"
            )
    parsed = [_parse_csv(train_path), _parse_csv(test_path)]
    if val_path.is_file():
        parsed.append(_parse_csv(val_path))
    user_ids, item_ids, parts = _index_parts(parsed)
    n_items = len(item_ids)
    for e, p in zip(parts, parsed, strict=True):
        _check_duplicates(e, p, n_items)
    if split == "random":
        train, val, test = random_split(Entries.concat(parts), DEFAULT_FRACTIONS, seed)
        return _make_split("csv", user_ids, item_ids, train, val, test)
    train, test = parts[0], parts[1]
    val = parts[2] if len(parts) == 3 else None
    _check_disjoint(test, parsed[1], train, train_path.name, n_items)
    if val is not None:
        _check_disjoint(val, parsed[2], train, train_path.name, n_items)
        _check_disjoint(test, parsed[1], val, val_path.name, n_items)
    return _make_split("csv", user_ids, item_ids, train, val, test)


def load_dataset(name: str, data_dir: str | Path, *, split: str = "u1", seed: int = 0) -> RatingSplit:
    """Load dataset `name` from `data_dir` and split it (`split`/`seed` as the dataset's protocol allows)."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in DATASETS:
        raise DataError(f"unknown dataset {name!r}; valid datasets: {', '.join(DATASETS)}")
    path = Path(data_dir).expanduser()
    if key == "ml-100k":
        return _load_ml100k(path, split, seed)
    if key in _MONTI_FILES:
        return _load_monti(key, path, split, seed)
    if key == "epinions":
        return _load_epinions(path, split, seed)
    return _load_csv(path, split, seed)
