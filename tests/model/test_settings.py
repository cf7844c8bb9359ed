"""Every inference setting is live: changing it changes some prediction of the mode that reads it.

The settings are declared once (model/config.py); `setting_names()` lists them. ALTERNATIVES below holds,
for each one, a base setting in which it is live and another value for it, so a new setting without a test
here fails `test_every_setting_has_an_alternative`, and a setting that a scorer ignores (as `crf.gamma` once
was by `paper`, and by `exact`) fails `test_changing_a_setting_changes_predictions`.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from model.artifact import StoredField
from model.config import (
    ConfigError,
    Crf,
    CrfSettings,
    InferenceConfig,
    ModelConfig,
    resolve_crf,
    setting_names,
)
from model.engine import Network
from model.exact import ExactScorer, FieldKey
from model.paper import PaperScorer
from model.ratings import Ratings
from model.scorers import NetworkScorer, build_scorer, predict_distributions


def _setup(seed: int = 0, n: int = 12, m: int = 10, d: int = 4):  # type: ignore[no-untyped-def]
    """A random network on levels 1..5, about half its entries known with integer ratings, and the
    unknown entries as queries."""
    rng = np.random.default_rng(seed)
    config = ModelConfig(n_users=n, n_items=m, levels=(1, 2, 3, 4, 5), hidden=(d,))
    network = Network(config, rng.normal(size=(n, d)), rng.normal(size=(m, d)), rng.normal(size=(5, d, d)))
    mask = rng.random((n, m)) < 0.5
    rows, cols = np.nonzero(mask)
    known = Ratings(rows, cols, rng.integers(1, 6, len(rows)).astype(float), n, m)
    q_rows, q_cols = np.nonzero(~mask)
    return network, known, q_rows, q_cols


NETWORK, KNOWN, Q_ROWS, Q_COLS = _setup()


def _predict(inference: InferenceConfig, stored: StoredField | None = None) -> np.ndarray:
    scorer = build_scorer(NETWORK, KNOWN, inference, stored)
    return predict_distributions(NETWORK, scorer, Q_ROWS, Q_COLS)


def _config(overrides: dict[str, Any]) -> InferenceConfig:
    return InferenceConfig().with_overrides(overrides)


def _value(inference: InferenceConfig, name: str) -> Any:
    group, _, setting = name.partition(".")
    return getattr(getattr(inference, group), setting) if setting else getattr(inference, group)


PAPER = {"mode": "paper", "paper.subset_rows": 6, "paper.subset_cols": 5, "paper.repeats": 3}
"""Paper mode with blocks of 6 x 5, two row and two column groups on the 12 x 10 matrix."""
EXACT = {"mode": "exact", "crf.gamma": 1.0, "kernel.known": "clamped"}
"""Exact mode over the clamped known ratings, normalized messages, a strong pairwise term."""
CO_RATED = {**EXACT, "kernel.co_rating": 2.0}
BASELINE = {**EXACT, "output.baseline": 0.5}

ALTERNATIVES: dict[str, tuple[dict[str, Any], Any]] = {
    "crf.gamma": (PAPER, 2.0),
    "crf.tau": (PAPER, 2.0),
    "crf.layers": (PAPER, 1),
    "paper.subset_rows": (PAPER, 4),
    "paper.subset_cols": (PAPER, 3),
    "paper.repeats": (PAPER, 2),
    "paper.seed": (PAPER, 1),
    "kernel.scaling": (EXACT, "sum"),
    "kernel.known": (EXACT, "predicted"),
    "kernel.same_user": (EXACT, 2.0),
    "kernel.same_item": (EXACT, 2.0),
    "kernel.co_rating": (EXACT, 2.0),
    "kernel.co_rating_user": (EXACT, 2.0),
    "kernel.co_rating_power": (CO_RATED, 5.0),  # only with a co-rating term
    "kernel.co_rating_shrink": (CO_RATED, 1.0),
    "kernel.co_rating_prior": (CO_RATED, 1.0),  # only with a co-rating term and normalized messages
    "output.baseline": (EXACT, 0.5),
    "output.baseline_user_shrink": (BASELINE, 0.1),  # only with a baseline weight
    "output.baseline_item_shrink": (BASELINE, 0.1),
}
"""Each inference setting (but `mode`): a base setting in which it is live, and another value for it."""

ALSO_READ_BY: list[tuple[str, dict[str, Any], Any]] = [
    # The CRF's weights are read by both CRF modes.
    ("crf.gamma", EXACT, 0.2),
    ("crf.gamma", {**EXACT, "kernel.known": "predicted"}, 0.2),
    ("crf.tau", EXACT, 2.0),
    ("crf.layers", {**EXACT, "kernel.known": "predicted"}, 1),  # clamped known entries do not iterate
    # exact reads the paper's block size through the `scaled` messages.
    ("paper.subset_rows", {**EXACT, "kernel.scaling": "scaled"}, 4),
    ("paper.subset_cols", {**EXACT, "kernel.scaling": "scaled"}, 3),
    # The co-rating settings act on the user-based term too.
    ("kernel.co_rating_power", {**EXACT, "kernel.co_rating_user": 2.0}, 5.0),
    ("kernel.co_rating_shrink", {**EXACT, "kernel.co_rating_user": 2.0}, 1.0),
    ("kernel.co_rating_prior", {**EXACT, "kernel.co_rating_user": 2.0}, 1.0),
]
"""Further modes or terms that read a setting of ALTERNATIVES."""


def test_every_setting_has_an_alternative() -> None:
    assert set(ALTERNATIVES) == set(setting_names()) - {"mode"}
    assert {name for name, _, _ in ALSO_READ_BY} <= set(ALTERNATIVES)


@pytest.mark.parametrize(
    ("name", "base", "value"),
    [pytest.param(name, base, value, id=name) for name, (base, value) in ALTERNATIVES.items()]
    + [pytest.param(*case, id=f"{case[0]}-also-{i}") for i, case in enumerate(ALSO_READ_BY)],
)
def test_changing_a_setting_changes_predictions(name: str, base: dict[str, Any], value: Any) -> None:
    before = _config(base)
    after = before.with_overrides({name: value})
    assert _value(after, name) == value != _value(before, name)
    assert before.mode == after.mode and before.reads(name)
    got, want = _predict(after), _predict(before)
    assert got.shape == want.shape == (len(Q_ROWS), 5)
    np.testing.assert_allclose(got.sum(axis=1), 1.0, atol=1e-10)
    assert not np.allclose(got, want), f"{name}={value!r} changes no prediction of {base}"


def test_crf_gamma_changes_paper_predictions() -> None:
    base = _config(PAPER)
    assert isinstance(build_scorer(NETWORK, KNOWN, base), PaperScorer)
    model_gamma = NETWORK.config.gamma
    # None is the model's gamma; another gamma moves the predictions.
    np.testing.assert_array_equal(_predict(base), _predict(base.with_overrides({"crf.gamma": model_gamma})))
    assert not np.allclose(_predict(base), _predict(base.with_overrides({"crf.gamma": 1.0})))
    assert not np.allclose(_predict(base), NETWORK.probabilities(Q_ROWS, Q_COLS))


@pytest.mark.parametrize("known", ["clamped", "predicted"])
def test_crf_gamma_changes_exact_predictions(known: str) -> None:
    base = _config({"mode": "exact", "kernel.known": known})
    assert isinstance(build_scorer(NETWORK, KNOWN, base), ExactScorer)
    model_gamma = NETWORK.config.gamma
    np.testing.assert_array_equal(_predict(base), _predict(base.with_overrides({"crf.gamma": model_gamma})))
    assert not np.allclose(_predict(base), _predict(base.with_overrides({"crf.gamma": 1.0})))
    assert not np.allclose(_predict(base), NETWORK.probabilities(Q_ROWS, Q_COLS))


@pytest.mark.parametrize(
    "base", [PAPER, EXACT, {**EXACT, "kernel.known": "predicted"}], ids=["paper", "clamped", "predicted"]
)
def test_zero_layers_is_the_base_network(base: dict[str, Any]) -> None:
    inference = _config({**base, "crf.layers": 0})
    assert isinstance(build_scorer(NETWORK, KNOWN, inference), NetworkScorer)
    np.testing.assert_array_equal(_predict(inference), NETWORK.probabilities(Q_ROWS, Q_COLS))
    np.testing.assert_array_equal(_predict(_config({"mode": "none"})), NETWORK.probabilities(Q_ROWS, Q_COLS))
    assert not np.allclose(_predict(_config(base)), NETWORK.probabilities(Q_ROWS, Q_COLS))


def test_resolve_crf_takes_each_setting_else_the_models() -> None:
    model = NETWORK.config
    assert resolve_crf(model, CrfSettings()) == Crf(model.gamma, model.tau, model.mf_layers)
    assert resolve_crf(model, CrfSettings(gamma=2.0)) == Crf(2.0, model.tau, model.mf_layers)
    assert resolve_crf(model, CrfSettings(tau=3.0, layers=0)) == Crf(model.gamma, 3.0, 0)
    assert resolve_crf(model, CrfSettings(gamma=0.0)).gamma == 0.0  # 0 is a value, not "unset"


# -- with_overrides -----------------------------------------------------------------------------------------


def test_unknown_setting_is_refused_with_the_valid_names() -> None:
    with pytest.raises(ConfigError, match=r"unknown inference setting 'crf\.gama'") as info:
        InferenceConfig().with_overrides({"crf.gama": 1})
    for name in setting_names():
        assert name in str(info.value)
    for bad in ("gamma", "crf", "kernel.gamma", "crf.gamma.x", "inference.crf.gamma"):
        with pytest.raises(ConfigError, match="unknown inference setting"):
            InferenceConfig().with_overrides({bad: 1})


@pytest.mark.parametrize(
    ("overrides", "unread"),
    [
        ({"kernel.co_rating": 1.0}, "kernel.co_rating"),  # mode paper
        ({"output.baseline": 0.5}, "output.baseline"),
        ({"mode": "exact", "paper.repeats": 3}, "paper.repeats"),
        ({"mode": "exact", "paper.seed": 3}, "paper.seed"),
        ({"mode": "exact", "paper.subset_rows": 4}, "paper.subset_rows"),  # only with scaled messages
        ({"mode": "none", "crf.gamma": 1.0}, "crf.gamma"),
    ],
)
def test_a_setting_the_mode_does_not_read_is_refused(overrides: dict[str, Any], unread: str) -> None:
    with pytest.raises(ConfigError, match=rf"does not read {unread}"):
        InferenceConfig().with_overrides(overrides)


def test_a_setting_is_read_once_its_mode_is_set() -> None:
    exact = InferenceConfig().with_overrides({"mode": "exact", "kernel.co_rating": 1.0})
    assert exact.mode == "exact" and exact.kernel.co_rating == 1.0
    scaled = exact.with_overrides({"kernel.scaling": "scaled", "paper.subset_rows": 4})
    assert scaled.paper.subset_rows == 4
    assert scaled.with_overrides({"paper.subset_cols": 7}).paper.subset_cols == 7
    # Settings stored earlier that the new mode does not read are kept, not refused.
    assert exact.with_overrides({"mode": "paper"}).kernel.co_rating == 1.0


def test_switching_the_mode_does_not_carry_the_crf_weights_over() -> None:
    searched = InferenceConfig().with_overrides({"mode": "exact", "crf.gamma": 4.0, "crf.tau": 20.25})
    paper = searched.with_overrides({"mode": "paper"})
    assert (paper.crf.gamma, paper.crf.tau, paper.crf.layers) == (None, None, None)  # the model's
    assert searched.with_overrides({"mode": "exact"}).crf.gamma == 4.0  # the same mode keeps them
    assert searched.with_overrides({"mode": "paper", "crf.gamma": 2.0}).crf.gamma == 2.0  # set with it
    assert searched.with_overrides({"crf.layers": 3}).crf.tau == 20.25


def test_overrides_convert_strings_by_the_declared_type() -> None:
    base = InferenceConfig().with_overrides({"crf.gamma": 2.0})
    for none in ("none", "None", "null"):
        assert base.with_overrides({"crf.gamma": none}).crf.gamma is None
    got = base.with_overrides({"paper.repeats": "3", "crf.tau": "4.5", "crf.layers": "2", "paper.seed": "-1"})
    assert got.paper.repeats == 3 and isinstance(got.paper.repeats, int)
    assert got.crf.tau == 4.5 and isinstance(got.crf.tau, float)
    assert got.crf.layers == 2 and got.paper.seed == -1
    assert got.crf.gamma == 2.0  # untouched
    exact = base.with_overrides({"mode": "exact", "kernel.co_rating": "1e10", "kernel.known": "clamped"})
    assert exact.kernel.co_rating == 1e10 and exact.kernel.known == "clamped"
    assert base.mode == "paper" and base.crf.gamma == 2.0  # the original is unchanged (frozen)


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        ({"paper.repeats": "many"}, "paper.repeats"),
        ({"paper.repeats": "3.5"}, "paper.repeats"),
        ({"paper.repeats": "none"}, "paper.repeats"),  # not optional: none is no value
        ({"paper.repeats": 0}, "paper.repeats"),
        ({"paper.subset_rows": -1}, "paper.subset_rows"),
        ({"crf.gamma": -1.0}, "crf.gamma"),
        ({"crf.gamma": "big"}, "crf.gamma"),
        ({"crf.tau": 0.0}, "crf.tau"),
        ({"crf.layers": -1}, "crf.layers"),
        ({"mode": "bogus"}, "mode"),
        ({"mode": "exact", "kernel.scaling": "bogus"}, "kernel.scaling"),
        ({"mode": "exact", "kernel.known": "guessed"}, "kernel.known"),
        ({"mode": "exact", "kernel.same_user": -1.0}, "kernel.same_user"),
        ({"mode": "exact", "kernel.co_rating_power": 0.0}, "kernel.co_rating_power"),
        ({"mode": "exact", "kernel.co_rating_shrink": 0.0}, "kernel.co_rating_shrink"),
        ({"mode": "exact", "kernel.co_rating_prior": -0.1}, "kernel.co_rating_prior"),
        ({"mode": "exact", "output.baseline": 1.5}, "output.baseline"),
        ({"mode": "exact", "output.baseline_user_shrink": 0.0}, "output.baseline_user_shrink"),
    ],
)
def test_a_bad_value_is_refused_naming_the_setting(overrides: dict[str, Any], name: str) -> None:
    with pytest.raises(ConfigError, match=rf"inference setting {name}\b"):
        InferenceConfig().with_overrides(overrides)


# -- from_dict: the nested form, and format 1's flat one ----------------------------------------------------

FORMAT_1 = {
    "mode": "exact",
    "subset_rows": 16,
    "subset_cols": 48,
    "repeats": 7,
    "seed": 3,
    "scaling": "normalized",
    "known": "clamped",
    "gamma": 1.0,
    "tau": None,
    "same_user": 0.0,
    "same_item": 0.5,
    "co_rating": 1e10,
    "co_rating_power": 5.0,
    "co_rating_shrink": 1.0,
    "co_rating_user": 1e10,
    "co_rating_prior": 0.01,
    "baseline": 0.25,
    "baseline_user_shrink": 1.5,
    "baseline_item_shrink": 4.0,
}
"""An inference dict as a format-1 artifact stored it: every setting at the top level."""


def test_format_1_flat_settings_map_to_their_groups() -> None:
    got = InferenceConfig.from_dict(FORMAT_1)
    assert got.mode == "exact"
    assert got.crf == CrfSettings(gamma=1.0, tau=None, layers=None)
    assert (got.paper.subset_rows, got.paper.subset_cols, got.paper.repeats, got.paper.seed) == (16, 48, 7, 3)
    kernel = got.kernel
    assert (kernel.scaling, kernel.known, kernel.same_user, kernel.same_item) == (
        "normalized",
        "clamped",
        0,
        0.5,
    )
    assert (kernel.co_rating, kernel.co_rating_user, kernel.co_rating_power) == (1e10, 1e10, 5.0)
    assert (kernel.co_rating_shrink, kernel.co_rating_prior) == (1.0, 0.01)
    assert (got.output.baseline, got.output.baseline_user_shrink, got.output.baseline_item_shrink) == (
        0.25,
        1.5,
        4.0,
    )
    # Every flat name lands in exactly one group, under the same name.
    flat = {name.partition(".")[2]: name for name in setting_names() if name != "mode"}
    for key, value in FORMAT_1.items():
        if key != "mode":
            assert _value(got, flat[key]) == value, key
    # A format-1 dict that leaves settings out takes their defaults.
    partial = InferenceConfig.from_dict({"mode": "paper", "gamma": 0.5, "repeats": 2})
    assert partial.crf.gamma == 0.5 and partial.paper.repeats == 2
    assert partial.paper.subset_rows == InferenceConfig().paper.subset_rows
    assert partial.kernel == InferenceConfig().kernel


def test_format_1_unknown_or_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="gama"):
        InferenceConfig.from_dict({**FORMAT_1, "gama": 1.0})
    with pytest.raises(ConfigError, match=r"crf\.gamma"):
        InferenceConfig.from_dict({**FORMAT_1, "gamma": -1.0})


def test_to_dict_from_dict_round_trip() -> None:
    for inference in (
        InferenceConfig(),
        InferenceConfig.from_dict(FORMAT_1),
        _config({**CO_RATED, "crf.tau": 3.0, "crf.layers": 2, "kernel.co_rating_prior": 0.5}),
        _config({**PAPER, "crf.gamma": 0.0}),
    ):
        d = inference.to_dict()
        assert set(d) == {"mode", "crf", "paper", "kernel", "output"}
        assert InferenceConfig.from_dict(d) == inference
        assert InferenceConfig.from_dict(json.loads(json.dumps(d))) == inference
    assert InferenceConfig.from_dict({}) == InferenceConfig()
    assert InferenceConfig.from_dict({"mode": "exact"}) == InferenceConfig(mode="exact")
    with pytest.raises(ConfigError, match=r"crf\.gama"):
        InferenceConfig.from_dict({"mode": "exact", "crf": {"gama": 1.0}})
    with pytest.raises(ConfigError, match="kernels"):
        InferenceConfig.from_dict({"mode": "exact", "kernels": {}})


# -- the stored field's key ---------------------------------------------------------------------------------


def _stored(scorer: ExactScorer) -> StoredField:
    """The scorer's field as an artifact stores it, its key through JSON."""
    key = json.loads(json.dumps(scorer.key.to_json()))
    return StoredField(key=key, g=scorer.field.g.copy(), h=scorer.field.h.copy(), t=scorer.field.t)


