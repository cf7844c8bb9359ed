"""Compacting the rating stream: `dcmc compact --artifacts LINK [--online-ratings REDIS_URL]`.

The stream `<prefix>:ratings` grows with every online rating. Once a retrain has read it up to an id Y and
its artifact is published, the entries up to Y are in that artifact; compaction replaces them in Redis by
their consolidated state (`model.stream.Compacted`: each pair's latest rating, the pairs taken back, the
users forgotten), stored under `<prefix>:ratings:compacted`, and trims them from the stream (XTRIM MINID).
Nothing acknowledged is lost: every rating is in the stream, or in the compacted head (and the artifact).

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
"""

from __future__ import annotations

import logging
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


def compact_stream(
    url: str, prefix: str, up_to: str, levels: Sequence[float] | None = None, timeout_s: float = 30.0
) -> dict[str, Any]:
    """Consolidate the stream's entries up to the id `up_to` (with any earlier compacted head) into the
    compacted head, then trim them from the stream; returns a record of what was done. DataError when
    Redis cannot be read or written."""
    import redis

    key = stream_key(prefix)
    online = read_online_ratings(url, prefix, timeout_s, levels=levels, up_to=up_to)
    if online.last_id == "0":
        return {"stream": key, "compacted_up_to": None, "trimmed": 0, "reason": "nothing to compact"}
    head = Compacted(
        online.last_id,
        online.identity,
        tuple(zip(online.users, online.items, online.values.tolist(), strict=True)),
        online.retracted,
        online.forgotten,
    )
    client = stream_client(url, timeout_s)
    try:
        client.set(compacted_key(key), head.to_json())
        trimmed = int(client.xtrim(key, minid=after(head.last), approximate=False))  # type: ignore[arg-type]
    except redis.RedisError as exc:
        raise DataError(f"cannot compact the online ratings at {redact_url(url)} ({key}): {exc}") from None
    finally:
        client.close()
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
        "trimmed": trimmed,
    }


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
