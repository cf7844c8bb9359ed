"""benchmarks/reproduce.py: the `exact/<scaling>` rows score the paper's CRF, not the artifact's setting."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest

import training.pipeline
from training.config import preset

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "reproduce.py"
_spec = importlib.util.spec_from_file_location("reproduce", SCRIPT)
reproduce = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reproduce)


def test_exact_rows_drop_the_artifacts_extra_terms_and_baseline(
    tmp_path: Path, synthetic_csv: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An artifact whose own inference carries every extra of the `exact` mode.
    own = replace(
        preset("csv", "tiny").inference,
        mode="exact",
        known="clamped",
        same_user=5.0,
        same_item=2.0,
        co_rating=50.0,
        co_rating_user=20.0,
        baseline=0.5,
    )
    tiny = replace(preset("csv", "tiny"), inference=own)
    monkeypatch.setattr(training.pipeline, "preset", lambda dataset, name="default": tiny)
    out = tmp_path / "run"
    train = training.pipeline.run_training("csv", synthetic_csv, out, split="random", progress=False)
    modes = ("default", "exact/normalized")
    default, paper = reproduce.evaluate_run("csv", "tiny", 0, str(synthetic_csv), out, modes, train, 1.0)
    assert default["settings"]["baseline"] == 0.5 and default["settings"]["co_rating"] == 50.0
    kernel = ("same_user", "same_item", "co_rating", "co_rating_user", "baseline")
    assert {k: paper["settings"][k] for k in kernel} == dict.fromkeys(kernel, 0.0)
    assert (paper["settings"]["known"], paper["settings"]["scaling"]) == ("predicted", "normalized")
    assert paper["rmse"] != default["rmse"]
