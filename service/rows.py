"""The per-worker cache of users' answers over the whole catalogue: `UserRows` (a model state's rows, bought
like a ski rental) and `Costs` (the prices it buys at, measured). service/scoring.py reads and fills it."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from model.exact import baseline_mixture
from model.online import OnlineState

MISS_FIXED_ITEMS = 40
"""What a miss costs besides its items, in items' worth, for the ski rental's estimate of a miss from the
measured ones (`Costs`): on ML-100K in process (two settings averaged, the fused path) 10 items 0.11 ms
and 100 items 0.30 ms, so about 2.1 us an item and 0.085 ms (~40 items) a call."""


class Costs:
    """What this worker's misses and rows have cost lately, measured (moving averages of seconds): the
    ski rental's prices (`UserRows.admit`), whatever the machine, the artifact and the path that answered.
    A miss is estimated per item (with MISS_FIXED_ITEMS for its fixed part); until one is measured, a
    row is priced as 17 misses of 100 items."""

    def __init__(self, per_item: float = 0.0, row: float = 0.0, learning: bool = True) -> None:
        self.per_item = per_item  # seconds a miss costs per item (MISS_FIXED_ITEMS more a call)
        self.row = row  # seconds a row costs
        self.learning = learning
        """Whether measured misses and rows move the prices (set prices stay: a test's)."""

    def miss(self, items: int) -> float:
        """The estimated seconds of a miss asking for `items`."""
        return self.per_item * (items + MISS_FIXED_ITEMS)

    def row_price(self) -> float:
        """The estimated seconds of a row over the catalogue."""
        return self.row if self.row > 0 else self.per_item * 17 * (100 + MISS_FIXED_ITEMS)

    def missed(self, items: int, seconds: float) -> None:
        """Count a measured miss."""
        if not self.learning:
            return
        rate = seconds / (items + MISS_FIXED_ITEMS)
        self.per_item = rate if self.per_item <= 0 else 0.95 * self.per_item + 0.05 * rate

    def filled(self, seconds: float) -> None:
        """Count a measured row."""
        if not self.learning:
            return
        self.row = seconds if self.row <= 0 else 0.9 * self.row + 0.1 * seconds


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

    A row is computed as a ski rental buys (`admit`): once the user's misses have cost what the row costs
    (counted per state where rows last one state; never on the first miss), or on the user's second miss
    (a return: the first was counted) while rows pay back: while the rows that ended lately (aged out,
    dropped by the budget, of an old state, replaced) had, over their lives, hits that saved what a row
    costs (each hit about a miss).
    Until PAYBACK_ROWS rows have ended, a return buys one unless the budget has dropped a row. A user who
    keeps coming back gets a row on the second request, and a new one on the first miss after it aged
    out; when rows die unread (states that last a fraction of a second, a budget that holds a few rows of
    a large catalogue), their lifetime hits fall and rows wait for the misses to cost what they do.
    """

    PAYBACK_ROWS = 32
    """Rows that ended before their lifetime hits decide whether a return buys one (and the window their
    counts are halved over)."""

    def __init__(self, max_bytes: int, max_age_s: float = 0.0) -> None:
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._newest = -1  # `applied` of the newest state seen
        # user -> (its state's `applied`, the user's version there, the state's `published`, the row)
        self._rows: OrderedDict[int, tuple[int, tuple[int, int], float, UserRow]] = OrderedDict()
        self._hits: dict[int, int] = {}  # user -> hits of the row held
        self._missed: dict[int, float] = {}  # user -> what its misses cost (in this state, at max_age 0)
        self._bytes = 0
        self._lock = threading.Lock()
        self._ended = 0.0  # rows that ended and their lifetime hits, halved every PAYBACK_ROWS past 2x
        self._ended_hits = 0.0
        self._evicted = False  # whether the budget ever dropped a row

    def _take(self, user: int) -> None:
        """Take `user`'s held row out, counting its end with its lifetime hits."""
        _, _, _, row = self._rows.pop(user)
        self._bytes -= row.nbytes
        self._ended += 1
        self._ended_hits += self._hits.pop(user, 0)
        if self._ended >= 2 * self.PAYBACK_ROWS:  # the recent rows count most
            self._ended /= 2
            self._ended_hits /= 2

    def _pays_back(self, cost: float, row_cost: float) -> bool:
        """Whether rows that ended lately had hits that saved what a row costs (misses of `cost` each);
        before PAYBACK_ROWS ended, yes unless the budget already dropped a row (a few rows of a large
        catalogue)."""
        if self._ended < self.PAYBACK_ROWS:
            return not self._evicted
        return self._ended_hits / self._ended * cost >= row_cost

    @property
    def hits_per_row(self) -> float:
        """Hits rows that ended lately had over their lives, on average (0 before PAYBACK_ROWS ended)."""
        return self._ended_hits / self._ended if self._ended >= self.PAYBACK_ROWS else 0.0

    def _seen(self, state: OnlineState) -> bool:
        """Whether `state` is the newest seen, after moving on to it when it is newer (states only grow: a
        request still holding an older one neither counts misses nor keeps rows)."""
        if state.applied < self._newest:
            return False
        if state.applied > self._newest:
            self._newest = state.applied
            if self.max_age_s <= 0:
                for user in list(self._rows):
                    self._take(user)
                self._missed.clear()
        return True

    def get(self, state: OnlineState, user: int, exact: bool = False) -> tuple[UserRow, bool] | None:
        """(the user's row that answers in `state`, whether it is of an earlier state) if held; `exact`:
        only a row of `state` itself."""
        with self._lock:
            held = self._rows.get(user)
            if held is None:
                return None
            applied, version, published, row = held
            if applied > state.applied or (exact and applied != state.applied):
                return None
            earlier = applied != state.applied
            if not earlier or (
                time.monotonic() - published <= self.max_age_s and version == state.user_version(user)
            ):
                self._rows.move_to_end(user)
                self._hits[user] = self._hits.get(user, 0) + 1
                return row, earlier
            self._take(user)  # it answers in no later state either
            if self.max_age_s > 0:  # a user whose row just aged out: the next miss buys a new one
                self._missed[user] = 1 << 62
            return None

    def admit(self, state: OnlineState, user: int, cost: float, row_cost: float) -> bool:
        """Whether a miss of `user` in `state` that costs `cost` should compute and keep the whole row,
        which costs `row_cost` (in one unit: seconds, or entries), instead: when the user's earlier misses
        and this one add up to the row's cost, or this is the user's second miss while rows pay back
        (`UserRows`); else this miss is counted and answered alone."""
        if self.max_bytes <= 0:
            return False
        with self._lock:
            if not self._seen(state):
                return False
            earlier = self._missed.get(user)  # None: a first miss (a user seen once may never come back)
            if earlier is not None and (earlier + cost >= row_cost or self._pays_back(cost, row_cost)):
                return True
            if len(self._missed) >= 1_000_000:  # bounded even under a scan of many users
                self._missed.clear()
            self._missed[user] = (earlier or 0) + cost
            return False

    def put(self, state: OnlineState, user: int, row: UserRow) -> None:
        """Keep `row`, dropping the least recently used rows beyond `max_bytes` (not for a state older than
        the newest seen, nor a row larger than the whole budget)."""
        with self._lock:
            if row.nbytes > self.max_bytes or not self._seen(state):
                return
            if user in self._rows:
                self._take(user)
            self._rows[user] = (state.applied, state.user_version(user), state.published, row)
            self._missed.pop(user, None)
            self._bytes += row.nbytes
            while self._bytes > self.max_bytes:
                self._take(next(iter(self._rows)))  # the least recently used
                self._evicted = True

    def __len__(self) -> int:
        return len(self._rows)
