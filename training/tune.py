"""Automatic selection of the inference settings on the artifact's own validation entries.

The `exact` CRF has a dozen settings (model/config.py declares them, and where each is searched). Which
ones help depends on the data: on ML-100K the co-rating terms decide, on Flixster a bias baseline mixed
into the output. Instead of constants picked by hand per dataset, `dcmc train` (and `dcmc tune` on an
existing artifact) searches them with Optuna's TPE sampler:

- the queries are the artifact's held-out validation ratings, carved from the training split (the
  network never trained on them); the CRF's known ratings are the training ratings alone, so that no
  validation rating predicts itself. The search reads nothing else: not the test split, which is not in
  the artifact at all;
- one search space for every dataset (`model.config.search_space`), with ranges in units of the rating
  scale and of the matrix size (`units`), so that one range fits ML-100K's 1..5 stars and YahooMusic's
  1..100;
- the first trial is the generic starting point `START` (what `--no-tune` serves); then TPE, seeded, for a
  fixed number of trials (deterministic), optionally cut by a time limit;
- the base network alone is scored too; the chosen settings are the best trial's when it beats the
  network on validation, else `mode=none`.

The artifact keeps the choice (config.json) and the whole record (tuning.json: every trial's settings and
validation RMSE, the network's, the budget and the time spent).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import optuna

from model import exact
from model.artifact import AVERAGED, Artifact, is_known_field_file, load_artifact, rewritten
from model.config import ConfigError, InferenceConfig, SearchRange, search_space
from model.engine import Network, expected_rating
from model.exact import ExactParts, ExactScorer, co_rating_affordable, gram_cost
from model.ratings import Ratings
from model.scorers import build_scorer, load_network
from training.export import save_exact_field

log = logging.getLogger(__name__)

TUNING = "tuning.json"

DEFAULT_TRIALS = 100
"""Trials of a search unless told otherwise (the cost per dataset: docs/inference.md, tune_cost.md)."""

MIN_VALIDATION = 100
"""Fewest validation ratings a search accepts: below that its RMSE is mostly noise."""

START: dict[str, float] = {
    "crf.gamma": 1.0,
    "crf.tau": 1.0,
    "kernel.same_user": 0.0,
    "kernel.same_item": 0.0,
    "kernel.co_rating": 1e6,
    "kernel.co_rating_user": 1e6,
    "kernel.co_rating_power": 3.0,
    "kernel.co_rating_shrink": 10.0,
    "kernel.co_rating_prior": 0.01,
    "output.baseline": 0.0,
}
"""The generic starting point, in the search space's units (0 = off): the same for every dataset. It is
the first trial of every search and the inference of an artifact trained with `--no-tune`."""

BASE: dict[str, Any] = {"mode": "exact", "kernel.known": "clamped", "kernel.scaling": "normalized"}
"""What every candidate shares: the exact CRF over every known rating, clamped to its label (what lets the
service fold ratings in incrementally), with normalized messages."""

CO_RATING = ("kernel.co_rating_power", "kernel.co_rating_shrink", "kernel.co_rating_prior")
"""Settings read only when a co-rating term is on (not sampled otherwise)."""

TABLES = {"items": "kernel.co_rating", "users": "kernel.co_rating_user"}
"""The co-rating term that reads each table."""


def unaffordable(known: Ratings) -> dict[str, int]:
    """The co-rating terms left off for these known ratings, with the co-rated pairs their sparse table
    would cost (`model.exact.co_rating_affordable`: above its GRAM_PAIR_BUDGET): {setting: pairs}."""
    tables = TABLES.items()
    return {term: gram_cost(known, what) for what, term in tables if not co_rating_affordable(known, what)}


def start_point(off: frozenset[str] | set[str] = frozenset()) -> dict[str, float]:
    """`START` with the terms `off` at 0 (those whose tables cost too much: `unaffordable`)."""
    return {name: 0.0 if name in off else value for name, value in START.items()}


def units(levels: np.ndarray, n_users: int, n_items: int) -> dict[str, float]:
    """The value of each search unit (model.config.SearchRange) for a rating scale and a matrix size."""
    levels = np.asarray(levels, dtype=np.float64)
    gap = float(np.median(np.diff(levels)))
    span = float(levels[-1] - levels[0])
    return {
        "": 1.0,
        "gap^-2": 1.0 / gap**2,
        "range^2": span**2,
        "users": float(n_users),
        "items": float(n_items),
    }


def settings_of(relative: dict[str, float], scale: dict[str, float]) -> dict[str, Any]:
    """Dotted inference overrides from values in search units (0 = off)."""
    space = search_space()
    out: dict[str, Any] = dict(BASE)
    for name, value in relative.items():
        out[name] = float(value) * scale[space[name].unit]
    return out


def start_inference(
    levels: np.ndarray, n_users: int, n_items: int, known: Ratings | None = None
) -> InferenceConfig:
    """`START` for this rating scale and matrix size (the inference of an untuned artifact), less the
    co-rating terms too costly for the `known` ratings (`unaffordable`) when given."""
    off = set(unaffordable(known)) if known is not None else set()
    for name in off:
        budget = exact.GRAM_PAIR_BUDGET
        log.warning("%s left off: its co-rating table costs more than %.0e pairs", name, budget)
    return InferenceConfig().with_overrides(settings_of(start_point(off), units(levels, n_users, n_items)))


def _sample(trial: optuna.Trial, off: frozenset[str] | set[str] = frozenset()) -> dict[str, float]:
    """One point of the search space, in its units (0 = off); the settings `off` stay at 0."""
    out: dict[str, float] = {}
    for name, r in search_space().items():
        if name in CO_RATING:
            continue
        out[name] = 0.0 if name in off else _suggest(trial, name, r)
    if out["kernel.co_rating"] > 0 or out["kernel.co_rating_user"] > 0:
        for name in CO_RATING:
            out[name] = _suggest(trial, name, search_space()[name])
    else:
        out.update({name: START[name] for name in CO_RATING})  # not read: kept at the start's values
    return out


def _suggest(trial: optuna.Trial, name: str, r: SearchRange) -> float:
    if r.off and not trial.suggest_categorical(f"{name}:on", [True, False]):
        return 0.0
    return float(trial.suggest_float(name, r.low, r.high, log=r.log))


def _params(relative: dict[str, float], off: frozenset[str] | set[str] = frozenset()) -> dict[str, Any]:
    """The Optuna parameters that `_sample` turns into `relative` (to enqueue a known point)."""
    space = search_space()
    co_rated = relative["kernel.co_rating"] > 0 or relative["kernel.co_rating_user"] > 0
    params: dict[str, Any] = {}
    for name, value in relative.items():
        if (name in CO_RATING and not co_rated) or name in off:
            continue
        if space[name].off:
            params[f"{name}:on"] = value > 0
        if value > 0 or not space[name].off:
            params[name] = value
    return params


@dataclass
class Tuning:
    """The outcome of a search: the chosen inference and the record of every trial."""

    chosen: InferenceConfig
    record: dict[str, Any] = field(default_factory=dict)


def _rmse(pred: np.ndarray, truth: np.ndarray) -> float:
    return float(np.sqrt(np.mean((pred - truth) ** 2)))


def tune(
    artifact: Artifact | Sequence[Artifact],
    trials: int = DEFAULT_TRIALS,
    timeout: float | None = None,
    seed: int = 0,
    progress: bool = True,
) -> Tuning:
    """Search the inference settings on the artifact's validation ratings (module docstring). Reads the
    artifact alone. `timeout` (seconds) stops the search early (then the number of trials depends on the
    machine); `trials` bounds it.

    Several artifacts (the folds of `TrainConfig.folds`: one matrix, each network trained without its own
    validation ratings) are searched together: a candidate's score is the RMSE over all their validation
    ratings, each predicted by its own network and CRF over its own known ratings."""
    if trials < 1:
        raise ConfigError(f"trials must be at least 1, got {trials}")
    artifacts = [artifact] if isinstance(artifact, Artifact) else list(artifact)
    n_val = sum(len(a.held_out) for a in artifacts)
    if n_val < MIN_VALIDATION:
        raise ConfigError(
            f"the artifact holds {n_val} validation ratings; a search needs at least {MIN_VALIDATION} "
            "(train with a larger --set val_fraction=..., or --no-tune)"
        )
    started = time.perf_counter()
    folds = [_Fold.of(a) for a in artifacts]
    levels = artifacts[0].levels
    scale = units(levels, folds[0].network.n_users, folds[0].network.n_items)
    costly: dict[str, int] = {}
    for f in folds:
        for name, pairs in unaffordable(f.known).items():
            costly[name] = max(costly.get(name, 0), pairs)
    off = set(costly)
    for name, pairs in costly.items():
        log.warning("%s left out of the search: its co-rating table costs %.2g pairs", name, pairs)
    start = start_point(off)
    truth = np.concatenate([f.val.values for f in folds])

    def score(inference: InferenceConfig) -> float:
        pred = np.concatenate([f.predict(inference) for f in folds])
        return _rmse(np.clip(expected_rating(pred, levels), levels[0], levels[-1]), truth)

    probs = np.concatenate([f.probs for f in folds])
    base_rmse = _rmse(np.clip(expected_rating(probs, levels), levels[0], levels[-1]), truth)
    record: list[dict[str, Any]] = []

    def objective(trial: optuna.Trial) -> float:
        t0 = time.perf_counter()
        relative = _sample(trial, off)
        inference = InferenceConfig().with_overrides(settings_of(relative, scale))
        value = score(inference)
        record.append(
            {
                "trial": trial.number,
                "relative": relative,
                "settings": _flat(inference),
                "val_rmse": value,
                "seconds": round(time.perf_counter() - t0, 4),
            }
        )
        return value

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the progress bar and the record say enough
    sampler = optuna.samplers.TPESampler(seed=seed)
    study = optuna.create_study(direction="minimize", sampler=sampler)
    study.enqueue_trial(_params(start, off))
    bar = _progress(trials, progress)
    try:
        study.optimize(
            objective,
            n_trials=trials,
            timeout=timeout,
            callbacks=[lambda s, t: bar.update(1, best=s.best_value)] if bar else None,
        )
    finally:
        if bar:
            bar.close()
    best = min(record, key=lambda r: (r["val_rmse"], r["trial"]))
    if best["val_rmse"] < base_rmse:
        chosen = InferenceConfig().with_overrides(settings_of(best["relative"], scale))
        why = f"trial {best['trial']}: validation RMSE {best['val_rmse']:.5f} < base network {base_rmse:.5f}"
    else:
        chosen = InferenceConfig(mode="none")
        why = f"no trial beat the base network on validation ({best['val_rmse']:.5f} >= {base_rmse:.5f})"
    seconds = time.perf_counter() - started
    log.info("inference chosen in %.1fs over %d trials: %s", seconds, len(record), why)
    summary = {
        "method": "optuna TPE, seeded; first trial = training.tune.START; queries = the artifact's held-out "
        "validation ratings, known = its training ratings; the test split is not read",
        "optuna": optuna.__version__,
        "seed": seed,
        "trials_requested": trials,
        "timeout_s": timeout,
        "trials_run": len(record),
        "seconds": round(seconds, 2),
        "n_validation": n_val,
        "n_known": [len(f.known) for f in folds] if len(folds) > 1 else len(folds[0].known),
        **({"folds": len(folds)} if len(folds) > 1 else {}),
        "units": scale,
        "search_space": {name: asdict(r) for name, r in search_space().items()},
        "start": start,
        "left_off": {"budget_pairs": exact.GRAM_PAIR_BUDGET, "terms": costly},
        "base_network_val_rmse": base_rmse,
        "best_trial": best["trial"],
        "best_val_rmse": best["val_rmse"],
        "chosen": chosen.to_dict(),
        "why": why,
        "trials": record,
    }
    return Tuning(chosen=chosen, record=summary)


@dataclass
class _Fold:
    """One artifact of a search: its network, known ratings (its training ratings: the validation ratings
    are the queries, not known to the CRF), the CRF's reusable parts, and its queries' network outputs."""

    network: Network
    known: Ratings
    parts: ExactParts
    val: Ratings
    probs: np.ndarray

    @classmethod
    def of(cls, artifact: Artifact) -> _Fold:
        network = load_network(artifact)
        known, val = artifact.train, artifact.held_out
        return cls(network, known, ExactParts(network, known), val, network.probabilities(val.rows, val.cols))

    def predict(self, inference: InferenceConfig) -> np.ndarray:
        """The level distributions of the queries under `inference`."""
        scorer = build_scorer(self.network, self.known, inference, parts=self.parts)
        return scorer.predict(self.val.rows, self.val.cols, self.probs)


def _flat(inference: InferenceConfig) -> dict[str, Any]:
    """The searched settings of an inference config, by dotted name."""
    d = inference.to_dict()
    out: dict[str, Any] = {"mode": d["mode"]}
    for name in search_space():
        group, _, setting = name.partition(".")
        out[name] = d[group][setting]
    return out


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    class _Bar:
        def __init__(self) -> None:
            self.bar = tqdm(total=total, desc="tune", unit="trial")

        def update(self, n: int, best: float) -> None:
            self.bar.set_postfix(best_val_rmse=f"{best:.4f}", refresh=False)
            self.bar.update(n)

        def close(self) -> None:
            self.bar.close()

    return _Bar()


def record_tuning(directory: Path, config: dict[str, Any], tuning: Tuning, artifact: Artifact) -> None:
    """Write the choice into an artifact being written in `directory` (of `artifact`'s network and known
    ratings): `config`'s inference, tuning.json and the known field for the new settings (over all known
    ratings, as the service reads it)."""
    config["inference"] = tuning.chosen.to_dict()
    config.pop(AVERAGED, None)  # one search's choice replaces a mean of several
    (directory / TUNING).write_text(json.dumps(tuning.record, indent=2) + "\n")
    if tuning.chosen.mode == "exact":
        scorer = build_scorer(load_network(artifact), artifact.known(), tuning.chosen)
        assert isinstance(scorer, ExactScorer)
        save_exact_field(scorer, directory)


def write_tuning(directory: str | Path, tuning: Tuning) -> Path:
    """Rewrite the artifact at `directory` with the chosen inference (`record_tuning`): a new manifest and
    so a new model version. Atomic, like every artifact write."""
    directory = Path(directory)
    artifact = load_artifact(directory)  # verifies the checksums first
    with rewritten(directory, drop=lambda name: name == TUNING or is_known_field_file(name)) as (tmp, config):
        record_tuning(tmp, config, tuning, artifact)
    return directory


def tune_artifact(
    directory: str | Path,
    trials: int = DEFAULT_TRIALS,
    timeout: float | None = None,
    seed: int = 0,
    progress: bool = True,
) -> Tuning:
    """`tune` the artifact at `directory` and write the choice into it."""
    tuning = tune(load_artifact(directory), trials=trials, timeout=timeout, seed=seed, progress=progress)
    write_tuning(directory, tuning)
    return tuning
