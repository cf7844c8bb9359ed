"""The scoring side of the service: the artifact's model with every online rating folded in.

Everything per model is prepared once at start-up: the verified artifact and the scorer of its inference
mode (model/scorers.py: the `paper` mode's partitions, or the `exact` mode's known field and tables). The
online ratings (service/online.py, in Redis) are then replayed and followed: each one updates this
worker's model (model/online.py). A request reads the current model state once and scores its entries.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import numpy as np
import redis

from model.artifact import Artifact
from model.config import InferenceConfig
from model.engine import OnnxNetwork, expected_rating, label_probabilities
from model.exact import level_distribution
from model.ids import UnknownIdError
from model.online import FoldIn
from model.ratings import Ratings
from model.scorers import check_inference
from model.types import Array
from service.metrics import Metrics
from service.online import Durability, Entry, Follower, RatingLog
from service.settings import Settings, inference_overrides

log = logging.getLogger(__name__)


def effective_inference(stored: InferenceConfig, settings: Settings) -> InferenceConfig:
    """The artifact's inference setting with the service's overrides (DCMC_INFERENCE__...) applied."""
    return stored.with_overrides(inference_overrides(settings))


def nearest(unit: np.ndarray, row: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k rows of `unit` other than `row` with the highest scaled cosine (1 + cos) / 2 to it, best
    first, ties by index (at the cut too): (indices, scores)."""
    scores = (1.0 + unit @ unit[row]) / 2.0
    scores[row] = -np.inf
    k = min(k, len(scores) - 1)
    if k <= 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float64)
    cut = -np.partition(-scores, k - 1)[k - 1]  # the k-th best score
    above = np.flatnonzero(scores > cut)
    tied = np.flatnonzero(scores == cut)[: k - len(above)]  # the lowest indices among those at the cut
    top = np.concatenate([above, tied])
    top = top[np.lexsort((top, -scores[top]))]  # by score, ties by index
    return top, scores[top]


