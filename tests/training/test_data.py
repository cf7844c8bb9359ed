"""Tests for training.data: readers in the real formats, splits, id maps and error messages."""

from __future__ import annotations

import bz2
import os
import time
from pathlib import Path

import numpy as np
import pytest

from training.data import (
    DATASETS,
    DataError,
    Entries,
    RatingSplit,
    carve_validation,
    load_dataset,
    random_split,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SHARED = Path(
    os.environ.get("DCMC_DATASETS", Path(__file__).resolve().parents[2].parent / "shared" / "datasets")
)

h5py = pytest.importorskip("h5py")


# ---------------------------------------------------------------------------------------------
# helpers


def write_monti_mat(
    path: Path, m: np.ndarray, o_train: np.ndarray, o_test: np.ndarray, *, extra: dict | None = None
) -> Path:
    """Write a Monti-layout MATLAB v7.3 file: HDF5 datasets stored column-major (transposed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as fh:
        fh.create_dataset("M", data=np.asarray(m, np.float64).T)
        fh.create_dataset("Otraining", data=np.asarray(o_train, np.float64).T)
        fh.create_dataset("Otest", data=np.asarray(o_test, np.float64).T)
        fh.create_dataset("W_users", data=np.eye(m.shape[0]))
        for key, value in (extra or {}).items():
            fh.create_dataset(key, data=value)
    return path


def small_monti(levels: np.ndarray, shape: tuple[int, int] = (6, 5), seed: int = 0):
    """A random (M, Otraining, Otest) triple with disjoint masks; row 5 / column 4 stay empty."""
    rng = np.random.default_rng(seed)
    m = np.zeros(shape)
    obs = rng.random(shape) < 0.6
    obs[-1, :] = False
    obs[:, -1] = False
    m[obs] = rng.choice(levels, size=int(obs.sum()))
    test = obs & (rng.random(shape) < 0.3)
    train = obs & ~test
    return m, train.astype(float), test.astype(float)


def dense(e: Entries, shape: tuple[int, int]) -> np.ndarray:
    out = np.zeros(shape)
    out[e.rows, e.cols] = e.values
    return out


def keys(split: RatingSplit, e: Entries | None) -> set[tuple[str, str]]:
    if e is None:
        return set()
    return {(split.user_ids[r], split.item_ids[c]) for r, c in zip(e.rows, e.cols, strict=True)}


def check_types(s: RatingSplit) -> None:
    for e in (s.train, s.val, s.test):
        if e is None:
            continue
        assert e.rows.dtype == np.int64 and e.cols.dtype == np.int64 and e.values.dtype == np.float64
        assert len(e.rows) == len(e.cols) == len(e.values) == len(e)
        if len(e):
            assert e.rows.min() >= 0 and e.rows.max() < s.n_users
            assert e.cols.min() >= 0 and e.cols.max() < s.n_items
    assert s.levels.dtype == np.float64
    assert np.all(np.diff(s.levels) > 0)
    assert all(isinstance(x, str) for x in s.user_ids + s.item_ids)
    assert len(set(s.user_ids)) == s.n_users and len(set(s.item_ids)) == s.n_items


def read_text_triples(path: Path, sep: str | None) -> list[tuple[str, str, float]]:
    out = []
    for line in path.read_text().splitlines():
        parts = line.split(sep) if sep else line.split()
        try:
            out.append((parts[0], parts[1], float(parts[2])))
        except ValueError:
            continue
    return out


def split_triples(s: RatingSplit) -> list[tuple[str, str, float]]:
    out = []
    for e in (s.train, s.val, s.test):
        if e is None:
            continue
        out += [
            (s.user_ids[r], s.item_ids[c], float(v)) for r, c, v in zip(e.rows, e.cols, e.values, strict=True)
        ]
    return out


# ---------------------------------------------------------------------------------------------
# splits


def test_entries_coerce_and_len() -> None:
    e = Entries([1, 2], [3, 4], [5, 4.5])
    assert len(e) == 2 and e.rows.dtype == np.int64 and e.values.dtype == np.float64
    with pytest.raises(ValueError):
        Entries([1], [2, 3], [1.0])


def test_random_split_fractions_seeded_and_disjoint() -> None:
    n = 1000
    e = Entries(np.arange(n), np.arange(n) % 7, np.ones(n))
    a = random_split(e, (0.75, 0.05, 0.20), seed=3)
    b = random_split(e, (0.75, 0.05, 0.20), seed=3)
    c = random_split(e, (0.75, 0.05, 0.20), seed=4)
    assert [len(x) for x in a] == [750, 50, 200]
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x.rows, y.rows)
    assert not np.array_equal(a[2].rows, c[2].rows)
    allrows = np.concatenate([x.rows for x in a])
    assert sorted(allrows.tolist()) == list(range(n))
    with pytest.raises(ValueError):
        random_split(e, (0.5, 0.2, 0.2), seed=0)


def test_carve_validation() -> None:
    e = Entries(np.arange(100), np.zeros(100), np.arange(100) / 10)
    rest, val = carve_validation(e, 0.1, seed=0)
    assert len(rest) == 90 and len(val) == 10
    assert set(rest.rows.tolist()).isdisjoint(val.rows.tolist())
    _rest2, val2 = carve_validation(e, 0.1, seed=0)
    assert np.array_equal(val.rows, val2.rows)
    with pytest.raises(ValueError):
        carve_validation(e, 1.5, seed=0)


# ---------------------------------------------------------------------------------------------
# ml-100k


def test_ml100k_random_fixture_both_dir_layouts() -> None:
    s = load_dataset("ml-100k", FIXTURES / "ml-100k", split="random", seed=0)
    s2 = load_dataset("ml-100k", FIXTURES, split="random", seed=0)
    check_types(s)
    assert s.name == "ml-100k"
    assert (len(s.train), len(s.val), len(s.test)) == (22, 2, 6)
    assert np.array_equal(s.test.rows, s2.test.rows)
    assert sorted(split_triples(s)) == sorted(read_text_triples(FIXTURES / "ml-100k" / "u.data", "\t"))
    # ids sorted numerically ("2" < "10"), every id of any part indexed
    assert [int(x) for x in s.user_ids] == sorted(int(x) for x in s.user_ids)
    assert set(s.levels) <= {1.0, 2.0, 3.0, 4.0, 5.0}
    assert np.array_equal(s.levels, np.unique(np.concatenate([s.train.values, s.val.values])))


def test_ml100k_canonical_split_needs_full_file() -> None:
    with pytest.raises(DataError, match=r"u\.data.*100000"):
        load_dataset("ml-100k", FIXTURES / "ml-100k", split="u1")


def test_ml100k_bad_split_lists_valid() -> None:
    with pytest.raises(DataError, match=r"u1, u2, u3, u4, u5, random"):
        load_dataset("ml-100k", FIXTURES / "ml-100k", split="u9")


@pytest.fixture(scope="module")
def synthetic_udata(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 100,000-line u.data with unique (user, item) pairs; rating encodes the line's block."""
    d = tmp_path_factory.mktemp("ml100k")
    n = 100_000
    line = np.arange(n)
    users = line // 200 + 1  # 500 users, 200 items each
    items = line % 200 + 1
    ratings = line // 20_000 + 1  # block k (0-based) has rating k + 1
    text = "".join(
        f"{u}\t{i}\t{r}\t88{k:07d}\n" for k, (u, i, r) in enumerate(zip(users, items, ratings, strict=True))
    )
    (d / "u.data").write_text(text)
    return d


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_ml100k_canonical_splits_by_line_range(synthetic_udata: Path, k: int) -> None:
    s = load_dataset("ml-100k", synthetic_udata, split=f"u{k}")
    assert len(s.train) == 80_000 and len(s.test) == 20_000 and s.val is None
    assert np.all(s.test.values == k)
    assert np.all(s.train.values != k)
    # test = lines (k-1)*20000+1 .. k*20000 in file order: line L holds user (L-1)//200+1
    first_line = (k - 1) * 20_000
    assert s.user_ids[s.test.rows[0]] == str(first_line // 200 + 1)
    assert s.item_ids[s.test.cols[0]] == "1"
    assert s.n_users == 500 and s.n_items == 200


def test_ml100k_resample_keeps_the_test_size(synthetic_udata: Path) -> None:
    s = load_dataset("ml-100k", synthetic_udata, split="resample", seed=3)
    assert len(s.train) == 80_000 and len(s.test) == 20_000 and s.val is None
    assert len(np.unique(s.test.values)) > 1 and not np.all(s.test.values == 1)  # not u1's block
    same = load_dataset("ml-100k", synthetic_udata, split="resample", seed=3)
    np.testing.assert_array_equal(same.test.rows, s.test.rows)
    np.testing.assert_array_equal(same.test.cols, s.test.cols)


def test_ml100k_loads_fast(synthetic_udata: Path) -> None:
    t = time.perf_counter()
    load_dataset("ml-100k", synthetic_udata, split="u1")
    assert time.perf_counter() - t < 2.0


def write(tmp_path: Path, rel: str, text: str) -> Path:
    p = tmp_path / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


GOOD_UDATA = "1\t1\t5\t1\n1\t2\t4\t2\n2\t1\t3\t3\n"


@pytest.mark.parametrize(
    ("bad_line", "pattern"),
    [
        ("196\t242", r"u\.data line 4: expected 4 tab-separated fields, got 2: '196\\t242'"),
        ("196\t242\tfive\t1", r"u\.data line 4: rating 'five' is not a number"),
        ("196\t242\tnan\t1", r"u\.data line 4: rating 'nan' is not finite"),
        ("196\t242\tinf\t1", r"u\.data line 4: rating 'inf' is not finite"),
        ("196\t242\t3\t1\textra", r"u\.data line 4: expected 4 tab-separated fields, got 5"),
        ("1\t2\t1\t9", r"u\.data line 4: duplicate rating for user '1' item '2' \(already rated on line 2\)"),
    ],
)
def test_ml100k_malformed_lines(tmp_path: Path, bad_line: str, pattern: str) -> None:
    write(tmp_path, "u.data", GOOD_UDATA + bad_line + "\n")
    with pytest.raises(DataError, match=pattern):
        load_dataset("ml-100k", tmp_path, split="random")


def test_malformed_line_text_truncated(tmp_path: Path) -> None:
    write(tmp_path, "u.data", "x" * 500 + "\n")
    with pytest.raises(DataError, match=r"line 1: .*\.\.\.'") as info:
        load_dataset("ml-100k", tmp_path, split="random")
    assert len(str(info.value)) < 300


def test_ml100k_missing_and_empty(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"u\.data.*dcmc data download ml-100k --to DIR"):
        load_dataset("ml-100k", tmp_path / "nowhere")
    write(tmp_path, "u.data", "")
    with pytest.raises(DataError, match=r"u\.data: file is empty"):
        load_dataset("ml-100k", tmp_path)
    write(tmp_path, "u.data", "\n  \n")
    with pytest.raises(DataError, match=r"u\.data: file is empty"):
        load_dataset("ml-100k", tmp_path)


def test_ml100k_blank_lines_keep_line_numbers(tmp_path: Path) -> None:
    write(tmp_path, "u.data", "1\t1\t5\t1\n\n\r\n1\t2\tx\t2\n")
    with pytest.raises(DataError, match=r"line 4"):
        load_dataset("ml-100k", tmp_path, split="random")


def test_unknown_dataset() -> None:
    with pytest.raises(DataError, match="valid datasets: " + ", ".join(DATASETS)):
        load_dataset("netflix", FIXTURES)


# ---------------------------------------------------------------------------------------------
# Monti .mat


@pytest.mark.parametrize(
    ("name", "fname", "levels"),
    [
        ("douban", "training_test_dataset.mat", np.arange(1.0, 6.0)),
        ("flixster", "training_test_dataset_10_NNs.mat", np.arange(1, 11) / 2),
        ("yahoo_music", "training_test_dataset_10_NNs.mat", np.array([1.0, 7, 33, 50, 99, 100])),
    ],
)
@pytest.mark.parametrize("layout", ["monti/{name}/{f}", "{name}/{f}", "{f}"])
def test_monti_reader(tmp_path: Path, name: str, fname: str, levels: np.ndarray, layout: str) -> None:
    m, o_train, o_test = small_monti(levels, seed=len(name))
    write_monti_mat(tmp_path / layout.format(name=name, f=fname), m, o_train, o_test)
    s = load_dataset(name, tmp_path)
    check_types(s)
    assert s.name == name and s.val is None
    assert (s.n_users, s.n_items) == m.shape  # full matrix, empty rows / columns included
    assert s.user_ids == [str(i) for i in range(1, 7)] and s.item_ids == [str(i) for i in range(1, 6)]
    assert np.array_equal(dense(s.train, m.shape), m * o_train)
    assert np.array_equal(dense(s.test, m.shape), m * o_test)
    assert np.array_equal(s.levels, np.unique(m[o_train == 1]))
    r = load_dataset(name, tmp_path, split="random", seed=1)
    assert r.val is not None and len(r.train) + len(r.val) + len(r.test) == int((m != 0).sum())
    # resample: the pooled ratings re-split with the standard test size, seeded, disjoint, nothing lost.
    a, b = (load_dataset(name, tmp_path, split="resample", seed=seed) for seed in (1, 2))
    again = load_dataset(name, tmp_path, split="resample", seed=1)
    assert a.val is None and len(a.test) == len(s.test) and len(a.train) == len(s.train)
    pooled = dense(a.train, m.shape) + dense(a.test, m.shape)
    assert np.array_equal(pooled, m * ((o_train + o_test) > 0))
    assert np.array_equal(dense(again.test, m.shape), dense(a.test, m.shape))
    assert not np.array_equal(dense(a.test, m.shape), dense(b.test, m.shape))


def test_monti_file_dir_itself(tmp_path: Path) -> None:
    m, a, b = small_monti(np.arange(1.0, 6.0))
    p = write_monti_mat(tmp_path / "x" / "training_test_dataset.mat", m, a, b)
    assert len(load_dataset("douban", p).train) == int(a.sum())
    assert len(load_dataset("douban", p.parent).train) == int(a.sum())


def test_monti_missing_file_suggests_download(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"training_test_dataset_10_NNs\.mat.*dcmc data download flixster"):
        load_dataset("flixster", tmp_path)


def test_monti_missing_key(tmp_path: Path) -> None:
    p = tmp_path / "training_test_dataset.mat"
    with h5py.File(p, "w") as fh:
        fh.create_dataset("M", data=np.ones((3, 3)))
        fh.create_dataset("Otraining", data=np.ones((3, 3)))
    with pytest.raises(DataError, match=r"training_test_dataset\.mat: missing dataset 'Otest'"):
        load_dataset("douban", tmp_path)


def test_monti_shape_mismatch(tmp_path: Path) -> None:
    m, a, b = small_monti(np.arange(1.0, 6.0))
    write_monti_mat(tmp_path / "training_test_dataset.mat", m, a, b[:, :3])
    with pytest.raises(DataError, match=r"training_test_dataset\.mat: shapes differ"):
        load_dataset("douban", tmp_path)


def test_monti_overlap_and_bad_masks(tmp_path: Path) -> None:
    m, a, b = small_monti(np.arange(1.0, 6.0))
    r, c = np.argwhere(a == 1)[0]
    b2 = b.copy()
    b2[r, c] = 1
    write_monti_mat(tmp_path / "training_test_dataset.mat", m, a, b2)
    with pytest.raises(
        DataError, match=rf"1 entries are in both Otraining and Otest, first: user {r + 1} item {c + 1}"
    ):
        load_dataset("douban", tmp_path)
    a2 = a.copy()
    a2[-1, -1] = 1  # observed but M == 0
    write_monti_mat(tmp_path / "training_test_dataset.mat", m, a2, b)
    with pytest.raises(
        DataError, match=r"training_test_dataset\.mat: 1 entries marked in Otraining have no rating"
    ):
        load_dataset("douban", tmp_path)
    write_monti_mat(tmp_path / "training_test_dataset.mat", m, a * 2, b)
    with pytest.raises(DataError, match=r"Otraining must be a 0/1 mask"):
        load_dataset("douban", tmp_path)


def test_monti_not_hdf5(tmp_path: Path) -> None:
    write(tmp_path, "training_test_dataset.mat", "MATLAB 5.0 MAT-file, not v7.3")
    with pytest.raises(DataError, match=r"training_test_dataset\.mat: not a readable MATLAB v7\.3"):
        load_dataset("douban", tmp_path)


def test_monti_rejects_ml_split(tmp_path: Path) -> None:
    m, a, b = small_monti(np.arange(1.0, 6.0))
    write_monti_mat(tmp_path / "training_test_dataset.mat", m, a, b)
    with pytest.raises(DataError, match=r"valid splits"):
        load_dataset("douban", tmp_path, split="u3")


# ---------------------------------------------------------------------------------------------
# epinions


def test_epinions_fixture_and_layouts(tmp_path: Path) -> None:
    s = load_dataset("epinions", FIXTURES, seed=5)
    check_types(s)
    assert (len(s.train), len(s.val), len(s.test)) == (22, 2, 6)
    assert sorted(split_triples(s)) == sorted(
        read_text_triples(FIXTURES / "epinions" / "ratings_data.txt", None)
    )
    s2 = load_dataset("epinions", FIXTURES / "epinions", seed=5)
    assert np.array_equal(s.test.rows, s2.test.rows)
    # a .bz2 copy next to it is read through the bz2 module
    raw = (FIXTURES / "epinions" / "ratings_data.txt").read_bytes()
    (tmp_path / "ratings_data.txt.bz2").write_bytes(bz2.compress(raw))
    s3 = load_dataset("epinions", tmp_path, seed=5)
    assert np.array_equal(s.test.values, s3.test.values) and s3.user_ids == s.user_ids


def test_epinions_malformed(tmp_path: Path) -> None:
    write(tmp_path, "epinions/ratings_data.txt", "1 2 3\n1 3\n")
    with pytest.raises(
        DataError, match=r"ratings_data\.txt line 2: expected 3 whitespace-separated fields, got 2"
    ):
        load_dataset("epinions", tmp_path)
    write(tmp_path, "epinions/ratings_data.txt", "1 2 3\n4 5 NaN\n")
    with pytest.raises(DataError, match=r"ratings_data\.txt line 2: rating 'NaN' is not finite"):
        load_dataset("epinions", tmp_path)
    write(tmp_path, "epinions/ratings_data.txt", "1 2 3\n4 5 3\n1  2 4\n")
    with pytest.raises(DataError, match=r"ratings_data\.txt line 3: duplicate rating"):
        load_dataset("epinions", tmp_path)


def test_epinions_missing(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"ratings_data\.txt.*dcmc data download epinions --to DIR"):
        load_dataset("epinions", tmp_path)


def test_corrupt_bz2(tmp_path: Path) -> None:
    (tmp_path / "ratings_data.txt.bz2").write_bytes(b"BZh9 this is not bzip2")
    with pytest.raises(DataError, match=r"ratings_data\.txt\.bz2: cannot read"):
        load_dataset("epinions", tmp_path)


# ---------------------------------------------------------------------------------------------
# csv


def test_csv_with_header_nonnumeric_ids() -> None:
    s = load_dataset("csv", FIXTURES / "ratings_header.csv", seed=2)
    check_types(s)
    assert s.name == "csv" and s.val is not None
    assert len(s.train) + len(s.val) + len(s.test) == 30
    assert s.user_ids == sorted(s.user_ids)  # lexicographic ids ("u10" < "u2")
    assert all(x.startswith("u") for x in s.user_ids)
    assert sorted(split_triples(s)) == sorted(read_text_triples(FIXTURES / "ratings_header.csv", ","))
    assert set(s.levels) <= set(np.arange(1, 11) / 2)


def test_tsv_without_header() -> None:
    s = load_dataset("csv", FIXTURES / "ratings.tsv", seed=2)
    assert sorted(split_triples(s)) == sorted(read_text_triples(FIXTURES / "ratings.tsv", "\t"))
    assert s.user_ids == sorted(s.user_ids, key=int)


@pytest.mark.parametrize(
    ("text", "sep"),
    [
        ("user;item;rating\n1;2;3\n2;3;4.5\n", ";"),
        ("1 2 3\n2   3 4.5\n", None),
        ("user,item,rating,timestamp\n1,2,3,99\n2,3,4.5,100\n", ","),
    ],
)
def test_csv_delimiters(tmp_path: Path, text: str, sep: str | None) -> None:
    p = write(tmp_path, "r.txt", text)
    s = load_dataset("csv", p, seed=0)
    assert sorted(split_triples(s)) == [("1", "2", 3.0), ("2", "3", 4.5)]


def test_csv_header_only_on_line_one(tmp_path: Path) -> None:
    p = write(tmp_path, "r.csv", "1,2,3\nuser,item,rating\n")
    with pytest.raises(DataError, match=r"r\.csv line 2: rating 'rating' is not a number"):
        load_dataset("csv", p)
    p = write(tmp_path, "h.csv", "user,item,rating\n")
    with pytest.raises(DataError, match=r"h\.csv: file is empty"):
        load_dataset("csv", p)


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("a,b,1\nc,d\n", r"bad\.csv line 2: expected 3 or 4 comma-separated fields, got 2: 'c,d'"),
        ("a,b,1\nc,d,inf\n", r"bad\.csv line 2: rating 'inf' is not finite"),
        ("a,b,1\nc,d,x\n", r"bad\.csv line 2: rating 'x' is not a number"),
        ("a,b,1\nc,d,2\na,b,3\n", r"bad\.csv line 3: duplicate rating for user 'a' item 'b'"),
        ("a,b,1\n,d,2\n", r"bad\.csv line 2: empty user or item id"),
    ],
)
def test_csv_malformed(tmp_path: Path, text: str, pattern: str) -> None:
    p = write(tmp_path, "bad.csv", text)
    with pytest.raises(DataError, match=pattern):
        load_dataset("csv", p)


