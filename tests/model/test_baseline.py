"""The bias baseline that `exact` inference can mix into the CRF's final distributions."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from model import engine, exact
from model.config import ConfigError, InferenceConfig, ModelConfig


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


def _model(seed: int = 0) -> engine.ScoringModel:
    rng = np.random.default_rng(seed)
    cfg = ModelConfig(n_users=8, n_items=6, levels=(1, 2, 3, 4, 5), hidden=(4,))
    rows, cols, values = _ratings(seed)
    return engine.ScoringModel(
        config=cfg,
        user_emb=rng.normal(size=(8, 4)),
        item_emb=rng.normal(size=(6, 4)),
        bilinear=rng.normal(size=(5, 4, 4)),
        known_rows=rows,
        known_cols=cols,
        known_values=values,
    )


@pytest.mark.parametrize("weight", [0.3, 1.0])
def test_exact_inference_mixes_the_baseline_into_the_crf_output(weight: float) -> None:
    model = _model()
    rows, cols = np.array([0, 3, 7, 7]), np.array([5, 2, 0, 5])  # the last user and item have no ratings
    crf = InferenceConfig(mode="exact", known="clamped", gamma=1.0, same_user=3.0, same_item=1.0)
    mixed = replace(crf, baseline=weight, baseline_user_shrink=1.5, baseline_item_shrink=4.0)
    q = engine.predict_entries(model, rows, cols, crf)
    got = engine.predict_entries(model, rows, cols, mixed)
    mu, b, c = exact.bias_baseline(model.known_rows, model.known_cols, model.known_values, 8, 6, 1.5, 4.0)
    baseline = np.clip(mu + b[rows] + c[cols], 1, 5)
    np.testing.assert_allclose(got.sum(axis=1), 1.0, atol=1e-12)
    want = (1 - weight) * engine.expected_rating(q, model.levels) + weight * baseline
    np.testing.assert_allclose(engine.expected_rating(got, model.levels), want, atol=1e-12)
    assert not np.allclose(got, q)
    # The baseline does not enter the CRF: the known field is shared with the plain setting.
    assert model.field_key(mixed) == model.field_key(crf)


def test_without_a_weight_the_baseline_changes_nothing() -> None:
    model = _model(2)
    rows, cols = np.array([1, 2, 4]), np.array([0, 3, 1])
    crf = InferenceConfig(mode="exact", known="clamped", gamma=0.5)
    off = replace(crf, baseline_user_shrink=0.1, baseline_item_shrink=0.1)
    np.testing.assert_array_equal(
        engine.predict_entries(model, rows, cols, off), engine.predict_entries(model, rows, cols, crf)
    )
    # and the base network alone (`none`) never mixes it in
    none = engine.predict_entries(model, rows, cols, replace(crf, mode="none", baseline=0.5))
    np.testing.assert_array_equal(none, model.probabilities(rows, cols))


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
    with pytest.raises(ConfigError, match=field):
        InferenceConfig(mode="exact", **changes)
