"""model/exact/explain.py: each reported effect is the prediction minus the prediction recomputed from
scratch without that known rating (network, tables and every other term held), and the list is the true
top k."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from model.artifact import load_artifact
from model.config import InferenceConfig
from model.engine import expected_rating
from model.exact import ExactScorer, known_field
from model.exact.explain import CannotExplain
from model.ratings import Ratings
from model.scorers import build_scorer, load_network

SETTINGS = {
    "mode": "exact",
    "crf.gamma": 2.0,
    "kernel.known": "clamped",
    "kernel.same_user": 20.0,
    "kernel.same_item": 5.0,
    "kernel.co_rating": 50.0,
    "kernel.co_rating_user": 50.0,
    "kernel.co_rating_prior": 0.1,
    "output.baseline": 0.3,
}


def _scorer(artifact: Path, **changes: object) -> ExactScorer:
    art = load_artifact(artifact)
    inference = InferenceConfig().with_overrides({**SETTINGS, **changes})
    scorer = build_scorer(load_network(art), art.known(), inference)
    assert isinstance(scorer, ExactScorer)
    return scorer


def _without(scorer: ExactScorer, position: int) -> ExactScorer:
    """The scorer with one known rating gone, its field computed from scratch over the others; the
    network, the co-rating tables and the bias baseline held."""
    known, levels = scorer.known, scorer.network.levels
    keep = np.ones(len(known), dtype=bool)
    keep[position] = False
    fewer = Ratings(known.rows[keep], known.cols[keep], known.values[keep], known.n_users, known.n_items)
    lines = None if scorer.lines is None else dataclasses.replace(scorer.lines, known=fewer)
    field = known_field(
        scorer.user_lifted, scorer.item_lifted, fewer.rows, fewer.cols, None, fewer.labels(levels),
        scorer.compat, scorer.crf.gamma, scorer.crf.layers, scorer.kernel.scaling, scorer.field.scale,
        "clamped", lines,
    )  # fmt: skip
    out = copy.copy(scorer)
    out.known, out.lines, out.field = fewer, lines, field
    return out


def _rating(scorer: ExactScorer, user: int, item: int) -> float:
    levels = scorer.network.levels
    dist = scorer.predict(np.array([user]), np.array([item]))
    return float(np.clip(expected_rating(dist, levels), levels[0], levels[-1])[0])


@pytest.mark.parametrize("scaling", ["normalized", "sum"])
def test_each_effect_is_the_prediction_without_that_rating(tiny_artifact: Path, scaling: str) -> None:
    scorer = _scorer(
        tiny_artifact, **{"kernel.scaling": scaling, "crf.gamma": 2.0 if scaling != "sum" else 0.01}
    )
    rng = np.random.default_rng(0)
    users = rng.choice(scorer.known.n_users, 4, replace=False)
    for user in users.tolist():
        items = rng.choice(scorer.known.n_items, 3, replace=False)
        for item, e in zip(items.tolist(), scorer.explain(user, items, 5), strict=True):
            assert e.rating == pytest.approx(_rating(scorer, user, item), abs=1e-12)
            assert len(e.known) == 5 and np.all(np.diff(np.abs(e.effects)) <= 0)  # largest first
            for position, effect in zip(e.known[:2].tolist(), e.effects[:2].tolist(), strict=True):
                recomputed = e.rating - _rating(_without(scorer, position), user, item)
                assert effect == pytest.approx(recomputed, abs=1e-9)
                assert abs(effect) > 1e-12  # a rating that moved it


def test_the_list_is_the_true_top_k_and_never_the_entry_itself(tiny_artifact: Path) -> None:
    scorer = _scorer(tiny_artifact)
    known = scorer.known
    position = int(known.by_row.of(3)[0])
    user, item = int(known.rows[position]), int(known.cols[position])  # a known entry, queried
    (e,) = scorer.explain(user, np.array([item]), 4)
    assert position not in e.known.tolist()
    # every other known rating taken out from scratch: the four largest |effects| are the ones reported
    others = [p for p in range(len(known)) if p != position]
    effects = np.array([e.rating - _rating(_without(scorer, p), user, item) for p in others])
    best = np.argsort(-np.abs(effects), kind="stable")[:4]
    assert e.known.tolist() == [others[b] for b in best]
    np.testing.assert_allclose(e.effects, effects[best], rtol=0, atol=1e-9)


def test_the_bound_sends_a_query_to_all_ratings_when_the_line_terms_are_off(tiny_artifact: Path) -> None:
    # Without line terms every known rating reaches the query through the field alone, with comparable
    # weights: the row and column cannot be trusted to hold the top k, and the answer must still be exact.
    scorer = _scorer(
        tiny_artifact,
        **{
            "kernel.same_user": 0.0,
            "kernel.same_item": 0.0,
            "kernel.co_rating": 0.0,
            "kernel.co_rating_user": 0.0,
        },
    )
    known = scorer.known
    user, item = 7, next(j for j in range(known.n_items) if j not in known.cols[known.by_row.of(7)])
    (e,) = scorer.explain(user, np.array([item]), 3)
    effects = np.array([e.rating - _rating(_without(scorer, p), user, item) for p in range(len(known))])
    best = np.argsort(-np.abs(effects), kind="stable")[:3]
    assert e.known.tolist() == best.tolist()
    assert any(int(known.rows[p]) != user and int(known.cols[p]) != item for p in e.known.tolist())


def test_modes_without_one_term_per_rating_cannot_explain(tiny_artifact: Path) -> None:
    art = load_artifact(tiny_artifact)
    network = load_network(art)
    for mode in ("paper", "none"):
        scorer = build_scorer(network, art.known(), InferenceConfig().with_overrides({"mode": mode}))
        with pytest.raises(CannotExplain, match=f"mode '{mode}' cannot explain"):
            scorer.explain(0, np.array([1]), 3)
    predicted = _scorer(tiny_artifact, **{"kernel.known": "predicted"})
    with pytest.raises(CannotExplain, match="clamped"):
        predicted.explain(0, np.array([1]), 3)


@pytest.mark.parametrize("scaling", ["normalized", "sum"])
def test_the_bound_holds_for_every_rating_off_the_row_and_column(tiny_artifact: Path, scaling: str) -> None:
    # `Queries.bound` decides which ratings are never scored: it must bound each one's exact effect.
    from model.exact.explain import MeanQueries, Queries

    gamma = 2.0 if scaling != "sum" else 0.01
    scorer = _scorer(tiny_artifact, **{"kernel.scaling": scaling, "crf.gamma": gamma})
    other = _scorer(
        tiny_artifact, **{"kernel.scaling": scaling, "crf.gamma": gamma / 2, "kernel.co_rating": 5.0}
    )
    other.network, other.known = scorer.network, scorer.known
    known = scorer.known
    rng = np.random.default_rng(4)
    tight = 0
    for user in rng.choice(known.n_users, 5, replace=False).tolist():
        items = rng.choice(known.n_items, 4, replace=False)
        single = Queries(scorer, user, items)
        mean = MeanQueries([single, Queries(other, user, items)])
        for ranking in (single, mean):
            for q, item in enumerate(items.tolist()):
                off = np.flatnonzero((known.rows != user) & (known.cols != item))
                weight = ranking.user_sim[known.rows[off]] * ranking.item_sims[q, known.cols[off]]
                effects = np.abs(ranking.effects(np.full(len(off), q), off))
                bound = ranking.bound(q, weight)
                assert np.all(effects <= bound + 1e-15)
                tight += int(np.any(effects > 0.1 * bound))
    assert tight > 0  # the bound is not vacuous
