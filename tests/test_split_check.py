"""benchmarks/split_check.py: the real test split's statistics, and where they fall among random splits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from training.data import load_dataset
from training.synthetic import low_rank_ratings, write_csv

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "split_check.py"


def _run(data: Path) -> dict[str, dict[str, float]]:
    cmd = [sys.executable, str(SCRIPT), "--dataset", "csv", "--data-dir", str(data), "--splits", "20"]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return {row["statistic"]: row for row in map(json.loads, run.stdout.splitlines())}


def test_a_random_test_split_sits_among_random_splits(tmp_path: Path) -> None:
    triples = low_rank_ratings()
    write_csv(tmp_path / "train.csv", triples[: len(triples) * 4 // 5])
    write_csv(tmp_path / "test.csv", triples[len(triples) * 4 // 5 :])
    rows = _run(tmp_path)
    assert set(rows) == {"global_mean_rmse", "user_mean_rmse", "item_mean_rmse", "mean_rating"}
    split = load_dataset("csv", tmp_path)
    # The real split's numbers are those of the predictors fitted on the training ratings.
    rmse = np.sqrt(np.mean((split.test.values - split.train.values.mean()) ** 2))
    assert rows["global_mean_rmse"]["test_split"] == round(rmse, 4)
    assert rows["mean_rating"]["test_split"] == round(split.test.values.mean(), 4)
    assert all(row["n_test"] == len(split.test) for row in rows.values())
    # The synthetic ratings are shuffled, so the tail shares are not extreme.
    assert 0.0 < rows["global_mean_rmse"]["share_random_at_or_above"] < 1.0


def test_a_test_split_of_outliers_lies_beyond_every_random_split(tmp_path: Path) -> None:
    triples = low_rank_ratings()
    ordered = sorted(triples, key=lambda t: abs(t[2] - 3.0))  # the most extreme ratings last
    cut = len(ordered) * 4 // 5
    write_csv(tmp_path / "train.csv", ordered[:cut])
    write_csv(tmp_path / "test.csv", ordered[cut:])
    rows = _run(tmp_path)
    assert rows["global_mean_rmse"]["share_random_at_or_above"] == 0.0
    assert rows["global_mean_rmse"]["test_split"] > rows["global_mean_rmse"]["random_mean"]
