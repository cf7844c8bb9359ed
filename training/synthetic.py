"""Seeded synthetic rating matrices: the built-in data of `dcmc demo` and of the tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def low_rank_ratings(
    n_users: int = 60, n_items: int = 50, rank: int = 3, density: float = 0.5, seed: int = 0
) -> list[tuple[str, str, float]]:
    """(user, item, rating) triples of a seeded rank-`rank` matrix quantised to the levels 1..5.

    Users are named "u0", "u1", ..., items "i0", "i1", ...; each entry is observed with `density`.
    """
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
    """Write triples as a `user,item,rating` CSV with a header; returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("user,item,rating\n" + "".join(f"{u},{i},{r:g}\n" for u, i, r in triples))
    return path
