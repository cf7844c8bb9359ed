"""The scoring side of the service: the artifact's model with every online rating folded in.

Everything per model is prepared once at start-up: the verified artifact and the scorer of its inference
mode (model/scorers.py: the `paper` mode's partitions, or the `exact` mode's known field and tables). The
online ratings (service/online.py, in Redis) are then replayed and followed: each one updates this
worker's model (model/online.py). A request reads the current model state once and scores its entries,
from a user's cached row where it can (service/rows.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from model.artifact import Artifact
from model.catalogue import ItemChange, ItemRecord
from model.config import InferenceConfig
from model.engine import OnnxNetwork, expected_rating
from model.exact import baseline_mixture, level_distribution
from model.ids import UnknownIdError
from model.online import FoldIn, OnlineState
from model.ratings import Ratings
from model.scorers import check_inference
from model.stream import Entry, Event, ItemEntry, Poison, entry_fields, event_fields, item_fields, off_levels
from model.types import Array
from service.catalogue import CatalogueIndex, CatalogueView
from service.experiments import Experiments, variant_models
from service.impressions import Impressions, new_id
from service.memory import release_memory
from service.metrics import Metrics
from service.online import Durability, NotDurable, RatingLog
from service.replication import FoldInFailed, Replica, changes_of, dismissals_of, entries_of
from service.rows import Costs, UserRow, UserRows
from service.settings import Settings, inference_overrides
from service.snapshot import SnapshotStore, fingerprint

log = logging.getLogger(__name__)

EXPLAIN_BYTES = 64 * 2**20
"""Memory an explanation takes at most per call into the scorer: each explained item reads its similarities
and co-rating line to every item (two float64 rows of the catalogue per averaged setting)."""

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


class TooManyNewIds(Exception):
    """A batch that would take the users or items the model did not have past their limits (nothing of
    it stored): per kind, (kind, the new ids, how many there are so far, the limit, its variable)."""

    def __init__(self, over: list[tuple[str, set[str], int, int, str]]) -> None:
        super().__init__("; ".join(f"{len(new)} new {kind}" for kind, new, *_ in over))
        self.over = over


@dataclass(frozen=True)
class Reservation:
    """The new users and items a batch being written counts against the limits until it is folded in."""

    users: frozenset[str]
    items: frozenset[str]


DURABILITY_REFRESH_S = 10.0
"""How often the replica's thread reads Redis's persistence settings again for /health (writes that
require durability read them themselves, every time)."""


class ServedModel:
    """Answers rating and similarity queries for one artifact, and takes ratings online."""

    def __init__(
        self, artifact: Artifact, settings: Settings, metrics: Metrics, experiments: Experiments | None = None
    ) -> None:
        self.artifact = artifact
        self.experiments = experiments
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
        # Whether a miss is answered by the scorer's fused path (`Scorer.answer`: exact, clamped).
        self.fused = modes == {"exact"} and all(i.kernel.known == "clamped" for i in self.inferences)
        self.costs = Costs()  # the ski rental's prices, measured
        # Per-model precomputation (the mode's scorer: partitions, known field, tables), once, here.
        start = time.perf_counter()
        self.fold = FoldIn(
            artifact,
            self.inferences,
            self._embed_rows,
            self._embed_cols,
            refine_trained=fold_in_refine(artifact, settings) == "all",
        )
        # The fused path's loops compiled (or loaded from numba's cache) before the worker takes traffic.
        state = self.fold.state
        if state.known.n_users and state.network.n_items:
            state.scorer.answer(0, np.zeros(1, dtype=np.int64))
            self._calibrate(state)
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
        # New ids of batches this worker is writing or wrote that its model has not folded in yet (counted
        # against the new-id limits meanwhile: reserved before the write, `admit`).
        self._pending_users: set[str] = set()
        self._pending_items: set[str] = set()
        self._pending_lock = threading.Lock()
        self._durability_checked = 0.0
        self._indexes: list[CatalogueIndex] = []  # the newest last; the one before for older states
        self._index_lock = threading.Lock()
        self.catalogue_index()  # at start-up, not on the first request (seconds for 1e5 items)
        self.ratings: RatingLog | None = None
        self.replica: Replica | None = None
        self.durability = Durability(False, "no Redis configured (REDIS_URL): online ratings are off")
        self._last_probe = 0.0
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
        self.variants: dict[tuple[str, str], ServedModel] = {}
        self.parent: ServedModel | None = None
        self.impressions: Impressions | None = None
        if settings.redis_url and settings.impressions_max:
            self.impressions = Impressions(
                settings.redis_url,
                settings.redis_key_prefix,
                settings.impressions_max,
                settings.redis_timeout_s,
                metrics,
            )
        if settings.redis_url:
            self.ratings = RatingLog(
                settings.redis_url,
                settings.redis_key_prefix,
                settings.redis_timeout_s,
                settings.redis_write_timeout_s,
            )
            snapshots = SnapshotStore(
                self.ratings.client,
                self.ratings.bulk_client,
                self.ratings.key,
                self.version,
                self.fingerprint,
            )
            self.replica = Replica(
                self.ratings, self.fold, artifact, snapshots, settings, metrics, self._check, self._apply
            )
            self.replica.on_recover = self.refresh_durability
        # The models of experiments' variants that change the model (service/experiments.py): made, started
        # and closed with this one, so a hot reload replaces them too.
        try:
            self.variants = variant_models(artifact, settings, metrics, experiments)
        except Exception:
            self.close()
            raise
        for variant in self.variants.values():
            variant.parent = self  # its answers' impressions go through this model's writer

    # -- start-up and shutdown ---------------------------------------------------------------------------
    def start(self) -> None:
        """Place this model in the rating stream and catch up with it (one try now: `ready` says whether
        it succeeded), then follow it; service/replication.py."""
        for variant in self.variants.values():
            variant.start()
        if self.replica is None:
            return
        try:
            self.refresh_durability()
        except redis.RedisError as exc:
            log.warning("cannot read Redis's persistence settings yet (%s)", exc)
        self.replica.start()

    @property
    def ready(self) -> bool:
        """Whether this worker may take traffic (/ready): decided by its replica alone (without Redis:
        once loaded)."""
        return (self.replica is None or self.replica.ready) and all(v.ready for v in self.variants.values())

    @property
    def needs_rebuild(self) -> str | None:
        """Why this model's state can no longer follow the stream (the supervisor replaces it), or None."""
        return self.replica.rebuild if self.replica is not None else None

    def refresh_durability(self) -> Durability:
        """Read the server's persistence settings again (at start-up, when Redis comes back, every
        DURABILITY_REFRESH_S while it follows, and on a write refused for want of them); a warning when
        they do not keep acknowledged writes. Raises redis.RedisError."""
        assert self.ratings is not None
        self._durability_checked = time.monotonic()
        durability = self.ratings.durability(self.settings.redis_wait_replicas)
        if not durability.durable and durability != self.durability:
            log.warning("Redis is not durable: %s", durability.detail)
        self.durability = durability
        return durability

    def close(self) -> None:
        """Stop following the stream and release Redis connections (the variants' models' too)."""
        for variant in getattr(self, "variants", {}).values():
            variant.close()
        if self.replica is not None:
            self.replica.stop()
        if self.ratings is not None:
            self.ratings.close()
        if self.impressions is not None:
            self.impressions.close()

    def redis_state(self) -> str:
        """`disabled` (no REDIS_URL), `ok` or `down` (probed again when down, at most once per retry)."""
        if self.ratings is None or self.replica is None:
            return "disabled"
        if self.replica.redis_down and time.monotonic() - self._last_probe >= self.retry_s:
            self._last_probe = time.monotonic()
            try:
                self.ratings.ping()
            except redis.RedisError:
                return "down"
            return "ok"
        return "down" if self.replica.redis_down else "ok"

    # -- online ratings ----------------------------------------------------------------------------------
    def _embed_rows(self, rows: Array) -> Array:
        try:
            with self._onnx_lock:
                return self.onnx.embed_users(rows)
        except MemoryError:
            raise
        except Exception as exc:  # ONNX Runtime's own errors: a resource, not the ratings
            raise FoldInFailed(f"ONNX Runtime: {type(exc).__name__}: {exc}") from exc

    def _embed_cols(self, cols: Array) -> Array:
        try:
            with self._onnx_lock:
                return self.onnx.embed_items(cols)
        except MemoryError:
            raise
        except Exception as exc:
            raise FoldInFailed(f"ONNX Runtime: {type(exc).__name__}: {exc}") from exc

    def admit(self, users: Sequence[str], items: Sequence[str]) -> Reservation:
        """Reserve a batch's users and items that would be new against DCMC_MAX_NEW_USERS and
        DCMC_MAX_NEW_ITEMS, counting those folded in and those of batches this worker is writing or wrote
        and has not folded in yet; raises TooManyNewIds (nothing reserved) past either. `release` gives a
        reservation back when its batch was not stored."""
        with self._pending_lock:
            known_users, known_items = self.fold.unseen(list(self._pending_users), list(self._pending_items))
            self._pending_users &= known_users  # the rest is folded in now
            self._pending_items &= known_items
            unseen_users, unseen_items = self.fold.unseen(users, items)
            unseen_users -= self._pending_users
            unseen_items -= self._pending_items
            over = []
            for kind, unseen, so_far, limit, variable in (
                ("users", unseen_users, self.fold.new_users + len(self._pending_users),
                 self.settings.max_new_users, "DCMC_MAX_NEW_USERS"),
                ("items", unseen_items, self.fold.new_items + len(self._pending_items),
                 self.settings.max_new_items, "DCMC_MAX_NEW_ITEMS"),
            ):  # fmt: skip
                if unseen and so_far + len(unseen) > limit:
                    over.append((kind, unseen, so_far, limit, variable))
            if over:
                raise TooManyNewIds(over)
            self._pending_users |= unseen_users
            self._pending_items |= unseen_items
            return Reservation(frozenset(unseen_users), frozenset(unseen_items))

    def release(self, reservation: Reservation) -> None:
        """Give back the new ids a batch reserved that was not stored."""
        with self._pending_lock:
            self._pending_users -= reservation.users
            self._pending_items -= reservation.items

    def pending_user(self, user: str) -> bool:
        """Whether this worker wrote a rating of `user` that its model has not folded in yet."""
        with self._pending_lock:
            return user in self._pending_users

    def _check(self, entries: list[Entry | ItemEntry | Event]) -> list[Poison]:
        """The entries this model cannot fold in: a rating that is not one of its levels."""
        return off_levels([e for e in entries if isinstance(e, Entry)], self.levels)

    def _apply(self, entries: list[Entry | ItemEntry | Event]) -> None:
        """Fold stream entries into the model (the replica calls it, in stream order), wholly or not at
        all, and index the catalogue they leave (before a request needs it); also reads Redis's
        persistence settings again every DURABILITY_REFRESH_S."""
        # No engine lock: requests go on with the state they took while the next one is built.
        ratings = entries_of(entries)
        self.fold.apply(ratings, changes_of(entries), dismissals_of(entries))
        self.catalogue_index()
        if ratings:
            release_memory()
        if time.monotonic() - self._durability_checked >= DURABILITY_REFRESH_S:
            self.refresh_durability()

    def write(
        self, ratings: Sequence[tuple[str, str, float | None]], recs: Sequence[str | None] | None = None
    ) -> str:
        """Store a batch of (user, item, rating) durably in Redis (one transaction); returns the stream id
        of its last rating. Every worker's replica then folds it in (service/consistency.py). With
        DCMC_REQUIRE_DURABLE, Redis's persistence settings are read before every write (NotDurable:
        nothing stored); with DCMC_REDIS_WAIT_REPLICAS the answer waits for that many replicas. Raises
        redis.RedisError (service.online.stored_unknown says whether it may have been stored),
        NotDurable, or RuntimeError when online ratings are off. `recs`: per rating, the recommendation
        id it answers (or None)."""
        recs = recs or [None] * len(ratings)
        last = self._store([entry_fields(*r, rec) for r, rec in zip(ratings, recs, strict=True)])
        self.metrics.ratings_written.inc(len(ratings))
        return last  # the replica folds it in behind the answer (reads wait for it with `after`)

    def write_items(self, changes: Sequence[tuple[str, ItemChange]]) -> str:
        """Store a batch of catalogue changes (item id, change) as `write` stores ratings: in the same
        stream, acknowledged once stored, folded in by every worker; returns the last one's stream id."""
        return self._store([item_fields(item, change) for item, change in changes])

    def write_events(self, events: Sequence[tuple[str, str, str, str | None]]) -> str:
        """Store a batch of events (user, item, kind, recommendation id or None) as `write` stores ratings:
        in the same stream, acknowledged once stored; returns the last one's stream id."""
        return self._store([event_fields(*e) for e in events])

    def _store(self, entries: list[dict[str, str]]) -> str:
        """Append stream entries as one transaction (`write`)."""
        if self.ratings is None or self.replica is None:
            raise RuntimeError("online writes need Redis: set REDIS_URL")
        try:
            last = self.ratings.append_fields(
                entries, self.settings.require_durable, self.settings.redis_wait_replicas
            )
        except NotDurable as exc:
            self.durability = Durability(False, str(exc))
            self._durability_checked = time.monotonic()
            raise
        if self.ratings.verdict is not None:
            self.durability = self.ratings.verdict
        return last

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

    def shown(
        self,
        route: str,
        subject: dict[str, str],
        items: Sequence[str],
        scores: Sequence[float],
        more: dict[str, Any] | None = None,
        recommendation_id: str | None = None,
    ) -> str:
        """A new recommendation id for an answer that shows `items` (to `subject`: {"user": id} or
        {"item": id}), its impression queued with `more` (experiment, variant, teams, distributions;
        service/impressions.py; nothing without Redis)."""
        if self.parent is not None:
            return self.parent.shown(route, subject, items, scores, more, recommendation_id)
        recommendation_id = recommendation_id or new_id()
        if self.impressions is not None:
            self.impressions.record(route, subject, items, scores, self.version, recommendation_id, more)
        return recommendation_id

    def variant_model(self, experiment: str, variant: str) -> ServedModel:
        """The model that answers for a variant: its own where it changes the model, else this one."""
        return self.variants.get((experiment, variant), self)

    @property
    def temperature(self) -> float:
        """The temperature of the served distributions (model/calibration.py): the artifact's
        `calibration` choice, else 1 (as the network and the CRF give them)."""
        return float((self.artifact.meta.get("calibration") or {}).get("temperature", 1.0))

    @property
    def diversity(self) -> float:
        """/recommend's default diversity: DCMC_DIVERSITY, else the artifact's choice (`ranking`), else 0."""
        if self.settings.diversity is not None:
            return self.settings.diversity
        return float((self.artifact.meta.get("ranking") or {}).get("diversity", 0.0))

    def catalogue(self, state: OnlineState | None = None) -> Mapping[str, ItemRecord]:
        """The items' records in `state` (default: now): the artifact's, as online changes left them."""
        return CatalogueView(self.artifact.catalogue or {}, (state or self.fold.state).records)

    def catalogue_index(self, state: OnlineState | None = None) -> CatalogueIndex:
        """The catalogue over the items of `state` (default: now), made once per state's items and
        catalogue version (an index's id never changes: states only grow), from the newest one: only new
        items and those whose record changed since are read. The replica makes each state's after its
        fold-in; the one before is kept for requests that still hold an older state."""
        state = state or self.fold.state
        n, version = state.known.n_items, state.records_applied
        for held in reversed(self._indexes):
            if held.n_items == n and held.version == version:
                return held
        newest = self._indexes[-1] if self._indexes else None
        if newest is not None and newest.n_items == n and newest.version > version:
            return newest  # an older state's items, with the catalogue as it is now
        with self._index_lock:
            newest = self._indexes[-1] if self._indexes else None
            base = (
                newest if newest is not None and newest.n_items <= n and newest.version <= version else None
            )
            changed: list[int] = []
            if base is not None and version > base.version:
                moved = [item for item, v in state.record_versions.items() if v > base.version]
                found = self.fold.item_indices(moved, state)
                changed = found[found >= 0].tolist()
            index = CatalogueIndex(self.catalogue(state), n, self.item_id, base, changed, version)
            if base is not None or newest is None:
                self._indexes = [*self._indexes[-1:], index]
        return index

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

    def user_ratings(self, user: int, state: OnlineState | None = None) -> list[tuple[str, float, bool]]:
        """The user's ratings in `state` (default: now) as (item id, rating, given online), by item index:
        the known ones (the artifact's and the online ones of items with an embedding) and the online ones
        of items without one yet."""
        state = state or self.fold.state
        known = state.known
        positions = known.by_row.of(user) if user < known.n_users else np.empty(0, dtype=np.int64)
        held = dict(zip(known.cols[positions].tolist(), known.values[positions].tolist(), strict=True))
        online = state.online.get(user, {})
        held.update(online)
        return [(self.item_id(j), float(v), j in online) for j, v in sorted(held.items())]

    def _calibrate(self, state: OnlineState) -> None:
        """The ski rental's first prices (`Costs`): one miss of 100 items and one row, timed (their
        answers thrown away), before the worker takes traffic."""
        items = np.arange(min(100, state.known.n_items), dtype=np.int64)
        start = time.perf_counter()
        if self._answer(state, 0, items) is None:
            self._predict(state, 0, items)
        self.costs.missed(len(items), time.perf_counter() - start)
        if self.rows.max_bytes > 0:
            self._row(state, 0, keep=False)

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
        # In seconds as this worker measured them, the ski rental compares like with like, whatever path
        # answers (`Costs`).
        costs = self.costs
        if row is None and self.rows.admit(state, user, costs.miss(len(items)), costs.row_price()):
            row = self._row(state, user)
            self._row_fill.inc()
        if row is None:
            start = time.perf_counter()
            answered = self._answer(state, user, items) or self._predict(state, user, items)
            costs.missed(len(items), time.perf_counter() - start)
            return answered
        # Each gather from a row is a cache miss per item (rows outgrow the CPU's caches): only what is read.
        fallback = row.fallback[items] if row.any_fallback else np.zeros(len(items), dtype=bool)
        return row.ratings[items], row.distributions(items) if distributions else None, fallback

    def _answer(
        self, state: OnlineState, user: int, items: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """`_predict` by the scorer's fused path (`Scorer.answer`: `exact` with clamped known entries), the
        same numbers in float64 at a fraction of the cost, or None where it has none."""
        with self._engine_lock:
            answered = state.scorer.answer(user, np.asarray(items, dtype=np.int64))
        if answered is None:
            return None
        dist, baseline = answered
        if baseline is not None:
            dist = baseline_mixture(dist, baseline, self.levels, state.scorer.baseline_weight)
        fallback = ~state.embedded[items]
        self._fall_back(state, user, items, fallback, dist)
        ratings = np.clip(expected_rating(dist, self.levels), self.levels[0], self.levels[-1])
        return ratings, dist, fallback

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

    def _row(self, state: OnlineState, user: int, keep: bool = True) -> UserRow:
        """The user's row in `state`, kept in the cache unless not `keep`."""
        items = np.arange(state.known.n_items, dtype=np.int64)
        fallback = ~state.embedded[items]
        scorer = state.scorer
        weight = 0.0
        # Unmixed: the expected rating of (1 - w) Q + w B is (1 - w) E[Q] + w clip(b), B's expectation,
        # so the row needs no mixed (items, p) array; reads of its distributions mix theirs. By the fused
        # path where the scorer has one (its whole-catalogue form: matrix products over whole lines).
        start = time.perf_counter()
        with self._engine_lock:
            answered = scorer.answer(user, items) if self.fused else None
            if answered is None:
                answered = scorer.unmixed(np.full(len(items), user, dtype=np.int64), items)
        dist, baseline = answered
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
        self.costs.filled(time.perf_counter() - start)
        if keep:
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
        self,
        user: int,
        items: np.ndarray,
        k: int,
        state: OnlineState | None = None,
        reveal: bool = False,
    ) -> list[dict[str, Any]]:
        """Each prediction's explanation (model/exact/explain.py) in `state` (default: now): the network's
        expected rating and the `k` known ratings that moved the prediction most. The user's own ratings
        are listed in `because` as {"user", "item", "rating", "effect"}; other users' are listed so only
        with `reveal` (the caller holds the write token), else grouped by item and rating in `others` as
        {"item", "rating", "users", "effect"} (the count and the summed effect: no user id). For an item
        without an embedding yet (answered by the bias baseline) a `reason` instead. Items are explained
        EXPLAIN_BYTES' worth at a time, the engine lock released in between. Raises
        model.exact.explain.CannotExplain when the mode cannot explain."""
        state = state or self.fold.state
        fallback = ~state.embedded[items]
        out: list[dict[str, Any]] = [{"reason": BASELINE_REASON} for _ in items]
        embedded = np.flatnonzero(~fallback)
        known = state.known
        chunk = max(1, EXPLAIN_BYTES // (16 * max(known.n_items, 1) * len(self.inferences)))
        found = []
        for start in range(0, max(len(embedded), 1), chunk):
            with self._engine_lock:
                found += state.scorer.explain(user, items[embedded[start : start + chunk]], k)
        for q, e in zip(embedded.tolist(), found, strict=True):
            because: list[dict[str, Any]] = []
            others: dict[tuple[str, float], dict[str, Any]] = {}
            for pos, effect in zip(e.known.tolist(), e.effects.tolist(), strict=True):
                rater, item, rating = (
                    int(known.rows[pos]),
                    self.item_id(int(known.cols[pos])),
                    float(known.values[pos]),
                )
                if rater == user or reveal:
                    because.append(
                        {"user": self.user_id(rater), "item": item, "rating": rating, "effect": effect}
                    )
                    continue
                group = others.setdefault(
                    (item, rating), {"item": item, "rating": rating, "users": 0, "effect": 0.0}
                )
                group["users"] += 1
                group["effect"] += effect
            out[q] = {"network": e.network, "because": because}
            if others:
                out[q]["others"] = sorted(others.values(), key=lambda g: -abs(g["effect"]))
        return out

    def similar_users(self, user: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k users with the highest scaled cosine s_r = (1 + cos) / 2 to `user`, best first (forgotten
        users never among them)."""
        state = self.fold.state
        return nearest(state.network.user_lifted, user, k, sorted(state.forgotten))

    def similar_items(
        self, item: int, k: int, allowed: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The k items with the highest scaled cosine s_c = (1 + cos) / 2 to `item`, best first; only
        `allowed` ones ((n_items,) bool) where given."""
        lifted = self.fold.state.network.item_lifted
        if allowed is None:
            return nearest(lifted, item, k)
        scores = lifted @ lifted[item]
        mask = np.zeros(len(scores), dtype=bool)
        n = min(len(scores), len(allowed))
        mask[:n] = allowed[:n]
        mask[item] = False
        top = top_k(scores, mask, k)
        return top, scores[top]
