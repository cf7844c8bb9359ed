"""The online fold-in's policy, chosen on the artifact's own validation ratings.

At fold-in (model/online.py) a rating user's embedding is recomputed by the row branch and may then be
refined by the decoder's likelihood of the user's ratings: for new users always, for users the network
was trained on only if that helps. On a converged network it neither helps nor hurts and costs about 7x
the fold-in time (benchmarks/results/fold_in_policy.md); on an under-trained one it helped. So each
artifact chooses (`choose_refine`):

- the users with at least 2 validation ratings (held out of training, never trained on; at most
  MAX_USERS of them, seeded) split theirs in two seeded halves: A arrives online, B is scored;
- the fold-in starts from the artifact without any validation rating known, takes A in batches of BATCH,
  and B is scored by the artifact's inference, once with every touched user refined (`all`) and once
  with only new users refined (`new`);
- `all` is kept only when it is better beyond doubt: the 95% interval of its RMSE minus `new`'s, over a
  paired bootstrap of the users, lies below 0. Otherwise the cheaper `new`.

The choice and its record go into config.json (`fold_in`); the service follows it unless
DCMC_FOLD_IN_REFINE says otherwise. The test split is not in the artifact and is not read.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from model.artifact import Artifact, load_artifact, rewritten
from model.engine import OnnxNetwork, expected_rating
from model.online import FoldIn
from model.ratings import Ratings

log = logging.getLogger(__name__)

MAX_USERS = 1000
"""Validation users the choice reads at most (a seeded sample): bounds its cost on large datasets."""

MIN_SCORED = 100
"""Fewest scored validation ratings a choice accepts; below that the artifact keeps the default (`all`)."""

BATCH = 100
"""Online ratings per fold-in batch, as a service at a few hundred ratings a second folds them in."""

BOOTSTRAP = 1000
"""Resamples of the users for the interval of the RMSE difference."""


def choose_refine(artifact: Artifact, seed: int = 0) -> dict[str, Any]:
    """The fold-in policy for `artifact` (see the module docstring): a record whose `refine` is `all` or
    `new`, or whose `skipped` says why no choice was made. With one BLAS thread, as a service worker runs:
    the refinement's small products ran 15x slower on 2 threads of 2 cores."""
    with threadpool_limits(limits=1):
        return _choose_refine(artifact, seed)


def _choose_refine(artifact: Artifact, seed: int) -> dict[str, Any]:
    held = artifact.held_out
    rng = np.random.default_rng(seed)
    users = np.flatnonzero(held.by_row.counts(np.arange(held.n_users)) >= 2)
    if len(users) > MAX_USERS:
        users = np.sort(rng.choice(users, MAX_USERS, replace=False))
    online, scored, owner = [], [], []
    for k, user in enumerate(users.tolist()):
        pos = rng.permutation(held.by_row.of(user))
        half = len(pos) // 2
        online.append(pos[:half])
        scored.append(pos[half:])
        owner.append(np.full(len(pos) - half, k))
    if not scored or sum(map(len, scored)) < MIN_SCORED:
        n = sum(map(len, scored))
        return {"skipped": f"{n} validation ratings to score (at least {MIN_SCORED}): refine `all` kept"}
    a = np.concatenate(online)[rng.permutation(sum(map(len, online)))]  # arrival order: random
    b, by_user = np.concatenate(scored), np.concatenate(owner)
    empty = Ratings(np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0), held.n_users, held.n_items)
    base = dataclasses.replace(artifact, held_out=empty, known_field=None)
    onnx = OnnxNetwork(artifact.files, threads=1)
    levels = artifact.levels
    arriving = [
        (artifact.users.external(int(r)), artifact.items.external(int(c)), float(v))
        for r, c, v in zip(held.rows[a], held.cols[a], held.values[a], strict=True)
    ]
    errors: dict[str, np.ndarray] = {}
    record: dict[str, Any] = {"users": len(users), "online": len(a), "scored": len(b), "batch": BATCH}
    for policy in ("all", "new"):
        fold = FoldIn(base, artifact.inference, onnx.embed_users, onnx.embed_items, policy == "all")
        started = time.perf_counter()
        for k in range(0, len(arriving), BATCH):
            fold.apply(arriving[k : k + BATCH])
        record[f"fold_in_s_{policy}"] = round(time.perf_counter() - started, 2)
        state = fold.state
        rows, cols = held.rows[b], held.cols[b]
        dist = state.scorer.predict(rows, cols, state.network.probabilities(rows, cols))
        predicted = np.clip(expected_rating(dist, levels), levels[0], levels[-1])
        errors[policy] = (predicted - held.values[b]) ** 2
        record[f"rmse_{policy}"] = round(float(np.sqrt(errors[policy].mean())), 5)
    low, high = difference_interval(errors["all"], errors["new"], by_user, rng)
    record["difference_95"] = [round(low, 5), round(high, 5)]
    record["refine"] = "all" if high < 0 else "new"
    log.info(
        "fold-in: refine %s (validation RMSE of %d ratings after %d arrived: all %.5f, new %.5f; "
        "all - new 95%% interval %.5f to %.5f; fold-in %.1fs against %.1fs)",
        record["refine"],
        len(b),
        len(a),
        record["rmse_all"],
        record["rmse_new"],
        low,
        high,
        record["fold_in_s_all"],
        record["fold_in_s_new"],
    )
    return record


def difference_interval(
    first: np.ndarray, second: np.ndarray, owner: np.ndarray, rng: np.random.Generator
) -> tuple[float, float]:
    """The 95% interval of RMSE(first) - RMSE(second), squared errors of the same ratings, by a paired
    bootstrap of their owners (users): both RMSEs of each resample read the same users."""
    users = int(owner.max()) + 1
    sums = [np.bincount(owner, weights=e, minlength=users) for e in (first, second)]
    counts = np.bincount(owner, minlength=users)
    draws = rng.integers(0, users, size=(BOOTSTRAP, users))
    n = np.maximum(counts[draws].sum(axis=1), 1)
    diff = np.sqrt(sums[0][draws].sum(axis=1) / n) - np.sqrt(sums[1][draws].sum(axis=1) / n)
    low, high = np.quantile(diff, [0.025, 0.975])
    return float(low), float(high)


def write_fold_in(directory: str | Path, record: dict[str, Any]) -> None:
    """Rewrite the artifact at `directory` with `record` as config.json's `fold_in` (a new manifest and so
    a new model version; atomic, like every artifact write)."""
    with rewritten(directory) as (_, config):
        config["fold_in"] = record


def choose_and_write(directory: str | Path, seed: int = 0) -> dict[str, Any]:
    """`choose_refine` for the artifact at `directory`, written into it when a choice was made."""
    record = choose_refine(load_artifact(directory), seed)
    if "refine" in record:
        write_fold_in(directory, record)
    return record
