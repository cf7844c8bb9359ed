"""Two embedding tiers in front of the ONNX branches: an in-process LRU, then Redis (shared, optional).

A request looks its user and items up in the worker's local tier (no network round trip), sends every
local miss to Redis in one MGET, and computes what Redis lacks through the ONNX row/column branch, writing
the result to both tiers. Redis is a cache, never a source of truth: keys carry the artifact version, a
failing Redis is skipped for `retry_s` (the service answers from the local tier and the engine meanwhile,
and /health says `degraded`), and the next call after that tries it again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from service.metrics import Metrics

log = logging.getLogger(__name__)

Kind = Literal["user", "item"]
Key = tuple[Kind, int]
# Computes embeddings of one kind for internal indices: (b,) -> (b, d) float32.
Compute = Callable[[Kind, np.ndarray], np.ndarray]

POPULATE_CHUNK = 2000


class LocalTier:
    """A bounded, thread-safe LRU of embeddings keyed by (kind, internal index)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._data: OrderedDict[Key, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._data)

    def get_many(self, keys: Sequence[Key]) -> list[np.ndarray | None]:
        """The cached vector of each key, or None; hits become most recently used."""
        out: list[np.ndarray | None] = []
        with self._lock:
            for key in keys:
                vec = self._data.get(key)
                if vec is not None:
                    self._data.move_to_end(key)
                out.append(vec)
        return out

    def put_many(self, items: Sequence[tuple[Key, np.ndarray]]) -> None:
        """Insert vectors, evicting the least recently used beyond the capacity."""
        if self.capacity <= 0:
            return
        with self._lock:
            for key, vec in items:
                self._data[key] = vec
                self._data.move_to_end(key)
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)

    def discard(self, keys: Sequence[Key]) -> None:
        """Forget some keys (tests and operators use it to force the next tier)."""
        with self._lock:
            for key in keys:
                self._data.pop(key, None)


