"""Per-worker caches of users' answers over the whole catalogue: `UserRows` (a model state's rows, bought
like a ski rental) and `UserParts` (the part of a user's answers that other users' ratings leave as it is,
valid across states). service/scoring.py reads and fills them."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from model.exact import RowParts, baseline_mixture
from model.online import OnlineState


@dataclass(frozen=True)
class UserRow:
    """One user's answers over the whole catalogue of one model state (read-only arrays)."""

    ratings: np.ndarray
    """(items,) expected ratings, clipped to the scale."""
    dist: np.ndarray
    """(items, p) label distributions: the CRF's alone where `baseline` is set (mixed when read)."""
    fallback: np.ndarray
    """(items,) bool: answered by the bias baseline (an item without an embedding yet)."""
    any_fallback: bool
    baseline: np.ndarray | None = None
    """(items,) the bias baseline's predictions that `distributions` mixes in (weight `weight`), or None
    when `dist` is final. A top-N reads `ratings` alone: the mixed (items, p) array is never made."""
    weight: float = 0.0
    levels: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        extra = 0 if self.baseline is None else self.baseline.nbytes
        return int(self.ratings.nbytes + self.dist.nbytes + self.fallback.nbytes + extra)

    def distributions(self, items: np.ndarray) -> np.ndarray:
        """The final label distributions of `items`: (K, p), a new array."""
        dist: np.ndarray = self.dist[items]
        if self.baseline is None or self.levels is None:
            return dist
        mix = ~self.fallback[items] if self.any_fallback else slice(None)  # fallback rows are final
        dist[mix] = baseline_mixture(dist[mix], self.baseline[items][mix], self.levels, self.weight)
        return dist


class UserRows:
    """Users' rows over the whole catalogue, least recently used first out, within `max_bytes`. A row costs
    the whole catalogue (17x a 100-item request on ML-100K). Every online rating moves every answer a
    little (the known field is global), so a row is exact for the state it was computed in; it answers in
    a later state only while `max_age_s` has not passed since its state was published and the user's own
    version (`OnlineState.user_version`: their ratings, their embedding, the items) is the same: other
    users' ratings reach a cached answer within `max_age_s`, the user's own at once. With `max_age_s` 0
    every answer is of the newest state, and a new state empties the cache.

    A row is computed as a ski rental buys (`admit`): once the user's misses have computed as many entries
    as the row holds (counted per state where rows last one state). A user who keeps coming back gets a
    row after a few requests, and a new one on the first miss after it aged out; when states last a
    fraction of a second and rows with them, misses stay cheaper than rows that would die unread."""

    def __init__(self, max_bytes: int, max_age_s: float = 0.0) -> None:
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._newest = -1  # `applied` of the newest state seen
        # user -> (its state's `applied`, the user's version there, the state's `published`, the row)
        self._rows: OrderedDict[int, tuple[int, tuple[int, int], float, UserRow]] = OrderedDict()
        self._missed: dict[int, int] = {}  # user -> entries its misses computed (in this state, at max_age 0)
        self._bytes = 0
        self._lock = threading.Lock()

    def _seen(self, state: OnlineState) -> bool:
        """Whether `state` is the newest seen, after moving on to it when it is newer (states only grow: a
        request still holding an older one neither counts misses nor keeps rows)."""
        if state.applied < self._newest:
            return False
        if state.applied > self._newest:
            self._newest = state.applied
            if self.max_age_s <= 0:
                self._rows.clear()
                self._missed.clear()
                self._bytes = 0
        return True

    def get(self, state: OnlineState, user: int, exact: bool = False) -> tuple[UserRow, bool] | None:
        """(the user's row that answers in `state`, whether it is of an earlier state) if held; `exact`:
        only a row of `state` itself."""
        with self._lock:
            held = self._rows.get(user)
            if held is None:
                return None
            applied, version, published, row = held
            if applied == state.applied:
                self._rows.move_to_end(user)
                return row, False
            if applied > state.applied or exact:
                return None
            if time.monotonic() - published <= self.max_age_s and version == state.user_version(user):
                self._rows.move_to_end(user)
                return row, True
            del self._rows[user]  # it answers in no later state either
            self._bytes -= row.nbytes
            if self.max_age_s > 0:  # a user whose row just aged out: the next miss buys a new one
                self._missed[user] = 1 << 62
            return None

    def admit(self, state: OnlineState, user: int, entries: int, size: int) -> bool:
        """Whether a miss of `user` in `state` that asks for `entries` should compute and keep the whole
        row of `size` entries instead: when the user's earlier misses and this one add up to the row's
        size (else this miss is counted and answered alone)."""
        if self.max_bytes <= 0:
            return False
        with self._lock:
            if not self._seen(state):
                return False
            spent = self._missed.get(user, 0) + entries
            if spent >= size:
                return True
            if len(self._missed) >= 1_000_000:  # bounded even under a scan of many users
                self._missed.clear()
            self._missed[user] = spent
            return False

    def put(self, state: OnlineState, user: int, row: UserRow) -> None:
        """Keep `row`, dropping the least recently used rows beyond `max_bytes` (not for a state older than
        the newest seen, nor a row larger than the whole budget)."""
        with self._lock:
            if row.nbytes > self.max_bytes or not self._seen(state):
                return
            held = self._rows.pop(user, None)
            if held is not None:
                self._bytes -= held[3].nbytes
            self._rows[user] = (state.applied, state.user_version(user), state.published, row)
            self._missed.pop(user, None)
            self._bytes += row.nbytes
            while self._bytes > self.max_bytes:
                _, old = self._rows.popitem(last=False)
                self._bytes -= old[3].nbytes

    def __len__(self) -> int:
        return len(self._rows)


class UserParts:
    """Users' `RowParts` (model/exact/scorer.py: the decoder's scores and the row terms over the whole
    catalogue), least recently used first out, within `max_bytes`. Unlike a `UserRows` row they outlive
    model states: each is kept with the user's version (`OnlineState.user_version`) and read while it
    holds, so a rating of another user leaves it valid. An answer from them reads the field and the column
    terms of its state anew (`ExactScorer.from_parts`)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._parts: OrderedDict[int, tuple[tuple[int, int], RowParts]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, state: OnlineState, user: int) -> tuple[RowParts | None, RowParts | None]:
        """(the user's parts if held and valid in `state`, else None; else the user's parts of an earlier
        state with the same items, which `ExactScorer.row_parts(previous=)` updates by the user's changed
        ratings, or None)."""
        with self._lock:
            held = self._parts.get(user)
            if held is None:
                return None, None
            version = state.user_version(user)
            if held[0] == version:
                self._parts.move_to_end(user)
                return held[1], None
            same_items = held[0][1] == version[1] and held[0][0] < version[0]
            return None, held[1] if same_items else None

    def put(self, state: OnlineState, user: int, parts: RowParts) -> None:
        """Keep the user's parts of `state` (replacing older ones), dropping the least recently used beyond
        `max_bytes`; not when the user's version moved on since `state`."""
        with self._lock:
            if parts.nbytes > self.max_bytes:
                return
            version = state.user_version(user)
            held = self._parts.pop(user, None)
            if held is not None:
                self._bytes -= held[1].nbytes
                if held[0] > version:  # a newer one is kept (states only grow)
                    self._parts[user] = held
                    self._bytes += held[1].nbytes
                    return
            self._parts[user] = (version, parts)
            self._bytes += parts.nbytes
            while self._bytes > self.max_bytes:
                _, (_, old) = self._parts.popitem(last=False)
                self._bytes -= old.nbytes

    def __len__(self) -> int:
        return len(self._parts)
