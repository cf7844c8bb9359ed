"""Evaluation on held-out entries: the validation entries are the ones the trainer held out."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from training.data import DataError
from training.evaluate import evaluate
from training.pipeline import run_training


def _train_test_dir(csv: Path, out: Path) -> Path:
    """The synthetic CSV split into train.csv / test.csv (no validation file)."""
    lines = csv.read_text().splitlines()
    header, body = lines[0], lines[1:]
    order = np.random.default_rng(0).permutation(len(body))
    cut = int(0.8 * len(body))
    out.mkdir()
    (out / "train.csv").write_text("\n".join([header, *(body[i] for i in order[:cut])]) + "\n")
    (out / "test.csv").write_text("\n".join([header, *(body[i] for i in order[cut:])]) + "\n")
    return out


@pytest.mark.parametrize("layout", ["random", "carved"])
def test_val_evaluation_matches_the_trainers_validation(
    synthetic_csv: Path, tmp_path: Path, layout: str
) -> None:
    # `random`: the split has its own validation part; `carved`: the trainer carved one from train.
    data = synthetic_csv if layout == "random" else _train_test_dir(synthetic_csv, tmp_path / "data")
    split = "random" if layout == "random" else "u1"
    out = tmp_path / "art"
    metrics = run_training(
        "csv", data, out, split=split, preset_name="tiny", epochs=4, seed=3, progress=False
    )
    result = evaluate(out, data, mode="none", part="val")
    assert result["on"] == "val"
    assert result["n"] == metrics["n_val"] > 0
    # The trainer scored the same entries with the torch network after its last epoch.
    assert result["rmse"] == pytest.approx(metrics["val_rmse"], abs=1e-4)
    test = evaluate(out, data, mode="none")
    assert test["on"] == "test" and test["n"] != result["n"]


def test_val_evaluation_without_validation_is_a_clear_error(synthetic_csv: Path, tmp_path: Path) -> None:
    data = _train_test_dir(synthetic_csv, tmp_path / "data")
    out = tmp_path / "art"
    run_training(
        "csv",
        data,
        out,
        split="u1",
        preset_name="tiny",
        epochs=2,
        settings={"val_fraction": "0"},
        progress=False,
    )
    with pytest.raises(DataError, match="without a validation split"):
        evaluate(out, data, mode="none", part="val")
    assert json.loads((out / "metrics.json").read_text())["n_val"] == 0
