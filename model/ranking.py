"""How a recommendation list is cut from predicted ratings beyond the top k: diversity by maximal marginal
relevance (`diversify`, which GET /recommend runs), and its default chosen on an artifact's validation
ratings (`choose_diversity`, which `dcmc train` runs after the inference search)."""

from __future__ import annotations

from typing import Any

import numpy as np

from model.engine import expected_rating, lift
from model.types import FloatArray, IntArray

POOL = 5
"""Diversity re-ranks the best POOL x k candidates (at least POOL_MIN) by maximal marginal relevance."""

POOL_MIN = 50

VALUES = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9)
"""The diversity values `choose_diversity` tries."""

KEEP = 0.95
"""The chosen diversity keeps at least this share of diversity 0's validation hit rate."""

LIKED = 4.0 / 5.0
"""A validation rating counts as liked at this share of the rating scale or above (4 of 1..5)."""


def diversify(
    pool: IntArray, relevance: FloatArray, lifted: FloatArray, k: int, diversity: float
) -> IntArray:
    """Maximal marginal relevance (Carbonell and Goldstein, 1998): k of `pool` (best first by
    `relevance`, in [0, 1] for ratings on the levels), each next the argmax of (1 - diversity) relevance
    - diversity max similarity to those already chosen, the similarity the paper's scaled cosine
    (1 + cos) / 2 of the item embeddings (`lifted` rows); ties by pool order."""
    k = min(k, len(pool))
    if diversity <= 0 or k <= 1:
        return pool[:k]
    rows = lifted[pool]
    similarity = rows @ rows.T  # (P, P)
    chosen = [0]
    closest = similarity[0].copy()
    taken = np.zeros(len(pool), dtype=bool)
    taken[0] = True
    for _ in range(1, k):
        value = (1 - diversity) * relevance - diversity * closest
        value[taken] = -np.inf
        nxt = int(np.argmax(value))
        chosen.append(nxt)
        taken[nxt] = True
        np.maximum(closest, similarity[nxt], out=closest)
    out: IntArray = pool[np.array(chosen)]
    return out


def unit_lifted(item_embeddings: np.ndarray) -> FloatArray:
    """The lifted unit item embeddings, whose products are the scaled cosines `diversify` reads."""
    emb = np.asarray(item_embeddings, dtype=np.float64)
    return lift(emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12))


def user_lists(
    artifact: Any,
    users: IntArray,
    include_held_out: bool,
    k: int = 10,
    values: tuple[float, ...] = VALUES,
) -> tuple[dict[float, list[IntArray]], list[FloatArray]]:
    """Each of `users`' top-k for each diversity value (`diversify` over the best max(POOL k, POOL_MIN)
    unrated items by predicted rating, as GET /recommend makes it), and their predicted ratings."""
    from model.scorers import artifact_scorer, predict_distributions

    network, scorer = artifact_scorer(artifact, include_held_out=include_held_out)
    known = artifact.known(include_held_out)
    n_items = len(artifact.items)
    lifted = unit_lifted(artifact.item_embeddings)
    lo, hi = float(artifact.levels[0]), float(artifact.levels[-1])
    cols = np.arange(n_items)
    out: dict[float, list[IntArray]] = {v: [] for v in values}
    predicted: list[FloatArray] = []
    for u in users.tolist():
        dist = predict_distributions(network, scorer, np.full(n_items, u), cols)
        ratings = np.clip(expected_rating(dist, artifact.levels), lo, hi)
        predicted.append(ratings)
        mask = np.ones(n_items, dtype=bool)
        mask[known.cols[known.by_row.of(u)]] = False
        cand = np.flatnonzero(mask)
        pool = cand[np.lexsort((cand, -ratings[cand]))][: max(POOL * k, POOL_MIN)]
        for v in values:
            out[v].append(diversify(pool, (ratings[pool] - lo) / max(hi - lo, 1e-12), lifted, k, v))
    return out, predicted


def liked_by(rows: IntArray, cols: IntArray, values: FloatArray, threshold: float) -> dict[int, set[int]]:
    """Each user's items rated at or above `threshold`."""
    out: dict[int, set[int]] = {}
    for u, j, r in zip(rows.tolist(), cols.tolist(), values.tolist(), strict=True):
        if r >= threshold:
            out.setdefault(u, set()).add(j)
    return out


def hit_rate(liked: dict[int, set[int]], users: IntArray, lists: list[IntArray]) -> float:
    """The share of `users` whose list holds an item they liked."""
    held = [
        bool(liked[u].intersection(items.tolist())) for u, items in zip(users.tolist(), lists, strict=True)
    ]
    return float(np.mean(held))


def choose_diversity(artifact: Any, k: int = 10, max_users: int = 1000, seed: int = 0) -> dict[str, Any]:
    """The default diversity of the artifact's lists, chosen on its held-out validation ratings (unknown
    to the CRF while the lists are made): the largest of VALUES whose hit rate (a list holds a liked
    validation item) is at least KEEP of diversity 0's, over up to `max_users` users with a liked one.
    {"skipped": why} without enough of them."""
    held = artifact.held_out
    lo, hi = float(artifact.levels[0]), float(artifact.levels[-1])
    liked = liked_by(held.rows, held.cols, held.values, lo + LIKED * (hi - lo))
    if len(liked) < 50:
        return {"skipped": f"{len(liked)} users with a liked validation rating (fewer than 50)"}
    users = np.array(sorted(liked), dtype=np.int64)
    if len(users) > max_users:
        users = np.sort(np.random.default_rng(seed).choice(users, max_users, replace=False))
    made, _ = user_lists(artifact, users, include_held_out=False, k=k)
    rates = {v: hit_rate(liked, users, lists) for v, lists in made.items()}
    base = rates[0.0]
    chosen = max(v for v, rate in rates.items() if rate >= KEEP * base)
    return {
        "diversity": chosen,
        "users": len(users),
        "k": k,
        "hit_rate": {str(v): round(rate, 4) for v, rate in rates.items()},
        "rule": f"the largest diversity keeping {KEEP:.0%} of diversity 0's validation hit rate",
    }
