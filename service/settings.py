"""The service's one configuration object, read from the environment (pydantic-settings).

`python -m service` (and so `dcmc serve`) turns its command-line flags into these variables before uvicorn
starts, so every worker process builds the same `Settings` from its environment.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field, PositiveInt, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from model.stream import cluster_url
from service.catalogue import Boost, Filter, shape_problem


class Settings(BaseSettings):
    """Service settings; every field is read from `DCMC_<NAME>` unless it says otherwise."""

    model_config = SettingsConfigDict(
        env_prefix="DCMC_", env_nested_delimiter="__", extra="ignore", frozen=True
    )

    artifacts: Path = Path("artifacts/current")
    """Artifact directory to serve (set by `dcmc serve --artifacts`)."""
    redis_url: str | None = Field(default=None, validation_alias=AliasChoices("REDIS_URL", "DCMC_REDIS_URL"))
    """The shared online state, e.g. redis://127.0.0.1:6379/0 (env `REDIS_URL`); unset = no online
    ratings (the artifact's model only). `?cluster=true` at its end: the URL names one node of a Redis
    Cluster (`model.stream.connect`)."""

    @field_validator("redis_url")
    @classmethod
    def _cluster_flag(cls, value: str | None) -> str | None:
        if value is not None:
            cluster_url(value)  # ValueError for a cluster flag that is neither true nor false
        return value

    redis_key_prefix: str = "dcmc"
    """First part of every Redis key: the rating stream is `<prefix>:ratings`."""
    redis_timeout_s: float = Field(default=0.25, gt=0)
    """Socket timeout of every Redis call; a slower Redis counts as down."""
    redis_write_timeout_s: float = Field(default=2.0, gt=0)
    """Socket timeout of a write (POST /ratings). Redis with `appendfsync always` answers once the write is
    fsynced, which a slow or busy disk can take tens of milliseconds or more to do; past this the outcome
    is unknown, and the 503 says that the batch may have been stored (retrying is safe)."""
    require_durable: bool = False
    """Refuse writes (503, saying why; nothing stored) while Redis would not keep them through a crash or
    a failover: an append-only file fsynced on every write (`appendonly yes`, `appendfsync always`), no
    `allkeys-*` eviction policy, and writes that wait for the replicas the primary has
    (DCMC_REDIS_WAIT_REPLICAS). Read from the server before every write (one round trip).
    docker-compose.yml sets it."""
    redis_wait_replicas: int = Field(default=0, ge=0)
    """A write is acknowledged only once this many replicas of the Redis primary have it (`WAIT`); fewer
    within DCMC_REDIS_WRITE_TIMEOUT_S is a 503 saying the batch may be stored. With replicas and 0, an
    acknowledged write can be lost on failover, and `/health` says the server is not durable (writes are
    refused where DCMC_REQUIRE_DURABLE is set)."""
    max_new_users: int = Field(default=10_000, ge=0)
    """How many users the artifact does not know POST /ratings may create (each one grows every worker's
    tables); a batch that would pass it gets 422 and nothing of it is stored. Mind the memory where the
    artifact's inference uses the user co-rating term (`kernel.co_rating_user` > 0): its table is dense,
    (users x users) float64, up to `model.exact.DENSE_TABLE_MAX` (8,192) users (0.5 GB), then sparse
    (each user's strongest pairs); a fold-in keeps the changed lines beside it (docs/online.md)."""
    max_new_items: int = Field(default=1_000, ge=0)
    """The same for items the artifact does not know (predicted by the bias baseline until a trained user
    rates one)."""
    fold_in_interval_s: float = Field(default=0.5, ge=0, le=10)
    """How long each worker gathers newly arrived ratings before it folds them in as one batch: each batch
    makes a new model state (a fold-in's fixed cost, and the raters' cached rows computed again),
    so under a stream of writes a batch per interval costs far less than one per write. A read with
    `after` cuts the wait short (it is answered once its write is folded in); other reads see a write up
    to this much later (docs/online.md)."""
    answer_staleness_s: float = Field(default=10.0, ge=0, le=60)
    """How late other users' ratings may reach an answer from a cached user row. Every online rating moves
    every answer a little (the CRF's known field is a sum over all known ratings), so under a stream of
    ratings a row exact for the newest state would last one fold-in (`fold_in_interval_s`). A row answers
    while its state is at most this old and the user's own ratings, embedding and the items are as they
    were: each answer is exact for the state it was computed in, the user's own ratings are in it at
    once, and a read with `after` (or `explain`) is of the newest state. 0: every answer of the newest
    state (docs/online.md)."""
    fold_in_refine: Literal["auto", "all", "new"] = "auto"
    """Which users an online rating's fold-in refines against the decoder (model/online.py): `all` the
    users it touches, or `new` only users the network was not trained on (new users, and any without
    training ratings; a trained user then keeps the row branch's embedding of its updated row, as training
    embeds it); `auto`: the artifact's choice, made on its validation ratings at training
    (training/fold_in.py; `all` for an artifact without one). `new` folds in about 14x faster; `all` helps
    an under-trained network."""
    snapshot_interval_s: float = Field(default=30.0, ge=0)
    """How often (at most) the deployment stores a fold-in snapshot in Redis while ratings arrive
    (service/snapshot.py): a starting or reloading worker loads the newest and replays only the stream
    after it. One worker at a time writes it (a lease); 0 = this worker never writes one (it still loads
    one another worker wrote)."""
    snapshot_every: PositiveInt = 50_000
    """A snapshot is also due once this many online ratings arrived since the stored one, however soon."""
    read_after_timeout_s: float = Field(default=1.0, ge=0)
    """How long a read with `after` (a stream id POST /ratings returned) waits for this worker to apply
    that rating before it answers 503 with Retry-After."""
    redis_retry_s: float = Field(default=1.0, gt=0)
    """After a Redis failure, the stream follower waits this long before trying again (and 503s say
    `Retry-After` this many seconds, rounded up)."""
    write_token: SecretStr | None = None
    """Bearer token that POST /ratings requires (`Authorization: Bearer <token>`); unset or empty = writes
    off. Never logged."""

    read_token: SecretStr | None = None
    """Bearer token every read route requires where it is set (`Authorization: Bearer <token>`; the write
    token is accepted too): /predict, /recommend, /similar-users, /similar-items. Unset or empty: reads are
    open. /health, /ready and /metrics stay open (service/auth.py). Never logged."""

    @field_validator("write_token", "read_token", mode="before")
    @classmethod
    def _empty_token_is_none(cls, value: object) -> object:
        return None if value == "" else value

    keep_alive_s: PositiveInt = 75
    """How long an idle HTTP connection stays open (uvicorn's keep-alive). Longer than a load balancer's
    idle timeout (commonly 60 s), so that the server never closes a connection the balancer is about to
    reuse (a request lost in that race fails without an answer)."""
    reload_poll_s: float = Field(default=5.0, ge=0)
    """How often each worker checks the artifact behind `artifacts` (e.g. the symlink ARTIFACTS/current)
    for a new model version and swaps it in (service/reload.py); 0 = never."""
    max_body_bytes: PositiveInt = 1_048_576
    """Largest request body read, in bytes; a larger one gets 413 before any of it is parsed (by its
    Content-Length, or while it streams in)."""
    max_ratings: PositiveInt = 1000
    """Largest `ratings` batch accepted by POST /ratings."""
    impressions_max: int = Field(default=100_000, ge=0)
    """Entries the impressions stream `<prefix>:impressions` keeps, about (service/impressions.py); 0 = no
    impressions written (answers still carry a `recommendation_id`)."""
    experiments: Path | None = None
    """An experiments file (TOML, model/experiments.py; docker/experiments.toml is an example): the
    experiments /recommend takes part in. A file that cannot be read stops start-up, saying why."""
    max_item_changes: PositiveInt = 1000
    """Largest `items` batch accepted by POST /items (catalogue changes)."""
    explain_k: PositiveInt = 5
    """Known ratings an explanation lists per prediction (`"explain": true`), largest effect first."""
    max_explain_items: PositiveInt = 100
    """Largest number of items one request may ask to explain (POST /predict with `explain`; a larger one
    is a 422): an explanation reads every item's similarities per asked item."""
    max_items: PositiveInt = 1000
    """Largest `items` list accepted by POST /predict."""
    max_k: PositiveInt = 100
    """Largest `k` accepted by GET /similar-users/{id}."""
    default_filter: Filter | None = None
    """A filter every /recommend and /similar-items request gets besides its own (JSON, the syntax of
    service/catalogue.py: `DCMC_DEFAULT_FILTER='{"op": "eq", "attribute": "in_stock", "value": true}'`);
    answers name it in `rules`."""
    boosts: list[Boost] = Field(default_factory=list, max_length=16)
    """Deployment-wide boosts (JSON list of {name, filter, amount}): `amount` is added to the ranking
    score of the items the filter holds for, on every /recommend; answers name the ones that moved an
    item of the list."""
    diversity: float | None = Field(default=None, ge=0, le=1)
    """How far /recommend trades predicted rating for variety when a request does not say: 0 = by rating
    alone, 1 = by dissimilarity alone (maximal marginal relevance over the learned item similarity,
    model/ranking.py); unset = the artifact's choice, made on its validation ratings by `dcmc train`
    (config.json `ranking`), or 0 where it made none."""

    @field_validator("default_filter")
    @classmethod
    def _filter_shape(cls, value: Filter | None) -> Filter | None:
        problem = None if value is None else shape_problem(value, ["default_filter"])
        if problem is not None:
            raise ValueError(f"{'.'.join(str(p) for p in problem[0])}: {problem[2]}")
        return value

    inference: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the artifact's inference settings, nested by group: `DCMC_INFERENCE__MODE=exact`,
    `DCMC_INFERENCE__CRF__GAMMA=2`, `DCMC_INFERENCE__KERNEL__CO_RATING=0` (names and meanings in
    docs/inference.md; an unknown name stops start-up with the list of valid ones)."""
    user_cache_mb: float = Field(default=128.0, ge=0)
    """Per-worker memory for users' predictions over the whole catalogue (POST /predict computes a user's
    row once the user's misses have cost what the row costs, sooner while rows pay back, and answers from
    it after; GET /recommend fills it); 0 = off. A row is exact for the model state it was computed in
    and answers in later ones as `answer_staleness_s` allows. A row costs 49 bytes an item (82 KB on
    ML-100K: every one of its 943 users fits in 78 MB)."""
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


def inference_overrides(settings: Settings) -> dict[str, Any]:
    """The nested `inference` overrides as dotted names: {"crf": {"gamma": "2"}} -> {"crf.gamma": "2"}."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, sub in value.items():
                walk(f"{prefix}.{key.lower()}" if prefix else key.lower(), sub)
        else:
            out[prefix] = value

    walk("", settings.inference)
    return out
