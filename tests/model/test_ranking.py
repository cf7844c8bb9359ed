"""Diversity (model/ranking.py): maximal marginal relevance and its default chosen on validation ratings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from model.artifact import load_artifact
from model.ranking import KEEP, VALUES, choose_diversity, diversify, unit_lifted


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 12), st.floats(0, 1), st.integers(0, 2**32 - 1))
def test_mmr_picks_distinct_pool_items_and_zero_keeps_the_order(
    n: int, k: int, lam: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    pool = rng.permutation(100)[:n]
    relevance = np.sort(rng.random(n))[::-1]
    lifted = unit_lifted(rng.normal(size=(100, 4)))
    got = diversify(pool, relevance, lifted, k, lam)
    assert len(got) == min(k, n) and len(set(got.tolist())) == len(got) and set(got) <= set(pool)
    assert got[0] == pool[0]  # the most relevant first
    np.testing.assert_array_equal(diversify(pool, relevance, lifted, k, 0.0), pool[:k])


def test_full_diversity_takes_the_least_similar_next() -> None:
    lifted = unit_lifted(np.array([[1.0, 0.0], [0.99, 0.1], [-1.0, 0.0]]))
    pool = np.array([0, 1, 2])
    np.testing.assert_array_equal(diversify(pool, np.array([1.0, 0.9, 0.1]), lifted, 2, 0.0), [0, 1])
    np.testing.assert_array_equal(diversify(pool, np.array([1.0, 0.9, 0.1]), lifted, 2, 0.9), [0, 2])


def test_the_chosen_default_keeps_the_validation_hit_rate(tiny_artifact: Path) -> None:
    record = choose_diversity(load_artifact(tiny_artifact), k=5)
    if "skipped" in record:
        assert "fewer than 50" in record["skipped"]
        return
    rates = {float(v): r for v, r in record["hit_rate"].items()}
    assert set(rates) == set(VALUES)
    assert rates[record["diversity"]] >= KEEP * rates[0.0] - 1e-4
    assert all(rates[v] < KEEP * rates[0.0] for v in VALUES if v > record["diversity"])
