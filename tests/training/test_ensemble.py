"""`TrainConfig.ensemble`: several networks trained, published as one fused network (model.network.fuse)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from model.artifact import load_artifact
from model.config import ConfigError
from model.engine import OnnxNetwork
from training.config import TrainConfig, preset
from training.evaluate import evaluate
from training.pipeline import run_training

SETTINGS = {"epochs": "3", "val_fraction": "0.1", "refit": "true"}


def test_an_ensemble_publishes_its_members_side_by_side_member_0_being_the_single_network(
    split_csv: Path, tmp_path: Path
) -> None:
    single, pair = tmp_path / "single", tmp_path / "pair"
    run_training("csv", split_csv, single, settings=SETTINGS, seed=3, progress=False, tune_trials=3)
    metrics = run_training("csv", split_csv, pair, settings={**SETTINGS, "ensemble": "2"}, seed=3,
                           progress=False, tune_trials=3)  # fmt: skip
    one, two = load_artifact(single), load_artifact(pair)
    d = preset("csv").model.get("hidden", (512, 128))[-1]
    assert one.config.hidden[-1] == d and two.config.hidden == tuple(2 * h for h in one.config.hidden)
    assert two.meta["train"]["ensemble"] == 2 and two.meta["train"]["refit"] is True
    # Member 0 is the network `--seed 3` trains alone (the carve's and the refit's): its embeddings are
    # the first d columns of the ensemble's; member 1 (seed 1003) is another network.
    u1, u2 = np.load(single / "user_embeddings.npy"), np.load(pair / "user_embeddings.npy")
    assert u2.shape == (len(u1), 2 * d)
    np.testing.assert_allclose(u2[:, :d], u1, atol=1e-5)
    assert not np.allclose(u2[:, d:], u1, atol=1e-2)
    assert [m["seed"] for m in metrics["members"]] == [3, 1003]
    assert all(isinstance(m["val_rmse"], float) for m in metrics["members"])
    assert isinstance(metrics["val_rmse"], float)  # the fused network's, on the carve
    # The exported graphs are the fused network's: ONNX Runtime embeds a row to 2d numbers.
    onnx = OnnxNetwork(two.files)
    rows = np.zeros((2, two.config.n_items), dtype=np.float32)
    assert onnx.embed_users(rows).shape == (2, 2 * d)
    assert evaluate(pair, split_csv)["n"] > 0


def test_an_ensemble_cannot_keep_each_members_best_epoch() -> None:
    with pytest.raises(ConfigError, match="ensemble > 1 with keep_best"):
        TrainConfig(ensemble=2, keep_best=True)
    with pytest.raises(ConfigError, match="at least 1"):
        TrainConfig(ensemble=0)