def test_csv_directory_split() -> None:
    s = load_dataset("csv", FIXTURES / "csv_dir")
    check_types(s)
    assert (len(s.train), len(s.val), len(s.test)) == (20, 4, 6)
    assert keys(s, s.test).isdisjoint(keys(s, s.train))
    assert sorted(split_triples(s)) == sorted(read_text_triples(FIXTURES / "ratings.tsv", "\t"))
    assert np.array_equal(s.levels, np.unique(np.concatenate([s.train.values, s.val.values])))


def test_csv_directory_without_val(tmp_path: Path) -> None:
    write(tmp_path, "train.csv", "1,1,5\n1,2,4\n")
    write(tmp_path, "test.csv", "2,1,3\n3,9,1\n")
    s = load_dataset("csv", tmp_path)
    assert s.val is None and s.user_ids == ["1", "2", "3"] and s.item_ids == ["1", "2", "9"]
    assert np.array_equal(s.levels, [4.0, 5.0])


def test_csv_directory_overlap(tmp_path: Path) -> None:
    write(tmp_path, "train.csv", "1,1,5\n1,2,4\n2,2,4\n")
    write(tmp_path, "test.csv", "user,item,rating\n2,1,3\n1,2,1\n2,2,2\n")
    with pytest.raises(
        DataError,
        match=r"test\.csv line 3: 2 \(user, item\) pair\(s\) also appear in train\.csv, "
        r"first: user '1' item '2'",
    ):
        load_dataset("csv", tmp_path)


