"""The online ratings in Redis, the shared state of every worker and replica.

Ratings that arrive after training are appended to one Redis stream, `<prefix>:ratings`, each entry
`{user, item, rating}` with external ids (retractions and forgetting too: model/stream.py holds the
format). The stream's order is the one global order: every worker of every replica catches up with it at
start-up (from a fold-in snapshot, service/snapshot.py, or by a replay) and then tails it, folding each
rating into its in-memory model (model/online.py). A write is acknowledged once Redis has executed the
whole batch as one transaction; with `appendonly yes` and `appendfsync always` that means it is on disk and
survives `kill -9` of Redis (`durability` reports whether the server is set up so).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from model.stream import (
    Compacted,
    Entry,
    Poison,
    cluster_url,
    compacted_key,
    connect,
    entry_fields,
    identity_key,
    parse_entry,
    redact_url,
    stream_key,
    stream_order,
    text,
)
from service.metrics import Metrics

log = logging.getLogger(__name__)

BULK_TIMEOUT_S = 30.0
"""Socket timeout of the calls that move a fold-in snapshot (tens of megabytes) in or out of Redis."""

READ_CHUNK = 5000
"""Stream entries read per call (replay and tail)."""

T = TypeVar("T")

TAIL_BLOCK_MS = 200
"""How long one tail read waits for new entries before it is issued again."""


@dataclass(frozen=True)
class Durability:
    """Whether the Redis server keeps acknowledged writes through `kill -9`, and why not."""

    durable: bool
    detail: str


def _client(url: str, timeout_s: float) -> redis.Redis:
    return connect(  # type: ignore[no-any-return]
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
    )


class RatingLog:
    """The stream of online ratings (see the module docstring)."""

    def __init__(self, url: str, prefix: str, timeout_s: float, write_timeout_s: float | None = None) -> None:
        self.shown_url = redact_url(url)  # what logs show: never the password
        self.key = stream_key(prefix)
        self.cluster = cluster_url(url)[1]
        self.dead_key = f"{self.key}:dead-letter"
        self.client = _client(url, timeout_s)
        # Writes wait for an fsync: a socket timeout of their own (`write_timeout_s`).
        self.write_client = _client(url, write_timeout_s or timeout_s)
        # Blocking tail reads wait TAIL_BLOCK_MS on the server: their socket waits longer than that.
        self.tail_client = _client(url, timeout_s + TAIL_BLOCK_MS / 1000)
        self.bulk_client = _client(url, max(timeout_s, BULK_TIMEOUT_S))  # fold-in snapshots

    def durability(self) -> Durability:
        """The server's persistence settings: durable only with an append-only file fsynced per write."""
        try:
            if self.cluster:  # every primary: the stream's keys may live on any of them
                nodes: Any = self.client.config_get("append*", target_nodes="primaries")
            else:
                nodes = {"": self.client.config_get("append*")}
        except redis.ResponseError as exc:  # CONFIG disabled (managed Redis): cannot tell
            return Durability(False, f"cannot read the server's persistence settings: {exc}")
        for node, config in sorted(nodes.items()):
            aof, fsync = config.get("appendonly"), config.get("appendfsync")
            if aof != "yes" or fsync != "always":
                where = f" on {node}" if node else ""
                return Durability(
                    False,
                    f"appendonly={aof}, appendfsync={fsync}{where}: acknowledged ratings can be lost when "
                    "Redis stops; run Redis with --appendonly yes --appendfsync always",
                )
        return Durability(True, "appendonly=yes, appendfsync=always")

    def append(self, ratings: Sequence[tuple[str, str, float | None]]) -> str:
        """Append (user, item, rating) triples as one transaction (rating None: a retraction); returns the
        last entry's id. Raises
        redis.RedisError when Redis fails: `stored_unknown(exc)` says whether the batch may have been stored
        (all of it or nothing: a transaction)."""
        if len(ratings) == 1:  # one command is atomic by itself: no MULTI/EXEC around it
            fields = entry_fields(*ratings[0])
            return text(self.write_client.xadd(self.key, fields))  # type: ignore[arg-type]
        pipe = self.write_client.pipeline(transaction=True)
        for user, item, rating in ratings:
            pipe.xadd(self.key, entry_fields(user, item, rating))  # type: ignore[arg-type]
        ids = pipe.execute()
        return text(ids[-1])

    def dead_letter(self, poison: Poison) -> bool:
        """Copy a poison entry to the dead-letter stream `<prefix>:ratings:dead-letter` under its own id,
        with the reason; False when it is there already (another worker, or an earlier run, copied it:
        stream ids only grow, so Redis refuses the same id twice). Raises redis.RedisError."""
        fields = {**{f"field:{k}": v for k, v in poison.fields.items()}, "reason": poison.reason}
        try:
            self.client.xadd(self.dead_key, fields, id=poison.id)  # type: ignore[arg-type]
        except redis.ResponseError as exc:
            if "equal or smaller" in str(exc):
                return False
            raise
        return True

    def read(self, after: str, *, block_ms: int | None = None) -> list[Entry | Poison]:
        """Entries after the id `after` ("0" = from the start), at most READ_CHUNK; `block_ms` waits for
        new ones (the tail)."""
        if block_ms is None:
            start = f"({after}" if after != "0" else "-"
            raw: Any = self.client.xrange(self.key, min=start, count=READ_CHUNK)
            return [parse_entry(i, f) for i, f in raw]
        reply: Any = self.tail_client.xread({self.key: after}, count=READ_CHUNK, block=block_ms)
        return [parse_entry(i, f) for _, entries in reply or [] for i, f in entries]

    def identity(self) -> str | None:
        """The stream's identity (`model.stream.identity_key`), set here first if it has none (SET NX: of
        several workers starting together, one sets it and all read the same); None where it has none and
        this client may not set it. Raises redis.RedisError."""
        key = identity_key(self.key)
        # A read-only replica, or no write permission: read what is there.
        with contextlib.suppress(redis.ResponseError):
            self.client.set(key, uuid.uuid4().hex, nx=True)
        value: Any = self.client.get(key)
        return text(value) if value is not None else None

    def compacted(self) -> Compacted | None:
        """The stream's compacted head (`dcmc compact`), None where it has none or it cannot be read (then
        logged: the ratings it holds are not in the stream any more). Raises redis.RedisError."""
        raw: Any = self.bulk_client.get(compacted_key(self.key))
        if raw is None:
            return None
        try:
            return Compacted.from_json(raw)
        except ValueError as exc:
            log.error("the compacted head of %s cannot be read (%s): its ratings are left out", self.key, exc)
            return None

    def last_generated(self) -> str:
        """The id of the newest entry the stream has ever had ("0-0" for none); raises redis.RedisError."""
        try:
            info: Any = self.client.xinfo_stream(self.key)
        except redis.ResponseError:  # no such key: no entry was ever written
            return "0-0"
        return text(info["last-generated-id"])

    def ping(self) -> None:
        """One PING (raises redis.RedisError when Redis is down)."""
        self.client.ping()

    def close(self) -> None:
        """Release the connections."""
        self.client.close()
        self.write_client.close()
        self.tail_client.close()
        self.bulk_client.close()