class RedisTier:
    """The shared tier: float32 vectors under `<prefix>:<version>:<kind>:<external id>`, with a breaker."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str,
        version: str,
        dim: int,
        timeout_s: float,
        retry_s: float,
        metrics: Metrics,
    ) -> None:
        self.client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        self.url = url
        self.namespace = f"{prefix}:{version}"
        self.dim = dim
        self.retry_s = retry_s
        self.metrics = metrics
        self._down_until = 0.0
        self._healthy = True
        self._lock = threading.Lock()
        self.on_recover: Callable[[], None] | None = None

    # -- state -------------------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        """False from a failed call until a later call succeeds."""
        return self._healthy

    def _usable(self) -> bool:
        return self._healthy or time.monotonic() >= self._down_until

    def _failed(self, exc: Exception) -> None:
        self.metrics.redis_errors.inc()
        with self._lock:
            self._down_until = time.monotonic() + self.retry_s
            was_healthy, self._healthy = self._healthy, False
        if was_healthy:
            log.warning(
                "Redis at %s failed (%s); serving without it, retrying every %.1fs",
                self.url,
                exc,
                self.retry_s,
            )

    def _succeeded(self) -> None:
        if self._healthy:
            return
        with self._lock:
            recovered, self._healthy = not self._healthy, True
        if recovered:
            log.warning("Redis at %s is back", self.url)
            if self.on_recover is not None:
                self.on_recover()

    # -- keys --------------------------------------------------------------------------------------------
    def key(self, kind: Kind, external_id: str) -> str:
        """Redis key of one embedding."""
        return f"{self.namespace}:{kind}:{external_id}"

    @property
    def marker(self) -> str:
        """Set once every embedding of this artifact version has been written."""
        return f"{self.namespace}:loaded"

    # -- calls -------------------------------------------------------------------------------------------
    def ping(self) -> bool:
        """One PING (also the way a down tier is probed again)."""
        try:
            self.client.ping()
        except redis.RedisError as exc:
            self._failed(exc)
            return False
        self._succeeded()
        return True

    def mget(self, keys: Sequence[str]) -> list[np.ndarray | None] | None:
        """Vectors of `keys` in one round trip (None per missing key); None when Redis is unavailable."""
        if not keys or not self._usable():
            return None
        try:
            raw = self.client.mget(keys)
        except redis.RedisError as exc:
            self._failed(exc)
            return None
        self._succeeded()
        out: list[np.ndarray | None] = []
        for value in raw:
            ok = isinstance(value, bytes) and len(value) == 4 * self.dim
            out.append(np.frombuffer(value, dtype=np.float32) if ok else None)  # type: ignore[arg-type]
        return out

    def mset(self, mapping: dict[str, np.ndarray]) -> None:
        """Write vectors in one round trip (best effort)."""
        if not mapping or not self._usable():
            return
        try:
            self.client.mset({k: np.asarray(v, dtype=np.float32).tobytes() for k, v in mapping.items()})
        except redis.RedisError as exc:
            self._failed(exc)
            return
        self._succeeded()

    def populate(self, tables: Mapping[Kind, tuple[Sequence[str], np.ndarray]]) -> str:
        """Bulk-write every embedding (pipelined), unless another replica did or is doing it.

        Returns what happened: `written`, `present` (the marker exists), `busy` (another replica holds the
        lock) or `unavailable`.
        """
        lock = f"{self.namespace}:loading"
        try:
            if self.client.exists(self.marker):
                self._succeeded()
                return "present"
            if not self.client.set(lock, "1", nx=True, ex=120):
                self._succeeded()
                return "busy"
            start, count = time.perf_counter(), 0
            pipe = self.client.pipeline(transaction=False)
            for kind, (ids, table) in tables.items():
                table = np.ascontiguousarray(table, dtype=np.float32)
                for lo in range(0, len(ids), POPULATE_CHUNK):
                    hi = min(lo + POPULATE_CHUNK, len(ids))
                    chunk = {self.key(kind, ids[i]): table[i].tobytes() for i in range(lo, hi)}
                    pipe.mset(chunk)
                    count += len(chunk)
            pipe.set(self.marker, str(count))
            pipe.delete(lock)
            pipe.execute()
        except redis.RedisError as exc:
            self._failed(exc)
            return "unavailable"
        self._succeeded()
        log.info(
            "wrote %d embeddings to Redis under %s:* in %.2fs",
            count,
            self.namespace,
            time.perf_counter() - start,
        )
        return "written"

    def close(self) -> None:
        """Release the connection pool."""
        self.client.close()


class EmbeddingStore:
    """Embeddings by internal index through the local tier, Redis, then the ONNX branches."""

    def __init__(
        self,
        local: LocalTier,
        shared: RedisTier | None,
        external_ids: dict[Kind, Sequence[str]],
        compute: Compute,
        metrics: Metrics,
    ) -> None:
        self.local = local
        self.shared = shared
        self.external_ids = external_ids
        self.compute = compute
        self.metrics = metrics

    def lookup(self, wanted: Sequence[tuple[Kind, np.ndarray]]) -> list[np.ndarray]:
        """For each (kind, indices) pair, the (len(indices), d) float32 embeddings."""
        keys: list[Key] = [(kind, int(i)) for kind, idx in wanted for i in idx]
        vectors = self.local.get_many(keys)
        missing = [k for k, v in enumerate(vectors) if v is None]
        self._count("local", len(keys) - len(missing), len(missing))
        if missing:
            self._fill(keys, vectors, missing)
        out, pos = [], 0
        for _, idx in wanted:
            found = [v for v in vectors[pos : pos + len(idx)] if v is not None]  # every miss was filled
            out.append(np.stack(found) if len(idx) else np.empty((0, 0), np.float32))
            pos += len(idx)
        return out

    def _fill(self, keys: list[Key], vectors: list[np.ndarray | None], missing: list[int]) -> None:
        """Fill `vectors[missing]` from Redis, then from the engine; write back to the tiers."""
        fetched: list[tuple[Key, np.ndarray]] = []
        still = missing
        if self.shared is not None:
            names = [self.shared.key(keys[k][0], self.external_ids[keys[k][0]][keys[k][1]]) for k in missing]
            got = self.shared.mget(names)
            if got is not None:
                still = [k for k, v in zip(missing, got, strict=True) if v is None]
                self._count("redis", len(missing) - len(still), len(still))
                for k, v in zip(missing, got, strict=True):
                    if v is not None:
                        vectors[k] = v
                        fetched.append((keys[k], v))
        computed: dict[str, np.ndarray] = {}
        for kind in ("user", "item"):
            todo = [k for k in still if keys[k][0] == kind]
            if not todo:
                continue
            unique = sorted({keys[k][1] for k in todo})
            table = self.compute(kind, np.asarray(unique, dtype=np.int64))  # (b, d)
            self.metrics.computed.labels(kind).inc(len(unique))
            row = {idx: table[j] for j, idx in enumerate(unique)}
            for k in todo:
                vectors[k] = row[keys[k][1]]
            for idx, vec in row.items():
                fetched.append(((kind, idx), vec))
                if self.shared is not None:
                    computed[self.shared.key(kind, self.external_ids[kind][idx])] = vec
        self.local.put_many(fetched)
        if self.shared is not None and computed:
            self.shared.mset(computed)

    def _count(self, tier: str, hits: int, misses: int) -> None:
        if hits:
            self.metrics.cache.labels(tier, "hit").inc(hits)
        if misses:
            self.metrics.cache.labels(tier, "miss").inc(misses)
