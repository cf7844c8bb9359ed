"""`dcmc data synth`: seeded rating matrices of a large dataset's shape with a planted structure."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from training.synthetic import SHAPES, planted_ratings

REPO = Path(__file__).resolve().parents[2]


def test_planted_ratings_cover_every_row_and_column_once_at_least_on_the_scale() -> None:
    rows, cols, values = planted_ratings(2000, 1000, 30_000, (0.5, 5.0, 0.5), seed=3)
    assert len(rows) == 30_000 and len(np.unique(rows * 1000 + cols)) == 30_000  # distinct entries
    assert len(np.unique(rows)) == 2000 and len(np.unique(cols)) == 1000
    assert set(np.unique(values)) <= set(np.arange(0.5, 5.01, 0.5))
    again = planted_ratings(2000, 1000, 30_000, (0.5, 5.0, 0.5), seed=3)
    assert all(np.array_equal(a, b) for a, b in zip((rows, cols, values), again, strict=True))
    assert not np.array_equal(planted_ratings(2000, 1000, 30_000, (0.5, 5.0, 0.5), seed=4)[2], values)
    degrees = np.bincount(rows)
    assert degrees.max() > 20 * np.median(degrees)  # power-law activity: a few heavy users
    with pytest.raises(ValueError, match="cannot cover"):
        planted_ratings(2000, 1000, 1500)


def test_planted_ratings_are_the_same_matrix_as_before_the_bitmap_rounds() -> None:
    # The rounds that fill the matrix past its cover dedupe through a bitmap since 2026-11-27 (they sorted
    # everything drawn so far before); the draws and the set they make are the same, so are the data of
    # the earlier benchmark records. The digest was computed by the earlier code on a saturating shape
    # (200,000 of 1,500,000 entries, most rounds hit heavy users and items already drawn).
    rows, cols, values = planted_ratings(3000, 500, 200_000, (0.5, 5.0, 0.5), seed=1)
    digest = hashlib.sha256(rows.tobytes() + cols.tobytes() + values.tobytes()).hexdigest()
    assert digest == "3ad072ebc4fe05384f102f40eb949d381f21cd24b8d9ddc2efb8d24b4cb8462c"


def test_the_planted_structure_is_learnable() -> None:
    # On held-out entries, user and item means beat the global mean by a clear margin: the biases and
    # preferences are in the data, not only noise.
    rows, cols, values = planted_ratings(1500, 800, 60_000, seed=0)
    test = np.random.default_rng(0).random(len(rows)) < 0.2
    mu = values[~test].mean()

    def means(index: np.ndarray, n: int) -> np.ndarray:
        s = np.bincount(index[~test], weights=values[~test] - mu, minlength=n)
        return s / (np.bincount(index[~test], minlength=n) + 5.0)

    b, c = means(rows, 1500), means(cols, 800)
    baseline = np.sqrt(np.mean((mu + b[rows[test]] + c[cols[test]] - values[test]) ** 2))
    global_mean = np.sqrt(np.mean((mu - values[test]) ** 2))
    assert baseline < 0.93 * global_mean


def test_dcmc_data_synth_writes_a_csv_the_csv_dataset_reads(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "training.cli", "data", "synth", "--shape", "epinions", "--ratings", "200000",
         "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["ratings"] == 200_000 and summary["users"] == SHAPES["epinions"].n_users
    from training.data import load_dataset

    split = load_dataset("csv", str(tmp_path / "ratings.csv"), split="random", seed=0)
    assert split.n_users == 40_163 and split.n_items == 139_738
    assert len(split.train) + len(split.test) + len(split.val or []) == 200_000
