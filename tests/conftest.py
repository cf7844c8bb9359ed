"""Shared fixtures: seeded synthetic rating matrices and a tiny trained artifact."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

try:  # tiny models train faster on one torch thread than on two that share the cores
    import torch

    torch.set_num_threads(1)
except ImportError:
    pass

from training.synthetic import low_rank_ratings, write_csv

REPO = Path(__file__).resolve().parents[1]
DATASETS = Path(os.environ.get("DCMC_DATASETS", REPO.parent / "shared" / "datasets"))


@pytest.fixture(scope="session")
def synthetic_csv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 60 x 50 low-rank rating matrix, half observed, as a CSV file."""
    return write_csv(tmp_path_factory.mktemp("data") / "ratings.csv", low_rank_ratings())


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory: pytest.TempPathFactory, synthetic_csv: Path) -> Path:
    """An artifact trained with the `tiny` preset on the synthetic matrix (a few seconds)."""
    from training.pipeline import run_training

    out = tmp_path_factory.mktemp("artifacts") / "tiny"
    run_training("csv", synthetic_csv, out, split="random", preset_name="tiny", progress=False)
    return out