@pytest.mark.parametrize("base", [EXACT, {**CO_RATED, "kernel.same_user": 1.0, "kernel.known": "predicted"}])
def test_a_stored_field_is_used_only_under_its_own_key(base: dict[str, Any]) -> None:
    inference = _config(base)
    fresh = build_scorer(NETWORK, KNOWN, inference)
    assert isinstance(fresh, ExactScorer) and fresh.field_source == "computed"
    stored = _stored(fresh)
    assert FieldKey.from_json(stored.key) == fresh.key
    same = build_scorer(NETWORK, KNOWN, inference, stored)
    assert isinstance(same, ExactScorer) and same.field_source == "artifact"
    assert same.field.g is stored.g and same.field.t is stored.t
    np.testing.assert_allclose(_predict(inference, stored), _predict(inference), rtol=1e-12, atol=1e-15)
    # Settings that do not enter the field (the output's) leave its key alone.
    mixed = inference.with_overrides({"output.baseline": 0.3})
    assert build_scorer(NETWORK, KNOWN, mixed, stored).field_source == "artifact"  # type: ignore[union-attr]
    # Any setting the field depends on gives another key: the field is recomputed. (gamma and T move the
    # field only where the known entries iterate, not where they are clamped to their labels.)
    changes: list[dict[str, Any]] = [{"crf.tau": 2.0}, {"kernel.scaling": "sum"}, {"kernel.same_item": 1.0}]
    if inference.kernel.known == "predicted":
        changes += [{"crf.gamma": 0.3}, {"crf.layers": 2}]
    for change in changes:
        other = inference.with_overrides(change)
        scorer = build_scorer(NETWORK, KNOWN, other, stored)
        assert isinstance(scorer, ExactScorer) and scorer.field_source == "computed", change
        assert scorer.key != fresh.key
        np.testing.assert_allclose(_predict(other, stored), _predict(other), rtol=1e-12, atol=1e-15)
    # And so do other known ratings.
    fewer = Ratings(KNOWN.rows[1:], KNOWN.cols[1:], KNOWN.values[1:], KNOWN.n_users, KNOWN.n_items)
    scorer = build_scorer(NETWORK, fewer, inference, stored if stored.t is None else None)
    assert isinstance(scorer, ExactScorer) and scorer.key.n_known == len(KNOWN) - 1
    if stored.t is None:
        assert scorer.field_source == "computed"


