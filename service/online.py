"""The online ratings in Redis, the shared state of every worker and replica.

Ratings that arrive after training are appended to one Redis stream, `<prefix>:ratings`, each entry
`{user, item, rating}` with external ids. The stream's order is the one global order: every worker of every
replica reads it from the start (at start-up, a replay) and then tails it, folding each rating into its
in-memory model (model/online.py). A write is acknowledged once Redis has executed the whole batch as one
transaction; with `appendonly yes` and `appendfsync always` that means it is on disk and survives `kill -9`
of Redis (`durability` reports whether the server is set up so).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from model.stream import redact_url, stream_key
from service.metrics import Metrics

log = logging.getLogger(__name__)

READ_CHUNK = 5000
"""Stream entries read per call (replay and tail)."""

TAIL_BLOCK_MS = 200
"""How long one tail read waits for new entries before it is issued again."""


@dataclass(frozen=True)
class Durability:
    """Whether the Redis server keeps acknowledged writes through `kill -9`, and why not."""

    durable: bool
    detail: str


@dataclass(frozen=True)
class Entry:
    """One online rating as stored: stream id, external user and item ids, rating."""

    id: str
    user: str
    item: str
    rating: float


def _client(url: str, timeout_s: float) -> redis.Redis:
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
    )


class RatingLog:
    """The stream of online ratings (see the module docstring)."""

    def __init__(self, url: str, prefix: str, timeout_s: float) -> None:
        self.shown_url = redact_url(url)  # what logs show: never the password
        self.key = stream_key(prefix)
        self.client = _client(url, timeout_s)
        # Blocking tail reads wait TAIL_BLOCK_MS on the server: their socket waits longer than that.
        self.tail_client = _client(url, timeout_s + TAIL_BLOCK_MS / 1000)

    def durability(self) -> Durability:
        """The server's persistence settings: durable only with an append-only file fsynced per write."""
        try:
            config = self.client.config_get("append*")
        except redis.ResponseError as exc:  # CONFIG disabled (managed Redis): cannot tell
            return Durability(False, f"cannot read the server's persistence settings: {exc}")
        aof, fsync = config.get("appendonly"), config.get("appendfsync")
        if aof != "yes" or fsync != "always":
            return Durability(
                False,
                f"appendonly={aof}, appendfsync={fsync}: acknowledged ratings can be lost when Redis "
                "stops; run Redis with --appendonly yes --appendfsync always",
            )
        return Durability(True, "appendonly=yes, appendfsync=always")

    def append(self, ratings: Sequence[tuple[str, str, float]]) -> str:
        """Append (user, item, rating) triples as one transaction; returns the last entry's id. Raises
        redis.RedisError when Redis fails, and then nothing of the batch was applied."""
        pipe = self.client.pipeline(transaction=True)
        for user, item, rating in ratings:
            pipe.xadd(self.key, {"user": user, "item": item, "rating": repr(float(rating))})
        ids = pipe.execute()
        return _text(ids[-1])

    def read(self, after: str, *, block_ms: int | None = None) -> list[Entry]:
        """Entries after the id `after` ("0" = from the start), at most READ_CHUNK; `block_ms` waits for
        new ones (the tail)."""
        if block_ms is None:
            start = f"({after}" if after != "0" else "-"
            raw: Any = self.client.xrange(self.key, min=start, count=READ_CHUNK)
            return [_entry(i, f) for i, f in raw]
        reply: Any = self.tail_client.xread({self.key: after}, count=READ_CHUNK, block=block_ms)
        return [_entry(i, f) for _, entries in reply or [] for i, f in entries]

    def ping(self) -> None:
        """One PING (raises redis.RedisError when Redis is down)."""
        self.client.ping()

    def close(self) -> None:
        """Release the connections."""
        self.client.close()
        self.tail_client.close()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _entry(entry_id: bytes | str, fields: dict[Any, Any]) -> Entry:
    f = {_text(k): _text(v) for k, v in fields.items()}
    return Entry(_text(entry_id), f["user"], f["item"], float(f["rating"]))


class Follower:
    """Applies the stream to this worker's model: `catch_up` reads everything new now; a daemon thread
    tails the stream in between. Redis failures leave the model as it is and are retried."""

    def __init__(
        self,
        ratings: RatingLog,
        apply: Callable[[list[Entry]], None],
        metrics: Metrics,
        retry_s: float,
    ) -> None:
        self.ratings, self.apply, self.metrics, self.retry_s = ratings, apply, metrics, retry_s
        self.last = "0"
        self.healthy = True
        self._lock = threading.Lock()  # one reader applies at a time, in stream order
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def catch_up(self) -> int:
        """Read and apply every entry after the last one applied; returns how many (raises RedisError)."""
        total = 0
        with self._lock:
            while entries := self.ratings.read(self.last):
                total += self._apply(entries)
        return total

    def _apply(self, entries: list[Entry]) -> int:
        """Apply entries that follow the last one applied (the caller holds the lock)."""
        self.apply(entries)
        self.last = entries[-1].id
        self.metrics.ratings_applied.inc(len(entries))
        return len(entries)

    def start(self) -> None:
        """Start the tail thread."""
        self._thread = threading.Thread(target=self._tail, name="rating-stream", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the tail thread (it ends within one block interval)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _tail(self) -> None:
        while not self._stop.is_set():
            try:
                # Wait for new entries without the lock, so a request's catch_up never waits on the tail.
                after = self.last
                entries = self.ratings.read(after, block_ms=TAIL_BLOCK_MS)
                if entries:
                    with self._lock:
                        if self.last == after:  # else a catch_up applied them meanwhile
                            self._apply(entries)
                    self.catch_up()
                if not self.healthy:
                    log.warning(
                        "Redis at %s is back; following the rating stream again", self.ratings.shown_url
                    )
                self.healthy = True
            except redis.RedisError as exc:
                self.metrics.redis_errors.inc()
                if self.healthy:
                    log.warning(
                        "Redis at %s failed (%s); serving the model as it is", self.ratings.shown_url, exc
                    )
                self.healthy = False
                self._stop.wait(self.retry_s)
            except Exception:  # a bug must not stop the thread silently
                log.exception("applying online ratings failed")
                self._stop.wait(self.retry_s)
