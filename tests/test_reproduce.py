"""benchmarks/reproduce.py: the `exact/<scaling>` rows score the paper's CRF, not the artifact's setting."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

import training.pipeline
from training.config import preset

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "reproduce.py"
sys.path.insert(0, str(SCRIPT.parent))  # the scripts import their sibling harness.py by name
_spec = importlib.util.spec_from_file_location("reproduce", SCRIPT)
reproduce = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reproduce)


def test_exact_rows_drop_the_artifacts_extra_terms_and_baseline(
    tmp_path: Path, synthetic_csv: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An artifact whose own inference carries every extra of the `exact` mode.
    own = preset("csv", "tiny").inference.with_overrides(
        {
            "mode": "exact",
            "crf.gamma": 2.0,
            "kernel.known": "clamped",
            "kernel.same_user": 5.0,
            "kernel.same_item": 2.0,
            "kernel.co_rating": 50.0,
            "kernel.co_rating_user": 20.0,
            "output.baseline": 0.5,
        }
    )
    tiny = dataclasses.replace(preset("csv", "tiny"), inference=own)
    monkeypatch.setattr(training.pipeline, "preset", lambda dataset, name="default": tiny)
    out = tmp_path / "run"
    train = training.pipeline.run_training("csv", synthetic_csv, out, split="random", progress=False)
    modes = ("default", "exact/normalized")
    default, paper = reproduce.evaluate_run("csv", "tiny", 0, str(synthetic_csv), out, modes, train, 1.0)
    assert default["settings"]["output"]["baseline"] == 0.5
    assert default["settings"]["kernel"]["co_rating"] == 50.0
    kernel = ("same_user", "same_item", "co_rating", "co_rating_user")
    assert {k: paper["settings"]["kernel"][k] for k in kernel} == dict.fromkeys(kernel, 0.0)
    assert paper["settings"]["output"]["baseline"] == 0.0
    assert (paper["settings"]["kernel"]["known"], paper["settings"]["kernel"]["scaling"]) == (
        "predicted",
        "normalized",
    )
    assert paper["settings"]["crf"]["gamma"] is None  # the model's
    assert paper["rmse"] != default["rmse"]


def test_paper_row_runs_the_models_gamma_and_tau_with_the_runs_seed() -> None:
    flags = reproduce.evaluate_flags("paper", "exact", 3)
    pairs = [flags[i + 1] for i in range(0, len(flags), 2)]
    assert pairs == [
        "inference.mode=paper",
        "inference.crf.gamma=none",
        "inference.crf.tau=none",
        "inference.paper.seed=3",
    ]
    assert reproduce.evaluate_flags("default", "exact", 3) == []
    assert reproduce.evaluate_flags("default", "paper", 3) == ["--set", "inference.paper.seed=3"]