def test_csv_directory_missing_files(tmp_path: Path) -> None:
    write(tmp_path, "train.csv", "1,1,5\n")
    with pytest.raises(DataError, match=r"test\.csv not found"):
        load_dataset("csv", tmp_path)
    with pytest.raises(DataError, match=r"does not exist"):
        load_dataset("csv", tmp_path / "nope.csv")


def test_not_utf8(tmp_path: Path) -> None:
    p = tmp_path / "r.csv"
    p.write_bytes(b"1,2,3\n1,3,\xff\n")
    with pytest.raises(DataError, match=r"r\.csv line 2: not valid UTF-8"):
        load_dataset("csv", p)


# ---------------------------------------------------------------------------------------------
# real datasets (slow)


def _need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} not available")
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "n_train", "n_test", "shape", "n_levels"),
    [
        ("douban", 123_202, 13_689, (3000, 3000), 5),
        ("flixster", 23_556, 2_617, (3000, 3000), 10),
        ("yahoo_music", 4_802, 533, (3000, 3000), None),
    ],
)
def test_real_monti(
    name: str, n_train: int, n_test: int, shape: tuple[int, int], n_levels: int | None
) -> None:
    _need(SHARED / "monti" / name)
    s = load_dataset(name, SHARED)
    assert (len(s.train), len(s.test)) == (n_train, n_test)
    assert (s.n_users, s.n_items) == shape
    if n_levels is not None:
        assert len(s.levels) == n_levels
    else:
        assert s.levels.min() >= 1 and s.levels.max() <= 100 and np.all(s.levels == np.round(s.levels))


