"""Compacting the rating stream: `dcmc compact --artifacts LINK [--online-ratings REDIS_URL]`.

The stream `<prefix>:ratings` grows with every online rating. Once a retrain has read it up to an id Y and
its artifact is published, the entries up to Y are in that artifact; compaction replaces them in Redis by
their consolidated state (`model.stream.Compacted`: each pair's latest rating, the pairs taken back, the
users forgotten, each item's catalogue changes composed into one), stored under
`<prefix>:ratings:compacted`, and trims them from the stream (XTRIM MINID). Nothing acknowledged is lost:
every rating and catalogue change is in the stream, or in the compacted head (and the artifact).

Who reads what afterwards:

- a retrain (`dcmc train --online-ratings`) starts from the compacted head, then reads the stream after it
  (`training.online.read_online_ratings`), so it trains on what it would have trained on before;
- a service worker on the published artifact replays only the entries after Y, as before;
- a worker on an older artifact, whose place in the stream is before Y, folds in the compacted head first
  (the ratings its artifact already had are folded in again: their users' embeddings are recomputed from
  the same ratings), then the entries after it; a fold-in snapshot older than Y is not used.

The head is written before the stream is trimmed, so a compaction that stops between the two leaves both
(readers skip the entries the head covers). The stream's identity must be the artifact's: an artifact of
another stream of that name says nothing about this one.

Compactions run one at a time (a lease, `<stream>:compact-lock`) and each writes its head only if the head
is still the one it read and built on (a compare-and-set on the head's digest, `SWAP_HEAD`): of two that
overlap, the second fails and says so, rather than putting back an older head over a newer one whose
entries are trimmed already. A head is only ever replaced by one that ends later, and the stream is only
trimmed up to the end of the head written. A reader behind the trim (a worker, a retrain) sees it
(`model.stream.head_last`, read after each read of the stream) and starts from the head again.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Sequence
from typing import Any

from model.artifact import load_artifact
from model.stream import (
    Compacted,
    after,
    compacted_key,
    identity_key,
    redact_url,
    stream_key,
    stream_order,
    text,
)
from training.data import DataError
from training.online import read_online_ratings, stream_client

log = logging.getLogger(__name__)

LOCK_S = 600.0
"""How long a compaction's lease lasts (one that dies leaves it to expire)."""

SWAP_HEAD = """
local current = redis.call('GET', KEYS[1])
local digest = current and redis.sha1hex(current) or ''
if digest ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
return 1
"""
"""Replace the compacted head only if it still has the SHA-1 digest `ARGV[1]` ('' for no head)."""

RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


def lock_key(stream: str) -> str:
    """The key of the compaction lease of `stream`."""
    return f"{stream}:compact-lock"


def compact_stream(
    url: str, prefix: str, up_to: str, levels: Sequence[float] | None = None, timeout_s: float = 30.0
) -> dict[str, Any]:
    """Consolidate the stream's entries up to the id `up_to` (with any earlier compacted head) into the
    compacted head, then trim them from the stream; returns a record of what was done. DataError when
    Redis cannot be read or written, when another compaction runs, or when the head changed meanwhile
    (nothing is then written)."""
    import redis

    key = stream_key(prefix)
    client = stream_client(url, timeout_s)
    token = uuid.uuid4().hex
    try:
        if not client.set(lock_key(key), token, nx=True, px=int(LOCK_S * 1000)):
            raise DataError(f"another compaction of {key} is running ({lock_key(key)} is held): nothing done")
        try:
            return _compact(client, url, prefix, key, up_to, levels, timeout_s)
        finally:
            client.eval(RELEASE, 1, lock_key(key), token)
    except redis.RedisError as exc:
        raise DataError(f"cannot compact the online ratings at {redact_url(url)} ({key}): {exc}") from None
    finally:
        client.close()


