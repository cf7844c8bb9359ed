"""The service's one configuration object, read from the environment (pydantic-settings).

`python -m service` (and so `dcmc serve`) turns its command-line flags into these variables before uvicorn
starts, so every worker process builds the same `Settings` from its environment.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, PositiveInt
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Service settings; every field is read from `DCMC_<NAME>` unless it says otherwise."""

    model_config = SettingsConfigDict(env_prefix="DCMC_", extra="ignore", frozen=True)

    artifacts: Path = Path("artifacts/current")
    """Artifact directory to serve (set by `dcmc serve --artifacts`)."""
    redis_url: str | None = Field(default=None, validation_alias=AliasChoices("REDIS_URL", "DCMC_REDIS_URL"))
    """Shared embedding tier, e.g. redis://127.0.0.1:6379/0 (env `REDIS_URL`); unset = in-process only."""
    redis_key_prefix: str = "dcmc"
    """First part of every Redis key: `<prefix>:<model_version>:user:<id>`."""
    redis_timeout_s: float = Field(default=0.25, gt=0)
    """Socket timeout of every Redis call; a slower Redis counts as down."""
    redis_retry_s: float = Field(default=1.0, gt=0)
    """After a Redis failure, requests skip Redis for this long before trying it again."""
    local_cache_size: int = Field(default=100_000, ge=0)
    """Embeddings kept in each worker's in-process tier (LRU); 0 disables the tier."""
    max_items: PositiveInt = 1000
    """Largest `items` list accepted by POST /predict."""
    max_k: PositiveInt = 100
    """Largest `k` accepted by GET /similar-users/{id}."""
    inference_mode: Literal["paper", "none", "exact"] | None = None
    """Override of the artifact's inference mode: `paper` (mean-field over random subsets), `exact`
    (mean-field over every known entry with exact linear-time messages) or `none` (base network)."""
    scaling: Literal["sum", "scaled", "normalized"] | None = None
    """`exact` only: override of the message scaling."""
    known: Literal["predicted", "clamped"] | None = None
    """`exact` only: override of how known entries enter the CRF (updated, or fixed to their ratings)."""
    tau: float | None = Field(default=None, gt=0)
    """`exact` only: override of the compatibility's truncation tau."""
    same_user: float | None = Field(default=None, ge=0)
    """`exact` only: override of the weight of the kernel's same-user term."""
    same_item: float | None = Field(default=None, ge=0)
    """`exact` only: override of the weight of the kernel's same-item term."""
    co_rating: float | None = Field(default=None, ge=0)
    """`exact` only: override of the weight of the kernel's co-rating term (item-based kNN)."""
    co_rating_power: float | None = Field(default=None, gt=0)
    """`exact` only: override of the exponent q of the co-rating weights."""
    co_rating_shrink: float | None = Field(default=None, gt=0)
    """`exact` only: override of the shrinkage s of the co-rating similarities."""
    co_rating_user: float | None = Field(default=None, ge=0)
    """`exact` only: override of the weight of the kernel's user-based co-rating term (user-based kNN)."""
    co_rating_prior: float | None = Field(default=None, ge=0)
    """`exact` only: override of the pseudo-count c in the co-rating terms' normaliser."""
    baseline: float | None = Field(default=None, ge=0, le=1)
    """`exact` only: override of the weight w of the bias baseline mixed into the final distributions."""
    baseline_user_shrink: float | None = Field(default=None, gt=0)
    """`exact` only: override of the ridge penalty of the baseline's user biases."""
    baseline_item_shrink: float | None = Field(default=None, gt=0)
    """`exact` only: override of the ridge penalty of the baseline's item biases."""
    repeats: PositiveInt | None = None
    """Override of R, the number of random partitions averaged."""
    subset_rows: PositiveInt | None = None
    """Override of the rows per random subset."""
    subset_cols: PositiveInt | None = None
    """Override of the columns per random subset."""
    seed: int | None = None
    """Override of the seed of the random partitions."""
    mf_layers: int | None = Field(default=None, ge=0)
    """Override of T, the number of mean-field layers."""
    gamma: float | None = Field(default=None, ge=0)
    """Override of gamma, the weight of the pairwise term."""
    onnx_threads: PositiveInt = 1
    """ONNX Runtime intra-op threads per worker (for embeddings recomputed on a cache miss)."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level of the service and of uvicorn."""
    metrics_dir: Path | None = Field(default=None, validation_alias="PROMETHEUS_MULTIPROC_DIR")
    """Prometheus multi-process directory (env `PROMETHEUS_MULTIPROC_DIR`; set by `python -m service`
    when it runs several workers, so /metrics adds up every worker)."""


@lru_cache
def get_settings() -> Settings:
    """The process's Settings, read from the environment once."""
    return Settings()
