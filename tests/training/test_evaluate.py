"""Evaluation on held-out entries: the validation entries are the ones the trainer held out."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from model.calibration import ECE_BINS
from model.calibration import scores as calibration
from model.config import ConfigError
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
    result = evaluate(out, data, overrides={"mode": "none"}, part="val")
    assert result["on"] == "val" and result["inference"] == "none"
    assert result["settings"] == {"mode": "none"}  # `none` reads no other setting
    assert result["n"] == metrics["n_val"] > 0
    # The trainer scored the same entries with the torch network after its last epoch.
    assert result["rmse"] == pytest.approx(metrics["val_rmse"], abs=1e-4)
    test = evaluate(out, data, overrides={"mode": "none"})
    assert test["on"] == "test" and test["n"] != result["n"]
    assert np.isfinite(test["log_loss"]) and test["log_loss"] > 0 and 0 <= test["ece"] <= 1


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
        evaluate(out, data, overrides={"mode": "none"}, part="val")
    assert json.loads((out / "metrics.json").read_text())["n_val"] == 0


def test_evaluate_applies_dotted_overrides_and_reports_the_settings_read(
    tiny_artifact: Path, synthetic_csv: Path
) -> None:
    base = evaluate(tiny_artifact, synthetic_csv)
    assert base["inference"] == "paper"
    assert set(base["settings"]) == {"mode", "crf", "paper"}  # the groups `paper` reads
    assert base["settings"]["paper"]["repeats"] == 3  # the tiny preset's
    changed = evaluate(tiny_artifact, synthetic_csv, overrides={"crf.gamma": "2", "paper.repeats": "2"})
    assert changed["settings"]["crf"]["gamma"] == 2.0 and changed["settings"]["paper"]["repeats"] == 2
    assert changed["rmse"] != base["rmse"]
    exact = evaluate(tiny_artifact, synthetic_csv, overrides={"mode": "exact", "kernel.known": "clamped"})
    assert exact["inference"] == "exact"
    assert set(exact["settings"]) == {"mode", "crf", "kernel", "output"}
    assert exact["settings"]["kernel"]["known"] == "clamped"
    with pytest.raises(ConfigError, match=r"unknown inference setting 'crf\.gama'"):
        evaluate(tiny_artifact, synthetic_csv, overrides={"crf.gama": 1})
    with pytest.raises(ConfigError, match=r"does not read kernel\.co_rating"):
        evaluate(tiny_artifact, synthetic_csv, overrides={"kernel.co_rating": 1})


def test_an_ensemble_averages_its_members_on_one_carve(synthetic_csv: Path, tmp_path: Path) -> None:
    # Two seeds that share one validation carve (`carve_seed`): each is scored on it, and the
    # ensemble's prediction is the mean of theirs, so its errors follow from the members' predictions.
    data = _train_test_dir(synthetic_csv, tmp_path / "data")
    outs = [tmp_path / f"seed{s}" for s in (1, 2)]
    for seed, out in zip((1, 2), outs, strict=True):
        run_training("csv", data, out, preset_name="tiny", epochs=3, seed=seed, progress=False,
                     settings={"carve_seed": "7"})  # fmt: skip
    singles = [evaluate(out, data, overrides={"mode": "none"}, part="val") for out in outs]
    both = evaluate(outs, data, overrides={"mode": "none"}, part="val")
    assert both["n"] == singles[0]["n"] == singles[1]["n"] > 0
    assert [m["rmse"] for m in both["members"]] == [s["rmse"] for s in singles]
    assert singles[0]["rmse"] != singles[1]["rmse"]  # two networks, not one twice
    # Averaging cannot be worse than the worse member (RMSE is convex), and with two different
    # networks it is below their mean unless their errors are identical.
    assert both["rmse"] <= max(s["rmse"] for s in singles)
    assert both["rmse"] < (singles[0]["rmse"] + singles[1]["rmse"]) / 2
    assert both["model_version"] == [s["model_version"] for s in singles]
    test = evaluate(outs, data, overrides={"mode": "none"})
    assert test["on"] == "test" and len(test["members"]) == 2


def test_an_ensemble_refuses_members_that_held_different_ratings_out(
    synthetic_csv: Path, tmp_path: Path
) -> None:
    data = _train_test_dir(synthetic_csv, tmp_path / "data")
    outs = [tmp_path / f"seed{s}" for s in (1, 2)]
    for seed, out in zip((1, 2), outs, strict=True):  # each carves its own validation ratings
        run_training("csv", data, out, preset_name="tiny", epochs=1, seed=seed, progress=False)
    with pytest.raises(DataError, match="carve_seed"):
        evaluate(outs, data, overrides={"mode": "none"}, part="val")
    # On the test split the members agree on the entries: scored together.
    assert len(evaluate(outs, data, overrides={"mode": "none"})["members"]) == 2
    other = tmp_path / "other"
    run_training("csv", synthetic_csv, other, split="random", preset_name="tiny", epochs=1, progress=False)
    with pytest.raises(DataError, match="one dataset and split"):
        evaluate([outs[0], other], data)


def test_calibration_is_the_log_loss_and_the_top_levels_calibration_error() -> None:
    levels = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    truth = np.array([1.0, 2.0, 5.0, 4.0])
    sure = np.eye(5)[[0, 1, 4, 3]]  # certain and right
    assert calibration(sure, truth, levels) == pytest.approx({"log_loss": 0.0, "ece": 0.0}, abs=1e-9)
    uniform = np.full((4, 5), 0.2)  # the top level is the first: right once in four, at 20%
    got = calibration(uniform, truth, levels)
    assert got["log_loss"] == pytest.approx(np.log(5)) and got["ece"] == pytest.approx(0.05)
    rng = np.random.default_rng(0)  # against the definition written out
    probs = rng.dirichlet(np.ones(5), size=500)
    truth = levels[rng.integers(0, 5, size=500)] + rng.normal(0, 0.1, size=500)  # off-level: the nearest
    nearest = np.rint(truth).clip(1, 5).astype(int) - 1
    conf, top = probs.max(axis=1), probs.argmax(axis=1)
    ece = 0.0
    for b in range(ECE_BINS):
        lo, hi = b / ECE_BINS, (b + 1) / ECE_BINS
        inside = (conf >= lo) & ((conf < hi) if b < ECE_BINS - 1 else (conf <= hi))
        if inside.any():
            ece += inside.sum() / 500 * abs((top[inside] == nearest[inside]).mean() - conf[inside].mean())
    got = calibration(probs, truth, levels)
    assert got["ece"] == pytest.approx(ece)
    assert got["log_loss"] == pytest.approx(-np.mean(np.log(probs[np.arange(500), nearest])))
