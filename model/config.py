"""Typed, torch-free configuration of the DCMC model and of its test-time inference.

Every field defaults to the value given in the paper ("Experiments: Hyperparameters Selection").
An artifact stores these next to the weights, so the weights and the architecture cannot disagree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MessageScaling = Literal["sum", "normalized"]
InputScaling = Literal["none", "sqrt", "mean"]


class ConfigError(ValueError):
    """A configuration value is out of range or unknown."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture and mean-field hyperparameters of one DCMC model."""

    n_users: int
    """Rows of the rating matrix (input width of the column branch)."""
    n_items: int
    """Columns of the rating matrix (input width of the row branch)."""
    levels: tuple[float, ...]
    """The p rating levels L_1 < ... < L_p, taken from the training data."""
    hidden: tuple[int, ...] = (512, 128)
    """Units of the FC+BatchNorm layers of each branch; the last one is the embedding size d."""
    dropout: float = 0.75
    """Dropout after every hidden layer except the last (paper: 0.75)."""
    gamma: float = 0.05
    """Weight of the pairwise term against the unary term (paper: 0.05)."""
    mf_layers: int = 5
    """Number T of unfolded mean-field layers (paper: 5)."""
    tau: float = 12.0
    """Truncation threshold of the quadratic label compatibility (paper: 12, YahooMusic 100)."""
    message_scaling: MessageScaling = "sum"
    """Messages of the mean-field layers in training and `paper` inference: summed over the nodes (`sum`,
    the paper's) or divided by sum_l s(k, l) (`normalized`, independent of how many nodes a batch holds)."""
    input_center: float = 0.0
    """Subtracted from every known rating a branch reads (a line's missing entries stay 0): with the
    training mean, a rating above it pushes the first layer one way and one below it the other (paper: 0)."""
    input_scaling: InputScaling = "none"
    """The first layer's sum over a line's ratings as is (`none`, the paper's), divided by the square root of
    their count (`sqrt`) or by their count (`mean`): without it a line's pre-activation grows with its number
    of ratings, which on power-law data spans three orders of magnitude."""

    def __post_init__(self) -> None:
        # Plain Python numbers only, so configs serialise to JSON and checkpoints load with weights_only.
        object.__setattr__(self, "levels", tuple(float(x) for x in self.levels))
        object.__setattr__(self, "hidden", tuple(int(x) for x in self.hidden))
        if self.n_users < 1 or self.n_items < 1:
            raise ConfigError(f"n_users and n_items must be positive, got {self.n_users} x {self.n_items}")
        if len(self.levels) < 2:
            raise ConfigError(f"need at least 2 rating levels, got {list(self.levels)}")
        if list(self.levels) != sorted(set(self.levels)):
            raise ConfigError("levels must be strictly increasing")
        if not self.hidden or any(h < 1 for h in self.hidden):
            raise ConfigError(f"hidden sizes must be positive, got {list(self.hidden)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must lie in [0, 1), got {self.dropout}")
        if self.message_scaling not in ("sum", "normalized"):
            raise ConfigError(f"message_scaling must be 'sum' or 'normalized', got {self.message_scaling!r}")
        if not math.isfinite(self.input_center):
            raise ConfigError(f"input_center must be a finite number, got {self.input_center}")
        if self.input_scaling not in ("none", "sqrt", "mean"):
            raise ConfigError(f"input_scaling must be 'none', 'sqrt' or 'mean', got {self.input_scaling!r}")
        if self.gamma < 0 or self.mf_layers < 0 or self.tau <= 0:
            raise ConfigError("gamma and mf_layers must be >= 0 and tau > 0")

    @property
    def embedding_dim(self) -> int:
        """Size d of the user and item embeddings."""
        return self.hidden[-1]

    @property
    def n_levels(self) -> int:
        """Number p of rating levels."""
        return len(self.levels)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        d = asdict(self)
        d["levels"] = list(self.levels)
        d["hidden"] = list(self.hidden)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Inverse of `to_dict`; unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown ModelConfig fields: {sorted(unknown)}")
        d = dict(d)
        d["levels"] = tuple(float(x) for x in d["levels"])
        d["hidden"] = tuple(int(x) for x in d.get("hidden", (512, 128)))
        return cls(**d)


