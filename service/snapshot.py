"""Fold-in snapshots in Redis: a starting worker loads the newest and replays only what follows.

Every worker folds the whole rating stream into its model (service/online.py). Replaying it from the
artifact's place at start-up costs what every fold-in since cost (embedding and refining each user, the
co-rating rows), so it would grow without bound with the online history. Instead one worker at a time
(a lease) stores its fold-in state (`model.online.FoldIn.snapshot`) with the stream id it covers:

    <stream>:snapshot:<model version>:<settings>        hash {meta: JSON, data: the .npz payload}
    <stream>:snapshot-lease:<model version>:<settings>  the writer's token while it writes (expires)

`<settings>` is the `fingerprint` of the inference settings and fold-in policy that shape a fold-in state
besides the artifact and the ratings. `meta` says what the payload is of: the model version, the settings,
the stream and its identity, the last stream id it includes and the payload's SHA-256. A worker trusts a
snapshot only when all of them match its own and the payload hashes to it; anything else is logged and
ignored (the worker replays the stream instead). Each command touches one key, so the keys work on Redis
Cluster as they are; a key prefix with a hash tag (`DCMC_REDIS_KEY_PREFIX={dcmc}`) keeps a stream's keys on
one shard.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis

FORMAT = 1
"""The layout of `meta`; a snapshot of another is ignored."""

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

    def load(self, identity: str | None) -> Snapshot | None:
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
        data: Any = self.bulk.hget(self.key, "data")
        if data is None or hashlib.sha256(data).hexdigest() != meta.get("sha256"):
            raise Untrusted("its payload does not match its checksum")
        try:
            return Snapshot(str(meta["last"]), int(meta["applied"]), bytes(data))
        except (KeyError, TypeError, ValueError) as exc:
            raise Untrusted(f"its meta is incomplete ({exc})") from exc

    def acquire(self, seconds: float) -> bool:
        """Take the writer's lease for at most `seconds` (False: another worker holds it)."""
        return bool(self.client.set(self.lease_key, self._token, nx=True, px=max(1, int(seconds * 1000))))

    def release(self) -> None:
        """Give the lease back (if this writer still holds it)."""
        self.client.eval(RELEASE, 1, self.lease_key, self._token)

    def write(self, last: str, applied: int, identity: str | None, data: bytes) -> None:
        """Store a snapshot covering the stream up to `last` (`applied` online ratings), replacing the
        previous one in one transaction."""
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
            "written_at": time.time(),
        }
        pipe = self.bulk.pipeline(transaction=True)
        pipe.hset(self.key, mapping={"meta": json.dumps(meta), "data": data})
        pipe.expire(self.key, KEEP_S)
        pipe.execute()
