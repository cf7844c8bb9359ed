"""The scoring side of the service: the artifact's model with every online rating folded in.

Everything per model is prepared once at start-up: the verified artifact and the scorer of its inference
mode (model/scorers.py: the `paper` mode's partitions, or the `exact` mode's known field and tables). The
online ratings (service/online.py, in Redis) are then replayed and followed: each one updates this
worker's model (model/online.py). A request reads the current model state once and scores its entries,
from a user's cached row or row parts where it can (service/rows.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import redis

from model.artifact import Artifact
from model.config import InferenceConfig
from model.engine import OnnxNetwork, expected_rating
from model.exact import RowParts, baseline_mixture, level_distribution
from model.ids import UnknownIdError
from model.online import FoldIn, OnlineState, SnapshotError
from model.ratings import Ratings
from model.scorers import check_inference
from model.stream import Entry, Poison, off_levels, stream_order
from model.types import Array
from service.memory import release_memory
from service.metrics import Metrics
from service.online import Durability, Follower, RatingLog
from service.rows import UserParts, UserRow, UserRows
from service.settings import Settings, inference_overrides
from service.snapshot import SnapshotStore, Untrusted, fingerprint

log = logging.getLogger(__name__)

PARTS_ANSWER_ENTRIES = 400
"""What an answer from row parts costs besides its items, in items' worth: on ML-100K in process, 100
items 0.085 ms and the whole catalogue (1,682) 0.36 ms, so about 0.17 us an item and 0.068 ms (~390
items) a call."""

BASELINE_REASON = (
    "baseline: a new item the network cannot embed yet, predicted by the bias baseline mu + b_user + c_item "
    "(no known rating's term reaches it)"
)
"""What an explanation of a bias-baseline answer says instead of `because`."""


def fold_in_refine(artifact: Artifact, settings: Settings) -> str:
    """The fold-in's refinement policy in force: DCMC_FOLD_IN_REFINE, or with `auto` the artifact's choice
    on its validation ratings (config.json `fold_in`), `all` where it has none."""
    if settings.fold_in_refine != "auto":
        return settings.fold_in_refine
    chosen = artifact.meta.get("fold_in", {}).get("refine")
    return chosen if chosen in ("all", "new") else "all"


def effective_inference(stored: InferenceConfig, settings: Settings) -> InferenceConfig:
    """The artifact's inference setting with the service's overrides (DCMC_INFERENCE__...) applied."""
    return stored.with_overrides(inference_overrides(settings))


def top_k(scores: np.ndarray, mask: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k highest `scores` among `mask`, best first, ties by the lower index (all of the
    candidates when fewer than k): the one top-k of /recommend and the similar-* routes."""
    cand = np.flatnonzero(mask)
    if 0 < k < len(cand):
        # Only the candidates at or above the k-th best score are sorted (a catalogue has ~1e5).
        values = scores[cand]
        cut = -np.partition(-values, k - 1)[k - 1]
        cand = cand[values >= cut]
    order = np.lexsort((cand, -scores[cand]))
    out: np.ndarray = cand[order[: max(k, 0)]]
    return out


def nearest(
    lifted: np.ndarray, row: int, k: int, exclude: Sequence[int] = ()
) -> tuple[np.ndarray, np.ndarray]:
    """The k rows other than `row` (and `exclude`) with the highest scaled cosine (1 + cos) / 2 to it,
    best first, ties by index (at the cut too): (indices, scores). `lifted`: the lifted unit rows
    [1, u] / sqrt(2), whose products are those scaled cosines (`model.engine.lift`)."""
    scores = lifted @ lifted[row]
    mask = np.ones(len(scores), dtype=bool)
    mask[row] = False
    mask[list(exclude)] = False
    top = top_k(scores, mask, k)
    return top, scores[top]


class NotDurable(Exception):
    """A write refused because DCMC_REQUIRE_DURABLE is set and Redis would not keep it through a crash."""


