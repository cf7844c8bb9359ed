"""Seeded synthetic rating matrices: the built-in data of `dcmc demo` and of the tests."""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class Shape:
    """A matrix size and rating scale (lowest, highest, step) for `planted_ratings`."""

    n_users: int
    n_items: int
    n_ratings: int
    levels: tuple[float, float, float]


SHAPES = {
    "epinions": Shape(40_163, 139_738, 664_824, (1.0, 5.0, 1.0)),
    "ml-10m": Shape(69_878, 10_677, 10_000_054, (0.5, 5.0, 0.5)),
}
"""The sizes of the paper's largest matrix (Epinions) and of MovieLens-10M, and their rating scales."""


def planted_ratings(
    n_users: int,
    n_items: int,
    n_ratings: int,
    levels: tuple[float, float, float] = (1.0, 5.0, 1.0),
    seed: int = 0,
    rank: int = 8,
    groups: int = 20,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, cols, values) of `n_ratings` distinct entries of a seeded n_users x n_items matrix with a
    planted structure, so that accuracy on it means something:

    - power-law degrees: users' activity and items' popularity are Pareto draws (a few users and items hold
      many ratings, most hold few); every user and every item gets at least one rating;
    - the rating: a global mean, user and item biases, a rank-`rank` preference U_u . V_i, a neighbourhood
      effect (users and items fall in `groups` groups with a group-by-group affinity) and Gaussian noise,
      rounded to the scale's step and clipped to it.
    """
    low, high, step = levels
    if n_ratings < max(n_users, n_items) or n_ratings > n_users * n_items:
        raise ValueError(f"{n_ratings} ratings cannot cover {n_users} users and {n_items} items once each")
    rng = np.random.default_rng(seed)
    activity = rng.pareto(1.2, n_users) + 1.0
    popularity = rng.pareto(1.0, n_items) + 1.0
    p_user, p_item = activity / activity.sum(), popularity / popularity.sum()
    # Every user and item once, then draws by activity x popularity until n_ratings distinct entries.
    rows = np.concatenate([np.arange(n_users), rng.choice(n_users, n_items, p=p_user)])
    cols = np.concatenate([rng.choice(n_items, n_users, p=p_item), rng.permutation(n_items)])
    cover = np.unique(rows.astype(np.int64) * n_items + cols)
    # The entries drawn so far are bits of a packed n_users x n_items bitmap, so a round costs what it
    # draws, not a sort of everything drawn before (the heavy users and items saturate: late rounds add few).
    seen = np.zeros((n_users * n_items + 7) // 8, dtype=np.uint8)
    _mark(seen, cover)
    fresh: list[np.ndarray] = []
    n_extra = 0
    while n_extra < n_ratings - len(cover):
        need = int((n_ratings - len(cover) - n_extra) * 1.2) + 16
        draws = rng.choice(n_users, need, p=p_user).astype(np.int64) * n_items + rng.choice(
            n_items, need, p=p_item
        )
        draws = np.unique(draws)
        draws = draws[(seen[draws >> 3] >> (draws & 7).astype(np.uint8)) & 1 == 0]
        _mark(seen, draws)
        fresh.append(draws)
        n_extra += len(draws)
    extra = np.sort(np.concatenate(fresh)) if fresh else np.empty(0, dtype=np.int64)
    keys = np.concatenate([cover, rng.permutation(extra)[: n_ratings - len(cover)]])
    rows, cols = keys // n_items, keys % n_items
    u = rng.normal(0.0, 1.0 / np.sqrt(rank), (n_users, rank))
    v = rng.normal(0.0, 1.0 / np.sqrt(rank), (n_items, rank))
    user_group, item_group = rng.integers(groups, size=n_users), rng.integers(groups, size=n_items)
    affinity = rng.normal(0.0, 0.5, (groups, groups))
    span = high - low
    score = (
        low + 0.65 * span
        + span * 0.1 * rng.normal(size=n_users)[rows]
        + span * 0.1 * rng.normal(size=n_items)[cols]
        + span * 0.2 * np.einsum("kr,kr->k", u[rows], v[cols])
        + span * 0.1 * affinity[user_group[rows], item_group[cols]]
        + span * 0.12 * rng.normal(size=len(rows))
    )  # fmt: skip
    values = np.clip(np.round((score - low) / step) * step + low, low, high)
    order = rng.permutation(len(rows))
    return rows[order], cols[order], values[order]


def _mark(bits: np.ndarray, keys: np.ndarray) -> None:
    """Set the bits of `keys` in the packed bitmap `bits`."""
    np.bitwise_or.at(bits, keys >> 3, np.left_shift(1, keys & 7).astype(np.uint8))


def write_ratings_csv(path: Path, rows: np.ndarray, cols: np.ndarray, values: np.ndarray) -> Path:
    """`user,item,rating` CSV (users "u<row>", items "i<col>") written in chunks; returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write("user,item,rating\n")
        for k in range(0, len(rows), 1_000_000):
            r, c, v = rows[k : k + 1_000_000], cols[k : k + 1_000_000], values[k : k + 1_000_000]
            f.write(
                "".join(
                    f"u{a},i{b},{x:g}\n" for a, b, x in zip(r.tolist(), c.tolist(), v.tolist(), strict=True)
                )
            )
    return path
