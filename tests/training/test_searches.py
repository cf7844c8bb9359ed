"""`TrainConfig.searches`: several searches, each on its own carve with its own network, whose settings the
published (refit) network serves averaged (model.scorers.MeanScorer)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from model.artifact import load_artifact
from model.config import ConfigError
from model.scorers import MeanScorer, artifact_scorer
from training.config import TrainConfig
from training.evaluate import evaluate, predict_ratings
from training.pipeline import run_training

SETTINGS = {"epochs": "3", "val_fraction": "0.1", "refit": "true"}
TRIALS = 12


def test_two_searches_publish_the_refit_network_with_both_carves_settings(
    split_csv: Path, tmp_path: Path
) -> None:
    single, other, pair = tmp_path / "single", tmp_path / "carve4", tmp_path / "pair"
    run_training("csv", split_csv, single, settings=SETTINGS, seed=3, progress=False, tune_trials=TRIALS)
    run_training("csv", split_csv, other, settings={**SETTINGS, "carve_seed": "4"}, seed=3, progress=False,
                 tune_trials=TRIALS)  # fmt: skip
    metrics = run_training("csv", split_csv, pair, settings={**SETTINGS, "searches": "2"}, seed=3,
                           progress=False, tune_trials=TRIALS)  # fmt: skip
    one, four, two = load_artifact(single), load_artifact(other), load_artifact(pair)
    # The published network is the `--seed 3` run's refit; the first setting that run's search, the second
    # the search a `--set carve_seed=4` run makes (its own carve, its own network).
    np.testing.assert_allclose(two.user_embeddings, one.user_embeddings, rtol=0, atol=1e-6)
    assert two.inference == one.inference and two.averaged == (four.inference,)
    assert two.settings() == (one.inference, four.inference)
    assert [s["carve_seed"] for s in metrics["searches"]] == [3, 4]
    assert (
        metrics["searches"][1]["best_val_rmse"]
        == json.loads((other / "metrics.json").read_text())["tuning"]["best_val_rmse"]
    )
    # The second search's record is the carve_seed=4 run's (its network, its validation ratings), not the
    # first's (the tiny matrix's searches may choose alike settings: the records tell the searches apart).
    files = (pair / "tuning.search1.json", other / "tuning.json", single / "tuning.json")
    second, theirs, first = (json.loads(f.read_text()) for f in files)
    for key in ("best_val_rmse", "base_network_val_rmse"):
        assert second[key] == theirs[key] != first[key]
    # `dcmc evaluate` scores the mean of the two settings' distributions.
    result = evaluate(pair, split_csv)
    assert len(result["averaged"]) == 1
    assert isinstance(artifact_scorer(two)[1], MeanScorer)
    rows, cols = np.arange(10), np.arange(10) * 3 % two.config.n_items
    mean = predict_ratings(two, rows, cols, two.settings())
    each = [predict_ratings(two, rows, cols, s) for s in two.settings()]
    np.testing.assert_allclose(mean, np.mean(each, axis=0), rtol=0, atol=1e-12)


def test_searches_need_a_refit_on_one_carve() -> None:
    with pytest.raises(ConfigError, match="needs refit=true and folds=1"):
        TrainConfig(searches=2)
    with pytest.raises(ConfigError, match="needs refit=true and folds=1"):
        TrainConfig(searches=2, refit=True, folds=3)
    with pytest.raises(ConfigError, match="at least 1"):
        TrainConfig(searches=0)


def test_searches_without_a_search_say_so_and_serve_one_setting(
    split_csv: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="training.pipeline"):
        run_training("csv", split_csv, tmp_path / "untuned", settings={**SETTINGS, "searches": "2"}, seed=3,
                     progress=False, tune=False)  # fmt: skip
    assert "searches=2 unused" in caplog.text
    assert load_artifact(tmp_path / "untuned").averaged == ()