class ServedModel:
    """Answers rating and similarity queries for one artifact, and takes ratings online."""

    def __init__(self, artifact: Artifact, settings: Settings, metrics: Metrics) -> None:
        self.artifact = artifact
        self.version = artifact.model_version
        self.model_config = artifact.config
        # Every setting served (one, or several searches' averaged: `Artifact.averaged`), overrides applied.
        self.inferences = artifact.settings(inference_overrides(settings))
        self.inference = self.inferences[0]
        for inference in self.inferences:
            check_inference(inference, self.model_config)
        modes = {inference.mode for inference in self.inferences}
        self.levels = artifact.levels
        self.metrics = metrics
        self.onnx = OnnxNetwork(artifact.files, threads=settings.onnx_threads)
        self._onnx_lock = threading.Lock()
        self._engine_lock = threading.Lock()
        # A query's answer depends on its own entry only in `none` and `exact` (the `paper` mode's blocks
        # couple the queries asked together), so only those can answer from a user's cached row.
        self.rows = UserRows(
            int(settings.user_cache_mb * 2**20) if "paper" not in modes else 0,
            settings.answer_staleness_s,
        )
        self._row_hit, self._row_fill = metrics.user_rows.labels("hit"), metrics.user_rows.labels("fill")
        self._row_stale_hit = metrics.user_rows.labels("stale_hit")
        self.parts = UserParts(int(settings.user_parts_mb * 2**20) if modes == {"exact"} else 0)
        # Whether a row is made from the user's row parts (`_row`), which the ski rental counts in.
        self.rows_from_parts = (
            self.parts.max_bytes > 0
            and modes == {"exact"}
            and all(inference.kernel.known == "clamped" for inference in self.inferences)
        )
        self._parts_hit = metrics.user_rows.labels("parts_hit")
        self._parts_fill = metrics.user_rows.labels("parts_fill")
        # Per-model precomputation (the mode's scorer: partitions, known field, tables), once, here.
        start = time.perf_counter()
        self.fold = FoldIn(
            artifact,
            self.inferences,
            self._embed_rows,
            self._embed_cols,
            refine_trained=fold_in_refine(artifact, settings) == "all",
        )
        source = getattr(self.fold.state.scorer, "field_source", None)
        log.info(
            "model %s ready in %.2fs (inference %s%s%s; fold-in refines %s)",
            self.version,
            time.perf_counter() - start,
            self.inference.mode,
            f", {len(self.inferences)} settings averaged" if len(self.inferences) > 1 else "",
            f", known field {source}" if source else "",
            "every rating user" if self.fold.refine_trained else "users without training ratings only",
        )
        self.retry_s = settings.redis_retry_s
        self.settings = settings
        # New ids of batches this worker wrote that its model has not folded in yet (counted against the
        # new-id limits meanwhile).
        self._pending_users: set[str] = set()
        self._pending_items: set[str] = set()
        self._pending_lock = threading.Lock()
        self._durability_checked = 0.0
        self.ratings: RatingLog | None = None
        self.follower: Follower | None = None
        self.durability = Durability(False, "no Redis configured (REDIS_URL): online ratings are off")
        self.replayed = settings.redis_url is None
        self._last_probe = 0.0
        self.snapshots: SnapshotStore | None = None
        # What shapes the fold-in state besides the artifact and the ratings: a snapshot must match it.
        self.fingerprint = fingerprint(
            {
                "inference": self.inference.to_dict(),
                "refine_trained": self.fold.refine_trained,
                **(
                    {"averaged": [i.to_dict() for i in self.inferences[1:]]}
                    if len(self.inferences) > 1
                    else {}
                ),
            }
        )
        self._identity: str | None = None
        self._snapshot_checked = 0.0
        self._snapshot_known = 0  # `applied` of the newest snapshot this worker knows is stored
        if settings.redis_url:
            self.ratings = RatingLog(
                settings.redis_url,
                settings.redis_key_prefix,
                settings.redis_timeout_s,
                settings.redis_write_timeout_s,
            )
            self.follower = Follower(
                self.ratings, self._apply, metrics, settings.redis_retry_s, check=self._check
            )
            self.follower.interval_s = settings.fold_in_interval_s
            self.follower.prepare = self._place_in_stream
            self.follower.after_read = self._maybe_snapshot
            self.snapshots = SnapshotStore(
                self.ratings.client,
                self.ratings.bulk_client,
                self.ratings.key,
                self.version,
                self.fingerprint,
            )

    # -- start-up and shutdown ---------------------------------------------------------------------------
    def start(self) -> None:
        """Replay the online ratings since the artifact, then follow the stream. When Redis is down the
        replay is retried by the follower, and /ready answers 503 until it has succeeded."""
        if self.ratings is None or self.follower is None:
            return
        self.follower.on_recover = self.refresh_durability
        try:
            self.refresh_durability()
            count = self.follower.catch_up()
            self.replayed = True
            log.info("replayed %d online ratings", count)
        except redis.RedisError as exc:
            log.error("cannot replay the online ratings yet (%s); not ready until Redis answers", exc)
        self.follower.start()

    def _place_in_stream(self) -> None:
        """Before the first read of the stream: start from the newest fold-in snapshot of this model in
        Redis where there is one it can trust (service/snapshot.py); else replay only what the artifact
        was not trained on (`dcmc train --online-ratings`), after folding in the ratings of held-out pairs
        it kept; all of the stream when the artifact read another stream of this name (its recorded
        identity differs)."""
        assert self.ratings is not None and self.follower is not None
        key, identity = self.ratings.key, self.ratings.identity()
        self._identity = identity
        start = self.artifact.online_snapshot(key, identity)
        head = self.ratings.compacted()  # `dcmc compact`: the entries up to head.last are trimmed
        if head is not None and head.identity != identity:
            log.warning("ignoring the compacted head of %s: it is of another stream of that name", key)
            head = None
        trimmed = head is not None and stream_order(head.last) > stream_order(start)
        if self._restore(head.last if head is not None and trimmed else start):
            return
        recorded = (self.artifact.meta.get("dataset") or {}).get("online_ratings") or {}
        if recorded.get("stream") == key and recorded.get("stream_identity") not in (None, identity):
            log.warning(
                "the artifact was trained on another stream named %s (identity %s, this one is %s): "
                "replaying all of this one",
                key,
                recorded.get("stream_identity"),
                identity,
            )
        self.follower.last = self.artifact.online_snapshot(key, identity)
        held = self.artifact.online_held_out(key, identity)
        if held:
            self.fold.apply(held)
            log.info("folded in %d online ratings of held-out pairs that the artifact kept", len(held))
        if head is not None and trimmed:  # the stream from the artifact's place on is partly trimmed
            self.fold.apply(head.entries())
            self.follower.last = head.last
            log.info(
                "folded in the compacted head of %s (%d ratings up to %s): the artifact is older",
                key,
                len(head.ratings),
                head.last,
            )

    def _restore(self, start: str) -> bool:
        """Start from the stored fold-in snapshot if it can be trusted and covers at least the artifact's
        place `start` in the stream; False (logged) when there is none or it is ignored."""
        assert self.snapshots is not None and self.follower is not None
        began = time.perf_counter()
        try:
            snapshot = self.snapshots.load(self._identity)
            if snapshot is None:
                return False
            if stream_order(snapshot.last) < stream_order(start):
                raise Untrusted(f"it ends at {snapshot.last}, before the artifact's place {start}")
            applied = self.fold.restore(snapshot.data)
        except (Untrusted, SnapshotError) as exc:
            log.warning("ignoring the fold-in snapshot %s: %s", self.snapshots.key, exc)
            self.metrics.snapshots.labels("ignored").inc()
            return False
        self.follower.last = snapshot.last
        self._snapshot_known = applied
        self.metrics.snapshots.labels("restored").inc()
        log.info(
            "started from the fold-in snapshot of %d online ratings (stream up to %s) in %.2fs",
            applied,
            snapshot.last,
            time.perf_counter() - began,
        )
        return True

    def _maybe_snapshot(self) -> None:
        """Store a fold-in snapshot when one is due (the tail thread calls it after each read):
        `snapshot_every` ratings past the stored one, or any past it and `snapshot_interval_s` since it
        was written. At most one worker writes at a time (a lease); a Redis failure is logged and counted,
        and the snapshot is tried again later."""
        interval = self.settings.snapshot_interval_s
        applied = self.fold.state.applied
        now = time.monotonic()
        if self.snapshots is None or self.follower is None or not interval or applied <= self._snapshot_known:
            return
        if now - self._snapshot_checked < min(1.0, interval):
            return
        self._snapshot_checked = now
        try:
            meta = self.snapshots.meta() or {}
            if meta.get("stream_identity") != self._identity:  # of a stream since emptied: replaced
                meta = {}
            stored, written = int(meta.get("applied", -1)), float(meta.get("written_at", 0.0))
            self._snapshot_known = max(stored, 0)
            due = applied - stored >= self.settings.snapshot_every or (
                applied > stored and time.time() - written >= interval
            )
            if not due or not self.snapshots.acquire(max(interval, 10.0)):
                return
            try:
                began = time.perf_counter()
                last, (count, data) = self.follower.capture(self.fold.snapshot)
                self.snapshots.write(last, count, self._identity, data)
                self._snapshot_known = count
                self.metrics.snapshots.labels("written").inc()
                log.info(
                    "stored a fold-in snapshot of %d online ratings (%.1f MB, stream up to %s) in %.2fs",
                    count,
                    len(data) / 1e6,
                    last,
                    time.perf_counter() - began,
                )
            finally:
                self.snapshots.release()
        except redis.RedisError as exc:
            self.metrics.redis_errors.inc()
            log.warning("cannot store a fold-in snapshot now (%s); trying again later", exc)

    def refresh_durability(self) -> Durability:
        """Read the server's persistence settings again (at start-up, when Redis comes back, and on a
        write refused for want of them); a warning when they do not keep acknowledged writes."""
        assert self.ratings is not None
        self._durability_checked = time.monotonic()
        durability = self.ratings.durability()
        if not durability.durable and durability != self.durability:
            log.warning("Redis is not durable: %s", durability.detail)
        self.durability = durability
        return durability

    def close(self) -> None:
        """Stop following the stream and release Redis connections."""
        if self.follower is not None:
            self.follower.stop()
        if self.ratings is not None:
            self.ratings.close()

    def redis_state(self) -> str:
        """`disabled` (no REDIS_URL), `ok` or `down` (probed again when down, at most once per retry)."""
        if self.ratings is None or self.follower is None:
            return "disabled"
        if not self.follower.healthy and time.monotonic() - self._last_probe >= self.retry_s:
            self._last_probe = time.monotonic()
            try:
                self.ratings.ping()
            except redis.RedisError:
                return "down"
            return "ok"
        return "ok" if self.follower.healthy else "down"

    # -- online ratings ----------------------------------------------------------------------------------
    def _embed_rows(self, rows: Array) -> Array:
        with self._onnx_lock:
            return self.onnx.embed_users(rows)

    def _embed_cols(self, cols: Array) -> Array:
        with self._onnx_lock:
            return self.onnx.embed_items(cols)

    def new_ids(self, users: Sequence[str], items: Sequence[str]) -> tuple[set[str], set[str], int, int]:
        """The users and items of a batch that would be new, and how many new users and items there are
        already: folded in, or written by this worker and not folded in yet."""
        with self._pending_lock:
            known_users, known_items = self.fold.unseen(list(self._pending_users), list(self._pending_items))
            self._pending_users &= known_users  # the rest is folded in now
            self._pending_items &= known_items
            unseen_users, unseen_items = self.fold.unseen(users, items)
            return (
                unseen_users - self._pending_users,
                unseen_items - self._pending_items,
                self.fold.new_users + len(self._pending_users),
                self.fold.new_items + len(self._pending_items),
            )

    def pending_user(self, user: str) -> bool:
        """Whether this worker wrote a rating of `user` that its model has not folded in yet."""
        with self._pending_lock:
            return user in self._pending_users

    def _check(self, entries: list[Entry]) -> list[Poison]:
        """The entries this model cannot fold in: a rating that is not one of its levels."""
        return off_levels(entries, self.levels)

    def _apply(self, entries: list[Entry]) -> None:
        """Fold stream entries into the model (the follower calls it, in stream order)."""
        # No engine lock: requests go on with the state they took while the next one is built.
        self.fold.apply([(e.user, e.item, e.rating) for e in entries])
        release_memory()
        if not self.replayed and self.follower is not None and self.follower.healthy:
            self.replayed = True

    def write(self, ratings: Sequence[tuple[str, str, float | None]]) -> str:
        """Store a batch of (user, item, rating) durably in Redis (one transaction); returns the stream id
        of its last rating. Every worker's follower then folds it in (service/consistency.py). Raises
        redis.RedisError (service.online.stored_unknown says whether it may have been stored), NotDurable,
        or RuntimeError when online ratings are off."""
        if self.ratings is None or self.follower is None:
            raise RuntimeError("online ratings need Redis: set REDIS_URL")
        if self.settings.require_durable and not self.durability.durable:
            if time.monotonic() - self._durability_checked >= 1.0:  # perhaps fixed since: read again
                self.refresh_durability()
            if not self.durability.durable:
                raise NotDurable(self.durability.detail)
        last = self.ratings.append(ratings)
        self.metrics.ratings_written.inc(len(ratings))
        rated = [(u, i) for u, i, r in ratings if r is not None]  # retractions add no user or item
        users, items = self.fold.unseen([u for u, _ in rated], [i for _, i in rated])
        with self._pending_lock:
            self._pending_users |= users
            self._pending_items |= items
        return last  # the follower folds it in behind the answer (reads wait for it with `after`)

    # -- queries -----------------------------------------------------------------------------------------
    def user_index(self, user: str, state: OnlineState | None = None) -> int:
        """The internal index of an external user id in `state` (default: now): the artifact's users, then
        those that arrived online (UnknownIdError for a user without any rating)."""
        index = self.fold.user_index(user, state)
        if index is None:
            raise UnknownIdError("user", [user])
        return index

    def user_id(self, index: int) -> str:
        """The external id of a user index."""
        return self.fold.user_id(index)

    def item_indices(self, items: Sequence[str], state: OnlineState | None = None) -> np.ndarray:
        """Internal indices of external item ids in `state` (default: now): the artifact's items, then those
        first rated online (UnknownIdError listing every unknown one, in request order)."""
        found = self.fold.item_indices(items, state)
        if (found < 0).any():
            missing = [items[int(k)] for k in np.flatnonzero(found < 0)]
            raise UnknownIdError("item", list(dict.fromkeys(missing)))
        return found

    def item_id(self, index: int) -> str:
        """The external id of an item index."""
        return self.fold.item_id(index)

    @property
    def state(self) -> OnlineState:
        """The model state now published: take it once per request and pass it on, so that every part of
        an answer comes from one state (states only grow: an index valid in one is valid in later ones)."""
        return self.fold.state

    @property
    def known(self) -> Ratings:
        """The known ratings of the current state: the artifact's training and held-out ratings, then the
        online ones of items with an embedding (a re-rating replaces the earlier one)."""
        return self.fold.state.known

    @property
    def n_items(self) -> int:
        """Items known so far (the artifact's, then new ones)."""
        return self.fold.state.known.n_items

    def online_count(self, user: int, state: OnlineState | None = None) -> int:
        """How many of the user's ratings arrived online and are folded into `state` (default: now)."""
        return self.fold.online_count(user, state)

    def rated_items(self, user: int, state: OnlineState | None = None) -> np.ndarray:
        """The items `user` has rated in `state` (default: now; training, held-out and online ratings):
        sorted item indices."""
        state = state or self.fold.state
        known = state.known
        online = np.fromiter(self.fold.online_items(user, state), dtype=np.int64)
        return np.union1d(known.cols[known.by_row.of(user)], online)

    def _cached_row(self, state: OnlineState, user: int, exact: bool) -> UserRow | None:
        """The user's cached row that answers in `state` (`UserRows.get`), counted."""
        held = self.rows.get(state, user, exact)
        if held is None:
            return None
        (self._row_stale_hit if held[1] else self._row_hit).inc()
        return held[0]

    def predict(
        self,
        user: int,
        items: np.ndarray,
        distributions: bool = True,
        state: OnlineState | None = None,
        exact: bool = False,
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """Expected ratings (K,), label distributions (K, p) of (user, items[k]) (None when not
        `distributions` and read from a cached row), and which of them come from the bias baseline (new
        items not embedded yet) rather than the model: (K,) bool. From the user's cached row when there is
        one (`UserRows`): the same numbers to rounding; a row of an earlier state (other users' ratings
        up to DCMC_ANSWER_STALENESS_S late) unless `exact`."""
        state = state or self.fold.state  # one consistent model for the whole request
        row = self._cached_row(state, user, exact)
        # A miss answered from parts costs a fixed part besides its items (PARTS_ANSWER_ENTRIES), and so
        # does a row made from them: counted in entries, the ski rental compares like with like.
        extra = PARTS_ANSWER_ENTRIES if self.rows_from_parts else 0
        if row is None and self.rows.admit(state, user, len(items) + extra, state.known.n_items + extra):
            row = self._row(state, user)
            self._row_fill.inc()
        if row is None:
            return self._from_parts(state, user, items) or self._predict(state, user, items)
        # Each gather from a row is a cache miss per item (rows outgrow the CPU's caches): only what is read.
        fallback = row.fallback[items] if row.any_fallback else np.zeros(len(items), dtype=bool)
        return row.ratings[items], row.distributions(items) if distributions else None, fallback

    def _from_parts(
        self, state: OnlineState, user: int, items: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """`_predict` from the user's `RowParts` (`UserParts`: computed and kept on a miss), or None where
        the scorer has none (not `exact` with clamped known entries, or the cache off)."""
        scorer = state.scorer
        parts = self._parts(state, user)
        if parts is None:
            return None
        with self._engine_lock:
            dist, baseline = scorer.from_parts(parts, items)
        if baseline is not None:
            dist = baseline_mixture(dist, baseline, self.levels, scorer.baseline_weight)
        fallback = ~state.embedded[items]
        self._fall_back(state, user, items, fallback, dist)
        ratings = np.clip(expected_rating(dist, self.levels), self.levels[0], self.levels[-1])
        return ratings, dist, fallback

    def _parts(self, state: OnlineState, user: int) -> RowParts | None:
        """The user's `RowParts` in `state` (`UserParts`: computed and kept on a miss), or None where the
        scorer has none (not `exact` with clamped known entries, or the cache off)."""
        if self.parts.max_bytes <= 0:
            return None
        parts, previous = self.parts.get(state, user)
        if parts is not None:
            self._parts_hit.inc()
            return parts
        with self._engine_lock:
            parts = state.scorer.row_parts(user, previous)
        if parts is not None:
            self.parts.put(state, user, parts)
            self._parts_fill.inc()
        return parts

    @property
    def blocking(self) -> bool:
        """Whether a query costs tens of milliseconds (the mode's scorer says): routes run it off the
        event loop."""
        return self.fold.state.scorer.blocking

    def row(self, user: int, state: OnlineState | None = None, exact: bool = False) -> np.ndarray:
        """The user's expected ratings over every item of `state` (default: now; cached: `UserRows`, as
        `predict`); read-only."""
        state = state or self.fold.state
        row = self._cached_row(state, user, exact)
        if row is None:
            row = self._row(state, user)
            self._row_fill.inc()
        return row.ratings

    def _row(self, state: OnlineState, user: int) -> UserRow:
        items = np.arange(state.known.n_items, dtype=np.int64)
        fallback = ~state.embedded[items]
        scorer = state.scorer
        weight = 0.0
        # Unmixed: the expected rating of (1 - w) Q + w B is (1 - w) E[Q] + w clip(b), B's expectation,
        # so the row needs no mixed (items, p) array; reads of its distributions mix theirs. From the
        # user's row parts where there are some: the same numbers, in float64, at about a third the cost.
        parts = self._parts(state, user)
        with self._engine_lock:
            if parts is not None:
                dist, baseline = scorer.from_parts(parts, items)
            else:
                dist, baseline = scorer.unmixed(np.full(len(items), user, dtype=np.int64), items)
        ratings = expected_rating(dist, self.levels)
        if baseline is not None:
            weight = scorer.baseline_weight
            ratings *= 1.0 - weight
            ratings += weight * np.clip(baseline, self.levels[0], self.levels[-1])
        self._fall_back(state, user, items, fallback, dist, ratings)
        np.clip(ratings, self.levels[0], self.levels[-1], out=ratings)
        for a in (ratings, dist, fallback, baseline):
            if a is not None:
                a.flags.writeable = False
        row = UserRow(ratings, dist, fallback, bool(fallback.any()), baseline, weight, self.levels)
        self.rows.put(state, user, row)
        return row

    def _fall_back(
        self,
        state: OnlineState,
        user: int,
        items: np.ndarray,
        fallback: np.ndarray,
        dist: np.ndarray,
        ratings: np.ndarray | None = None,
    ) -> None:
        """The items without an embedding yet answered by the bias baseline: their distributions (and
        expected ratings) replaced in place."""
        if fallback.any():
            dist[fallback] = level_distribution(state.baseline(user, items[fallback]), self.levels)
            if ratings is not None:
                ratings[fallback] = expected_rating(dist[fallback], self.levels)

    def _predict(
        self, state: OnlineState, user: int, items: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        fallback = ~state.embedded[items]
        k = len(items)
        rows = np.full(k, user, dtype=np.int64)
        # One mean-field run at a time per worker: the batches are large numpy arrays, and threads running
        # them side by side thrash memory without adding throughput (workers use the cores). Each scorer
        # reads the network's probabilities itself (`exact` with its messages).
        with self._engine_lock:
            dist = state.scorer.predict(rows, items)
        self._fall_back(state, user, items, fallback, dist)
        ratings = np.clip(expected_rating(dist, self.levels), self.levels[0], self.levels[-1])
        return ratings, dist, fallback

    def explain(
        self, user: int, items: np.ndarray, k: int, state: OnlineState | None = None
    ) -> list[dict[str, Any]]:
        """Each prediction's explanation (model/exact/explain.py) in `state` (default: now): the network's
        expected rating and the `k` known ratings that moved the prediction most, as
        {"user", "item", "rating", "effect"}; for an item without an embedding yet (answered by the bias
        baseline) a `reason` instead. Raises model.exact.explain.CannotExplain when the mode cannot
        explain."""
        state = state or self.fold.state
        fallback = ~state.embedded[items]
        out: list[dict[str, Any]] = [{"reason": BASELINE_REASON} for _ in items]
        embedded = np.flatnonzero(~fallback)
        known = state.known
        with self._engine_lock:
            found = state.scorer.explain(user, items[embedded], k)
        for q, e in zip(embedded.tolist(), found, strict=True):
            out[q] = {
                "network": e.network,
                "because": [
                    {
                        "user": self.user_id(int(known.rows[pos])),
                        "item": self.item_id(int(known.cols[pos])),
                        "rating": float(known.values[pos]),
                        "effect": float(effect),
                    }
                    for pos, effect in zip(e.known.tolist(), e.effects.tolist(), strict=True)
                ],
            }
        return out

    def similar_users(self, user: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k users with the highest scaled cosine s_r = (1 + cos) / 2 to `user`, best first (forgotten
        users never among them)."""
        state = self.fold.state
        return nearest(state.network.user_lifted, user, k, sorted(state.forgotten))

    def similar_items(self, item: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k items with the highest scaled cosine s_c = (1 + cos) / 2 to `item`, best first."""
        return nearest(self.fold.state.network.item_lifted, item, k)
