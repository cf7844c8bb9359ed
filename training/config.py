"""Training configuration and per-dataset presets.

Two presets per dataset: `paper`, the paper's procedure read literally (an epoch samples every row once,
300 epochs, mean-field layers in training), and `default`, the schedule chosen on validation data (an
epoch visits every row-chunk x column-chunk block once). `tiny` trains in seconds for tests and CI.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

from model.config import ConfigError, InferenceConfig

EpochMode = Literal["blocks", "pass"]


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and batching of one training run."""

    epochs: int = 300
    """Number of epochs (paper: 300)."""
    lr: float = 0.01
    """Initial Adam learning rate (paper: 0.01)."""
    lr_halve_every: int = 25
    """The learning rate is halved every this many epochs (paper: 25)."""
    block_rows: int = 128
    """Rows sampled per mini-batch (n^t)."""
    block_cols: int = 256
    """Columns sampled per mini-batch (m^t)."""
    epoch_mode: EpochMode = "blocks"
    """`pass`: one epoch = every row chunk once, paired with column chunks in turn (the paper's count);
    `blocks`: one epoch = every row-chunk x column-chunk block once."""
    beta: float = 1.5
    """Weight of the similarity loss (paper: 1.5)."""
    sigma2: float = 3.5
    """sigma^2 of the ground-truth Gaussian similarity (paper: 3.5, YahooMusic 3000)."""
    rating_mse: float = 0.0
    """Weight of an extra loss term: the squared error of the expected rating, divided by the squared
    rating range (not in the paper; 0 = the paper's loss)."""
    train_mf: bool = True
    """Train through the mean-field layers (paper) or on the base network's probabilities alone."""
    val_fraction: float = 0.05
    """Share of the training entries held out for validation when the dataset has no validation split."""
    weight_decay: float = 0.0
    """Adam L2 penalty."""
    input_dropout: float = 0.0
    """Dropout on the rating rows and columns the branches read, in training only (a denoising input,
    not in the paper; 0 = off)."""
    keep_best: bool = False
    """Publish the network of the epoch with the lowest validation RMSE instead of the last epoch's (not in
    the paper; needs validation ratings, and counts the epochs of a resumed run's checkpoint too)."""
    ema_decay: float = 0.0
    """Decay of an exponential moving average of the weights and BatchNorm statistics, updated after every
    step; validation and the artifact use the average (not in the paper; 0 = off, the live weights)."""
    refit: bool = False
    """After the network trained on the training ratings less the validation carve, and the inference
    search and fold-in choice ran on that carve: train the published network again, on every training
    rating, with the same settings and epochs (the kept epoch's count with `keep_best`), and publish it
    with the choices made on the carve (not in the paper; about twice the training time). The artifact
    then holds no validation ratings."""
    folds: int = 1
    """With `refit` (ignored without it), on a dataset without a validation split: choose the inference
    settings on this many folds of the training ratings instead of one `val_fraction` carve. Each fold's
    network trains without its fold, and the search scores a candidate over every training rating, each
    predicted by the network that did not train on it (`folds` networks before the refit, not one; not in
    the paper; 1 = one carve)."""
    searches: int = 1
    """With `refit`, on a dataset without a validation split and one carve (`folds` 1): search the
    inference settings this many times, each on its own `val_fraction` carve (seeds `carve`, `carve + 1`,
    ...) with its own network, and serve the mean of the settings' final distributions on the refit
    network (model.scorers.MeanScorer; not in the paper; 1 = one search). Costs `searches` carve networks
    before the refit, and one CRF per setting at serving."""
    ensemble: int = 1
    """Train this many networks (seeds `seed + k * 1000`) and publish their fusion: one network whose
    embeddings are theirs side by side and whose decoder averages their scores (model.network.fuse; not in
    the paper; N times the networks' training, and an N times wider network to serve)."""
    checkpoint_every: int = 10
    """Write a resumable checkpoint every this many epochs (and at the end)."""
    seed: int = 0
    """Seed of initialisation, data order, dropout and (unless `carve_seed` is set) validation carving."""
    carve_seed: int | None = None
    """Seed of the validation carve when it should not follow `seed`: networks of several seeds that
    share one carve can be scored together on it (an ensemble, `dcmc evaluate` with several artifacts)."""

    @property
    def carve(self) -> int:
        """The validation carve's seed: `carve_seed`, or `seed` when that is unset."""
        return self.seed if self.carve_seed is None else self.carve_seed

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.lr <= 0 or self.lr_halve_every < 1:
            raise ConfigError("epochs, lr and lr_halve_every must be positive")
        if self.block_rows < 2 or self.block_cols < 2:
            raise ConfigError("block_rows and block_cols must be >= 2 (BatchNorm needs a batch)")
        if self.epoch_mode not in ("blocks", "pass"):
            raise ConfigError(f"epoch_mode must be 'blocks' or 'pass', got {self.epoch_mode!r}")
        if not 0.0 <= self.val_fraction < 0.5:
            raise ConfigError(f"val_fraction must lie in [0, 0.5), got {self.val_fraction}")
        if not 0.0 <= self.input_dropout < 1.0:
            raise ConfigError(f"input_dropout must lie in [0, 1), got {self.input_dropout}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"ema_decay must lie in [0, 1), got {self.ema_decay}")
        if self.folds < 1:
            raise ConfigError(f"folds must be at least 1, got {self.folds}")
        if self.searches < 1:
            raise ConfigError(f"searches must be at least 1, got {self.searches}")
        if self.searches > 1 and (not self.refit or self.folds > 1):
            raise ConfigError(
                "searches > 1 needs refit=true and folds=1: each search has its own carve's network, and "
                "the published network is refit on every training rating"
            )
        if self.ensemble < 1:
            raise ConfigError(f"ensemble must be at least 1, got {self.ensemble}")
        if self.ensemble > 1 and self.keep_best:
            raise ConfigError("ensemble > 1 with keep_best: the members would keep different epochs; use one")
        if self.beta < 0 or self.sigma2 <= 0 or self.checkpoint_every < 1 or self.rating_mse < 0:
            raise ConfigError("beta and rating_mse must be >= 0, sigma2 > 0, checkpoint_every >= 1")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """Inverse of `to_dict`."""
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown TrainConfig fields: {sorted(unknown)}")
        return cls(**d)


@dataclass(frozen=True)
class Preset:
    """Everything a dataset needs beyond the data: model, training and inference settings."""

    model: dict[str, Any]
    train: TrainConfig
    inference: InferenceConfig
    tune: bool = False
    """Search the inference settings on validation entries after training (`inference` is then only the
    mode: the search starts from training.tune.START)."""


PRESET_NAMES = ("default", "paper", "tiny")

# tau and sigma^2 from the paper; block sizes from the measured prototype (see README).
_DATASET = {
    "ml-100k": {"tau": 12.0, "sigma2": 3.5, "block": (128, 256)},
    "douban": {"tau": 12.0, "sigma2": 3.5, "block": (256, 512)},
    "flixster": {"tau": 12.0, "sigma2": 3.5, "block": (256, 512)},
    "yahoo_music": {"tau": 100.0, "sigma2": 3000.0, "block": (256, 512)},
    "epinions": {"tau": 12.0, "sigma2": 3.5, "block": (1024, 2048)},
    "csv": {"tau": 12.0, "sigma2": 3.5, "block": (128, 256)},
}

# Default schedules (epochs, halve-every), chosen on validation entries carved from the training set; the
# record of what was tried is benchmarks/results/validation.md.
_DEFAULT_EPOCHS = {
    "ml-100k": (100, 25),
    "douban": (25, 10),
    "flixster": (20, 10),
    "yahoo_music": (30, 10),
    "epinions": (10, 4),
    "csv": (60, 20),
}

# The default preset publishes an exponential moving average of the weights (horizon ~100 steps).
_DEFAULT_EMA = 0.99

# The default preset holds out 5% of the training entries: the queries of the automatic inference
# selection (training/tune.py). Chosen on an outer validation set of ML-100K (benchmarks/results/
# val_share.md): with 1% the search overfits its ~800 queries and loses to the base network; 2.5 to 10%
# gain alike, 5% the most. Validation experiments hold out TUNING_VAL_FRACTION, the same share.
_DEFAULT_VAL_FRACTION = 0.05
TUNING_VAL_FRACTION = 0.05
"""The held-out share of every validation experiment (benchmarks/results/validation.md)."""

# The default preset refits (`TrainConfig.refit`) on the four benchmark datasets: on an outer 5% of each
# one's training split the refit network with the carve's choices scored better or alike (ML-100K and
# Douban by 0.002-0.003 RMSE; benchmarks/results/refit.md). Elsewhere (`csv`, epinions: large matrices,
# where it would double hours of training) it is `--set refit=true`.
_DEFAULT_REFIT = frozenset({"ml-100k", "douban", "flixster", "yahoo_music"})

# The default preset chooses the inference settings on folds (`TrainConfig.folds`) where a 5% carve holds
# too few ratings for a steady search: Flixster (1,178) and YahooMusic (240). On an outer 20% of each
# training split, 3 seeds (benchmarks/results/folds.md), against one carve: Flixster 3 folds -0.0017 RMSE
# (worse in 1 seed of 3), 5 folds -0.0042 (better in every seed, and than 3 folds in every seed);
# YahooMusic 3 folds -0.35, 5 folds -0.34 (both better in every seed): 5 for Flixster, and the cheaper 3 for
# YahooMusic. ML-100K (4,000 carved ratings) keeps one carve: 5 folds were alike there (mean -0.00002, worse
# in 1 seed of 3, at 3.1x the run). Douban (6,160) was not measured and keeps one carve. Flixster with 10
# folds on fresh outer sets: +0.0002 on average (folds.md), so 5.
_DEFAULT_FOLDS = {"flixster": 5, "yahoo_music": 3}

# The default preset averages two searches' settings (`TrainConfig.searches`) on ML-100K: on its fresh outer
# sets (pools 3 and 4, benchmarks/results/ensemble.md, rule set before) one network under two searches'
# settings averaged scored 0.0007-0.0009 better than under either alone on average, and better than the
# better one in 4 of 4; as built, 0.0007 and 0.0017 better than the default's one search, for 1.5x the
# trainings. Douban (also one carve) keeps one search: on its fresh outer sets two were -0.0014 and +0.0003
# (ensemble.md, rule set before). Flixster and YahooMusic search on folds, which `searches` does not combine
# with.
_DEFAULT_SEARCHES = {"ml-100k": 2}

# No preset sets `TrainConfig.ensemble`: on ML-100K's outer sets (benchmarks/results/ensemble.md, six runs)
# two fused networks scored 0.0008 RMSE better than one (better in 5 of 6), short of the 0.0010 set
# beforehand, at 2-2.5x the training; on Flixster's fresh outer sets (folds.md) 0.0005, bar 0.002.

# Where the default preset's similarity-loss weight beta and input dropout differ from the paper's.
_DEFAULT_BETA = {"ml-100k": 0.0, "flixster": 0.0}
_DEFAULT_INPUT_DROPOUT = {"ml-100k": 0.1}


# The default preset's test-time inference is not a constant here: `dcmc train` searches it on the
# validation entries after training (training/tune.py), starting from one generic point for every dataset.
_DEFAULT_INFERENCE = InferenceConfig.from_dict(
    {"mode": "exact", "kernel": {"scaling": "normalized", "known": "clamped"}}
)


def preset(dataset: str, name: str = "default") -> Preset:
    """The named preset for a dataset."""
    if dataset not in _DATASET:
        raise ConfigError(f"unknown dataset {dataset!r}; choose one of {sorted(_DATASET)}")
    if name not in PRESET_NAMES:
        raise ConfigError(f"unknown preset {name!r}; choose one of {PRESET_NAMES}")
    ds = _DATASET[dataset]
    model: dict[str, Any] = {"tau": ds["tau"]}
    rows, cols = ds["block"]
    if name == "paper":
        # The paper read literally: 300 epochs where an epoch samples every row once, lr halved every 25,
        # mean-field layers trained end to end on small batches.
        train = TrainConfig(
            epochs=300,
            block_rows=32,
            block_cols=64,
            epoch_mode="pass",
            sigma2=ds["sigma2"],
            train_mf=True,
        )
        inference = InferenceConfig.from_dict(
            {"mode": "paper", "paper": {"subset_rows": 32, "subset_cols": 64, "repeats": 10}}
        )
    elif name == "default":
        epochs, halve = _DEFAULT_EPOCHS[dataset]
        train = TrainConfig(
            epochs=epochs,
            lr_halve_every=halve,
            block_rows=rows,
            block_cols=cols,
            epoch_mode="blocks",
            sigma2=ds["sigma2"],
            train_mf=False,
            ema_decay=_DEFAULT_EMA,
            val_fraction=_DEFAULT_VAL_FRACTION,
            beta=_DEFAULT_BETA.get(dataset, TrainConfig.beta),
            input_dropout=_DEFAULT_INPUT_DROPOUT.get(dataset, 0.0),
            refit=dataset in _DEFAULT_REFIT,
            folds=_DEFAULT_FOLDS.get(dataset, 1),
            searches=_DEFAULT_SEARCHES.get(dataset, 1),
        )
        inference = _DEFAULT_INFERENCE
    else:  # tiny: seconds on 2 cores, for tests and CI
        model.update(hidden=(32, 16), dropout=0.0, mf_layers=2)
        train = TrainConfig(
            epochs=40,
            lr_halve_every=20,
            block_rows=16,
            block_cols=16,
            epoch_mode="blocks",
            sigma2=ds["sigma2"],
            train_mf=True,
            checkpoint_every=10,
        )
        inference = InferenceConfig.from_dict(
            {"mode": "paper", "paper": {"subset_rows": 8, "subset_cols": 8, "repeats": 3}}
        )
    return Preset(model=model, train=train, inference=inference, tune=name == "default")


BLOCK_ENTRIES = 1024
"""The fewest ratings a mini-batch block of the `csv` preset holds on average: on a sparse matrix the
preset's block (128 x 256) would hold a handful (Epinions' density, 1e-4: 4), and an epoch would be
tens of thousands of steps of almost no data."""


BLOCK_CHUNKS = 24
"""On a dense matrix, the `csv` preset cuts the rows and the columns into at most this many chunks each: at
most 576 blocks (steps) an epoch. Each step reads its rows' and columns' whole ratings and updates every
input-weight line they touch, which on a dense matrix is nearly every line of both branches whatever the
block: ml-10m's density-sized blocks (226 x 451) made 7,440 steps of 0.55 s an epoch."""


def sized_blocks(rows: int, cols: int, n_users: int, n_items: int, n_ratings: int) -> tuple[int, int]:
    """A block of the shape rows x cols, grown (same aspect) until it holds BLOCK_ENTRIES ratings on
    average at this density, and at most the matrix. Where that makes more than BLOCK_CHUNKS^2 blocks, the
    rows and the columns are cut into BLOCK_CHUNKS chunks each instead: with the block count fixed, equal
    counts minimise the ratings an epoch reads, N (n / rows + m / cols)."""
    expected = rows * cols * n_ratings / max(1, n_users * n_items)
    grow = math.sqrt(BLOCK_ENTRIES / expected) if 0 < expected < BLOCK_ENTRIES else 1.0
    rows = min(n_users, max(rows, round(rows * grow)))
    cols = min(n_items, max(cols, round(cols * grow)))
    if math.ceil(n_users / rows) * math.ceil(n_items / cols) > BLOCK_CHUNKS**2:
        rows, cols = max(2, math.ceil(n_users / BLOCK_CHUNKS)), max(2, math.ceil(n_items / BLOCK_CHUNKS))
    return rows, cols


LARGE_RATINGS = 400_000
"""From this many training ratings on, the `csv` preset trains LARGE_NETWORK, not the paper's network."""

LARGE_NETWORK: dict[str, Any] = {"hidden": (32,), "input_center": "mean", "input_scaling": "sqrt"}
"""The `csv` preset's network for LARGE_RATINGS ratings or more: one layer of 32 units reading the known
ratings centred on their mean, over the square root of the line's count. The paper's network (two layers of
512 and 128 units reading the raw ratings) learns little beyond the users' and items' biases on a large
matrix: on a one-fifth-scale synthetic ml-10m (1.5 M training ratings) its validation RMSE stalls at 0.662
against the biases' own 0.659 and Surprise SVD's 0.623, where one layer of 64 or 32 units reaches 0.614 in 4
epochs of a third of the time. On the full synthetic ml-10m 32 units learn faster than 64 (validation 0.6387
against 0.6440 after 3 epochs). On a small matrix it overfits: on ML-100K (76,000 ratings) the 64-unit
layer's best validation RMSE is 0.92 against the paper's network's 0.88. On the synthetic Epinions (498,618
ratings, 12 a user) the 64-unit layer overfits after one epoch, and ends at the paper's network's 0.6975
after the inference search, with a fraction of the embedding and a twentieth of the training.
All measured on validation ratings alone (benchmarks/results/network_probe.md); between 76,000 and 498,618
ratings nothing was measured."""

LARGE_TRAINING: dict[str, Any] = {"beta": 0.0, "keep_best": True, "lr": 0.005, "input_dropout": 0.2}
"""Its training: no similarity loss (faster, and more accurate on the probe above), Adam at 0.005 and a fifth
of the input ratings dropped (on the full synthetic ml-10m, after 3 epochs, 0.6305 and 0.6341 against 0.6440
at 0.01 without dropout), and the epoch of the lowest validation RMSE published (the full synthetic ml-10m's
64-unit network passed its best after 6 of 8 epochs, this one after 9 of 10)."""


def sized_network(n_ratings: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The `csv` preset's (model, train) settings for a training set of `n_ratings` ratings."""
    if n_ratings < LARGE_RATINGS:
        return {}, {}
    return dict(LARGE_NETWORK), dict(LARGE_TRAINING)


def resolve_model_settings(settings: dict[str, Any], train_values: Any) -> dict[str, Any]:
    """ModelConfig keyword arguments from a preset's (and the user's) model settings: `input_center`
    "mean" becomes the mean of the ratings trained on (`train_values`, without the validation ones)."""
    if settings.get("input_center") == "mean":
        return {**settings, "input_center": round(float(train_values.mean()), 6)}
    return dict(settings)


def override(train: TrainConfig, **changes: Any) -> TrainConfig:
    """A copy of `train` with the non-None `changes` applied."""
    return replace(train, **{k: v for k, v in changes.items() if v is not None})
