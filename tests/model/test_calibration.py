"""Calibration of the rating-level distributions (model/calibration.py): tempering, the temperature a
validation set chooses, and what the service serves with it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from model.artifact import load_artifact, rewritten
from model.calibration import TEMPERATURES, best_temperature, choose_temperature, tempered

LEVELS = np.array([1.0, 2.0, 3.0, 4.0, 5.0])


def test_tempering_flattens_or_sharpens_and_keeps_the_order() -> None:
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(5), size=100)
    assert tempered(probs, 1.0) is probs
    for t in (0.5, 2.0):
        out = tempered(probs, t)
        np.testing.assert_allclose(out.sum(axis=1), 1.0)
        assert (out.argmax(axis=1) == probs.argmax(axis=1)).all()
        spread = (out.max(axis=1) - probs.max(axis=1)).mean()
        assert spread < 0 if t > 1 else spread > 0  # flatter above 1, sharper below
    np.testing.assert_allclose(tempered(tempered(probs, 2.0), 0.5), probs, atol=1e-12)


@pytest.mark.parametrize("truth_t", [0.5, 2.0])
def test_the_chosen_temperature_undoes_a_known_miscalibration(truth_t: float) -> None:
    rng = np.random.default_rng(1)
    calibrated = rng.dirichlet(np.ones(5) * 0.7, size=20_000)
    truth = LEVELS[[rng.choice(5, p=p) for p in calibrated]]  # ratings drawn from the true distributions
    served = tempered(calibrated, 1 / truth_t)  # too sharp (2.0) or too flat (0.5) by that temperature
    found = best_temperature(served, truth, LEVELS)
    assert found["temperature"] == pytest.approx(truth_t, abs=0.15)
    assert found["log_loss"] < found["log_loss_at_1"]
    assert best_temperature(calibrated, truth, LEVELS)["temperature"] == pytest.approx(1.0, abs=0.1)
    assert set(TEMPERATURES) >= {0.5, 1.0, 2.0, 3.0}


def test_an_artifacts_temperature_is_chosen_on_its_validation_ratings_and_served(
    tiny_artifact: Path, tmp_path: Path, synthetic_csv: Path
) -> None:
    from fastapi.testclient import TestClient

    from service.main import create_app
    from service.settings import Settings

    record = choose_temperature(load_artifact(tiny_artifact))
    assert record["ratings"] > 0 and ("temperature" in record) != ("skipped" in record)
    if "temperature" in record:
        assert record["val_log_loss"] < record["val_log_loss_at_1"]
    assert load_artifact(tiny_artifact).meta.get("calibration") == (
        record if "temperature" in record else None
    )
    plain = Path(shutil.copytree(tiny_artifact, tmp_path / "plain"))
    with rewritten(plain) as (_, config):
        config.pop("calibration", None)
    copy = Path(shutil.copytree(plain, tmp_path / "calibrated"))
    with rewritten(copy) as (_, config):
        config["calibration"] = {"temperature": 2.0}
    body = {"user": "u1", "items": ["i1", "i2", "i3"], "distribution": True}
    answers = []
    for directory in (plain, copy):
        with TestClient(create_app(Settings(artifacts=directory, log_level="warning"))) as client:
            r = client.post("/predict", json=body)
            assert r.status_code == 200, r.text
            answers.append(r.json()["predictions"])
    raw = np.array([p["distribution"] for p in answers[0]])
    np.testing.assert_allclose([p["distribution"] for p in answers[1]], tempered(raw, 2.0), atol=1e-9)
    assert [p["rating"] for p in answers[1]] == [p["rating"] for p in answers[0]]  # RMSE unchanged
    assert json.loads((copy / "config.json").read_text())["calibration"] == {"temperature": 2.0}
    from training.evaluate import evaluate  # the offline figures of what the service serves

    plain_result, served = evaluate(plain, synthetic_csv), evaluate(copy, synthetic_csv)
    assert served["rmse"] == plain_result["rmse"] and served["temperature"] == 2.0
    assert served["uncalibrated"] == {"log_loss": plain_result["log_loss"], "ece": plain_result["ece"]}
    assert served["log_loss"] != plain_result["log_loss"]
