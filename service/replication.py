"""The one path from the rating stream to this worker's published model states: `Replica`.

Every kind of online data is an entry of one durable log (service/online.py); a worker turns that log into
immutable model states (model/online.py `FoldIn`: each batch builds the next state whole, then publishes
it) and answering code only reads a state. The `Replica` is that turning, one per served model, with one
explicit state machine that alone decides readiness:

    starting     nothing read yet
    catching_up  placing itself in the stream (a fold-in snapshot, or the artifact's place and the
                 compacted head), or reading towards the stream's end: after start-up, and after a
                 compaction trimmed the stream past its place (it then folds the compacted head in)
    following    it has read to the stream's end at least once since then, and tails it
    degraded     Redis fails, the compacted head cannot be read, or a fold-in fails for a reason that
                 passes (memory, ONNX Runtime): the state stays as it was and the same entries are tried
                 again (backing off), never skipped

A worker is ready once it has read to the stream's end since it was placed (or since its last gap): a
worker that starts while Redis is down, or whose replay fails half way, is not ready until it has; one
that had caught up stays ready while degraded (it answers from what it has). The replica never skips an
entry unknowingly: every read returns what the stream deleted at that instant, and an entry deleted after
its place means a compaction trimmed past it, so it folds the compacted head in (which holds those
entries consolidated) before it reads on; were no head to hold them (a trim by hand), it says so loudly
(`lost`), as it does for a stream that was begun again (`rebuild`: the supervisor, service/reload.py,
builds a fresh model in its place).

An entry it cannot apply is skipped only when the entry itself is at fault: poison (a missing field, a
rating off the model's levels), or a fold-in that fails on it alone for a reason that would not pass
(a bug); the skip is copied to the dead-letter stream, counted and reported. A fold-in that fails for a
reason that passes leaves the state as it was (the batch is applied wholly or not at all) and is retried.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis

import service.online
from model.artifact import Artifact
from model.catalogue import ItemChange
from model.online import FoldIn, SnapshotError
from model.stream import DISMISS, FORGET, Compacted, Entry, Event, ItemEntry, Page, Poison, stream_order
from service.metrics import Metrics
from service.online import HeadUnreadable, RatingLog
from service.settings import Settings
from service.snapshot import SnapshotStore, Untrusted

log = logging.getLogger(__name__)

HEAD_CHUNK = 2000
"""Entries of a compacted head folded in per batch (a batch's dense rows are users x items float32)."""

HURRY_MIN_S = 0.05
"""A read with `after` folds in what arrived at once, but not more often than this: reads cannot make a
fold-in per write."""

MAX_BACKOFF_S = 10.0
"""The longest wait between two tries of a round that failed."""


class Phase(enum.Enum):
    """Where a replica stands (module docstring)."""

    STARTING = "starting"
    CATCHING_UP = "catching_up"
    FOLLOWING = "following"
    DEGRADED = "degraded"


class FoldInFailed(Exception):
    """A fold-in failed for a reason that passes (memory, ONNX Runtime, the disk): retried, never skipped."""


PASSING = (MemoryError, OSError, FoldInFailed)
"""Failures of a fold-in that say nothing about the entries: the batch is tried again later."""


class Replica:
    """Follows the rating stream into `fold`'s states (module docstring)."""

    def __init__(
        self,
        ratings: RatingLog,
        fold: FoldIn,
        artifact: Artifact,
        snapshots: SnapshotStore,
        settings: Settings,
        metrics: Metrics,
        check: Callable[[list[Entry | ItemEntry | Event]], list[Poison]],
        apply: Callable[[list[Entry | ItemEntry | Event]], None],
    ) -> None:
        """`check(entries)` says which entries the model cannot take (as Poison); `apply(entries)` folds
        the others in, wholly or not at all (raises on failure: PASSING ones are retried)."""
        self.ratings, self.fold, self.artifact, self.snapshots = ratings, fold, artifact, snapshots
        self.settings, self.metrics = settings, metrics
        self.check, self.apply = check, apply
        self.retry_s = settings.redis_retry_s
        self.interval_s = settings.fold_in_interval_s
        self.on_recover: Callable[[], object] = lambda: None
        """Called (from the replica's thread) when a round succeeds after a failure."""
        self.phase = Phase.STARTING
        self.reason = "not started"
        """Why the replica is where it is (the failure while degraded)."""
        self.redis_down = False
        self.last = "0"
        """The last stream entry folded into the published state (or skipped)."""
        self.skipped = 0
        """Entries skipped (poison, or a fold-in that failed on the entry itself)."""
        self.last_skipped: Poison | None = None
        self.gaps = 0
        """Times a compaction trimmed the stream past this replica's place and it folded the head in."""
        self.lost = 0
        """Times entries after its place were deleted with no compacted head to hold them."""
        self.last_gap: str | None = None
        self.rebuild: str | None = None
        """Why this replica's state can no longer follow the stream (it was begun again): replace it."""
        self.identity: str | None = None
        self._foreign_head: str | None = None
        self._reported: str | None = None
        self._placed = False
        self._caught_up = False
        self._failures = 0
        self._skipped_ids: dict[str, None] = {}
        self._lock = threading.Lock()  # one reader applies at a time, in stream order
        self._stop = threading.Event()
        self._hurry = threading.Event()
        self._last_fold = 0.0
        self._waiters: list[tuple[tuple[int, int], Callable[[], None]]] = []
        self._waiters_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._snapshot_checked = 0.0
        self._snapshot_known = 0  # `writes` of the newest snapshot this worker knows is stored

    # -- readiness and what it reports -------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Whether this worker may take traffic: it has read to the stream's end since it was placed (or
        since its last gap), and its state can still follow the stream."""
        return self._caught_up and self.rebuild is None

    def applied(self, entry_id: str) -> bool:
        """Whether the published state includes the stream entry `entry_id` (and all before it)."""
        return stream_order(self.last) >= stream_order(entry_id)

    def notify(self, entry_id: str, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback()` (from the replica's thread, or here) once `entry_id` is applied; returns a
        function that cancels it."""
        item = (stream_order(entry_id), callback)
        with self._waiters_lock:
            self._waiters.append(item)
        self._wake_waiters()

        def cancel() -> None:
            with self._waiters_lock:
                if item in self._waiters:
                    self._waiters.remove(item)

        return cancel

    def _wake_waiters(self) -> None:
        now = stream_order(self.last)
        with self._waiters_lock:
            due = [w for w in self._waiters if w[0] <= now]
            self._waiters = [w for w in self._waiters if w[0] > now]
        for _, callback in due:
            callback()

    def hurry(self) -> None:
        """Fold in what has arrived now rather than at the end of the gathering interval (a read with
        `after` waits for it), at most once per HURRY_MIN_S."""
        self._hurry.set()

    def describe(self) -> dict[str, Any]:
        """What /health shows of it."""
        return {
            "phase": self.phase.value,
            "ready": self.ready,
            "reason": None if self.phase is Phase.FOLLOWING else self.reason,
            "applied_up_to": self.last,
            "gaps": self.gaps,
            "lost_gaps": self.lost,
            "last_gap": self.last_gap,
            "rebuild": self.rebuild,
        }

    # -- the thread --------------------------------------------------------------------------------------
    def start(self) -> None:
        """One round now (placing and catching up, or failing and saying why), then follow the stream in a
        daemon thread."""
        self._round()
        self._thread = threading.Thread(target=self._run, name="rating-stream", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop following (the thread ends within one block interval)."""
        self._stop.set()
        self._hurry.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.rebuild is not None or (self.phase is Phase.DEGRADED and self._failures):
                self._stop.wait(min(MAX_BACKOFF_S, self.retry_s * 2 ** max(0, self._failures - 1)))
                if self.rebuild is not None:
                    continue
                self._round()
                continue
            try:
                # Wait for new entries without the lock: a blocking read, the tail's wake-up.
                if self.ratings.wait_new(self.last) and self.interval_s > 0:
                    # Whatever else arrives within the interval joins them: one new state per interval,
                    # sooner when a read waits (`hurry`), but not more often than HURRY_MIN_S.
                    self._hurry.wait(self.interval_s)
                    self._hurry.clear()
                    self._stop.wait(max(0.0, self._last_fold + HURRY_MIN_S - time.monotonic()))
            except redis.RedisError as exc:
                self._failed(f"Redis at {self.ratings.shown_url} failed: {exc}", redis_down=True)
                continue
            if not self._stop.is_set():
                self._round()

    def _round(self) -> bool:
        """Place (once), then read and fold in to the stream's end; False (degraded, saying why) when it
        could not."""
        try:
            self._catch_up()
        except redis.RedisError as exc:
            self._failed(f"Redis at {self.ratings.shown_url} failed: {exc}", redis_down=True)
            return False
        except HeadUnreadable as exc:
            self._failed(f"{exc}: not going on without the ratings it holds")
            return False
        except PASSING as exc:
            self._failed(f"a fold-in failed ({type(exc).__name__}: {exc}); trying the same entries again")
            return False
        except Exception as exc:  # a bug must not stop the thread silently
            log.exception("following %s failed", self.ratings.key)
            self._failed(f"{type(exc).__name__}: {exc}")
            return False
        recovered = self._failures > 0
        self._failures = 0
        self.redis_down = False
        if recovered:
            log.warning("%s: following the rating stream again (up to %s)", self.ratings.shown_url, self.last)
            try:
                self.on_recover()
            except redis.RedisError as exc:
                self._failed(f"Redis at {self.ratings.shown_url} failed: {exc}", redis_down=True)
                return False
        self._maybe_snapshot()
        return True

    def _failed(self, reason: str, redis_down: bool = False) -> None:
        if self._failures == 0 or reason != self.reason:
            (log.warning if redis_down else log.error)("%s; %s", reason, self._what_now())
        if redis_down:
            self.metrics.redis_errors.inc()
        self.metrics.fold_in_failures.inc()
        self._failures += 1
        self.redis_down = redis_down
        self.phase, self.reason = Phase.DEGRADED, reason

    def _what_now(self) -> str:
        if self._caught_up:
            return "serving the model as it is, trying again"
        return "not ready until it succeeds, trying again"

    # -- catching up -------------------------------------------------------------------------------------
    def catch_up(self) -> None:
        """Read and fold in to the stream's end now (placing first, once); raises what stops it
        (redis.RedisError, HeadUnreadable, a fold-in's failure). The thread does this on its own."""
        self._catch_up()
        while self.ratings.read(self.last).entries:  # a following round folds one batch in
            self._catch_up()

    def _catch_up(self) -> None:
        """Place (once), then read and fold in: to the stream's end while catching up; once caught up, one
        batch per round (the next round gathers what arrived meanwhile), more only while a whole
        READ_CHUNK came back (it fell behind)."""
        with self._lock:
            if not self._placed:
                self.phase, self.reason = Phase.CATCHING_UP, "placing itself in the stream"
                self._place()
                self._placed = True
            elif (identity := self.ratings.identity()) != self.identity:
                self._begun_again(f"its identity is {identity}, this worker followed {self.identity}")
                return
            while True:
                read = self.ratings.read(self.last)
                page = read.page
                if (
                    page.last_generated is not None
                    and self.last != "0"
                    and stream_order(page.last_generated) < stream_order(self.last)
                ):
                    self._begun_again(f"its newest id {page.last_generated} is before {self.last}")
                    return
                if self._trimmed_past():
                    continue
                if page.deleted_after(self.last):
                    self._deleted(page)
                if not read.entries:
                    self._caught_up = True
                    break
                if not self._caught_up:
                    self.phase, self.reason = Phase.CATCHING_UP, "reading towards the stream's end"
                self._fold(read.entries)
                if self._caught_up and len(read.entries) < service.online.READ_CHUNK:
                    break  # following: one fold-in per round (what arrived meanwhile waits for the next)
            self.phase, self.reason = Phase.FOLLOWING, "following"

    def _fold(self, entries: list[Entry | ItemEntry | Event | Poison]) -> None:
        """Fold entries that follow the last one applied in (the caller holds the lock): poison skipped,
        the rest as one batch; a batch that fails for a reason that passes raises (nothing applied), one
        that fails otherwise is applied one entry at a time, skipping only the entries that fail alone."""
        valid = [e for e in entries if not isinstance(e, Poison)]
        poison = [e for e in entries if isinstance(e, Poison)] + self.check(valid)
        refused = {p.id: p for p in poison}
        for bad in sorted(poison, key=lambda p: stream_order(p.id)):
            self._skip(bad)
        good = [e for e in valid if e.id not in refused]
        try:
            self.apply(good)
        except PASSING:
            raise
        except Exception:  # the data or a bug: find the entries it fails on, skip only those
            log.exception("folding in %d stream entries failed; applying them one at a time", len(good))
            for entry in entries:
                if entry.id in refused:
                    self._advance(entry.id)
                    continue
                assert not isinstance(entry, Poison)
                try:
                    self.apply([entry])
                except PASSING:
                    raise
                except Exception as exc:
                    self._skip(
                        Poison(entry.id, entry.fields(), f"fold-in failed: {type(exc).__name__}: {exc}")
                    )
                self._advance(entry.id)
        self.metrics.ratings_applied.inc(sum(1 for e in good if isinstance(e, Entry)))
        self._advance(entries[-1].id)

    def _advance(self, entry_id: str) -> None:
        self.last = entry_id
        self._last_fold = time.monotonic()
        self._wake_waiters()

    def _skip(self, bad: Poison) -> None:
        """Copy a skipped entry to the dead-letter stream (logged by whichever worker copies it first) and
        count it (once, however often it is read again)."""
        if self.ratings.dead_letter(bad):
            log.error(
                "stream entry %s of %s cannot be applied (%s): skipped, copied to %s",
                bad.id,
                self.ratings.key,
                bad.reason,
                self.ratings.dead_key,
            )
        if bad.id not in self._skipped_ids:
            self._skipped_ids[bad.id] = None
            if len(self._skipped_ids) > 10_000:
                self._skipped_ids.pop(next(iter(self._skipped_ids)))
            self.skipped += 1
            self.last_skipped = bad
            self.metrics.entries_skipped.inc()

    def _trimmed_past(self) -> bool:
        """Whether a compaction's head ends past this replica's place (read after the entries, so that a
        trim before that read is seen: a compaction writes its head first): then the head is folded in
        and the replica reads on after it (True: read again)."""
        ends = self.ratings.head_last()
        if ends is None or stream_order(ends) <= stream_order(self.last) or ends == self._foreign_head:
            return False
        head = self._head()
        if head is None or stream_order(head.last) <= stream_order(self.last):
            self._foreign_head = ends  # of another stream: not read again until it changes
            return False
        self._caught_up = False
        self.phase, self.reason = Phase.CATCHING_UP, "folding in the compacted head after a trim"
        log.warning(
            "the stream %s was compacted past this worker's place (%s): folding in its compacted head "
            "(%d ratings up to %s)",
            self.ratings.key,
            self.last,
            len(head.ratings),
            head.last,
        )
        self._fold_head(head)
        self.gaps += 1
        self.metrics.stream_gaps.labels("recovered").inc()
        self.last_gap = f"trimmed past {self.last}; folded the compacted head in up to {head.last}"
        self._advance(head.last)
        return True

    def _deleted(self, page: Page) -> None:
        """Entries after this replica's place were deleted (XDEL): a forgotten user's earlier entries (the
        purge mark reaches them: read on as if they were never written), or by hand (said loudly, once:
        they are lost to every reader)."""
        if page.max_deleted == self._reported or self.ratings.purged(page):
            return
        self._reported = page.max_deleted
        self.lost += 1
        self.metrics.stream_gaps.labels("lost").inc()
        self.last_gap = f"entries after {self.last} up to {page.max_deleted} deleted by hand: lost"
        log.error(
            "entries of the stream %s after this worker's place %s were deleted (up to %s), not by "
            "compaction nor by forgetting a user: they are lost to every reader",
            self.ratings.key,
            self.last,
            page.max_deleted,
        )

    def _begun_again(self, why: str) -> None:
        self.rebuild = f"the stream {self.ratings.key} was begun again ({why})"
        self.phase, self.reason = Phase.DEGRADED, self.rebuild
        log.error("%s: this model is rebuilt from its artifact", self.rebuild)

    def _head(self) -> Compacted | None:
        head = self.ratings.compacted()
        if head is not None and head.identity != self.identity:
            log.warning(
                "ignoring the compacted head of %s: it is of another stream of that name", self.ratings.key
            )
            return None
        return head

    def _fold_head(self, head: Compacted) -> None:
        """Fold a compacted head's entries in, in batches of HEAD_CHUNK (its order kept: forgets, then
        retractions, then ratings; then the catalogue changes, then the dismissals)."""
        entries = head.entries()
        for start in range(0, len(entries), HEAD_CHUNK):
            self.fold.apply(entries[start : start + HEAD_CHUNK])
        for start in range(0, len(head.items), HEAD_CHUNK * 10):
            self.fold.apply([], head.items[start : start + HEAD_CHUNK * 10])
        for start in range(0, len(head.dismissed), HEAD_CHUNK * 10):
            self.fold.apply([], (), head.dismissed[start : start + HEAD_CHUNK * 10])

    def _place(self) -> None:
        """Before the first read: start from the newest fold-in snapshot of this model in Redis where
        there is one it can trust (service/snapshot.py); else replay only what the artifact was not
        trained on (`dcmc train --online-ratings`), after folding in the ratings of held-out pairs it
        kept, and the compacted head where the stream from the artifact's place is trimmed; all of the
        stream when the artifact read another stream of this name (its recorded identity differs)."""
        key = self.ratings.key
        self.identity = identity = self.ratings.identity()
        start = self.artifact.online_snapshot(key, identity)
        head = self._head()  # `dcmc compact`: the entries up to head.last are trimmed
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
        held = self.artifact.online_held_out(key, identity)
        if held:
            self.fold.apply(held)
            log.info("folded in %d online ratings of held-out pairs that the artifact kept", len(held))
        self.last = start
        if head is not None and trimmed:  # the stream from the artifact's place on is partly trimmed
            self._fold_head(head)
            self.last = head.last
            log.info(
                "folded in the compacted head of %s (%d ratings up to %s): the artifact is older",
                key,
                len(head.ratings),
                head.last,
            )

    def _restore(self, start: str) -> bool:
        """Start from the stored fold-in snapshot if it can be trusted and covers at least `start`; False
        (logged) when there is none or it is ignored."""
        began = time.perf_counter()
        try:
            snapshot = self.snapshots.load(self.identity)
            if snapshot is None:
                return False
            if stream_order(snapshot.last) < stream_order(start):
                raise Untrusted(f"it ends at {snapshot.last}, before the artifact's place {start}")
            applied = self.fold.restore(snapshot.data)
        except (Untrusted, SnapshotError) as exc:
            log.warning("ignoring the fold-in snapshot %s: %s", self.snapshots.key, exc)
            self.metrics.snapshots.labels("ignored").inc()
            return False
        self.last = snapshot.last
        self._snapshot_known = applied
        self.metrics.snapshots.labels("restored").inc()
        log.info(
            "started from the fold-in snapshot of %d online writes (stream up to %s) in %.2fs",
            applied,
            snapshot.last,
            time.perf_counter() - began,
        )
        return True

    # -- snapshots ---------------------------------------------------------------------------------------
    def _maybe_snapshot(self) -> None:
        """Store a fold-in snapshot when one is due (after each round): `snapshot_every` ratings past the
        stored one, or any past it and `snapshot_interval_s` since it was written. At most one worker
        writes at a time (a lease); a Redis failure is logged and counted, and it is tried again later."""
        interval = self.settings.snapshot_interval_s
        applied = self.fold.state.writes
        now = time.monotonic()
        if (
            not interval
            or applied <= self._snapshot_known
            or now - self._snapshot_checked < min(1.0, interval)
        ):
            return
        self._snapshot_checked = now
        try:
            meta = self.snapshots.meta() or {}
            if meta.get("stream_identity") != self.identity:  # of a stream since emptied: replaced
                meta = {}
            stored, written = int(meta.get("applied", -1)), float(meta.get("written_at", 0.0))
            self._snapshot_known = max(stored, 0)
            due = applied - stored >= self.settings.snapshot_every or (
                applied > stored and time.time() - written >= interval
            )
            if not due or not self.snapshots.acquire(max(interval, 60.0)):
                return
            try:
                began = time.perf_counter()
                with self._lock:
                    last, (count, data) = self.last, self.fold.snapshot()
                self.snapshots.write(last, count, self.identity, data)
                self._snapshot_known = count
                self.metrics.snapshots.labels("written").inc()
                log.info(
                    "stored a fold-in snapshot of %d online writes (%.1f MB, stream up to %s) in %.2fs",
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


def entries_of(batch: Sequence[Entry | ItemEntry | Event]) -> list[tuple[str, str, float | None]]:
    """The ratings among stream entries as the (user, item, rating) triples `FoldIn.apply` takes."""
    return [(e.user, e.item, e.rating) for e in batch if isinstance(e, Entry)]


def changes_of(batch: Sequence[Entry | ItemEntry | Event]) -> list[tuple[str, ItemChange]]:
    """The catalogue changes among stream entries as the (item, change) pairs `FoldIn.apply` takes."""
    return [(e.item, e.change) for e in batch if isinstance(e, ItemEntry)]


def dismissals_of(batch: Sequence[Entry | ItemEntry | Event]) -> list[tuple[str, str]]:
    """The dismissals (user, item) and the forgets (user, FORGET) among stream entries, in their order, as
    `FoldIn.apply` takes them."""
    return [
        (e.user, e.item) if isinstance(e, Event) else (e.user, FORGET)
        for e in batch
        if (isinstance(e, Event) and e.kind == DISMISS)
        or (isinstance(e, Entry) and e.item == FORGET and e.rating is None)
    ]
