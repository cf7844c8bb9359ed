"""model/scorers.py `MeanScorer`: the mean of several settings' final distributions (`TrainConfig.searches`),
answered, cached by rows, updated online and explained exactly like one setting."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from model.artifact import AVERAGED, load_artifact, rewritten
from model.config import InferenceConfig
from model.engine import expected_rating
from model.exact import ExactScorer
from model.exact.explain import CannotExplain
from model.ratings import Ratings
from model.scorers import MeanScorer, artifact_scorer, build_scorer, load_network
from tests.model.test_explain import SETTINGS, _rating, _without

A = InferenceConfig().with_overrides(SETTINGS)  # line terms on, the bias baseline mixed in
B = InferenceConfig().with_overrides(
    {**SETTINGS, "crf.gamma": 0.7, "kernel.same_user": 0.0, "kernel.co_rating": 0.0, "output.baseline": 0.0}
)


def _mean(artifact: Path) -> MeanScorer:
    _, scorer = artifact_scorer(load_artifact(artifact), [A, B])
    assert isinstance(scorer, MeanScorer)
    return scorer


def test_the_mean_scorer_answers_the_mean_of_its_settings_final_distributions(tiny_artifact: Path) -> None:
    art = load_artifact(tiny_artifact)
    network, known = load_network(art), art.known()
    mean = _mean(tiny_artifact)
    rng = np.random.default_rng(0)
    rows, cols = rng.integers(0, known.n_users, 40), rng.integers(0, known.n_items, 40)
    a, b = (build_scorer(network, known, s).predict(rows, cols) for s in (A, B))
    assert np.abs(a - b).max() > 1e-3  # two settings that answer differently
    np.testing.assert_allclose(mean.predict(rows, cols), (a + b) / 2, rtol=0, atol=1e-12)
    dist, baseline = mean.unmixed(rows, cols)
    assert baseline is None and mean.baseline_weight == 0.0  # each member mixed its own in
    np.testing.assert_allclose(dist, (a + b) / 2, rtol=0, atol=1e-12)
    # A user's answers from the members' row parts: the same numbers as asking for them (few items: the
    # general path, in float64; a whole row reads the catalogue in float32).
    user, items = 5, np.array([0, 2, 5, 7, 11])
    parts = mean.row_parts(user)
    assert parts is not None and parts.nbytes == sum(p.nbytes for p in parts.members) > 0
    from_parts, none = mean.from_parts(parts, items)
    assert none is None
    np.testing.assert_allclose(from_parts, mean.predict(np.full(len(items), user), items), rtol=0, atol=1e-10)
    every = np.arange(known.n_items)
    row = mean.predict(np.full(len(every), user), every)
    np.testing.assert_allclose(mean.from_parts(parts, every)[0], row, rtol=0, atol=1e-6)


def test_an_online_rating_updates_every_member(tiny_artifact: Path) -> None:
    art = load_artifact(tiny_artifact)
    network, known = load_network(art), art.known()
    user = 2
    item = next(j for j in range(known.n_items) if j not in known.cols[known.by_row.of(user)].tolist())
    more = Ratings(np.append(known.rows, user), np.append(known.cols, item), np.append(known.values, 5.0),
                   known.n_users, known.n_items)  # fmt: skip
    before = _mean(tiny_artifact)
    updated = before.updated(network, more, np.array([user]))
    assert isinstance(updated, MeanScorer)
    # each setting's scorer updated as it is alone (model/exact: the field by the new rating's terms, the
    # user's bias refitted), and the two averaged
    alone = [build_scorer(network, known, s).updated(network, more, np.array([user])) for s in (A, B)]
    queries = np.arange(0, known.n_items, 3)
    rows = np.full(len(queries), user)
    want = (alone[0].predict(rows, queries) + alone[1].predict(rows, queries)) / 2
    np.testing.assert_allclose(updated.predict(rows, queries), want, rtol=0, atol=1e-12)
    assert np.abs(updated.predict(rows, queries) - before.predict(rows, queries)).max() > 1e-4
    assert all(name.startswith(("m0.", "m1.")) for name in updated.online_tables())


def test_an_averaged_explanation_is_the_true_top_k_of_the_mean_effects(tiny_artifact: Path) -> None:
    mean = _mean(tiny_artifact)
    members = [m for m in mean.members if isinstance(m, ExactScorer)]
    known, levels = members[0].known, members[0].network.levels
    user, item = 7, next(j for j in range(known.n_items) if j not in known.cols[known.by_row.of(7)])
    (e,) = mean.explain(user, np.array([item]), 4)
    dist = mean.predict(np.array([user]), np.array([item]))
    assert e.rating == pytest.approx(float(expected_rating(dist, levels)[0]), abs=1e-12)
    # every known rating taken out from scratch in each member: the mean effect's top 4 is the list
    effects = np.array(
        [np.mean([_rating(m, user, item) - _rating(_without(m, p), user, item) for m in members])
         for p in range(len(known))]
    )  # fmt: skip
    best = np.argsort(-np.abs(effects), kind="stable")[:4]
    assert e.known.tolist() == best.tolist()
    np.testing.assert_allclose(e.effects, effects[best], rtol=0, atol=1e-9)


def test_an_artifact_serves_its_averaged_settings_until_one_search_replaces_them(
    tiny_artifact: Path, tmp_path: Path
) -> None:
    import shutil

    from training.tune import Tuning, write_tuning

    copy = tmp_path / "averaged"
    shutil.copytree(tiny_artifact, copy)
    with rewritten(copy) as (_, config):
        config["inference"], config[AVERAGED] = A.to_dict(), [B.to_dict()]
    art = load_artifact(copy)
    assert art.settings() == (A, B) and AVERAGED not in art.meta
    assert art.settings({"crf.gamma": 0.5}) == (
        A.with_overrides({"crf.gamma": 0.5}),
        B.with_overrides({"crf.gamma": 0.5}),
    )
    assert isinstance(artifact_scorer(art)[1], MeanScorer)
    assert not isinstance(artifact_scorer(art, art.inference)[1], MeanScorer)
    write_tuning(copy, Tuning(B, {"trials_run": 1}))  # what `dcmc tune` writes: one search's choice
    again = load_artifact(copy)
    assert again.averaged == () and again.settings() == (B,)


def test_a_search_that_chose_the_network_alone_is_averaged_without_touching_the_queries(
    tiny_artifact: Path,
) -> None:
    # A search that finds no CRF setting better than the network chooses `mode=none`; its scorer hands the
    # queries' own distributions back, which the mean must not write over.
    art = load_artifact(tiny_artifact)
    network, known = load_network(art), art.known()
    none = InferenceConfig().with_overrides({"mode": "none"})
    _, mean = artifact_scorer(art, [none, A])
    rows, cols = np.arange(8), np.arange(8) * 2
    probs = network.probabilities(rows, cols)
    kept = probs.copy()
    got = mean.predict(rows, cols, probs)
    np.testing.assert_array_equal(probs, kept)
    want = (build_scorer(network, known, A).predict(rows, cols, kept.copy()) + kept) / 2
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    with pytest.raises(CannotExplain):
        mean.explain(0, np.array([1]), 3)
