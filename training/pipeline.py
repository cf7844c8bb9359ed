"""From a dataset name to a published artifact: the work behind `dcmc train`."""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from model.artifact import AVERAGED, load_artifact, load_staged
from model.calibration import choose_temperature
from model.catalogue import ItemRecord, read_items, read_movielens_items
from model.config import ConfigError, InferenceConfig, ModelConfig
from model.network import DCMC
from model.ranking import choose_diversity
from model.ratings import Ratings
from training.config import (
    BLOCK_ENTRIES,
    TrainConfig,
    preset,
    resolve_model_settings,
    sized_blocks,
    sized_network,
)
from training.data import Entries, RatingSplit, carve_validation, fold_carves, load_dataset
from training.export import write_artifact
from training.fold_in import choose_and_write, choose_refine
from training.online import read_online_ratings, with_item_changes, with_online
from training.trainer import History, RatingMatrix, member_seed, train_ensemble
from training.tune import (
    DEFAULT_TRIALS,
    MIN_VALIDATION,
    TUNING,
    Tuning,
    record_tuning,
    start_inference,
    write_tuning,
)
from training.tune import tune as search_inference  # `tune` is run_training's switch

log = logging.getLogger(__name__)

FOLD_IN_SUMMARY = (
    "refine",
    "skipped",
    "rmse_all",
    "rmse_new",
    "difference_95",
    "fold_in_s_all",
    "fold_in_s_new",
)
"""What the training metrics keep of the fold-in choice's record (training/fold_in.py)."""


@dataclass(frozen=True)
class _Run:
    """What every network of one `run_training` shares: the carve's, the other folds' and the refit's."""

    data: RatingSplit
    model_cfg: ModelConfig
    train_cfg: TrainConfig
    preset_name: str
    dataset_record: dict[str, Any]
    ckpt: Path
    resume: bool
    progress: bool
    rank0: bool
    catalogue: dict[str, ItemRecord] | None = None

    def fit(
        self,
        train_cfg: TrainConfig,
        entries: Entries,
        val: Entries | None,
        name: str | None = None,
        model_cfg: ModelConfig | None = None,
    ) -> tuple[DCMC, RatingMatrix, History]:
        """Train a network of the run (`model_cfg`: another than the run's): the first's checkpoints go
        to `ckpt`, another's beside them (`<ckpt>.<name>`)."""
        checkpoints = self.ckpt if name is None else self.ckpt.parent / f"{self.ckpt.name}.{name}"
        model_cfg = model_cfg or self.model_cfg
        return train_ensemble(model_cfg, train_cfg, entries, val, checkpoint_dir=checkpoints,
                              resume=self.resume, progress=self.progress)  # fmt: skip

    def train_record(self, train_cfg: TrainConfig) -> dict[str, Any]:
        """The training config an artifact of the run records."""
        return {**train_cfg.to_dict(), "preset": self.preset_name}