@pytest.mark.slow
def test_real_ml100k_u1_equals_monti_split_1() -> None:
    _need(SHARED / "ml-100k" / "u.data")
    t = time.perf_counter()
    s = load_dataset("ml-100k", SHARED, split="u1")
    assert time.perf_counter() - t < 2.0
    assert (len(s.train), len(s.test), s.n_users, s.n_items) == (80_000, 20_000, 943, 1682)
    assert s.user_ids == [str(i) for i in range(1, 944)] and s.item_ids == [str(i) for i in range(1, 1683)]
    assert np.array_equal(s.levels, [1.0, 2.0, 3.0, 4.0, 5.0])
    mat = _need(SHARED / "monti" / "movielens" / "split_1.mat")
    with h5py.File(mat, "r") as fh:
        m = fh["M"][()].T
        o_train = fh["Otraining"][()].T
        o_test = fh["Otest"][()].T
    assert m.shape == (943, 1682)
    assert np.array_equal(dense(s.train, m.shape), m * o_train)
    assert np.array_equal(dense(s.test, m.shape), m * o_test)
    for k in range(2, 6):
        sk = load_dataset("ml-100k", SHARED / "ml-100k", split=f"u{k}")
        assert (len(sk.train), len(sk.test)) == (80_000, 20_000)


def test_fold_carves_hold_each_entry_out_once() -> None:
    from training.data import Entries, fold_carves

    rng = np.random.default_rng(0)
    # The values number the entries, so that each one can be followed into the folds.
    entries = Entries(rng.integers(0, 50, 103), rng.integers(0, 40, 103), np.arange(103.0))
    carves = fold_carves(entries, 4, seed=5)
    held = np.concatenate([val.values for _, val in carves])
    assert sorted(held.tolist()) == list(range(103))  # every entry in exactly one fold's validation
    for rest, val in carves:
        assert sorted([*rest.values, *val.values]) == list(range(103)) and len(val) in (25, 26)
        assert np.array_equal(entries.rows[val.values.astype(int)], val.rows)
    assert [v.values.tolist() for _, v in fold_carves(entries, 4, seed=5)] == [
        v.values.tolist() for _, v in carves
    ]
    assert [v.values.tolist() for _, v in fold_carves(entries, 4, seed=6)] != [
        v.values.tolist() for _, v in carves
    ]
    with pytest.raises(ValueError, match="at least 2"):
        fold_carves(entries, 1, seed=0)
