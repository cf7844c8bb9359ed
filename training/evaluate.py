"""Offline evaluation of an artifact on its dataset's test split (numpy engine, no torch)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from model.artifact import Artifact, load_artifact
from model.calibration import scores, tempered
from model.config import InferenceConfig
from model.engine import expected_rating
from model.scorers import artifact_scorer, predict_distributions
from training.data import DataError, Entries, RatingSplit, carve_validation, load_dataset


def read_settings(inference: InferenceConfig) -> dict[str, Any]:
    """The settings the mode in force reads, nested by group (what a result line records)."""
    out: dict[str, Any] = {}
    for group, values in inference.to_dict().items():
        if group == "mode":
            out[group] = values
            continue
        read = {k: v for k, v in values.items() if inference.reads(f"{group}.{k}")}
        if read:
            out[group] = read
    return out


def map_entries(
    artifact: Artifact, user_ids: list[str], item_ids: list[str], entries: Entries
) -> tuple[np.ndarray, np.ndarray]:
    """Indices of `entries` (indexed by the dataset's id lists) in the artifact's id maps."""
    users = artifact.users.indices([user_ids[i] for i in entries.rows])
    items = artifact.items.indices([item_ids[j] for j in entries.cols])
    return users, items


def predict_ratings(
    artifact: Artifact,
    rows: np.ndarray,
    cols: np.ndarray,
    inference: InferenceConfig | Sequence[InferenceConfig],
    include_held_out: bool = True,
) -> np.ndarray:
    """Expected ratings of artifact-indexed entries under `inference` (several settings: the mean of
    their distributions); `include_held_out=False` when scoring the held-out validation ratings
    themselves (they must not be known ratings then)."""
    probs = predict_levels(artifact, rows, cols, inference, include_held_out)
    return expected_rating(probs, artifact.levels)


def predict_levels(
    artifact: Artifact,
    rows: np.ndarray,
    cols: np.ndarray,
    inference: InferenceConfig | Sequence[InferenceConfig],
    include_held_out: bool = True,
) -> np.ndarray:
    """The rating-level distributions (K, levels) of artifact-indexed entries (`predict_ratings`)."""
    network, scorer = artifact_scorer(artifact, inference, include_held_out)
    return np.asarray(predict_distributions(network, scorer, rows, cols), dtype=np.float64)


def held_out(artifact: Artifact, split: RatingSplit, part: str) -> Entries:
    """The artifact's test entries, or the validation entries it was trained without.

    A dataset without a validation split had one carved from its training entries by the trainer; the
    artifact's training config (fraction and seed) carves the same entries again.
    """
    if part == "test":
        return split.test
    if part != "val":
        raise DataError(f"unknown evaluation part {part!r}; choose 'test' or 'val'")
    if artifact.meta.get("train", {}).get("refit"):
        raise DataError(
            f"{artifact.path}: refit on every training rating (`refit`), so no validation ratings are left; "
            "evaluate on 'test' (the carve's validation figures are in its metrics.json)"
        )
    if split.val is not None:
        return split.val
    train_cfg = artifact.meta.get("train", {})
    fraction = float(train_cfg.get("val_fraction", 0.0))
    if fraction <= 0:
        raise DataError(f"{artifact.path}: trained without a validation split; evaluate on 'test'")
    seed = train_cfg.get("carve_seed")  # TrainConfig.carve: carve_seed, else the training seed
    if seed is None:
        seed = train_cfg.get("seed", 0)
    return carve_validation(split.train, fraction, int(seed))[1]


def evaluate(
    artifact_dirs: str | Path | Sequence[str | Path],
    data_dir: str | Path,
    *,
    overrides: dict[str, Any] | None = None,
    part: str = "test",
) -> dict[str, Any]:
    """RMSE and MAE of the artifact on its test (or validation) entries; returns a JSON-ready dict.
    `overrides`: inference settings by dotted name (`crf.gamma`), applied to the artifact's.

    Several artifacts of one dataset and split are an ensemble: each predicts with its own inference
    settings (and `overrides`), and their expected ratings are averaged, which is the expected rating
    of their averaged level distributions. On `val` they must hold the same validation entries out
    (`--set carve_seed=K` when they were trained with different seeds)."""
    dirs = [artifact_dirs] if isinstance(artifact_dirs, (str, Path)) else list(artifact_dirs)
    if not dirs:
        raise DataError("evaluate needs at least one artifact")
    artifacts = [load_artifact(d) for d in dirs]
    ds = artifacts[0].meta["dataset"]
    where = (ds["name"], ds.get("split", "u1"), ds.get("seed", 0))
    for other in artifacts[1:]:
        o = other.meta["dataset"]
        if (o["name"], o.get("split", "u1"), o.get("seed", 0)) != where:
            raise DataError(
                f"an ensemble is of one dataset and split: {other.path} holds {o['name']} split "
                f"{o.get('split')} (seed {o.get('seed', 0)}), {artifacts[0].path} {where[0]} split "
                f"{where[1]} (seed {where[2]})"
            )
    split = load_dataset(where[0], data_dir, split=where[1], seed=where[2])
    entries = held_out(artifacts[0], split, part)
    for other in artifacts[1:]:
        if part == "val" and not _same_entries(held_out(other, split, part), entries):
            raise DataError(
                f"{other.path} and {artifacts[0].path} hold different validation ratings out: train the "
                "members of an ensemble with one --set carve_seed=K to score them together on 'val'"
            )
    t0 = time.perf_counter()
    inferences = [a.settings(overrides) for a in artifacts]
    members, distributions = [], []
    for artifact, inference in zip(artifacts, inferences, strict=True):
        rows, cols = map_entries(artifact, split.user_ids, split.item_ids, entries)
        probs = predict_levels(artifact, rows, cols, inference, include_held_out=part != "val")
        distributions.append(probs)
        members.append(expected_rating(probs, artifact.levels))
    seconds = time.perf_counter() - t0
    pred = np.mean(members, axis=0)  # the expected rating of the averaged distributions
    inference, *averaged = inferences[0]
    result = {
        "dataset": where[0],
        "split": where[1],
        "on": part,
        "model_version": artifacts[0].model_version,
        "inference": inference.mode,
        **_errors(pred, entries.values),
        **_calibration(artifacts, np.mean(distributions, axis=0), entries.values),
        "n": len(entries),
        "settings": read_settings(inference),
        **({"averaged": [read_settings(a) for a in averaged]} if averaged else {}),
        "seconds": round(seconds, 3),
    }
    if len(artifacts) > 1:
        result["model_version"] = [a.model_version for a in artifacts]
        result["members"] = [_errors(p, entries.values) for p in members]
    return result


def _calibration(artifacts: list[Artifact], probs: np.ndarray, truth: np.ndarray) -> dict[str, Any]:
    """`log_loss` and `ece` of the distributions as the service serves them: tempered by the artifact's
    `calibration` temperature where it has one (an ensemble's averaged distributions: untempered), then
    the untempered figures beside them."""
    levels = artifacts[0].levels
    temperature = float((artifacts[0].meta.get("calibration") or {}).get("temperature", 1.0))
    if len(artifacts) > 1 or temperature == 1.0:
        return scores(probs, truth, levels)
    return {
        **scores(tempered(probs, temperature), truth, levels),
        "temperature": temperature,
        "uncalibrated": scores(probs, truth, levels),
    }


def _errors(pred: np.ndarray, truth: np.ndarray) -> dict[str, float]:
    err = pred - truth
    return {"rmse": float(np.sqrt(np.mean(err**2))), "mae": float(np.mean(np.abs(err)))}


def _same_entries(a: Entries, b: Entries) -> bool:
    return len(a) == len(b) and bool(np.array_equal(a.rows, b.rows) and np.array_equal(a.cols, b.cols))
