"""Impressions: what each answer showed, kept off the answer's path.

Every /recommend and /similar-items answer (and /predict's where asked) carries a `recommendation_id` (a
random 128-bit id, hex). With Redis configured, what it showed is appended to a bounded Redis stream,
`<prefix>:impressions` (about DCMC_IMPRESSIONS_MAX entries, the oldest going first): the id, the route,
the `user` or the `item` asked about, the items in order with their scores, the model version, when, and
in an experiment its `experiment` and `variant`, the variant that placed each item (`teams`, interleaved)
and each item's served distribution (`dists`). A thread of its own writes them: the answer only puts the
impression on a bounded queue. When the queue is full (Redis slow or down) the impression is dropped and
counted (`dcmc_impressions_total{outcome="dropped"}`); the answer is never slower for it. Impressions are
evaluation data, not state: unlike ratings they are not durable, and a lost one changes no model.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from model.calibration import tempered
from model.stream import connect

log = logging.getLogger(__name__)

QUEUE_SIZE = 10_000
"""Impressions waiting to be written at most; past it they are dropped."""

BATCH = 2000
"""Impressions written per Redis round trip at most."""

FLUSH_S = 0.2
"""How often the thread writes what has queued: one pipelined round trip per interval, not one per
answer (each costs Redis an fsync where it runs with appendfsync always)."""


def new_id() -> str:
    """A recommendation id: 32 hex digits, random."""
    return uuid.uuid4().hex


def impressions_key(prefix: str) -> str:
    """The stream of impressions under the key prefix `prefix`."""
    return f"{prefix}:impressions"


@dataclass(frozen=True)
class Served:
    """Distributions an answer served, made into what the impression keeps by the writing thread: the
    model's (K, levels) array, tempered by `temperature` (as /predict serves them), rounded to 6 places."""

    probs: np.ndarray
    temperature: float

    def dists(self) -> list[list[float]]:
        return np.round(tempered(self.probs, self.temperature), 6).tolist()  # type: ignore[no-any-return]


class Impressions:
    """The queue and the thread that write impressions to Redis (module docstring)."""

    def __init__(self, url: str, prefix: str, max_entries: int, timeout_s: float, metrics: Any) -> None:
        self.key = impressions_key(prefix)
        self.max_entries = max_entries
        self.client = connect(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._written = metrics.impressions.labels("written")
        self._dropped = metrics.impressions.labels("dropped")
        self._queue: queue.Queue[tuple[Any, ...]] = queue.Queue(QUEUE_SIZE)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="impressions", daemon=True)
        self._thread.start()

    def record(
        self,
        route: str,
        subject: dict[str, str],
        items: Sequence[str],
        scores: Sequence[float],
        model_version: str,
        recommendation_id: str,
        more: dict[str, Any] | None = None,
    ) -> None:
        """Queue what an answer showed (never blocks: a full queue drops it, counted). `subject`: {"user":
        id} or {"item": id}; `more`: `experiment` and `variant` (strings), `teams` (the variant that placed
        each item, interleaved), `dists` (each item's served distribution, or None; or `Served`: computed
        by the writing thread). Serialised by the writing thread too: the answer only queues it."""
        shown = (recommendation_id, route, subject, items, scores, model_version, time.time(), more)
        try:
            self._queue.put_nowait(shown)
        except queue.Full:
            self._dropped.inc()

    @staticmethod
    def _fields(shown: tuple[Any, ...]) -> dict[str, bytes | str]:
        recommendation_id, route, subject, items, scores, model_version, at, more = shown
        fields: dict[str, bytes | str] = {
            "id": recommendation_id,
            "route": route,
            **subject,
            "items": orjson.dumps(list(items)),
            "scores": orjson.dumps([float(s) for s in scores]),
            "model_version": model_version,
            "at": repr(at),
        }
        for name, value in (more or {}).items():
            if isinstance(value, Served):
                value = value.dists()
            fields[name] = value if isinstance(value, str) else orjson.dumps(value)
        return fields

    def _run(self) -> None:
        import redis

        while not self._stop.wait(FLUSH_S):
            batch: list[tuple[Any, ...]] = []
            while len(batch) < BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if not batch:
                continue
            try:
                pipe = self.client.pipeline(transaction=False)
                for shown in batch:
                    pipe.xadd(self.key, self._fields(shown), maxlen=self.max_entries, approximate=True)
                pipe.execute()
                self._written.inc(len(batch))
            except redis.RedisError as exc:
                self._dropped.inc(len(batch))
                log.warning("%d impressions dropped: Redis failed (%s)", len(batch), exc)
                self._stop.wait(0.5)

    def close(self) -> None:
        """Stop the thread (what is queued is dropped) and release the connection."""
        self._stop.set()
        self._thread.join(timeout=2)
        self.client.close()