# -- test-time inference ------------------------------------------------------------------------------------
# Every inference setting is declared once below: its type, default, range and docstring. The groups are
# named by what reads them, so that a setting the mode in force does not read cannot be set by mistake.

InferenceMode = Literal["paper", "none", "exact"]
Scaling = Literal["sum", "scaled", "normalized"]
KnownMode = Literal["predicted", "clamped"]


class _Group(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


SearchUnit = Literal["", "gap^-2", "range^2", "users", "items"]


@dataclass(frozen=True)
class SearchRange:
    """Where the automatic selection (`dcmc tune`) looks for a setting: low..high (log-uniform when `log`)
    times `unit`, and also the setting's off value 0 when `off`.

    Units make one range fit every dataset: `gap^-2` is 1 / (median gap between adjacent rating levels)^2
    (what makes gamma's effect on the logits independent of the rating scale), `range^2` is
    (L_p - L_1)^2 (the largest squared label distance), and `users` / `items` the number of rows / columns
    (a same-row term sums over about N / n entries and a same-column term over N / m, so a weight in
    these units balances the term against the N-entry product kernel on any matrix size)."""

    low: float
    high: float
    log: bool = True
    off: bool = False
    unit: SearchUnit = ""


def _search(low: float, high: float, log: bool = True, off: bool = False, unit: SearchUnit = "") -> Any:
    return {"search": SearchRange(low, high, log, off, unit)}


class CrfSettings(_Group):
    """The mean-field CRF's weights, read by `paper` and `exact`; None = the value the model trained with."""

    gamma: float | None = Field(default=None, ge=0, json_schema_extra=_search(0.03, 30.0, unit="gap^-2"))
    """Weight gamma of the pairwise term against the unary term (none = the model's gamma)."""
    tau: float | None = Field(default=None, gt=0, json_schema_extra=_search(0.1, 1.0, unit="range^2"))
    """Truncation of the label compatibility min((L_u - L_v)^2, tau) (none = the model's tau)."""
    layers: int | None = Field(default=None, ge=0)
    """Number T of mean-field layers (none = the model's T; 0 = the base network alone)."""


class PaperSettings(_Group):
    """The paper's test-time procedure: CRFs over random row x column blocks, averaged over partitions."""

    subset_rows: int = Field(default=32, ge=1)
    """Rows per random subset (also read by `exact` with kernel.scaling = scaled)."""
    subset_cols: int = Field(default=64, ge=1)
    """Columns per random subset (also read by `exact` with kernel.scaling = scaled)."""
    repeats: int = Field(default=10, ge=1)
    """Number R of random partitions whose predictions are averaged."""
    seed: int = 0
    """Seed of the random partitions."""


class KernelSettings(_Group):
    """The `exact` CRF over every known entry: its message scaling and the terms of its kernel."""

    scaling: Scaling = "normalized"
    """Messages as summed (`sum`, the paper's), times the expected share of nodes in a paper block
    (`scaled`), or divided by sum_l s(k, l) (`normalized`)."""
    known: KnownMode = "predicted"
    """Known entries start from the base network's distributions and are updated (`predicted`), or are
    fixed to their observed labels (`clamped`)."""
    same_user: float = Field(default=0.0, ge=0, json_schema_extra=_search(1e-3, 1e9, off=True, unit="users"))
    """Weight lambda_u of the same-user term lambda_u [i = i'] s_c(j, j') (0 = off; see model/exact/)."""
    same_item: float = Field(default=0.0, ge=0, json_schema_extra=_search(1e-3, 1e9, off=True, unit="items"))
    """Weight lambda_i of the same-item term lambda_i [j = j'] s_r(i, i') (0 = off)."""
    co_rating: float = Field(default=0.0, ge=0, json_schema_extra=_search(1e-3, 1e9, off=True, unit="users"))
    """Weight lambda_r of the item-based co-rating term lambda_r [i = i'] w(j, j'), w the shrunk adjusted
    cosine of the items' known rating columns (item-based kNN inside the CRF; 0 = off)."""
    co_rating_user: float = Field(
        default=0.0, ge=0, json_schema_extra=_search(1e-3, 1e9, off=True, unit="items")
    )
    """Weight lambda_c of the user-based co-rating term lambda_c [j = j'] w_u(i, i') (user-based kNN on the
    query's column; 0 = off)."""
    co_rating_power: float = Field(default=2.0, gt=0, json_schema_extra=_search(0.5, 6.0, log=False))
    """Exponent q of the co-rating weights, w = max(0, rho)^q (larger = sharper)."""
    co_rating_shrink: float = Field(default=10.0, gt=0, json_schema_extra=_search(0.3, 100.0))
    """Shrinkage s of the co-rating similarities, rho x n / (n + s) for n co-raters."""
    co_rating_prior: float = Field(default=0.0, ge=0, json_schema_extra=_search(1e-4, 10.0, off=True))
    """Pseudo-count c of the co-rating terms with `normalized` messages: (lambda_r + lambda_c) c joins the
    normaliser, so a query with few or weakly similar neighbours keeps more of the base network (0 = none)."""


class OutputSettings(_Group):
    """What `exact` mixes into the CRF's final distributions."""

    baseline: float = Field(
        default=0.0, ge=0, le=1, json_schema_extra=_search(0.05, 0.9, log=False, off=True)
    )
    """Weight w of a ridge bias baseline mixed into the final distributions, (1 - w) Q + w B, so the
    expected rating becomes (1 - w) E_Q + w (mu + b_i + c_j) (not in the paper; 0 = the CRF alone)."""
    baseline_user_shrink: float = Field(default=2.0, gt=0)
    """Ridge penalty of the baseline's user biases b_i (a pseudo-count of ratings)."""
    baseline_item_shrink: float = Field(default=5.0, gt=0)
    """Ridge penalty of the baseline's item biases c_j (a pseudo-count of ratings)."""


GROUPS_READ: dict[str, tuple[str, ...]] = {
    "none": (),
    "paper": ("crf", "paper"),
    "exact": ("crf", "kernel", "output"),
}
"""The setting groups each mode reads (`exact` also reads paper.subset_rows/cols with scaled messages)."""


class InferenceConfig(_Group):
    """Test-time procedure: `paper`, `exact` or `none`, and the settings of the groups the mode reads."""

    mode: InferenceMode = "paper"
    """`paper`: mean-field over random subsets of known + queried entries; `none`: base network only;
    `exact`: mean-field over all known entries with exact linear-time messages, queries attached."""
    crf: CrfSettings = CrfSettings()
    paper: PaperSettings = PaperSettings()
    kernel: KernelSettings = KernelSettings()
    output: OutputSettings = OutputSettings()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready nested dict."""
        return self.model_dump()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> InferenceConfig:
        """Inverse of `to_dict`; also reads the flat dict of format-1 artifacts. Errors are ConfigError."""
        if d and not any(isinstance(v, dict) for v in d.values()) and set(d) - {"mode"}:
            d = _from_flat(d)
        try:
            return cls.model_validate(d)
        except ValidationError as exc:
            raise ConfigError(_explain(exc)) from None

    def reads(self, name: str) -> bool:
        """Whether the mode in force reads the setting `name` (`group.setting`, or `mode`)."""
        group, _, setting = name.partition(".")
        if group == "mode":
            return True
        if group == "paper" and self.mode == "exact" and setting in ("subset_rows", "subset_cols"):
            return self.kernel.scaling == "scaled"
        return group in GROUPS_READ[self.mode]

    def with_overrides(self, overrides: Mapping[str, Any]) -> InferenceConfig:
        """A copy with `overrides` applied: dotted names (`crf.gamma`, `mode`) to values, strings converted
        by the declared type (`none` = None where a setting allows it). An unknown name, a bad value or a
        setting that the resulting mode does not read is a ConfigError that says which.

        A mode's CRF weights are its own: switching `mode` resets `crf` to the model's values (what a search
        chose for one mode is not the other's best), unless `crf.*` is set too."""
        valid = setting_names()
        merged = self.to_dict()
        if "mode" in overrides and overrides["mode"] != self.mode:
            merged["crf"] = CrfSettings().model_dump()
        for name, value in overrides.items():
            if name not in valid:
                raise ConfigError(f"unknown inference setting {name!r}; valid: {', '.join(valid)}")
            group, _, setting = name.partition(".")
            if setting:
                if isinstance(value, str) and value.lower() in ("none", "null") and _optional(group, setting):
                    value = None
                merged[group][setting] = value
            else:
                merged[group] = value
        new = InferenceConfig.from_dict(merged)
        unread = [name for name in overrides if not new.reads(name)]
        if unread:
            raise ConfigError(
                f"inference mode {new.mode!r} does not read {', '.join(unread)}; it reads "
                f"{', '.join(GROUPS_READ[new.mode]) or 'no settings'} (set inference.mode to use them)"
            )
        return new


def setting_names() -> list[str]:
    """Every inference setting's dotted name: `mode`, then `group.setting` in declaration order."""
    names = ["mode"]
    for group, info in InferenceConfig.model_fields.items():
        if group != "mode":
            sub = info.annotation
            assert isinstance(sub, type) and issubclass(sub, _Group)
            names += [f"{group}.{s}" for s in sub.model_fields]
    return names


def search_space() -> dict[str, SearchRange]:
    """The settings the automatic selection searches, by dotted name, with their ranges (declared on the
    settings above); the others keep their values."""
    out: dict[str, SearchRange] = {}
    for name in setting_names()[1:]:
        group, _, setting = name.partition(".")
        sub = InferenceConfig.model_fields[group].annotation
        assert isinstance(sub, type) and issubclass(sub, _Group)
        extra = sub.model_fields[setting].json_schema_extra
        if isinstance(extra, dict) and isinstance(extra.get("search"), SearchRange):
            out[name] = extra["search"]  # type: ignore[assignment]
    return out


def setting_doc(name: str) -> str:
    """The docstring of a setting (its one-line description)."""
    group, _, setting = name.partition(".")
    info = InferenceConfig.model_fields[group]
    if setting:
        sub = info.annotation
        assert isinstance(sub, type) and issubclass(sub, _Group)
        info = sub.model_fields[setting]
    return info.description or ""


def _optional(group: str, setting: str) -> bool:
    sub = InferenceConfig.model_fields[group].annotation
    assert isinstance(sub, type) and issubclass(sub, _Group)
    return sub.model_fields[setting].default is None


def _explain(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(x) for x in err["loc"])
        parts.append(f"inference setting {where}: {err['msg']} (got {err.get('input')!r})")
    return "; ".join(parts)


_FLAT_GROUPS = {
    "crf": ("gamma", "tau"),
    "paper": ("subset_rows", "subset_cols", "repeats", "seed"),
    "kernel": tuple(KernelSettings.model_fields),
    "output": tuple(OutputSettings.model_fields),
}


def _from_flat(d: dict[str, Any]) -> dict[str, Any]:
    """The nested form of a format-1 artifact's flat inference dict."""
    out: dict[str, Any] = {"mode": d.get("mode", "paper")}
    for group, names in _FLAT_GROUPS.items():
        out[group] = {k: d[k] for k in names if k in d}
    left = set(d) - {"mode"} - {k for names in _FLAT_GROUPS.values() for k in names}
    if left:
        raise ConfigError(f"unknown inference settings {sorted(left)}; valid: {', '.join(setting_names())}")
    return out


@dataclass(frozen=True)
class Crf:
    """The CRF weights in force: the inference settings resolved against the model's."""

    gamma: float
    tau: float
    layers: int


def resolve_crf(model: ModelConfig, crf: CrfSettings) -> Crf:
    """gamma, tau and T in force: each inference setting if set, else the model's (the one place)."""
    return Crf(
        gamma=model.gamma if crf.gamma is None else crf.gamma,
        tau=model.tau if crf.tau is None else crf.tau,
        layers=model.mf_layers if crf.layers is None else crf.layers,
    )
