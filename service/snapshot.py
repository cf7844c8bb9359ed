"""Fold-in snapshots in Redis: a starting worker loads the newest and replays only what follows.

Every worker folds the whole rating stream into its model (service/online.py). Replaying it from the
artifact's place at start-up costs what every fold-in since cost (embedding and refining each user, the
co-rating rows), so it would grow without bound with the online history. Instead one worker at a time
(a lease) stores its fold-in state (`model.online.FoldIn.snapshot`) with the stream id it covers:

    <stream>:snapshot:<model version>:<settings>                 hash {meta: JSON}
    <stream>:snapshot-part:<model version>:<settings>:<gen>:<k>  the payload's k-th PART_BYTES
    <stream>:snapshot-lease:<model version>:<settings>           the writer's token while it writes

`<settings>` is the `fingerprint` of the inference settings and fold-in policy that shape a fold-in state
besides the artifact and the ratings. `meta` says what the payload is of: the model version, the settings,
the stream and its identity, the last stream id it includes, the payload's SHA-256 and where its parts
are (`generation`, `parts`). The payload (a hundred megabytes and more with a long history) is stored in
parts of at most PART_BYTES, one command each, so that no command holds Redis (single-threaded, and
fsyncing every write) for long: every other client's commands go on between two parts. A write stores
the new generation's parts, then switches `meta` to them (one key: atomic), then deletes the previous
generation's parts; parts of a write that never switched expire on their own (PENDING_S). A reader that
finds a part gone (replaced while it read) reads the new meta once more. A worker trusts a snapshot only
when all of it matches its own and the payload hashes to it; anything else is logged and ignored (the
worker replays the stream instead). Each command touches one key, so the keys work on Redis Cluster as
they are; a key prefix with a hash tag (`DCMC_REDIS_KEY_PREFIX={dcmc}`) keeps a stream's keys on one
shard.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis

FORMAT = 2
"""The layout of `meta` (2: the payload in parts); a snapshot of another is ignored."""

PART_BYTES = 4 << 20
"""The largest part of a payload stored by one command (4 MiB: a few milliseconds of Redis's time)."""

PENDING_S = 3600
"""How long the parts of a write stay before its meta points to them (a writer that died leaves them)."""

KEEP_S = 7 * 24 * 3600
"""How long a snapshot stays in Redis after its last write: a model version no longer served loses its
snapshot a week after its last one (a reload to it replays the stream)."""

RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
"""Delete the lease only if this writer still holds it."""


def fingerprint(settings: dict[str, Any]) -> str:
    """A short digest of what shapes a fold-in state besides the artifact and the ratings."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Untrusted(Exception):
    """A stored snapshot that is not of this model, settings or stream, or whose payload is damaged."""


@dataclass(frozen=True)
class Snapshot:
    """A verified snapshot: its payload, the last stream id and the number of online ratings it includes."""

    last: str
    applied: int
    data: bytes


class SnapshotStore:
    """One model version's snapshot in Redis (see the module docstring). Raises redis.RedisError."""

    def __init__(
        self, client: redis.Redis, bulk: redis.Redis, stream: str, version: str, settings: str
    ) -> None:
        """`client` for the small commands (its short timeout: a slow Redis counts as down), `bulk` for the
        payload (tens of megabytes)."""
        self.client, self.bulk = client, bulk
        self.key = f"{stream}:snapshot:{version}:{settings}"
        self.lease_key = f"{stream}:snapshot-lease:{version}:{settings}"
        self.part_prefix = f"{stream}:snapshot-part:{version}:{settings}"
        self.stream, self.version, self.settings = stream, version, settings
        self._token = uuid.uuid4().hex

    def meta(self) -> dict[str, Any] | None:
        """The stored snapshot's meta (None: none, or unreadable)."""
        raw: Any = self.client.hget(self.key, "meta")
        if raw is None:
            return None
        try:
            meta = json.loads(raw)
        except ValueError:
            return None
        return meta if isinstance(meta, dict) else None

    def load(self, identity: str | None, _retry: bool = True) -> Snapshot | None:
        """The stored snapshot (None: there is none). Raises Untrusted, saying why, when it is not of this
        model and settings and of this stream (`identity`), or its payload does not match its checksum."""
        meta = self.meta()
        if meta is None:
            return None
        expected = {
            "format": FORMAT,
            "model_version": self.version,
            "stream": self.stream,
            "stream_identity": identity,
            "settings": self.settings,
        }
        wrong = [name for name, value in expected.items() if meta.get(name) != value]
        if wrong:
            raise Untrusted(f"its {', '.join(wrong)} differ from this worker's")
        try:
            last, applied = str(meta["last"]), int(meta["applied"])
            generation, parts = str(meta["generation"]), int(meta["parts"])
        except (KeyError, TypeError, ValueError) as exc:
            raise Untrusted(f"its meta is incomplete ({exc})") from exc
        data = self._payload(generation, parts)
        if data is None:  # replaced while this worker read it: the newer one, once
            again = self.meta()
            if again is not None and again.get("generation") != generation and _retry:
                return self.load(identity, _retry=False)
            raise Untrusted("a part of its payload is missing")
        if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
            raise Untrusted("its payload does not match its checksum")
        return Snapshot(last, applied, data)

    def _part_key(self, generation: str, k: int) -> str:
        return f"{self.part_prefix}:{generation}:{k}"

    def _payload(self, generation: str, parts: int) -> bytes | None:
        """The payload of a generation, its parts read one command each (None: a part is missing)."""
        chunks = []
        for k in range(parts):
            chunk: Any = self.bulk.get(self._part_key(generation, k))
            if chunk is None:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    def acquire(self, seconds: float) -> bool:
        """Take the writer's lease for at most `seconds` (False: another worker holds it)."""
        return bool(self.client.set(self.lease_key, self._token, nx=True, px=max(1, int(seconds * 1000))))

    def release(self) -> None:
        """Give the lease back (if this writer still holds it)."""
        self.client.eval(RELEASE, 1, self.lease_key, self._token)

    def write(self, last: str, applied: int, identity: str | None, data: bytes) -> None:
        """Store a snapshot covering the stream up to `last` (`applied` online ratings) in parts, switch
        the meta to it, then delete the previous one's parts (module docstring)."""
        previous = self.meta() or {}
        generation = uuid.uuid4().hex[:12]
        view = memoryview(data)
        parts = max(1, -(-len(data) // PART_BYTES))
        for k in range(parts):
            self.bulk.set(
                self._part_key(generation, k), view[k * PART_BYTES : (k + 1) * PART_BYTES], ex=PENDING_S
            )
        meta = {
            "format": FORMAT,
            "model_version": self.version,
            "stream": self.stream,
            "stream_identity": identity,
            "settings": self.settings,
            "last": last,
            "applied": applied,
            "sha256": hashlib.sha256(data).hexdigest(),
            "bytes": len(data),
            "generation": generation,
            "parts": parts,
            "written_at": time.time(),
        }
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(self.key, "meta", json.dumps(meta))
        pipe.hdel(self.key, "data")  # the payload of a snapshot of format 1
        pipe.expire(self.key, KEEP_S)
        pipe.execute()
        for k in range(parts):
            self.client.expire(self._part_key(generation, k), KEEP_S)
        old, count = previous.get("generation"), previous.get("parts")
        if isinstance(old, str) and isinstance(count, int) and old != generation:
            for k in range(count):
                self.client.delete(self._part_key(old, k))