def split_overrides(
    settings: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Route `key=value` overrides to ModelConfig or TrainConfig fields, converting types, or (keys
    `inference.<group>.<name>`) to the artifact's inference settings."""
    model_fields = {f.name: f for f in fields(ModelConfig)}
    train_fields = {f.name: f for f in fields(TrainConfig)}
    model: dict[str, Any] = {}
    train: dict[str, Any] = {}
    inference: dict[str, Any] = {}
    for key, raw in settings.items():
        if key.startswith("inference."):
            inference[key.removeprefix("inference.")] = raw
            continue
        if key in ("n_users", "n_items", "levels"):
            raise ConfigError(f"{key} comes from the data and cannot be set")
        target, known = (model, model_fields) if key in model_fields else (train, train_fields)
        if key not in known:
            raise ConfigError(
                f"unknown setting {key!r}; model: {sorted(model_fields)}, train: {sorted(train_fields)}, "
                "inference: inference.<group>.<name> (docs/inference.md)"
            )
        target[key] = _convert(key, raw, str(known[key].type))
    return model, train, inference


def _convert(key: str, raw: Any, type_name: str) -> Any:
    if not isinstance(raw, str):
        return raw
    try:
        if type_name == "bool":
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1")
        if type_name in ("int", "int | None"):
            return int(raw)
        if type_name == "float":
            if key == "input_center" and raw == "mean":
                return raw  # the training ratings' mean, resolved by run_training
            return float(raw)
        if type_name.startswith("tuple[int"):
            return tuple(int(x) for x in raw.split(","))
    except ValueError:
        raise ConfigError(f"setting {key}={raw!r}: expected {type_name}") from None
    return raw


def run_training(
    dataset: str,
    data_dir: str | Path,
    out: str | Path,
    *,
    split: str = "u1",
    split_seed: int = 0,
    preset_name: str = "default",
    epochs: int | None = None,
    seed: int | None = None,
    settings: dict[str, Any] | None = None,
    checkpoint_dir: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    tune: bool = True,
    tune_trials: int | None = None,
    tune_timeout: float | None = None,
    online_ratings: str | None = None,
    online_prefix: str = "dcmc",
    items: str | Path | None = None,
) -> dict[str, Any]:
    """Load data, train, and (on rank 0) write the artifact; returns the training metrics.

    With a preset that searches its inference (`default`), the settings are then chosen on the validation
    entries (training/tune.py) unless `tune` is False or inference settings were given (`settings`
    `inference.*`: an explicit choice is kept); untuned, the artifact serves training.tune.START.
    `online_ratings`: a Redis URL whose stream `<online_prefix>:ratings` (the service's online ratings)
    adds training ratings (training/online.py); the artifact records how far it was read. `items`: a
    catalogue file (model/catalogue.py `read_items`) the artifact keeps; for MovieLens-100K without one,
    its own u.item when the data directory has it."""
    catalogue = _catalogue(dataset, data_dir, items)  # read first: a bad file fails before the training
    chosen = preset(dataset, preset_name)
    model_over, train_over, inference_over = split_overrides(settings or {})
    if epochs is not None:
        train_over["epochs"] = epochs
    if seed is not None:
        train_over["seed"] = seed
    train_cfg = replace(chosen.train, **train_over)
    data_seed = split_seed  # random splits stay fixed across training seeds
    data = load_dataset(dataset, data_dir, split=split, seed=data_seed)
    dataset_record: dict[str, Any] = {"name": dataset, "split": split, "seed": data_seed}
    if online_ratings:  # the service's rating stream: extra training ratings (training/online.py)
        online = read_online_ratings(online_ratings, online_prefix, levels=data.levels)
        data, dataset_record["online_ratings"] = with_online(data, online)
        catalogue, skipped = with_item_changes(catalogue, online)  # and its catalogue changes
        dataset_record["online_ratings"]["item_changes"] = len(online.item_changes) - skipped
    sized_model: dict[str, Any] = {}
    if dataset == "csv" and preset_name == "default":  # a large matrix trains another network
        sized_model, sized_train = sized_network(len(data.train))
        if sized_model:
            log.info("%d training ratings: the network for large matrices (%s)", len(data.train), sized_model)
            train_cfg = replace(train_cfg, **{k: v for k, v in sized_train.items() if k not in train_over})
    carves: list[tuple[Entries, Entries]] = []
    if "folds" in train_over and train_cfg.folds > 1 and not (train_cfg.refit and data.val is None):
        why = "the dataset has its own validation split" if data.val is not None else "refit is off"
        log.warning("folds=%d unused: %s (the folds choose the settings of a refit)", train_cfg.folds, why)
    if data.val is not None:
        train_entries, val_entries = data.train, data.val
    elif train_cfg.folds > 1 and train_cfg.refit and tune and not inference_over:
        carves = fold_carves(data.train, train_cfg.folds, train_cfg.carve)
        train_entries, val_entries = carves[0]
    elif train_cfg.val_fraction > 0:
        train_entries, val_entries = carve_validation(data.train, train_cfg.val_fraction, train_cfg.carve)
    else:
        train_entries, val_entries = data.train, None

    def model_for(entries: Entries) -> ModelConfig:  # the model settings resolved on these training ratings
        return ModelConfig(
            n_users=data.n_users,
            n_items=data.n_items,
            levels=tuple(float(x) for x in data.levels),
            **resolve_model_settings({**chosen.model, **sized_model, **model_over}, entries.values),
        )

    model_cfg = model_for(train_entries)
    inference = chosen.inference
    if chosen.tune:
        inference = start_inference(
            np.asarray(model_cfg.levels),
            model_cfg.n_users,
            model_cfg.n_items,
            Ratings(data.train.rows, data.train.cols, data.train.values, data.n_users, data.n_items),
        )
    inference = inference.with_overrides(inference_over)
    if dataset == "csv" and preset_name == "default" and not {"block_rows", "block_cols"} & set(train_over):
        rows, cols = sized_blocks(
            train_cfg.block_rows, train_cfg.block_cols, data.n_users, data.n_items, len(data.train)
        )
        if (rows, cols) != (train_cfg.block_rows, train_cfg.block_cols):
            log.info("blocks of %d x %d (%d expected ratings each)", rows, cols, BLOCK_ENTRIES)
            train_cfg = replace(train_cfg, block_rows=rows, block_cols=cols)
    log.info(
        "%s: %d users x %d items, %d train / %d validation / %d test ratings, %d levels",
        dataset,
        data.n_users,
        data.n_items,
        len(train_entries),
        len(val_entries or []),
        len(data.test),
        model_cfg.n_levels,
    )
    out = Path(out)
    ckpt = Path(checkpoint_dir) if checkpoint_dir else out.parent / f"{out.name}.ckpt"
    rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    run = _Run(
        data, model_cfg, train_cfg, preset_name, dataset_record, ckpt, resume, progress, rank0, catalogue
    )
    if catalogue is not None:
        rated = set(data.item_ids)
        both = sum(1 for x in catalogue if x in rated)
        log.info("catalogue: %d items, %d of them rated; %d rated items have no record", len(catalogue),
                 both, len(rated) - both)  # fmt: skip
    t0 = time.perf_counter()
    model, matrix, history = run.fit(train_cfg, train_entries, val_entries)
    seconds = time.perf_counter() - t0
    last = history.epochs[-1] if history.epochs else {}
    if history.best is not None:  # keep_best: the published network is that epoch's
        last = next(r for r in history.epochs if r["epoch"] == history.best["epoch"])
    metrics: dict[str, Any] = {
        "train_seconds": round(seconds, 2),
        "epochs": train_cfg.epochs,
        "final_loss": last.get("loss"),
        "val_rmse": last.get("val_rmse"),
        "val_mae": last.get("val_mae"),
        "kept_epoch": last.get("epoch"),
        "n_train": len(train_entries),
        "n_val": len(val_entries or []),
        "history": history.epochs,
    }
    if history.members:  # an ensemble: each member network's own validation figure
        metrics["members"] = [
            {"seed": member_seed(train_cfg.seed, k), "val_rmse": h.epochs[-1].get("val_rmse")}
            for k, h in enumerate(history.members)
        ]
    # The search writes the field of its choice: no field of the starting settings before it.
    searched = chosen.tune and tune and not inference_over and len(val_entries or []) >= MIN_VALIDATION
    if carves and not searched:
        carves = []  # nothing to choose on folds: the first is one carve

    def finish(directory: Path, config: dict[str, Any]) -> None:  # in the artifact being written, once
        if carves:
            return  # the search and the fold-in choice run on every fold's artifact, once all are written
        if chosen.tune:
            metrics["tuning"] = _tune(directory, config, tune, inference_over, len(val_entries or []),
                                      train_cfg.seed, tune_trials, tune_timeout, progress)  # fmt: skip
        metrics["fold_in"] = _fold_in(directory, config, tune, train_cfg.seed)
        metrics["ranking"] = _ranking(directory, config, tune, train_cfg.seed)
        metrics["calibration"] = _calibration(directory, config, tune, train_cfg.seed)

    refit = train_cfg.refit and val_entries is not None and len(val_entries) > 0
    first = out.parent / f".{out.name}.carve" if refit else out  # the carve's artifact, then the refit's
    if carves:
        first = out.parent / f".{out.name}.fold0"
    if rank0:
        write_artifact(
            first,
            model,
            matrix,
            train_entries,
            held_out=val_entries,
            user_ids=data.user_ids,
            item_ids=data.item_ids,
            inference=inference,
            train_config=run.train_record(train_cfg),
            dataset=dataset_record,
            metrics=metrics,
            known_field=not searched,
            catalogue=catalogue,
            finish=finish,
        )
    if carves:
        metrics = _choose_on_folds(run, first, carves, inference, metrics, tune_trials, tune_timeout)
    searches: list[Tuning] = []
    if train_cfg.searches > 1 and searched and refit and not carves and data.val is None:
        metrics, searches = _search_more(run, first, model_for, inference, metrics, tune_trials, tune_timeout)
    elif train_cfg.searches > 1:
        log.warning("searches=%d unused: no search on carves of the training ratings", train_cfg.searches)
    if refit:
        assert val_entries is not None
        metrics = _refit(run, out, first, Entries.concat([train_entries, val_entries]), metrics, searches)
    return metrics


def _catalogue(dataset: str, data_dir: str | Path, items: str | Path | None) -> dict[str, ItemRecord] | None:
    """The catalogue the artifact keeps: `items`, else MovieLens-100K's u.item where the data has it."""
    if items is not None:
        return read_items(items)
    if dataset == "ml-100k":
        return read_movielens_items(data_dir)
    return None


def _search_more(
    run: _Run,
    first: Path,
    model_for: Callable[[Entries], ModelConfig],
    inference: InferenceConfig,
    metrics: dict[str, Any],
    trials: int | None,
    timeout: float | None,
) -> tuple[dict[str, Any], list[Tuning]]:
    """`TrainConfig.searches`: the searches after the first carve's (written at `first`), each on its own
    carve (seed `carve + k`) with its own network, trained and searched as `--set carve_seed=<carve + k>`
    would; returns the metrics with every search's summary, and the searches (on rank 0)."""
    cfg = run.train_cfg
    records = [{"carve_seed": cfg.carve, "val_rmse": metrics["val_rmse"], **metrics.get("tuning", {})}]
    found: list[Tuning] = []
    seconds = metrics["train_seconds"]
    for k in range(1, cfg.searches):
        carve = cfg.carve + k
        rest, val = carve_validation(run.data.train, cfg.val_fraction, carve)
        log.info("search %d of %d: carve seed %d, %d train / %d validation ratings", k + 1, cfg.searches,
                 carve, len(rest), len(val))  # fmt: skip
        t0 = time.perf_counter()
        model, matrix, history = run.fit(cfg, rest, val, f"search{k}", model_for(rest))
        seconds += time.perf_counter() - t0
        record: dict[str, Any] = {"carve_seed": carve, "val_rmse": history.epochs[-1].get("val_rmse")}
        if run.rank0:
            directory = first.parent / f"{first.name}.search{k}"
            write_artifact(directory, model, matrix, rest, held_out=val, user_ids=run.data.user_ids,
                           item_ids=run.data.item_ids, inference=inference,
                           train_config=run.train_record(replace(cfg, carve_seed=carve)),
                           dataset=run.dataset_record, metrics={}, known_field=False)  # fmt: skip
            result = search_inference(load_artifact(directory), trials=trials or DEFAULT_TRIALS,
                                      timeout=timeout, seed=cfg.seed, progress=run.progress)  # fmt: skip
            found.append(result)
            record.update(_tuning_summary(result))
            shutil.rmtree(directory, ignore_errors=True)
        records.append(record)
    return {**metrics, "train_seconds": round(seconds, 2), "searches": records}, found


def _refit(
    run: _Run,
    out: Path,
    carve: Path,
    everything: Entries,
    carve_metrics: dict[str, Any],
    searches: Sequence[Tuning] = (),
) -> dict[str, Any]:
    """`TrainConfig.refit`: train the network again on every training rating (`everything`), as many
    epochs as the carve's run published, and write it to `out` with the inference settings, their
    tuning record and the fold-in policy chosen on the carve (the artifact at `carve`, removed after),
    and the settings of the other `searches` to average with them (their records `tuning.search<k>.json`)."""
    cfg = run.train_cfg
    epochs = int(carve_metrics["kept_epoch"] or cfg.epochs) if cfg.keep_best else cfg.epochs
    again = replace(cfg, epochs=epochs, keep_best=False)
    log.info("refit: the network again on all %d training ratings, %d epochs", len(everything), epochs)
    t0 = time.perf_counter()
    model, matrix, history = run.fit(again, everything, None, "refit")
    seconds = time.perf_counter() - t0
    last = history.epochs[-1] if history.epochs else {}
    # The carve's figures stay (val_rmse, tuning, fold_in: of the carve's network, on its validation
    # ratings); the training time is both runs'.
    metrics: dict[str, Any] = {
        **{k: v for k, v in carve_metrics.items() if k != "history"},
        "train_seconds": round(carve_metrics["train_seconds"] + seconds, 2),
        "refit": {
            "epochs": epochs,
            "train_seconds": round(seconds, 2),
            "final_loss": last.get("loss"),
            "n_train": len(everything),
            "history": history.epochs,
        },
    }
    if not run.rank0:
        return metrics
    chosen = json.loads((carve / "config.json").read_text())

    def finish(directory: Path, config: dict[str, Any]) -> None:  # the carve's choices, as they were made
        if (carve / TUNING).exists():
            shutil.copy2(carve / TUNING, directory / TUNING)
        if "fold_in" in chosen:
            config["fold_in"] = chosen["fold_in"]
        if "ranking" in chosen:
            config["ranking"] = chosen["ranking"]
        if "calibration" in chosen:
            config["calibration"] = chosen["calibration"]
        if searches:
            config[AVERAGED] = [result.chosen.to_dict() for result in searches]
        for k, result in enumerate(searches, start=1):
            (directory / f"tuning.search{k}.json").write_text(json.dumps(result.record, indent=2) + "\n")

    write_artifact(
        out,
        model,
        matrix,
        everything,
        user_ids=run.data.user_ids,
        item_ids=run.data.item_ids,
        inference=InferenceConfig.from_dict(chosen["inference"]),
        train_config=run.train_record(again),  # again.refit: True
        dataset=run.dataset_record,
        metrics=metrics,
        catalogue=run.catalogue,
        finish=finish,
    )
    shutil.rmtree(carve, ignore_errors=True)
    return metrics


def _choose_on_folds(
    run: _Run,
    fold0: Path,
    carves: list[tuple[Entries, Entries]],
    inference: InferenceConfig,
    metrics: dict[str, Any],
    trials: int | None,
    timeout: float | None,
) -> dict[str, Any]:
    """`TrainConfig.folds`: train the networks of folds 1.. (fold 0's is written at `fold0`), search the
    inference settings on all the folds' validation ratings together, and write the choice and the fold-in
    policy (chosen on fold 0) into `fold0`, which the refit then reads like a single carve's artifact."""
    directories = [fold0]
    seconds = metrics["train_seconds"]
    val_rmse = [metrics["val_rmse"]]
    for k, (rest, val) in enumerate(carves[1:], start=1):
        log.info("fold %d of %d: %d train / %d validation ratings", k + 1, len(carves), len(rest), len(val))
        t0 = time.perf_counter()
        model, matrix, history = run.fit(run.train_cfg, rest, val, f"fold{k}")
        seconds += time.perf_counter() - t0
        val_rmse.append(history.epochs[-1].get("val_rmse") if history.epochs else None)
        directories.append(fold0.parent / f"{fold0.name.removesuffix('0')}{k}")
        if run.rank0:
            write_artifact(directories[-1], model, matrix, rest, held_out=val, user_ids=run.data.user_ids,
                           item_ids=run.data.item_ids, inference=inference,
                           train_config=run.train_record(run.train_cfg), dataset=run.dataset_record,
                           metrics={}, known_field=False)  # fmt: skip
    metrics = {
        **metrics,
        "train_seconds": round(seconds, 2),
        "val_rmse": float(np.mean([v for v in val_rmse if v is not None])) if any(val_rmse) else None,
        "folds": {"k": len(carves), "val_rmse": val_rmse, "n_val": [len(v) for _, v in carves]},
        "n_val": sum(len(v) for _, v in carves),
    }
    if not run.rank0:
        return metrics
    seed = run.train_cfg.seed
    result = search_inference([load_artifact(d) for d in directories], trials=trials or DEFAULT_TRIALS,
                              timeout=timeout, seed=seed, progress=run.progress)  # fmt: skip
    write_tuning(fold0, result)
    metrics["tuning"] = {**_tuning_summary(result), "folds": len(carves)}
    record = choose_and_write(fold0, seed)
    metrics["fold_in"] = {k: v for k, v in record.items() if k in FOLD_IN_SUMMARY}
    for directory in directories[1:]:
        shutil.rmtree(directory, ignore_errors=True)
    return metrics


def _fold_in(directory: Path, config: dict[str, Any], enabled: bool, seed: int) -> dict[str, Any]:
    """Choose the online fold-in's policy on the validation ratings (training/fold_in.py) of the artifact
    being written in `directory` and put it in its `config`, or say why not: a summary for the training
    metrics."""
    if not enabled:
        return {"skipped": "--no-tune: the service refines every rating user at fold-in"}
    record = choose_refine(load_staged(directory, config), seed)
    if "refine" in record:
        config["fold_in"] = record
    return {k: v for k, v in record.items() if k in FOLD_IN_SUMMARY}


def _ranking(directory: Path, config: dict[str, Any], enabled: bool, seed: int) -> dict[str, Any]:
    """Choose the lists' default diversity on the validation ratings (model/ranking.py) of the artifact
    being written; recorded in its config as `ranking`."""
    if not enabled:
        return {"skipped": "--no-tune: the service ranks by predicted rating alone (diversity 0)"}
    record = choose_diversity(load_staged(directory, config), seed=seed)
    if "diversity" in record:
        config["ranking"] = record
    return record


def _calibration(directory: Path, config: dict[str, Any], enabled: bool, seed: int) -> dict[str, Any]:
    """Choose the temperature of the served distributions on the validation ratings (model/calibration.py)
    of the artifact being written, after its inference settings; recorded in its config as `calibration`
    where it lowers the validation log loss."""
    if not enabled:
        return {"skipped": "--no-tune: the service serves the distributions untempered"}
    record = choose_temperature(load_staged(directory, config), seed=seed)
    if "temperature" in record:
        config["calibration"] = record
    return record


def _tune(
    directory: Path,
    config: dict[str, Any],
    enabled: bool,
    inference_over: dict[str, Any],
    n_val: int,
    seed: int,
    trials: int | None,
    timeout: float | None,
    progress: bool,
) -> dict[str, Any]:
    """Search the inference settings of the artifact being written in `directory` and put the choice in
    it (`config` and its files), or say why not: a summary for the training metrics."""
    if not enabled:
        return {"skipped": "--no-tune: the artifact serves training.tune.START"}
    if inference_over:
        names = ", ".join(f"inference.{k}" for k in inference_over)
        return {"skipped": f"inference settings given ({names}): kept as set"}
    if n_val < MIN_VALIDATION:
        why = (
            f"only {n_val} validation ratings (a search needs {MIN_VALIDATION}; raise --set val_fraction): "
            "the artifact serves training.tune.START"
        )
        log.warning("inference not tuned: %s", why)
        return {"skipped": why}
    artifact = load_staged(directory, config)
    result = search_inference(
        artifact, trials=trials or DEFAULT_TRIALS, timeout=timeout, seed=seed, progress=progress
    )
    record_tuning(directory, config, result, artifact)
    return _tuning_summary(result)


def _tuning_summary(result: Tuning) -> dict[str, Any]:
    """What the training metrics keep of a search's record."""
    r = result.record
    return {
        "mode": result.chosen.mode,
        "trials": r["trials_run"],
        "seconds": r["seconds"],
        "best_val_rmse": r["best_val_rmse"],
        "base_network_val_rmse": r["base_network_val_rmse"],
    }
