"""Fixtures of the training tests: an artifact whose inference is `exact`, so it stores a known field."""

from __future__ import annotations

from pathlib import Path

import pytest

EXACT_SETTINGS = {"inference.mode": "exact", "inference.crf.gamma": "0.5"}
"""The `tiny` preset infers with `paper`; these make the artifact's inference `exact` (strings, as from
the command line)."""


@pytest.fixture(scope="session")
def exact_artifact(tmp_path_factory: pytest.TempPathFactory, synthetic_csv: Path) -> Path:
    """The `tiny` artifact of the synthetic matrix trained with `exact` inference settings."""
    from training.pipeline import run_training

    out = tmp_path_factory.mktemp("artifacts") / "tiny-exact"
    run_training(
        "csv",
        synthetic_csv,
        out,
        split="random",
        preset_name="tiny",
        settings=EXACT_SETTINGS,
        progress=False,
    )
    return out