class Scorer:
    """Answers rating and similarity queries for one artifact, and takes ratings online."""

    def __init__(self, artifact: Artifact, settings: Settings, metrics: Metrics) -> None:
        self.artifact = artifact
        self.version = artifact.model_version
        self.model_config = artifact.config
        self.inference = effective_inference(artifact.inference, settings)
        check_inference(self.inference, self.model_config)
        self.levels = artifact.levels
        self.metrics = metrics
        self.onnx = OnnxNetwork(artifact.path, threads=settings.onnx_threads)
        self._onnx_lock = threading.Lock()
        self._engine_lock = threading.Lock()
        # Per-model precomputation (the mode's scorer: partitions, known field, tables), once, here.
        start = time.perf_counter()
        self.fold = FoldIn(artifact, self.inference, self._embed_rows, self._embed_cols)
        source = getattr(self.fold.state.scorer, "field_source", None)
        log.info(
            "model %s ready in %.2fs (inference %s%s)",
            self.version,
            time.perf_counter() - start,
            self.inference.mode,
            f", known field {source}" if source else "",
        )
        self.retry_s = settings.redis_retry_s
        self.ratings: RatingLog | None = None
        self.follower: Follower | None = None
        self.durability = Durability(False, "no Redis configured (REDIS_URL): online ratings are off")
        self.replayed = settings.redis_url is None
        self._last_probe = 0.0
        if settings.redis_url:
            self.ratings = RatingLog(settings.redis_url, settings.redis_key_prefix, settings.redis_timeout_s)
            self.follower = Follower(self.ratings, self._apply, metrics, settings.redis_retry_s)

    # -- start-up and shutdown ---------------------------------------------------------------------------
    def start(self) -> None:
        """Replay the online ratings since the artifact, then follow the stream. When Redis is down the
        replay is retried by the follower, and /ready answers 503 until it has succeeded."""
        if self.ratings is None or self.follower is None:
            return
        try:
            self.durability = self.ratings.durability()
            count = self.follower.catch_up()
            self.replayed = True
            log.info("replayed %d online ratings", count)
        except redis.RedisError as exc:
            log.error("cannot replay the online ratings yet (%s); not ready until Redis answers", exc)
        if not self.durability.durable:
            log.warning("Redis is not durable: %s", self.durability.detail)
        self.follower.start()

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

    def _apply(self, entries: list[Entry]) -> None:
        """Fold stream entries into the model (the follower calls it, in stream order)."""
        # No engine lock: requests go on with the state they took while the next one is built.
        self.fold.apply([(e.user, e.item, e.rating) for e in entries])
        if not self.replayed and self.follower is not None and self.follower.healthy:
            self.replayed = True

    def write(self, ratings: Sequence[tuple[str, str, float]]) -> str:
        """Store a batch of (user, item, rating) durably in Redis (one transaction), then fold it in here;
        returns the stream id of its last rating. Raises redis.RedisError (nothing stored) or
        RuntimeError when online ratings are off."""
        if self.ratings is None or self.follower is None:
            raise RuntimeError("online ratings need Redis: set REDIS_URL")
        last = self.ratings.append(ratings)
        self.metrics.ratings_written.inc(len(ratings))
        try:
            self.follower.catch_up()  # this worker answers with the batch from now on
        except redis.RedisError as exc:  # stored: the follower applies it once Redis answers again
            log.warning("rating batch stored but not yet applied here (%s)", exc)
        return last

    # -- queries -----------------------------------------------------------------------------------------
    def user_index(self, user: str) -> int:
        """The internal index of an external user id: the artifact's users, then those that arrived online
        (UnknownIdError for a user without any rating)."""
        index = self.fold.user_index(user)
        if index is None:
            raise UnknownIdError("user", [user])
        return index

    def user_id(self, index: int) -> str:
        """The external id of a user index."""
        return self.fold.user_id(index)

    def item_indices(self, items: Sequence[str]) -> np.ndarray:
        """Internal indices of external item ids: the artifact's items, then those first rated online
        (UnknownIdError listing every unknown one, in request order)."""
        found = [self.fold.item_index(item) for item in items]
        missing = [item for item, j in zip(items, found, strict=True) if j is None]
        if missing:
            raise UnknownIdError("item", list(dict.fromkeys(missing)))
        return np.array(found, dtype=np.int64)

    def item_id(self, index: int) -> str:
        """The external id of an item index."""
        return self.fold.item_id(index)

    @property
    def known(self) -> Ratings:
        """The known ratings of the current state: the artifact's training and held-out ratings, then the
        online ones of items with an embedding (a re-rating replaces the earlier one)."""
        return self.fold.state.known

    @property
    def n_items(self) -> int:
        """Items known so far (the artifact's, then new ones)."""
        return self.fold.state.known.n_items

    def online_count(self, user: int) -> int:
        """How many of the user's ratings arrived online (and are folded in)."""
        return self.fold.online_count(user)

    def rated_items(self, user: int) -> np.ndarray:
        """The items `user` has rated (training, held-out and online ratings): sorted item indices."""
        known = self.fold.state.known
        online = np.fromiter(self.fold.online_items(user), dtype=np.int64)
        return np.union1d(known.cols[known.by_row.of(user)], online)

    def predict(self, user: int, items: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Expected ratings (K,), label distributions (K, p) of (user, items[k]), and which of them come
        from the bias baseline (new items not embedded yet) rather than the model: (K,) bool."""
        state = self.fold.state  # one consistent model for the whole request
        fallback = ~state.embedded[items]
        k = len(items)
        rows = np.full(k, user, dtype=np.int64)
        probs = label_probabilities(
            state.network.user_emb, state.network.item_emb, state.network.bilinear, rows, items
        )
        # One mean-field run at a time per worker: the batches are large numpy arrays, and threads running
        # them side by side thrash memory without adding throughput (workers use the cores).
        with self._engine_lock:
            dist = state.scorer.predict(rows, items, probs)
        if fallback.any():
            dist[fallback] = level_distribution(state.baseline(user, items[fallback]), self.levels)
        ratings = np.clip(expected_rating(dist, self.levels), self.levels[0], self.levels[-1])
        return ratings, dist, fallback

    def similar_users(self, user: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k users with the highest scaled cosine s_r = (1 + cos) / 2 to `user`, best first."""
        return nearest(self.fold.state.network.user_unit, user, k)

    def similar_items(self, item: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k items with the highest scaled cosine s_c = (1 + cos) / 2 to `item`, best first."""
        return nearest(self.fold.state.network.item_unit, item, k)
