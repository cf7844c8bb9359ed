"""The fused one-user answer (`Scorer.answer`, model/exact/direct.py) against the reference `unmixed`: the
same distributions and baselines to 1e-9 for random users, items, kernel settings and online states, with
dense, patched dense and sparse co-rating tables, averaged settings, and without numba."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model.artifact import Artifact, load_artifact
from model.engine import OnnxNetwork
from model.exact import ExactScorer, direct
from model.exact.affinity import DenseAffinity, SparseAffinity
from model.online import FoldIn, OnlineState
from model.scorers import MeanScorer, build_scorer

TOLERANCE = 1e-9
SCALINGS = ("normalized", "sum", "scaled")


@pytest.fixture(scope="module")
def artifact(tiny_artifact: Path) -> Artifact:
    return load_artifact(tiny_artifact)


def _overrides(scaling: str, terms: tuple[float, float, float, float], baseline: float) -> dict[str, object]:
    same_user, same_item, co_rating, co_rating_user = terms
    return {
        "mode": "exact",
        "kernel.known": "clamped",
        "kernel.scaling": scaling,
        "crf.gamma": 1.0,
        "kernel.same_user": same_user,
        "kernel.same_item": same_item,
        "kernel.co_rating": co_rating,
        "kernel.co_rating_user": co_rating_user,
        "kernel.co_rating_prior": 0.5,
        "output.baseline": baseline,
    }


def _online(artifact: Artifact, overrides: dict[str, object]) -> list[OnlineState]:
    """The artifact's state, then one after a re-rating, new ratings of a known user and a new user's
    ratings, then one after a retraction: the tables grown and their user lines replaced."""
    onnx = OnnxNetwork(artifact.path)
    fold = FoldIn(artifact, artifact.inference.with_overrides(overrides), onnx.embed_users, onnx.embed_items)
    states = [fold.state]
    train, users, items = artifact.train, artifact.users.external, artifact.items.external
    u0, i0 = int(train.rows[0]), int(train.cols[0])
    fold.apply(
        [
            (users(u0), items(i0), 1.0 if train.values[0] != 1.0 else 5.0),
            (users(u0), items(5), 4.0),
            (users(2), items(9), 2.0),
            ("newcomer", items(3), 5.0),
            ("newcomer", items(7), 1.0),
        ]
    )
    states.append(fold.state)
    fold.apply([(users(2), items(9), None)])
    states.append(fold.state)
    return states


@pytest.fixture(scope="module")
def states(artifact: Artifact) -> dict[str, list[OnlineState]]:
    """Per scaling, the online states of a scorer with every term on and a bias baseline."""
    return {s: _online(artifact, _overrides(s, (2.0, 1.5, 3.0, 5.0), 0.3)) for s in SCALINGS}


def _check(scorer: ExactScorer | MeanScorer, user: int, cols: np.ndarray) -> None:
    answered = scorer.answer(user, cols)
    assert answered is not None
    got, got_base = answered
    # The reference in float64 throughout: the general path given the network's probabilities (one user's
    # catalogue-sized queries would otherwise take its float32 catalogue read, equal only to ~1e-7).
    rows = np.full(len(cols), user, dtype=np.int64)
    network = scorer.members[0].network if isinstance(scorer, MeanScorer) else scorer.network
    want, want_base = scorer.unmixed(rows, cols, network.probabilities(rows, cols))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    assert (got_base is None) == (want_base is None)
    if got_base is not None and want_base is not None:
        np.testing.assert_allclose(got_base, want_base, rtol=0, atol=TOLERANCE)


def _queries(data: st.DataObject, state: OnlineState) -> tuple[int, np.ndarray]:
    """A user of the state (trained, or arrived online) and 1 to 60 of its items, repeats allowed."""
    n_users, n_items = state.known.n_users, state.network.n_items
    user = data.draw(st.integers(0, n_users - 1), label="user")
    cols = data.draw(st.lists(st.integers(0, n_items - 1), min_size=1, max_size=60), label="items")
    return user, np.array(cols, dtype=np.int64)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_fused_answer_equals_the_reference(
    states: dict[str, list[OnlineState]], data: st.DataObject
) -> None:
    scaling = data.draw(st.sampled_from(SCALINGS), label="scaling")
    state = states[scaling][data.draw(st.integers(0, len(states[scaling]) - 1), label="state")]
    user, cols = _queries(data, state)
    _check(state.scorer, user, cols)


@pytest.mark.parametrize(
    "terms",
    [
        (0.0, 0.0, 0.0, 0.0),
        (2.0, 0.0, 0.0, 0.0),
        (0.0, 1.5, 0.0, 0.0),
        (0.0, 0.0, 3.0, 0.0),
        (0.0, 0.0, 0.0, 5.0),
    ],
)
def test_each_term_alone_equals_the_reference(
    artifact: Artifact, terms: tuple[float, float, float, float]
) -> None:
    state = _online(artifact, _overrides("normalized", terms, 0.0))[1]
    rng = np.random.default_rng(0)
    for user in (0, 5, state.known.n_users - 1):  # the last: the newcomer
        _check(state.scorer, user, rng.integers(0, state.network.n_items, 40))


def _with_item_table(scorer: ExactScorer, table: object) -> ExactScorer:
    new = dataclasses.replace(scorer.lines, affinity=table)  # type: ignore[type-var]
    out = ExactScorer.__new__(ExactScorer)
    out.__dict__.update(scorer.__dict__)
    out.lines = new
    return out


def test_patched_dense_and_sparse_item_tables_equal_the_reference(
    states: dict[str, list[OnlineState]],
) -> None:
    scorer = states["normalized"][1].scorer
    assert isinstance(scorer, ExactScorer) and scorer.lines is not None
    dense = scorer.lines.affinity
    assert isinstance(dense, DenseAffinity)
    size = len(dense)
    rng = np.random.default_rng(1)
    lines = np.array([1, 4, size - 1])
    fresh = np.abs(rng.normal(size=(len(lines), size)))
    patched = dense.with_lines(lines, fresh)
    assert len(patched.patched) == len(lines)
    sparse = SparseAffinity.from_dense(dense.toarray(), size).with_lines(lines, fresh)
    cols = np.r_[lines, rng.integers(0, size, 30)]
    rated = int(scorer.known.rows[scorer.known.by_row.of(0)][0]) if len(scorer.known.by_row.of(0)) else 0
    for table in (patched, sparse):
        variant = _with_item_table(scorer, table)
        for user in (rated, 3, scorer.known.n_users - 1):
            _check(variant, user, cols)


def test_averaged_settings_share_the_scores_and_equal_the_reference(artifact: Artifact) -> None:
    state = _online(artifact, _overrides("normalized", (0.0, 0.0, 3.0, 5.0), 0.0))[1]
    other = artifact.inference.with_overrides(_overrides("normalized", (1.0, 0.5, 0.0, 2.0), 0.4))
    second = build_scorer(state.network, state.known, other)
    mean = MeanScorer([state.scorer, second], state.network.levels)
    rng = np.random.default_rng(2)
    for user in rng.integers(0, state.known.n_users, 5):
        _check(mean, int(user), rng.integers(0, state.network.n_items, 50))


def test_without_numba_the_numpy_loops_give_the_same_answers(
    states: dict[str, list[OnlineState]], monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(3)
    cases = [(s, int(u), rng.integers(0, 40, 25)) for s in SCALINGS for u in (0, 7)]
    compiled = [states[s][1].scorer.answer(u, c) for s, u, c in cases]
    monkeypatch.setattr(direct, "COMPILED", False)
    for (scaling, user, cols), want in zip(cases, compiled, strict=True):
        _check(states[scaling][1].scorer, user, cols)
        got = states[scaling][1].scorer.answer(user, cols)
        assert got is not None and want is not None
        np.testing.assert_allclose(got[0], want[0], rtol=0, atol=TOLERANCE)


def test_a_predicted_field_has_no_fused_answer(artifact: Artifact) -> None:
    state = _online(
        artifact, {**_overrides("normalized", (2.0, 0.0, 0.0, 0.0), 0.0), "kernel.known": "predicted"}
    )[0]
    assert state.scorer.answer(0, np.arange(5)) is None


def test_prepared_vectors_are_the_computed_ones(states: dict[str, list[OnlineState]]) -> None:
    for scaling in SCALINGS:
        scorer = states[scaling][1].scorer  # a FoldIn state: prepared
        assert isinstance(scorer, ExactScorer) and scorer.users is not None
        rows = scorer.field_rows
        for user in (0, 3, scorer.known.n_users - 1):
            held = scorer.users[user]
            from_table = scorer.vectors(user, held[:rows].copy())
            np.testing.assert_allclose(from_table, scorer.vectors(user), atol=1e-12)
            np.testing.assert_allclose(held[rows:], scorer.probe(user), atol=1e-12)


@pytest.mark.parametrize("prepared", [False, True])
def test_wide_queries_equal_the_reference(states: dict[str, list[OnlineState]], prepared: bool) -> None:
    """Queries over a quarter of the catalogue or more (a user's row) take the matrix-product path: the
    whole catalogue in order, and a shuffled half of it with repeats."""
    rng = np.random.default_rng(4)
    for scaling in SCALINGS:
        for state in states[scaling]:
            scorer = state.scorer
            assert isinstance(scorer, ExactScorer)
            if not prepared:
                scorer = _with_item_table(scorer, scorer.lines.affinity if scorer.lines else None)
                scorer.users = None
            m = state.network.n_items
            for user in (0, state.known.n_users - 1):
                _check(scorer, user, np.arange(m, dtype=np.int64))
                _check(scorer, user, rng.integers(0, m, max(m // 2, 1)))


def test_a_prepared_mean_answers_as_an_unprepared_one(artifact: Artifact) -> None:
    state = _online(artifact, _overrides("normalized", (1.0, 0.0, 3.0, 5.0), 0.0))[1]
    other = artifact.inference.with_overrides(_overrides("normalized", (0.0, 0.5, 2.0, 2.0), 0.0))
    second = build_scorer(state.network, state.known, other)
    mean = MeanScorer([state.scorer, second], state.network.levels)
    prepared = MeanScorer([state.scorer, second], state.network.levels)
    prepared.prepare()
    assert mean.users is None and prepared.users is not None
    rng = np.random.default_rng(5)
    m = state.network.n_items
    for user in rng.integers(0, state.known.n_users, 4):
        for cols in (rng.integers(0, m, 20), np.arange(m, dtype=np.int64)):
            _check(prepared, int(user), cols)
            got, want = prepared.answer(int(user), cols), mean.answer(int(user), cols)
            assert got is not None and want is not None
            np.testing.assert_allclose(got[0], want[0], rtol=0, atol=TOLERANCE)
