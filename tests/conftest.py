"""Shared fixtures: seeded synthetic rating matrices and a tiny trained artifact."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
DATASETS = Path(os.environ.get("DCMC_DATASETS", REPO.parent / "shared" / "datasets"))


def low_rank_ratings(
    n_users: int = 60, n_items: int = 50, rank: int = 3, density: float = 0.5, seed: int = 0
) -> list[tuple[str, str, float]]:
    """(user, item, rating) triples of a seeded rank-`rank` matrix quantised to the levels 1..5."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(n_users, rank))
    b = rng.normal(size=(n_items, rank))
    scores = a @ b.T
    scores = (scores - scores.mean()) / scores.std()
    ratings = np.clip(np.round(3.0 + 1.2 * scores), 1, 5)
    mask = rng.random((n_users, n_items)) < density
    rows, cols = np.nonzero(mask)
    return [(f"u{i}", f"i{j}", float(ratings[i, j])) for i, j in zip(rows, cols, strict=True)]


def write_csv(path: Path, triples: list[tuple[str, str, float]]) -> Path:
    """Write triples as a `user,item,rating` CSV with a header."""
    path.write_text("user,item,rating\n" + "".join(f"{u},{i},{r:g}\n" for u, i, r in triples))
    return path


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