def _compact(
    client: Any,
    url: str,
    prefix: str,
    key: str,
    up_to: str,
    levels: Sequence[float] | None,
    timeout_s: float,
) -> dict[str, Any]:
    """`compact_stream` holding the lease."""
    raw: Any = client.get(compacted_key(key))
    digest = hashlib.sha1(raw).hexdigest() if raw is not None else ""
    try:
        before = None if raw is None else Compacted.from_json(raw).last
    except ValueError as exc:
        raise DataError(f"the compacted head of {key} cannot be read ({exc}): nothing done") from None
    online = read_online_ratings(url, prefix, timeout_s, levels=levels, up_to=up_to, head=raw)
    if online.last_id == "0" or (before is not None and stream_order(online.last_id) <= stream_order(before)):
        return {"stream": key, "compacted_up_to": before, "trimmed": 0, "reason": "nothing to compact"}
    head = Compacted(
        online.last_id,
        online.identity,
        tuple(zip(online.users, online.items, online.values.tolist(), strict=True)),
        online.retracted,
        online.forgotten,
        online.item_changes,
        online.dismissed,
    )
    if not int(client.eval(SWAP_HEAD, 1, compacted_key(key), digest, head.to_json())):
        raise DataError(
            f"the compacted head of {key} changed while this compaction read the stream (another "
            "compaction?): nothing written; run it again"
        )
    trimmed = int(client.xtrim(key, minid=after(head.last), approximate=False))
    purged = _purge_dead_letters(client, key, set(online.forgotten_now), head.last)
    log.info(
        "compacted %s up to %s: %d ratings kept, %d entries trimmed",
        key,
        head.last,
        len(head.ratings),
        trimmed,
    )
    return {
        "stream": key,
        "compacted_up_to": head.last,
        "ratings": len(head.ratings),
        "retracted": len(head.retracted),
        "forgotten": len(head.forgotten),
        "item_changes": len(head.items),
        "dismissed": len(head.dismissed),
        "trimmed": trimmed,
        "dead_letters_purged": purged,
    }


def _purge_dead_letters(client: Any, key: str, users: set[str], up_to: str) -> int:
    """Delete the dead-letter copies of the forgotten `users`' entries up to `up_to` (what the service's
    forget did not reach, e.g. a copy a lagging worker made after it)."""
    if not users:
        return 0
    dead = f"{key}:dead-letter"
    doomed, low = [], "-"
    while page := client.xrange(dead, low, "+", count=5000):
        for entry_id, fields in page:
            user = fields.get(b"field:user", fields.get("field:user"))
            original = fields.get(b"entry_id", fields.get("entry_id")) or entry_id
            if (
                user is not None
                and text(user) in users
                and stream_order(text(original)) <= stream_order(up_to)
            ):
                doomed.append(text(entry_id))
        low = f"({text(page[-1][0])}"
    for start in range(0, len(doomed), 1000):
        client.xdel(dead, *doomed[start : start + 1000])
    return len(doomed)


def compact_for_artifact(url: str, prefix: str, artifact_dir: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """`compact_stream` up to the place in the stream of the artifact at `artifact_dir` (the one published:
    the entries it read are in it). Nothing when it read none of this stream."""
    import redis

    artifact = load_artifact(artifact_dir)
    key = stream_key(prefix)
    client = stream_client(url, timeout_s)
    try:
        raw: Any = client.get(identity_key(key))
    except redis.RedisError as exc:
        raise DataError(f"cannot read the online ratings at {redact_url(url)} ({key}): {exc}") from None
    finally:
        client.close()
    identity = text(raw) if raw is not None else None
    up_to = artifact.online_snapshot(key, identity)
    if stream_order(up_to) == (0, 0):
        return {
            "stream": key,
            "compacted_up_to": None,
            "trimmed": 0,
            "reason": "the artifact read none of it",
        }
    return compact_stream(url, prefix, up_to, artifact.levels.tolist(), timeout_s)