def stored_unknown(exc: redis.RedisError) -> bool:
    """Whether a failed `append` may have stored its batch: its transaction reached Redis and no answer
    came back (a timeout, or the connection lost while waiting). Not when it could not connect, nor send."""
    if isinstance(exc, redis.TimeoutError):
        return True
    if isinstance(exc, redis.ConnectionError):
        text = str(exc)
        return not ("connecting to" in text or "writing to socket" in text)
    return False


class Follower:
    """Applies the stream to this worker's model: `catch_up` reads everything new now; a daemon thread
    tails the stream in between. Redis failures leave the model as it is and are retried."""

    def __init__(
        self,
        ratings: RatingLog,
        apply: Callable[[list[Entry]], None],
        metrics: Metrics,
        retry_s: float,
        check: Callable[[list[Entry]], list[Poison]] = lambda entries: [],
    ) -> None:
        """`apply(entries)` folds entries in; `check(entries)` first says which of them the model cannot
        take (e.g. a rating off its levels), as Poison."""
        self.ratings, self.apply, self.metrics, self.retry_s = ratings, apply, metrics, retry_s
        self.check = check
        self.interval_s = 0.0
        """After the first new entry, how long the tail waits for more before it folds them in together."""
        self.on_recover: Callable[[], object] = lambda: None
        """Called (by the tail thread) when Redis answers again after a failure."""
        self.prepare: Callable[[], object] = lambda: None
        """Called once before the first read of the stream, retried until it succeeds (raises RedisError):
        where the artifact's place in this stream is decided."""
        self.after_read: Callable[[], object] = lambda: None
        """Called by the tail thread after each read of the stream, whether or not it brought entries (a
        fold-in snapshot may be due: after the start-up replay, or after new entries)."""
        self._prepared = False
        self.last = "0"
        self.healthy = True
        self.skipped = 0
        """Entries skipped as poison (`Poison`) by this worker."""
        self.last_skipped: Poison | None = None
        self._lock = threading.Lock()  # one reader applies at a time, in stream order
        self._stop = threading.Event()
        self._hurry = threading.Event()  # a read waits for an entry: fold in without the interval
        self._thread: threading.Thread | None = None

    def catch_up(self) -> int:
        """Read and apply every entry after the last one applied; returns how many (raises RedisError)."""
        total = 0
        with self._lock:
            self._prepare()
            while entries := self.ratings.read(self.last):
                total += self._apply(entries)
        return total

    def capture(self, read: Callable[[], T]) -> tuple[str, T]:
        """(the last entry applied, read()) with nothing applied in between: what a snapshot covers."""
        with self._lock:
            return self.last, read()

    def _prepare(self) -> None:
        """`prepare`, once (the caller holds the lock)."""
        if not self._prepared:
            self.prepare()
            self._prepared = True

    def _apply(self, entries: list[Entry | Poison]) -> int:
        """Apply entries that follow the last one applied (the caller holds the lock). Poison entries are
        copied to the dead-letter stream, logged once (by whichever worker copies them first), counted and
        skipped; a Redis failure while copying leaves `last` where it was (the batch is read again)."""
        valid = [e for e in entries if isinstance(e, Entry)]
        poison = [e for e in entries if isinstance(e, Poison)] + self.check(valid)
        refused = {p.id for p in poison}
        for bad in sorted(poison, key=lambda p: stream_order(p.id)):
            self._skip(bad)
        valid = [e for e in valid if e.id not in refused]
        if valid:
            try:
                self.apply(valid)
            except Exception:  # a bug, not the data: find the entries it fails on, skip only those
                log.exception("folding in %d stream entries failed; applying them one at a time", len(valid))
                for entry in valid:
                    try:
                        self.apply([entry])
                    except Exception as exc:
                        reason = f"fold-in failed: {type(exc).__name__}: {exc}"
                        self._skip(Poison(entry.id, entry.fields(), reason))
        self.last = entries[-1].id
        self.metrics.ratings_applied.inc(len(entries) - len(poison))
        return len(entries)

    def _skip(self, bad: Poison) -> None:
        """Copy a poison entry to the dead-letter stream (logged by whichever worker copies it first) and
        count it as skipped."""
        if self.ratings.dead_letter(bad):
            log.error(
                "stream entry %s of %s cannot be applied (%s): skipped, copied to %s",
                bad.id,
                self.ratings.key,
                bad.reason,
                self.ratings.dead_key,
            )
        self.skipped += 1
        self.last_skipped = bad
        self.metrics.entries_skipped.inc()

    def start(self) -> None:
        """Start the tail thread."""
        self._thread = threading.Thread(target=self._tail, name="rating-stream", daemon=True)
        self._thread.start()

    def hurry(self) -> None:
        """Fold in what has arrived now rather than at the end of the gathering interval (a read with
        `after` waits for it)."""
        self._hurry.set()

    def stop(self) -> None:
        """Stop the tail thread (it ends within one block interval)."""
        self._stop.set()
        self._hurry.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _tail(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._prepared:
                    with self._lock:
                        self._prepare()
                # Wait for new entries without the lock, so a request's catch_up never waits on the tail.
                after = self.last
                entries = self.ratings.read(after, block_ms=TAIL_BLOCK_MS)
                if entries and self.interval_s > 0:
                    # Whatever else arrives within the interval joins these: read again and fold them all
                    # in at once (one new model state per interval), sooner when a read waits (`hurry`).
                    self._hurry.wait(self.interval_s)
                    self._hurry.clear()
                    if self._stop.is_set():
                        return
                    self.catch_up()
                elif entries:
                    with self._lock:
                        if self.last == after:  # else a catch_up applied them meanwhile
                            self._apply(entries)
                    self.catch_up()
                self.after_read()
                if not self.healthy:
                    log.warning(
                        "Redis at %s is back; following the rating stream again", self.ratings.shown_url
                    )
                    self.on_recover()
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
