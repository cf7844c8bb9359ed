"""The bias baseline that `exact` inference can mix into the CRF's final distributions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from model import engine, exact
from model.artifact import ArtifactFiles, StoredField, _load_known_field
from model.config import ConfigError, InferenceConfig, ModelConfig
from model.engine import Network
from model.ratings import Ratings
from model.scorers import NetworkScorer, build_scorer, predict_distributions
from training.export import save_exact_field


def _ratings(seed: int = 0, n: int = 8, m: int = 6, k: int = 30):  # type: ignore[no-untyped-def]
    """Known ratings on levels 1..5 that leave the last user and the last item without any."""
    rng = np.random.default_rng(seed)
    pairs = rng.choice((n - 1) * (m - 1), size=k, replace=False)
    rows, cols = pairs // (m - 1), pairs % (m - 1)
    values = rng.integers(1, 6, size=k).astype(np.float64)
    return rows, cols, values


def test_bias_baseline_is_the_ridge_least_squares_solution() -> None:
    n, m = 8, 6
    rows, cols, values = _ratings(n=n, m=m)
    mu, b, c = exact.bias_baseline(rows, cols, values, n, m, user_shrink=2.0, item_shrink=5.0)
    # Ridge regression on one-hot user and item indicators, solved directly: the penalty rows append
    # sqrt(lambda) I to the design matrix and zeros to the target.
    design = np.zeros((len(values), n + m))
    design[np.arange(len(values)), rows] = 1.0
    design[np.arange(len(values)), n + cols] = 1.0
    penalty = np.diag(np.r_[np.full(n, np.sqrt(2.0)), np.full(m, np.sqrt(5.0))])
    x, *_ = np.linalg.lstsq(np.vstack([design, penalty]), np.r_[values - values.mean(), np.zeros(n + m)])
    assert mu == pytest.approx(values.mean())
    np.testing.assert_allclose(b, x[:n], atol=1e-8)
    np.testing.assert_allclose(c, x[n:], atol=1e-8)
    assert b[-1] == 0.0 and c[-1] == 0.0  # no ratings: no bias
    assert np.abs(b).max() > 0.1 and np.abs(c).max() > 0.1


def test_a_stronger_penalty_shrinks_the_biases() -> None:
    rows, cols, values = _ratings(seed=1)
    _, b_weak, c_weak = exact.bias_baseline(rows, cols, values, 8, 6, 0.5, 0.5)
    _, b_strong, c_strong = exact.bias_baseline(rows, cols, values, 8, 6, 50.0, 50.0)
    assert np.abs(b_strong).sum() < 0.5 * np.abs(b_weak).sum()
    assert np.abs(c_strong).sum() < 0.5 * np.abs(c_weak).sum()


def test_level_distribution_has_the_clipped_value_as_its_expectation() -> None:
    levels = np.array([0.5, 1.0, 2.0, 4.0, 5.0])
    values = np.array([-3.0, 0.5, 0.75, 1.0, 3.1, 4.0, 4.99, 5.0, 9.0])
    dist = exact.level_distribution(values, levels)
    assert dist.min() >= 0.0
    np.testing.assert_allclose(dist.sum(axis=1), 1.0, atol=1e-15)
    np.testing.assert_allclose(dist @ levels, np.clip(values, 0.5, 5.0), atol=1e-14)
    assert ((dist > 0).sum(axis=1) <= 2).all()
    # A value on a level puts all its weight there; one between two levels splits it between them alone.
    np.testing.assert_allclose(dist[5], [0, 0, 0, 1, 0])
    np.testing.assert_allclose(dist[4], [0, 0, 0.45, 0.55, 0])
    # The mixture adds the two non-zero levels where they fall: exactly (1 - w) Q + w B, written over Q.
    q = np.random.default_rng(0).dirichlet(np.ones(5), size=len(values))
    mixed = q.copy()
    assert exact.baseline_mixture(mixed, values, levels, 0.3) is mixed
    np.testing.assert_array_equal(mixed, 0.7 * q + 0.3 * dist)
    wide = np.hstack([q, q])  # columns of a wider array: written over all the same
    assert exact.baseline_mixture(wide[:, :5], values, levels, 0.3) is not None
    np.testing.assert_array_equal(wide[:, :5], 0.7 * q + 0.3 * dist)
    np.testing.assert_array_equal(wide[:, 5:], q)


@pytest.mark.parametrize("levels", [np.arange(1.0, 6.0), np.arange(0.5, 5.01, 0.5), np.arange(0.0, 69.0)])
def test_evenly_spaced_levels_split_a_value_between_its_two_neighbours(levels: np.ndarray) -> None:
    # Evenly spaced levels take arithmetic, not a search: the same distributions as the definition.
    rng = np.random.default_rng(4)
    values = np.r_[rng.normal(levels.mean(), levels.std() * 1.5, 500), levels, levels[:-1] + 1e-9]
    dist = exact.level_distribution(values, levels)
    clipped = np.clip(values, levels[0], levels[-1])
    np.testing.assert_allclose(dist @ levels, clipped, atol=1e-12)
    assert dist.min() >= 0.0 and ((dist > 0).sum(axis=1) <= 2).all()
    nonzero = [np.flatnonzero(row) for row in dist]
    assert all(len(nz) == 1 or nz[1] == nz[0] + 1 for nz in nonzero)  # two neighbouring levels
    on_level = np.flatnonzero(np.isin(clipped, levels))
    np.testing.assert_allclose(dist[on_level].max(axis=1), 1.0)  # a value on a level: all its weight there


def _model(seed: int = 0) -> tuple[Network, Ratings]:
    rng = np.random.default_rng(seed)
    cfg = ModelConfig(n_users=8, n_items=6, levels=(1, 2, 3, 4, 5), hidden=(4,))
    rows, cols, values = _ratings(seed)
    network = Network(cfg, rng.normal(size=(8, 4)), rng.normal(size=(6, 4)), rng.normal(size=(5, 4, 4)))
    return network, Ratings(rows, cols, values, 8, 6)


def _exact(
    crf: dict[str, Any], kernel: dict[str, Any], output: dict[str, Any] | None = None
) -> InferenceConfig:
    return InferenceConfig.from_dict({"mode": "exact", "crf": crf, "kernel": kernel, "output": output or {}})


def _predict(network: Network, known: Ratings, rows, cols, inference: InferenceConfig, stored=None):  # type: ignore[no-untyped-def]
    return predict_distributions(network, build_scorer(network, known, inference, stored), rows, cols)


@pytest.mark.parametrize("weight", [0.3, 1.0])
def test_exact_inference_mixes_the_baseline_into_the_crf_output(weight: float) -> None:
    network, known = _model()
    rows, cols = np.array([0, 3, 7, 7]), np.array([5, 2, 0, 5])  # the last user and item have no ratings
    crf = _exact({"gamma": 1.0}, {"known": "clamped", "same_user": 3.0, "same_item": 1.0})
    mixed = crf.with_overrides(
        {"output.baseline": weight, "output.baseline_user_shrink": 1.5, "output.baseline_item_shrink": 4.0}
    )
    q = _predict(network, known, rows, cols, crf)
    got = _predict(network, known, rows, cols, mixed)
    mu, b, c = exact.bias_baseline(known.rows, known.cols, known.values, 8, 6, 1.5, 4.0)
    baseline = np.clip(mu + b[rows] + c[cols], 1, 5)
    np.testing.assert_allclose(got.sum(axis=1), 1.0, atol=1e-12)
    want = (1 - weight) * engine.expected_rating(q, network.levels) + weight * baseline
    np.testing.assert_allclose(engine.expected_rating(got, network.levels), want, atol=1e-12)
    assert not np.allclose(got, q)
    # The baseline does not enter the CRF: the known field is shared with the plain setting.
    plain, with_baseline = build_scorer(network, known, crf), build_scorer(network, known, mixed)
    assert isinstance(plain, exact.ExactScorer) and isinstance(with_baseline, exact.ExactScorer)
    assert with_baseline.key == plain.key
    stored = StoredField(plain.key.to_json(), plain.field.g, plain.field.h, plain.field.t)
    shared = build_scorer(network, known, mixed, stored)
    assert isinstance(shared, exact.ExactScorer) and shared.field_source == "artifact"
    np.testing.assert_allclose(_predict(network, known, rows, cols, mixed, stored), got, rtol=1e-12)


def test_the_artifact_keeps_the_baseline_fit_and_a_worker_reads_it_instead_of_refitting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    network, known = _model(1)
    rows, cols = np.array([0, 3, 7, 2]), np.array([5, 2, 0, 1])
    mixed = _exact({"gamma": 1.0}, {"known": "clamped", "same_user": 2.0}, {"baseline": 0.4})
    mixed = mixed.with_overrides({"output.baseline_user_shrink": 1.5, "output.baseline_item_shrink": 4.0})
    scorer = build_scorer(network, known, mixed)
    assert isinstance(scorer, exact.ExactScorer) and scorer.biases is not None
    want = predict_distributions(network, scorer, rows, cols)
    save_exact_field(scorer, tmp_path)
    config = ModelConfig(n_users=8, n_items=6, levels=(1, 2, 3, 4, 5), hidden=(4,))
    stored = _load_known_field(ArtifactFiles.present(tmp_path), config, len(known))
    assert stored is not None and stored.biases is not None
    assert (stored.biases.user_shrink, stored.biases.item_shrink) == (1.5, 4.0)
    np.testing.assert_array_equal(stored.biases.users, scorer.biases.users)
    fits: list[float] = []
    fit = exact.bias_baseline
    monkeypatch.setattr(exact.baseline, "bias_baseline", lambda *a, **k: fits.append(a[5]) or fit(*a, **k))
    served = build_scorer(network, known, mixed, stored)
    assert fits == []  # read, not refitted
    np.testing.assert_array_equal(predict_distributions(network, served, rows, cols), want)
    # Other penalties, or other known ratings, are fitted anew.
    other = mixed.with_overrides({"output.baseline_user_shrink": 3.0})
    build_scorer(network, known, other, stored)
    assert fits == [3.0]
    fewer = Ratings(known.rows[1:], known.cols[1:], known.values[1:], 8, 6)
    build_scorer(network, fewer, mixed, stored)
    assert fits == [3.0, 1.5]


def test_without_a_weight_the_baseline_changes_nothing() -> None:
    network, known = _model(2)
    rows, cols = np.array([1, 2, 4]), np.array([0, 3, 1])
    crf = _exact({"gamma": 0.5}, {"known": "clamped"})
    off = crf.with_overrides({"output.baseline_user_shrink": 0.1, "output.baseline_item_shrink": 0.1})
    np.testing.assert_array_equal(
        _predict(network, known, rows, cols, off), _predict(network, known, rows, cols, crf)
    )
    # and the base network alone (`none`) never mixes it in (nor takes the setting)
    stale = InferenceConfig.from_dict({**crf.to_dict(), "mode": "none", "output": {"baseline": 0.5}})
    assert isinstance(build_scorer(network, known, stale), NetworkScorer)
    np.testing.assert_array_equal(
        _predict(network, known, rows, cols, stale), network.probabilities(rows, cols)
    )
    with pytest.raises(ConfigError, match=r"'none' does not read output\.baseline"):
        crf.with_overrides({"mode": "none", "output.baseline": 0.5})


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"baseline": -0.1}, "baseline"),
        ({"baseline": 1.5}, "baseline"),
        ({"baseline_user_shrink": 0.0}, "baseline_user_shrink"),
        ({"baseline_item_shrink": -1.0}, "baseline_item_shrink"),
    ],
)
def test_out_of_range_baseline_settings_are_refused(changes: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"output\.{field}\b"):
        InferenceConfig.from_dict({"mode": "exact", "output": changes})
    with pytest.raises(ConfigError, match=rf"output\.{field}\b"):
        InferenceConfig(mode="exact").with_overrides({f"output.{k}": v for k, v in changes.items()})


def test_the_bias_model_refits_users_and_items_by_the_ridge_rule() -> None:
    model = exact.BiasModel(3.0, np.array([0.0, 0.1]), np.array([0.5, -0.5, 0.0]), 2.0, 5.0)
    grown = model.grown(3, 4)  # a new user and a new item, biases 0
    assert grown.users.tolist() == [0.0, 0.1, 0.0] and grown.items.tolist() == [0.5, -0.5, 0.0, 0.0]
    # ((5 - 3 - 0.5) + (2 - 3 + 0.5)) / (2 + 2) = 0.25; no ratings: 0
    users = grown.with_users(
        [2, 1],
        {2: (np.array([0, 1]), np.array([5.0, 2.0])), 1: (np.array([], np.int64), np.array([]))}.__getitem__,
    )
    assert users.users.tolist() == pytest.approx([0.0, 0.0, 0.25]) and grown.users[1] == 0.1  # a copy
    # (4 - 3 - 0.25) / (1 + 5) = 0.125 for item 3 rated 4 by user 2
    items = users.with_items([3], lambda item: (np.array([2]), np.array([4.0])))
    assert items.items[3] == pytest.approx(0.125)
    assert items.predict(2, np.array([0, 3])).tolist() == pytest.approx([3.75, 3.375])
    assert items.predict(np.array([0, 2]), np.array([1, 1])).tolist() == pytest.approx([2.5, 2.75])
