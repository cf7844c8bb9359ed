"""The online ratings in Redis, the shared state of every worker and replica: `RatingLog`, the one place
that speaks to the stream.

Ratings that arrive after training are appended to one Redis stream, `<prefix>:ratings`, each entry
`{user, item, rating}` with external ids (retractions and forgetting too: model/stream.py holds the
format). The stream's order is the one global order: every worker of every replica turns it into its model
states (service/replication.py). A write is acknowledged once Redis has executed the whole batch as one
transaction; with `appendonly yes` and `appendfsync always` that means it is on disk and survives `kill -9`
of Redis (`durability` says whether the server is set up so, and `append` checks it before every write
where the service requires it).

Entries leave the stream two ways only: `dcmc compact` trims a prefix that its compacted head holds
(training/compact.py; the head is written first), and forgetting a user deletes that user's earlier
entries (`purge_user`; the purge mark `<stream>:purged` is raised first). A reader checks after each read
whether a head ends past its place (`head_last`: it then folds the head in) and whether anything after its
place was deleted (`max-deleted-entry-id`, Redis >= 7.0, returned with the entries atomically: a purge,
or a loss by hand), so it never skips an entry unknowingly.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from model.stream import (
    Compacted,
    Entry,
    Event,
    ItemEntry,
    Page,
    Poison,
    cluster_url,
    compacted_key,
    connect,
    entry_fields,
    explained_by_purge,
    head_last,
    identity_key,
    mark_purged,
    parse_entry,
    read_page,
    redact_url,
    stream_key,
    stream_order,
    text,
)
from service.impressions import impressions_key

log = logging.getLogger(__name__)

BULK_TIMEOUT_S = 30.0
"""Socket timeout of the calls that move a fold-in snapshot (tens of megabytes) in or out of Redis."""

READ_CHUNK = 5000
"""Stream entries read per call (replay and tail)."""

TAIL_BLOCK_MS = 200
"""How long one tail read waits for new entries before it is issued again."""

DEAD_LETTER_MAX = 10_000
"""The dead-letter stream keeps about this many entries (the oldest go first)."""

PURGE_CHUNK = 1000
"""Stream entries deleted per call when a user is forgotten."""


@dataclass(frozen=True)
class Durability:
    """Whether the Redis server keeps acknowledged writes through `kill -9` and a failover, and why not."""

    durable: bool
    detail: str


class NotDurable(Exception):
    """A write refused because DCMC_REQUIRE_DURABLE is set and Redis would not keep it through a crash."""


class ReplicasBehind(redis.TimeoutError):
    """A write stored on the primary that fewer replicas than DCMC_REDIS_WAIT_REPLICAS confirmed in time:
    a failover now could lose it (`stored_unknown` says it may be stored)."""


class HeadUnreadable(Exception):
    """The stream's compacted head is there but cannot be read: the ratings it holds are nowhere else, so
    a worker that needs it does not go on without it."""


@dataclass(frozen=True)
class Read:
    """One read of the stream (`RatingLog.read`): the entries after an id, parsed, and the `Page` they came
    in (what was deleted and added at that instant)."""

    entries: list[Entry | ItemEntry | Event | Poison]
    page: Page


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
        self.impressions_key = impressions_key(prefix)
        self.client = _client(url, timeout_s)
        # Writes wait for an fsync: a socket timeout of their own (`write_timeout_s`).
        self.write_timeout_s = write_timeout_s or timeout_s
        self.write_client = _client(url, self.write_timeout_s)
        # Blocking tail reads wait TAIL_BLOCK_MS on the server: their socket waits longer than that.
        self.tail_client = _client(url, timeout_s + TAIL_BLOCK_MS / 1000)
        self.bulk_client = _client(url, max(timeout_s, BULK_TIMEOUT_S))  # snapshots, heads, purges
        self.verdict: Durability | None = None
        """What the last write that required durability read of the server's settings."""

    # -- durability --------------------------------------------------------------------------------------
    def _configs(self, names: Sequence[str], client: Any) -> dict[str, dict[str, str]]:
        """The settings `names` of every primary of a cluster (the stream, its head and snapshots may live
        on any of them), by node."""
        raw = client.execute_command("CONFIG", "GET", *names, target_nodes="primaries")
        if not isinstance(raw, dict) or names[0] in raw or names[0].encode() in raw:
            raw = {"": raw}  # one primary answered for all
        return self._as_configs(raw)

    @staticmethod
    def _as_configs(raw: dict[Any, Any]) -> dict[str, dict[str, str]]:
        out = {}
        for node, values in raw.items():
            if isinstance(values, list):  # RESP2: a flat list of names and values
                values = dict(zip(values[::2], values[1::2], strict=True))
            out[text(node) if node else ""] = {text(k): text(v) for k, v in values.items()}
        return out

    def durability(self, wait_replicas: int = 0) -> Durability:
        """The server's settings: durable only with an append-only file fsynced per write, an eviction
        policy that never evicts the stream, and, where it has replicas, writes that wait for them
        (`wait_replicas`). Raises redis.RedisError."""
        return self._durable_now(self.client, wait_replicas)

    def _durable_now(self, client: Any, wait_replicas: int) -> Durability:
        """`durability`, read through `client` (a write reads it on its own connection)."""
        names = ("appendonly", "appendfsync", "maxmemory-policy", "maxmemory")
        try:
            if self.cluster:
                nodes = self._configs(names, client)
                replicas = self._replicas(client)
            else:  # one round trip
                pipe = client.pipeline(transaction=False)
                pipe.execute_command("CONFIG", "GET", *names)
                pipe.info("replication")
                config, info = pipe.execute()
                nodes = self._as_configs({"": config})
                replicas = int(info.get("connected_slaves", 0))
        except redis.ResponseError as exc:  # CONFIG or INFO disabled (managed Redis): cannot tell
            return Durability(False, f"cannot read the server's persistence settings: {exc}")
        for node, config in sorted(nodes.items()):
            where = f" on {node}" if node else ""
            aof, fsync = config.get("appendonly"), config.get("appendfsync")
            if aof != "yes" or fsync != "always":
                return Durability(
                    False,
                    f"appendonly={aof}, appendfsync={fsync}{where}: acknowledged ratings can be lost when "
                    "Redis stops; run Redis with --appendonly yes --appendfsync always",
                )
            policy = config.get("maxmemory-policy", "noeviction")
            if policy.startswith("allkeys") and config.get("maxmemory", "0") != "0":
                return Durability(
                    False,
                    f"maxmemory-policy={policy}{where}: Redis may evict the rating stream when it is full; "
                    "use noeviction (or a volatile-* policy)",
                )
        if replicas and not wait_replicas:
            return Durability(
                False,
                f"the primary has {replicas} replica(s) and writes do not wait for them: a failover can "
                "lose acknowledged ratings; set DCMC_REDIS_WAIT_REPLICAS",
            )
        if wait_replicas > replicas:
            return Durability(
                False,
                f"DCMC_REDIS_WAIT_REPLICAS={wait_replicas} but the primary has {replicas} replica(s) "
                "connected: writes cannot be confirmed",
            )
        waits = f", writes wait for {wait_replicas} replica(s)" if wait_replicas else ""
        return Durability(True, f"appendonly=yes, appendfsync=always{waits}")

    def _replicas(self, client: Any) -> int:
        """How many replicas the primary holding the stream has connected."""
        if self.cluster:
            node = client.get_node_from_key(self.key)
            info: Any = client.info("replication", target_nodes=node)
            info = next(iter(info.values())) if "connected_slaves" not in info else info
        else:
            info = client.info("replication")
        return int(info.get("connected_slaves", 0))

    # -- writes ------------------------------------------------------------------------------------------
    def append(
        self,
        ratings: Sequence[tuple[str, str, float | None]],
        require_durable: bool = False,
        wait_replicas: int = 0,
    ) -> str:
        """Append (user, item, rating) triples as one transaction (rating None: a retraction); returns the
        last entry's id (`append_fields`)."""
        return self.append_fields([entry_fields(*r) for r in ratings], require_durable, wait_replicas)

    def append_fields(
        self,
        entries: Sequence[dict[str, str]],
        require_durable: bool = False,
        wait_replicas: int = 0,
    ) -> str:
        """Append entries (their fields, model/stream.py: ratings, catalogue changes) as one transaction;
        returns the last entry's id. With `require_durable`, the server's settings are read first (one
        round trip) and NotDurable raised, nothing written, when they could lose the write; with
        `wait_replicas`, the answer waits until that many replicas have the batch. Raises
        redis.RedisError when Redis fails: `stored_unknown(exc)` says whether the batch may have been
        stored (all of it or nothing)."""
        if require_durable:
            self.verdict = self._durable_now(self.write_client, wait_replicas)
            if not self.verdict.durable:
                raise NotDurable(self.verdict.detail)
        if len(entries) == 1:  # one command is atomic by itself: no MULTI/EXEC around it
            last = text(self.write_client.xadd(self.key, entries[0]))  # type: ignore[arg-type]
        else:
            pipe = self.write_client.pipeline(transaction=True)
            for fields in entries:
                pipe.xadd(self.key, fields)  # type: ignore[arg-type]
            last = text(pipe.execute()[-1])
        if wait_replicas:
            timeout_ms = max(1, int(self.write_timeout_s * 800))  # the answer comes before the socket's
            confirmed = int(self.write_client.wait(wait_replicas, timeout_ms))
            if confirmed < wait_replicas:
                raise ReplicasBehind(
                    f"stored on the primary, confirmed by {confirmed} of {wait_replicas} replica(s)"
                )
        return last

    def dead_letter(self, poison: Poison) -> bool:
        """Copy a poison entry to the dead-letter stream `<prefix>:ratings:dead-letter` under its own id
        (or, when a later entry is there already, under a new id with its own as `entry_id`), with the
        reason; False when it is there already (another worker, or an earlier run, copied it). The stream
        keeps about DEAD_LETTER_MAX entries. Raises redis.RedisError."""
        fields = {**{f"field:{k}": v for k, v in poison.fields.items()}, "reason": poison.reason}
        try:
            self.client.xadd(self.dead_key, fields, id=poison.id, maxlen=DEAD_LETTER_MAX, approximate=True)  # type: ignore[arg-type]
        except redis.ResponseError as exc:
            if "equal or smaller" not in str(exc):
                raise
            if self.client.xrange(self.dead_key, poison.id, poison.id):
                return False
            copy = {**fields, "entry_id": poison.id}
            self.client.xadd(self.dead_key, copy, maxlen=DEAD_LETTER_MAX, approximate=True)  # type: ignore[arg-type]
        return True

    def purge_user(self, user: str, before: str) -> tuple[int, int]:
        """Delete every entry of `user` before the stream id `before` (the request to forget them) from the
        stream, and their copies from the dead-letter stream: (entries deleted, copies deleted). The purge
        mark is raised first (`model.stream.mark_purged`): readers behind the deletion tell it from a
        trim and read on, skipping the purged entries as if never written, which folds in as the forget
        would have. Raises redis.RedisError (what was deleted so far stays deleted; the rest goes at the
        next compaction)."""
        ids = [i for i, fields in self._scan(self.key, "-", f"({before}") if _field(fields, "user") == user]
        deleted = 0
        if ids:
            mark_purged(self.bulk_client, self.key, ids[-1])
        for start in range(0, len(ids), PURGE_CHUNK):
            deleted += int(self.bulk_client.xdel(self.key, *ids[start : start + PURGE_CHUNK]))
        copies = [
            i
            for i, fields in self._scan(self.dead_key, "-", "+")
            if _field(fields, "field:user") == user
            and stream_order(_field(fields, "entry_id") or i) < stream_order(before)
        ]
        removed = 0
        for start in range(0, len(copies), PURGE_CHUNK):
            removed += int(self.bulk_client.xdel(self.dead_key, *copies[start : start + PURGE_CHUNK]))
        # What the user was shown (service/impressions.py): evaluation data that names them.
        shown = [
            i for i, fields in self._scan(self.impressions_key, "-", "+") if _field(fields, "user") == user
        ]
        for start in range(0, len(shown), PURGE_CHUNK):
            self.bulk_client.xdel(self.impressions_key, *shown[start : start + PURGE_CHUNK])
        return deleted, removed

    def _scan(self, key: str, low: str, high: str) -> list[tuple[str, dict[Any, Any]]]:
        out = []
        while True:
            page: Any = self.bulk_client.xrange(key, low, high, count=READ_CHUNK)
            out += [(text(i), f) for i, f in page]
            if len(page) < READ_CHUNK:
                return out
            low = f"({out[-1][0]}"

    # -- reads -------------------------------------------------------------------------------------------
    def read(self, after: str) -> Read:
        """Entries after the id `after` ("0" = from the start), at most READ_CHUNK, with what the stream had
        deleted and added at the same instant (`model.stream.read_page`)."""
        page = read_page(self.client, self.key, after, READ_CHUNK)
        return Read([parse_entry(i, f) for i, f in page.entries], page)

    def head_last(self) -> str | None:
        """The end of the compacted head (`model.stream.head_last`: its first bytes alone), None where
        there is none. Raises HeadUnreadable, redis.RedisError."""
        try:
            return head_last(self.client, self.key)
        except ValueError as exc:
            raise HeadUnreadable(f"the compacted head of {self.key} cannot be read: {exc}") from None

    def purged(self, page: Page) -> bool:
        """Whether what `page` says was deleted after a reader's place was a forgotten user's entries
        (`model.stream.explained_by_purge`). Raises redis.RedisError."""
        return explained_by_purge(self.client, self.key, page)

    def wait_new(self, after: str, block_ms: int = TAIL_BLOCK_MS) -> bool:
        """Whether an entry after `after` arrives within `block_ms` (a blocking XREAD: the tail's wake-up;
        the entries themselves are then read with `read`)."""
        reply: Any = self.tail_client.xread({self.key: after}, count=1, block=block_ms)
        return bool(reply)

    def identity(self) -> str | None:
        """The stream's identity (`model.stream.identity_key`), set here first if it has none (SET NX: of
        several workers starting together, one sets it and all read the same); None where it has none and
        this client may not set it. Raises redis.RedisError."""
        key = identity_key(self.key)
        value: Any = self.client.get(key)
        if value is None:
            # A read-only replica, or no write permission: read what is there.
            with contextlib.suppress(redis.ResponseError):
                self.client.set(key, uuid.uuid4().hex, nx=True)
            value = self.client.get(key)
        return text(value) if value is not None else None

    def compacted(self) -> Compacted | None:
        """The stream's compacted head (`dcmc compact`), None where it has none. Raises HeadUnreadable when
        it cannot be read (its ratings are nowhere else), redis.RedisError."""
        raw: Any = self.bulk_client.get(compacted_key(self.key))
        if raw is None:
            return None
        try:
            return Compacted.from_json(raw)
        except ValueError as exc:
            raise HeadUnreadable(f"the compacted head of {self.key} cannot be read: {exc}") from None

    def last_generated(self) -> str:
        """The id of the newest entry the stream has ever had ("0-0" for none); raises redis.RedisError."""
        try:
            info: Any = self.client.xinfo_stream(self.key)
        except redis.ResponseError as exc:  # no such key: no entry was ever written
            if "no such key" not in str(exc).lower():
                raise
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


def _field(fields: dict[Any, Any], name: str) -> str | None:
    for key in (name, name.encode()):
        if key in fields:
            with contextlib.suppress(UnicodeDecodeError):
                return text(fields[key])
    return None


def stored_unknown(exc: redis.RedisError) -> bool:
    """Whether a failed `append` may have stored its batch. Not when Redis refused the command (a reply
    error: nothing ran), nor when it could not connect or send the whole of it (a transaction runs only
    once its EXEC, sent last, arrives); otherwise it may have: a timeout, a connection lost while waiting
    for the answer, a cluster that lost it, or a batch stored that fewer replicas confirmed than the
    service waits for."""
    if isinstance(exc, redis.ResponseError):
        return False
    if isinstance(exc, redis.ConnectionError):
        said = str(exc)
        return not any(s in said for s in ("connecting to", "writing to socket", "refused the command"))
    return True
