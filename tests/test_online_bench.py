"""benchmarks/online.py (online_accuracy.py, harness.py): the pure helpers of the online-ratings benchmark
(no service, no training)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from model.config import InferenceConfig
from training.config import TrainConfig, preset
from training.data import Entries, RatingSplit, load_dataset

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the scripts import their siblings (harness.py) by name


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


online, harness = _load("online_accuracy"), _load("harness")


def test_held_out_users_are_a_seeded_tenth_of_the_users_with_training_ratings() -> None:
    rows = np.repeat(np.arange(0, 300, 3), 4)  # 100 distinct users, 4 ratings each
    held = online.select_users(rows, 0.1, 0)
    assert len(held) == 10 and len(np.unique(held)) == 10
    assert np.array_equal(held, np.sort(held)) and np.isin(held, rows).all()
    assert np.array_equal(held, online.select_users(rows[::-1], 0.1, 0))  # the set, not the order, counts
    assert not np.array_equal(held, online.select_users(rows, 0.1, 1))
    assert len(online.select_users(np.arange(943), 0.1, 0)) == 94


def _split() -> RatingSplit:
    train = Entries(np.array([0, 0, 1, 2, 2, 3]), np.array([0, 1, 1, 0, 2, 2]), np.array([5, 4, 3, 2, 1, 4]))
    test = Entries(np.array([0, 1, 3]), np.array([2, 0, 1]), np.array([3.0, 2.0, 5.0]))
    return RatingSplit("t", ["10", "11", "12", "13"], ["7", "8", "9"], np.arange(1.0, 6.0), train, None, test)


def test_the_dataset_writer_drops_exactly_the_held_out_users_training_ratings(tmp_path: Path) -> None:
    split = _split()
    keep = online.write_dataset(tmp_path, split, np.array([0, 2]))
    assert keep.tolist() == [False, False, True, False, False, True]
    train = (tmp_path / "train.csv").read_text().splitlines()
    test = (tmp_path / "test.csv").read_text().splitlines()
    assert train == ["user,item,rating", "11,8,3", "13,9,4"]
    assert test == ["user,item,rating", "10,9,3", "11,7,2", "13,8,5"]
    back = load_dataset("csv", tmp_path, split="u1")  # the trainer reads it as written
    assert len(back.train) == 2 and len(back.test) == 3
    assert back.user_ids == ["10", "11", "13"]  # a held-out user with test ratings keeps its id


def test_summaries_and_rmse() -> None:
    s = harness.summarize(range(1, 101))
    assert s["n"] == 100 and s["p50_ms"] == pytest.approx(50.5) and s["p99_ms"] == pytest.approx(99.01)
    assert s["max_ms"] == 100 and s["mean_ms"] == pytest.approx(50.5)
    assert harness.summarize([]) == {"n": 0}
    assert online.rmse(np.array([1.0, 3.0]), np.array([2.0, 2.0])) == pytest.approx(1.0)


def test_the_cold_start_plan_posts_each_users_first_n_then_the_rest() -> None:
    plan = online.steps((0, 1, 2), {7: 3, 8: 1})
    assert plan == [(0, {}), (1, {7: (0, 1), 8: (0, 1)}), (2, {7: (1, 2)}), (-1, {7: (2, 3)})]
    assert [list(c) for c in online.chunks(list(range(5)), 2)] == [[0, 1], [2, 3], [4]]


def test_time_order_sorts_each_users_ratings_by_timestamp_then_position() -> None:
    order = online.time_order(np.array([1, 0, 1, 0, 1]), np.array([5, 3, 2, 3, 2]))
    assert order[0].tolist() == [1, 3] and order[1].tolist() == [2, 4, 0]


def test_the_overrides_turn_the_csv_preset_into_the_base_artifacts_settings(tmp_path: Path) -> None:
    # The reduced model is trained as the base artifact was (its config.json), whatever the presets are.
    train = dataclasses.replace(preset("ml-100k").train, val_fraction=0.01, beta=0.0, epochs=7)
    inference = InferenceConfig.from_dict(
        {"mode": "exact", "crf": {"gamma": 1.5}, "kernel": {"known": "clamped", "co_rating": 3.0}}
    )
    model = {"n_users": 9, "n_items": 8, "levels": [1.0, 2.0], "hidden": [32, 16], "tau": 12.0}
    config = {
        "train": {**train.to_dict(), "preset": "default"},
        "model": model,
        "inference": inference.to_dict(),
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    pairs = dict(p.split("=", 1) for p in online.artifact_overrides(tmp_path, preset("csv"), TrainConfig))
    types = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    kinds = {"int": int, "float": float, "bool": lambda v: v == "true"}
    got = {k: kinds[types[k]](v) for k, v in pairs.items() if k in types}
    assert dataclasses.replace(preset("csv").train, **got) == dataclasses.replace(train, seed=0)
    assert pairs["hidden"] == "32,16" and "tau" not in pairs  # the csv preset's tau is the same
    settings = {k.removeprefix("inference."): v for k, v in pairs.items() if k.startswith("inference.")}
    assert preset("csv").inference.with_overrides(settings) == inference


def test_paired_bootstrap_of_the_gap() -> None:
    rng = np.random.default_rng(1)
    groups = np.repeat(np.arange(20), 5)
    truth = rng.integers(1, 6, 100).astype(float)
    good = truth + rng.normal(0, 0.5, 100)
    assert online.bootstrap_gap(groups, good, good, truth, n=200) == (0.0, 0.0)
    lo, hi = online.bootstrap_gap(groups, good, good + 1.0, truth, n=200)
    assert lo < hi < 0


def test_wrk_output_is_parsed() -> None:
    out = """Running 10s test @ http://127.0.0.1:1/ratings
  Latency Distribution
     50%    1.50ms
     75%    2.00ms
     90%    3.00ms
     99%   12.00ms
  5000 requests in 10.00s, 1.00MB read
  Non-2xx or 3xx responses: 3
Requests/sec:    500.00
"""
    r = harness.parse_wrk(out)
    assert r == {
        "rps": 500.0,
        "p50_ms": 1.5,
        "p99_ms": 12.0,
        "requests": 5000,
        "non_2xx": 3,
        "socket_errors": "",
    }
    assert harness.parse_wrk(out.replace("1.50ms", "900.00us"))["p50_ms"] == pytest.approx(0.9)
