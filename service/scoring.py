"""The scoring side of the service: the artifact's model, the embedding tiers and the ONNX branches.

Everything per model is prepared once at start-up: the verified artifact and the scorer of its inference
mode (model/scorers.py: the `paper` mode's partitions, or the `exact` mode's known field and tables). A
request then only looks up its embeddings and runs the scorer on its entries.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from model.artifact import Artifact
from model.config import InferenceConfig
from model.engine import OnnxNetwork, expected_rating, label_probabilities
from model.scorers import artifact_scorer, check_inference
from service.cache import EmbeddingStore, Kind, LocalTier, RedisTier
from service.metrics import Metrics
from service.settings import Settings, inference_overrides

log = logging.getLogger(__name__)


def effective_inference(stored: InferenceConfig, settings: Settings) -> InferenceConfig:
    """The artifact's inference setting with the service's overrides (DCMC_INFERENCE__...) applied."""
    return stored.with_overrides(inference_overrides(settings))


class Scorer:
    """Answers rating and similarity queries for one artifact."""

    def __init__(self, artifact: Artifact, settings: Settings, metrics: Metrics) -> None:
        self.artifact = artifact
        self.version = artifact.model_version
        self.model_config = artifact.config
        self.inference = effective_inference(artifact.inference, settings)
        check_inference(self.inference, self.model_config)
        self.levels = artifact.levels
        self.onnx = OnnxNetwork(artifact.path, threads=settings.onnx_threads)
        # Per-model precomputation (the mode's scorer: partitions, known field, tables), once, here.
        start = time.perf_counter()
        self.network, self.crf = artifact_scorer(artifact, self.inference)
        source = getattr(self.crf, "field_source", None)
        log.info(
            "model %s ready in %.2fs (inference %s%s)",
            self.version,
            time.perf_counter() - start,
            self.inference.mode,
            f", known field {source}" if source else "",
        )
        self._onnx_lock = threading.Lock()
        self._engine_lock = threading.Lock()
        self._last_probe = 0.0
        shared = None
        if settings.redis_url:
            shared = RedisTier(
                settings.redis_url,
                prefix=settings.redis_key_prefix,
                version=self.version,
                dim=self.model_config.embedding_dim,
                timeout_s=settings.redis_timeout_s,
                retry_s=settings.redis_retry_s,
                metrics=metrics,
            )
            shared.on_recover = self._populate_in_background
        self.store = EmbeddingStore(
            LocalTier(settings.local_cache_size),
            shared,
            {"user": artifact.users.ids, "item": artifact.items.ids},
            self._compute,
            metrics,
        )

    # -- start-up ----------------------------------------------------------------------------------------
    def populate(self) -> str:
        """Seed the tiers: Redis gets every embedding (once per version), else the local tier does."""
        tables: dict[Kind, tuple[list[str], np.ndarray]] = {
            "user": (self.artifact.users.ids, self.artifact.user_embeddings),
            "item": (self.artifact.items.ids, self.artifact.item_embeddings),
        }
        if self.store.shared is None:
            local = self.store.local
            for kind, (ids, table) in tables.items():
                room = max(0, local.capacity - len(local))
                local.put_many([((kind, i), table[i]) for i in range(min(len(ids), room))])
            return "local"
        return self.store.shared.populate(tables)

    def _populate_in_background(self) -> None:
        threading.Thread(target=self.populate, name="redis-populate", daemon=True).start()

    def redis_state(self) -> str:
        """`disabled` (no REDIS_URL), `ok` or `down` (probed again when down)."""
        shared = self.store.shared
        if shared is None:
            return "disabled"
        if time.monotonic() - self._last_probe >= shared.retry_s:  # at most one PING per retry interval
            self._last_probe = time.monotonic()
            shared.ping()
        return "ok" if shared.healthy else "down"

    def close(self) -> None:
        """Release Redis connections."""
        if self.store.shared is not None:
            self.store.shared.close()

    # -- queries -----------------------------------------------------------------------------------------
    def user_index(self, user: str) -> int:
        """The internal index of an external user id (UnknownIdError when the service knows no such user)."""
        return self.artifact.users.index(user)

    def rated_items(self, user: int) -> np.ndarray:
        """The items `user` has rated (training, held-out and online ratings): sorted item indices."""
        known = self.artifact.known()
        return np.unique(known.cols[known.by_row.of(user)])

    def _compute(self, kind: Kind, idx: np.ndarray) -> np.ndarray:
        """Embeddings through the ONNX row/column branch from the known ratings: (b, d) float32."""
        with self._onnx_lock:
            if kind == "user":
                return self.onnx.embed_users(self.artifact.train.dense_rows(idx))
            return self.onnx.embed_items(self.artifact.train.dense_cols(idx))

    def predict(self, user: int, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Expected ratings (K,) and label distributions (K, p) of (user, items[k])."""
        user_vec, item_vecs = self.store.lookup([("user", np.array([user])), ("item", items)])
        k = len(items)
        rows = np.full(k, user, dtype=np.int64)
        # The query's base-network probabilities come from the cached embeddings (float32 -> float64, the
        # same numbers the offline evaluator reads from the artifact's tables).
        probs = label_probabilities(
            user_vec.astype(np.float64),
            item_vecs.astype(np.float64),
            self.network.bilinear,
            np.zeros(k, dtype=np.int64),
            np.arange(k),
        )
        # One mean-field run at a time per worker: the batches are large numpy arrays, and threads running
        # them side by side thrash memory without adding throughput (workers use the cores).
        with self._engine_lock:
            dist = self.crf.predict(rows, items, probs)
        ratings = np.clip(expected_rating(dist, self.levels), self.levels[0], self.levels[-1])
        return ratings, dist

    def similar_users(self, user: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k users with the highest scaled cosine s_r = (1 + cos) / 2 to `user`, best first."""
        (vec,) = self.store.lookup([("user", np.array([user]))])
        unit = vec[0].astype(np.float64)
        unit = unit / max(float(np.linalg.norm(unit)), 1e-12)
        scores = (1.0 + self.network.user_unit @ unit) / 2.0  # (n,)
        scores[user] = -np.inf
        k = min(k, len(scores) - 1)
        top = np.argpartition(-scores, k - 1)[:k] if k > 0 else np.empty(0, dtype=np.int64)
        top = top[np.lexsort((top, -scores[top]))]  # by score, ties by index
        return top, scores[top]
