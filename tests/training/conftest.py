"""Fixtures of the training tests: an artifact whose inference is `exact`, so it stores a known field, and a
dataset directory with its own test split."""

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


@pytest.fixture(scope="session")
def split_csv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """train.csv and test.csv of a seeded 70 x 50 matrix, half observed (`csv` data with a test split)."""
    import numpy as np

    from training.synthetic import low_rank_ratings, write_csv

    root = tmp_path_factory.mktemp("split-csv")
    triples = low_rank_ratings(n_users=70, n_items=50, density=0.5, seed=5)
    test = np.random.default_rng(1).random(len(triples)) < 0.2
    write_csv(root / "train.csv", [t for t, held in zip(triples, test, strict=True) if not held])
    write_csv(root / "test.csv", [t for t, held in zip(triples, test, strict=True) if held])
    return root
