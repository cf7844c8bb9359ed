"""The fold-in policy chosen on the artifact's validation ratings (training/fold_in.py), and the service
following it (service/scoring.fold_in_refine)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from model.artifact import load_artifact
from service.scoring import fold_in_refine
from service.settings import Settings
from training.fold_in import MIN_SCORED, choose_refine, difference_interval
from training.pipeline import run_training
from training.synthetic import low_rank_ratings, write_csv


def test_the_interval_says_which_policy_is_better_beyond_doubt() -> None:
    rng = np.random.default_rng(0)
    owner = np.repeat(np.arange(50), 4)
    errors = rng.random(len(owner))
    low, high = difference_interval(errors * 0.5, errors, owner, np.random.default_rng(1))
    assert high < 0  # the first is better on every user
    low, high = difference_interval(errors, errors * 0.5, owner, np.random.default_rng(1))
    assert low > 0
    low, high = difference_interval(errors, errors, owner, np.random.default_rng(1))
    assert low == high == 0.0  # a tie is no reason for the costlier policy
    noisy = errors + rng.normal(0, 0.3, len(errors)) ** 2 - 0.09
    low, high = difference_interval(np.abs(noisy), errors, owner, np.random.default_rng(1))
    assert low < high


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    """An artifact of the default preset cut to 4 epochs, 10% of the training ratings for validation."""
    root = tmp_path_factory.mktemp("fold-in")
    data = write_csv(root / "ratings.csv", low_rank_ratings(n_users=100, n_items=60, density=0.8, seed=3))
    settings = {"epochs": "4", "val_fraction": "0.1"}
    metrics = run_training(
        "csv", data, root / "a", split="random", preset_name="default", settings=settings,
        progress=False, tune_trials=2,
    )  # fmt: skip
    return root / "a", metrics


def test_training_chooses_the_policy_on_validation_and_the_artifact_keeps_it(
    trained: tuple[Path, dict[str, object]],
) -> None:
    out, metrics = trained
    summary = metrics["fold_in"]
    assert isinstance(summary, dict) and summary["refine"] in ("all", "new")
    record = json.loads((out / "config.json").read_text())["fold_in"]
    artifact = load_artifact(out)  # the rewrite kept the manifest valid
    assert artifact.meta["fold_in"] == record and record["refine"] == summary["refine"]
    held = artifact.held_out
    counts = held.by_row.counts(np.arange(held.n_users))
    assert record["users"] == int((counts >= 2).sum())
    assert record["online"] + record["scored"] == int(counts[counts >= 2].sum()) >= MIN_SCORED
    assert 0 < record["rmse_new"] < 2 and 0 < record["rmse_all"] < 2
    low, high = record["difference_95"]
    assert low <= high and (record["refine"] == "all") == (high < 0)
    # Seeded: the same artifact and seed choose the same way, from the same numbers.
    again = choose_refine(artifact, seed=artifact.meta["train"]["seed"])
    assert {k: again[k] for k in ("rmse_all", "rmse_new", "refine")} == {
        k: record[k] for k in ("rmse_all", "rmse_new", "refine")
    }


def test_the_service_follows_the_artifacts_choice_unless_told(
    trained: tuple[Path, dict[str, object]],
) -> None:
    artifact = load_artifact(trained[0])
    meta = dict(artifact.meta)
    for chosen in ("all", "new"):
        mine = dataclasses.replace(artifact, meta={**meta, "fold_in": {"refine": chosen}})
        assert fold_in_refine(mine, Settings()) == chosen
        for told in ("all", "new"):
            assert fold_in_refine(mine, Settings(fold_in_refine=told)) == told
    without = dataclasses.replace(artifact, meta={k: v for k, v in meta.items() if k != "fold_in"})
    assert fold_in_refine(without, Settings()) == "all"


def test_no_tune_makes_no_choice(tmp_path: Path) -> None:
    data = write_csv(tmp_path / "ratings.csv", low_rank_ratings(n_users=40, n_items=30, density=0.5, seed=1))
    metrics = run_training(
        "csv", data, tmp_path / "a", split="random", preset_name="tiny", progress=False, tune=False
    )
    assert "--no-tune" in metrics["fold_in"]["skipped"]
    assert "fold_in" not in load_artifact(tmp_path / "a").meta