def test_a_stored_field_under_another_gamma_is_recomputed() -> None:
    gamma_1 = _config({**EXACT, "kernel.known": "predicted"})  # the known entries iterate with gamma
    stored = _stored(build_scorer(NETWORK, KNOWN, gamma_1))  # type: ignore[arg-type]
    gamma_2 = gamma_1.with_overrides({"crf.gamma": 2.0})
    scorer = build_scorer(NETWORK, KNOWN, gamma_2, stored)
    assert isinstance(scorer, ExactScorer) and scorer.field_source == "computed"
    assert scorer.key.gamma == 2.0 and stored.key["gamma"] == 1.0


def test_settings_that_cannot_change_the_field_do_not_enter_its_key() -> None:
    plain = build_scorer(NETWORK, KNOWN, _config(EXACT))
    quiet = _config({**EXACT, "kernel.co_rating_power": 7.0, "kernel.co_rating_prior": 3.0})
    assert isinstance(plain, ExactScorer)
    stored = _stored(plain)
    scorer = build_scorer(NETWORK, KNOWN, quiet, stored)
    assert isinstance(scorer, ExactScorer) and scorer.key == plain.key and scorer.field_source == "artifact"
    np.testing.assert_allclose(_predict(quiet), _predict(_config(EXACT)), rtol=1e-12)
    # The block size enters only with scaled messages.
    scaled = _config({**EXACT, "kernel.scaling": "scaled"})
    assert build_scorer(NETWORK, KNOWN, scaled).key.scale > 0  # type: ignore[union-attr]
    assert plain.key.scale == 0.0


