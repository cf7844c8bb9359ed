"""How well the rating-level distributions forecast ratings, and a temperature that calibrates them.

`scores` gives the log loss and the expected calibration error of distributions against ratings (what
`dcmc evaluate` reports). `choose_temperature` picks, on an artifact's held-out validation ratings (unknown
to the CRF while they are predicted), the temperature T of `tempered` (p_l^(1/T), normalised) with the
lowest validation log loss; the artifact keeps it only where it lowers that log loss (config.json
`calibration`), and the service then serves tempered distributions. The predicted rating stays the
expected rating of the untempered distribution, so RMSE and MAE do not change.
"""

from __future__ import annotations

from typing import Any

import numpy as np

ECE_BINS = 15
"""Equal-width bins of the top level's probability in the expected calibration error."""

TEMPERATURES = tuple(round(0.5 + 0.05 * k, 2) for k in range(51))
"""The temperatures tried: 0.5 (sharper) to 3.0 (flatter), in steps of 0.05; 1 leaves a distribution as
it is."""

MAX_RATINGS = 20_000
"""Validation ratings a choice reads at most (a seeded sample of them)."""

MIN_RATINGS = 50
"""Fewer validation ratings than this: no temperature is chosen."""


def nearest_levels(truth: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """The index of each rating's nearest level."""
    levels = np.asarray(levels, dtype=np.float64)
    return np.asarray(np.abs(np.asarray(truth, dtype=np.float64)[:, None] - levels[None, :]).argmin(axis=1))


def tempered(probs: np.ndarray, temperature: float) -> np.ndarray:
    """Distributions (K, levels) with each probability raised to 1 / temperature, normalised per row
    (a softmax of log p / T): T > 1 flattens, T < 1 sharpens, 1 is the identity."""
    if temperature == 1.0:
        return probs
    logp = np.log(np.clip(probs, 1e-300, None)) / temperature
    logp -= logp.max(axis=-1, keepdims=True)
    out = np.exp(logp)
    return np.asarray(out / out.sum(axis=-1, keepdims=True))


def log_loss(probs: np.ndarray, true: np.ndarray) -> float:
    """Mean negative natural log of the probability of each rating's level index `true` (each at least
    1e-12)."""
    picked = probs[np.arange(len(true)), true]
    return float(-np.mean(np.log(np.clip(picked, 1e-12, None))))


def scores(probs: np.ndarray, truth: np.ndarray, levels: np.ndarray) -> dict[str, float]:
    """How well the level distributions `probs` (K, levels) forecast the ratings `truth` (K,): the log
    loss (`log_loss`) and the expected calibration error of the top level (ECE_BINS equal-width bins of
    its probability: the bins' |share of ratings at that level - mean probability|, weighted by their
    counts). A rating off the levels counts as its nearest level."""
    true = nearest_levels(truth, levels)
    top = probs.argmax(axis=1)
    confidence = probs.max(axis=1)
    hit = (top == true).astype(np.float64)
    bins = np.minimum((confidence * ECE_BINS).astype(np.int64), ECE_BINS - 1)
    ece = 0.0
    for b in range(ECE_BINS):
        inside = bins == b
        if inside.any():
            ece += inside.mean() * abs(hit[inside].mean() - confidence[inside].mean())
    return {"log_loss": log_loss(probs, true), "ece": float(ece)}


def best_temperature(probs: np.ndarray, truth: np.ndarray, levels: np.ndarray) -> dict[str, Any]:
    """The temperature of TEMPERATURES with the lowest log loss of `probs` against `truth`, with the log
    loss at it and at 1."""
    true = nearest_levels(truth, levels)
    losses = {t: log_loss(tempered(probs, t), true) for t in TEMPERATURES}
    chosen = min(losses, key=lambda t: (losses[t], abs(t - 1.0)))
    return {"temperature": chosen, "log_loss": losses[chosen], "log_loss_at_1": losses[1.0]}


def choose_temperature(artifact: Any, seed: int = 0) -> dict[str, Any]:
    """The artifact's temperature, chosen on its held-out validation ratings (up to MAX_RATINGS, unknown
    to the CRF while they are predicted, under the artifact's own inference settings): a record with
    `temperature` where it lowers the validation log loss, else one saying why none is kept."""
    from model.scorers import artifact_scorer, predict_distributions

    held = artifact.held_out
    n = len(held.values)
    if n < MIN_RATINGS:
        return {"skipped": f"{n} validation ratings (fewer than {MIN_RATINGS})"}
    pick = np.arange(n)
    if n > MAX_RATINGS:
        pick = np.sort(np.random.default_rng(seed).choice(n, MAX_RATINGS, replace=False))
    network, scorer = artifact_scorer(artifact, None, include_held_out=False)
    probs = np.asarray(predict_distributions(network, scorer, held.rows[pick], held.cols[pick]), np.float64)
    found = best_temperature(probs, held.values[pick], artifact.levels)
    record = {
        "ratings": len(pick),
        "val_log_loss_at_1": round(found["log_loss_at_1"], 5),
        "val_log_loss": round(found["log_loss"], 5),
        "rule": "the temperature of 0.5..3.0 with the lowest validation log loss, kept where it lowers it",
    }
    if found["temperature"] == 1.0 or found["log_loss"] >= found["log_loss_at_1"]:
        return {"skipped": "no temperature lowers the validation log loss", **record}
    return {"temperature": found["temperature"], **record}
