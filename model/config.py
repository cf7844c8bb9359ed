"""Typed, torch-free configuration of the DCMC model and of its test-time inference.

Every field defaults to the value given in the paper ("Experiments: Hyperparameters Selection").
An artifact stores these next to the weights, so the weights and the architecture cannot disagree.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

InferenceMode = Literal["paper", "none", "exact"]
Scaling = Literal["sum", "scaled", "normalized"]
MessageScaling = Literal["sum", "normalized"]
KnownMode = Literal["predicted", "clamped"]


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


KERNEL_SETTINGS = (
    "scaling",
    "known",
    "gamma",
    "tau",
    "same_user",
    "same_item",
    "co_rating",
    "co_rating_power",
    "co_rating_prior",
    "co_rating_user",
    "co_rating_shrink",
)
"""The InferenceConfig fields the `exact` mode's CRF reads (a known field depends on these)."""

EXACT_SETTINGS = (*KERNEL_SETTINGS, "baseline", "baseline_user_shrink", "baseline_item_shrink")
"""The InferenceConfig fields that only the `exact` mode reads: the CRF's, then the bias baseline's."""


@dataclass(frozen=True)
class InferenceConfig:
    """Test-time procedure: CRFs over random row x column subsets, averaged over repeats."""

    mode: InferenceMode = "paper"
    """`paper`: mean-field over random subsets of known + queried entries; `none`: base network only;
    `exact`: mean-field over all known entries with exact linear-time messages, queries attached."""
    subset_rows: int = 32
    """Rows per random subset."""
    subset_cols: int = 64
    """Columns per random subset."""
    repeats: int = 10
    """Number R of random partitions whose predictions are averaged."""
    seed: int = 0
    """Seed of the random partitions."""
    scaling: Scaling = "normalized"
    """`exact` only: messages as summed (`sum`, the paper's), times the expected share of nodes in a
    subset_rows x subset_cols block (`scaled`), or divided by sum_l s(k, l) (`normalized`)."""
    known: KnownMode = "predicted"
    """`exact` only: known entries start from the base network's distributions and are updated
    (`predicted`), or are fixed to their observed labels (`clamped`)."""
    gamma: float | None = None
    """Weight of the pairwise term at test time; None = the model's gamma."""
    tau: float | None = None
    """`exact` only: truncation of the label compatibility min((L_u - L_v)^2, tau) at test time;
    None = the model's tau."""
    same_user: float = 0.0
    """`exact` only: weight lambda_u of the kernel's same-user term, lambda_u [i = i'] s_c(j, j'), added to
    s_r(i, i') s_c(j, j') (0 = the model's kernel; see model/exact.py)."""
    same_item: float = 0.0
    """`exact` only: weight lambda_i of the kernel's same-item term, lambda_i [j = j'] s_r(i, i')."""
    co_rating: float = 0.0
    """`exact` only: weight lambda_r of the kernel's co-rating term, lambda_r [i = i'] w(j, j'), with w the
    shrunk adjusted cosine of the items' training rating columns (item-based kNN; see model/exact.py)."""
    co_rating_power: float = 2.0
    """`exact` only: exponent q of the co-rating weights, w = max(0, rho)^q (larger = sharper)."""
    co_rating_shrink: float = 10.0
    """`exact` only: shrinkage s of the co-rating similarities, rho x n / (n + s) for n co-raters (> 0)."""
    co_rating_user: float = 0.0
    """`exact` only: weight lambda_c of the kernel's user-based co-rating term, lambda_c [j = j'] w_u(i, i'),
    with w_u the same shrunk adjusted cosine between the users' training rating rows (each item's mean
    removed) and exponent q (user-based kNN on the query's column; 0 = off)."""
    co_rating_prior: float = 0.0
    """`exact` with `normalized` messages only: pseudo-count c of the co-rating terms, which adds
    (lambda_r + lambda_c) c to the normaliser. A query whose co-rated neighbours weigh little then receives
    a weaker pull and keeps more of the base network's distribution (0 = none)."""
    baseline: float = 0.0
    """`exact` only: weight w of a bias baseline mixed into the CRF's final distributions, (1 - w) Q + w B.
    B puts the baseline's prediction mu + b_i + c_j on the two levels around it, so the expected rating
    becomes (1 - w) E_Q + w (mu + b_i + c_j) (not in the paper; 0 = the CRF alone, 1 = the baseline alone;
    see model/exact.py)."""
    baseline_user_shrink: float = 2.0
    """`exact` only: ridge penalty of the baseline's user biases b_i (a pseudo-count of ratings, > 0)."""
    baseline_item_shrink: float = 5.0
    """`exact` only: ridge penalty of the baseline's item biases c_j (a pseudo-count of ratings, > 0)."""

    def __post_init__(self) -> None:
        if self.mode not in ("paper", "none", "exact"):
            raise ConfigError(f"unknown inference mode {self.mode!r}; choose 'paper', 'none' or 'exact'")
        if self.scaling not in ("sum", "scaled", "normalized"):
            raise ConfigError(f"unknown scaling {self.scaling!r}; choose 'sum', 'scaled' or 'normalized'")
        if self.known not in ("predicted", "clamped"):
            raise ConfigError(f"unknown known-entry mode {self.known!r}; choose 'predicted' or 'clamped'")
        if self.gamma is not None and self.gamma < 0:
            raise ConfigError(f"gamma must be >= 0, got {self.gamma}")
        if self.same_user < 0 or self.same_item < 0:
            raise ConfigError(f"same_user and same_item must be >= 0, got {self.same_user}, {self.same_item}")
        if min(self.co_rating, self.co_rating_user, self.co_rating_prior) < 0:
            raise ConfigError(
                "co_rating, co_rating_user and co_rating_prior must be >= 0, got "
                f"{self.co_rating}, {self.co_rating_user} and {self.co_rating_prior}"
            )
        if not (self.co_rating_power > 0 and self.co_rating_shrink > 0):
            raise ConfigError(
                "co_rating_power and co_rating_shrink must be > 0, got "
                f"{self.co_rating_power} and {self.co_rating_shrink}"
            )
        if not 0.0 <= self.baseline <= 1.0:
            raise ConfigError(f"baseline must lie in [0, 1], got {self.baseline}")
        if not (self.baseline_user_shrink > 0 and self.baseline_item_shrink > 0):
            raise ConfigError(
                "baseline_user_shrink and baseline_item_shrink must be > 0, got "
                f"{self.baseline_user_shrink} and {self.baseline_item_shrink}"
            )
        if self.tau is not None and not self.tau > 0:
            raise ConfigError(f"tau must be > 0, got {self.tau}")
        if self.subset_rows < 1 or self.subset_cols < 1 or self.repeats < 1:
            raise ConfigError("subset_rows, subset_cols and repeats must be >= 1")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> InferenceConfig:
        """Inverse of `to_dict`."""
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown InferenceConfig fields: {sorted(unknown)}")
        return cls(**d)