@pytest.mark.parametrize(
    "mangle",
    [
        lambda d: {},
        lambda d: {k: v for k, v in d.items() if k != "gamma"},  # a field missing
        lambda d: {**d, "extra": 1},  # a field this version does not know
        lambda d: {k: v for k, v in d.items() if k != "n_known"},
        lambda d: [1, 2, 3],  # not an object
    ],
    ids=["empty", "missing", "extra", "no-n-known", "list"],
)
def test_a_malformed_key_reads_as_none_and_the_field_is_recomputed(mangle: Any) -> None:
    inference = _config(EXACT)
    scorer = build_scorer(NETWORK, KNOWN, inference)
    assert isinstance(scorer, ExactScorer)
    bad = mangle(scorer.key.to_json())
    assert FieldKey.from_json(bad) is None
    stored = StoredField(key=bad, g=scorer.field.g, h=scorer.field.h, t=None)
    assert build_scorer(NETWORK, KNOWN, inference, stored).field_source == "computed"  # type: ignore[union-attr]


def test_field_key_round_trips_through_json() -> None:
    scorer = build_scorer(NETWORK, KNOWN, _config({**CO_RATED, "kernel.co_rating_user": 1e10}))
    assert isinstance(scorer, ExactScorer)
    text = json.dumps(scorer.key.to_json())
    assert FieldKey.from_json(json.loads(text)) == scorer.key
    assert json.loads(text)["co_rating_user"] == 1e10 and json.loads(text)["n_known"] == len(KNOWN)
