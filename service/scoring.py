"""The scoring side of the service: the artifact's model, the embedding tiers and the ONNX branches.

Everything per model is prepared once at start-up (verified artifact, known-entry probabilities, the random
partitions of the inference setting with their similarity tables); a request then only looks up its
embeddings and runs the mean-field layers over the blocks its entries fall in.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any

import numpy as np

from model import exact
from model.artifact import Artifact
from model.config import EXACT_SETTINGS, ConfigError, InferenceConfig
from model.engine import OnnxNetwork, expected_rating, label_probabilities, predict_entries
from service.cache import EmbeddingStore, Kind, LocalTier, RedisTier
from service.metrics import Metrics
from service.settings import Settings

log = logging.getLogger(__name__)


class _Ratings:
    """The known ratings as compressed rows, to rebuild dense rating rows/columns for the ONNX branches."""

    def __init__(
        self, major: np.ndarray, minor: np.ndarray, values: np.ndarray, n_major: int, n_minor: int
    ) -> None:
        order = np.argsort(major, kind="stable")
        self.indptr = np.searchsorted(major[order], np.arange(n_major + 1))
        self.minor = minor[order]
        self.values = values[order].astype(np.float32)
        self.width = n_minor

    def dense(self, idx: np.ndarray) -> np.ndarray:
        """Dense rating vectors (0 = not rated) of the given rows: (b, width) float32."""
        out = np.zeros((len(idx), self.width), dtype=np.float32)
        for j, i in enumerate(idx):
            lo, hi = self.indptr[i], self.indptr[i + 1]
            out[j, self.minor[lo:hi]] = self.values[lo:hi]
        return out


INFERENCE_OVERRIDES = (
    "repeats",
    "subset_rows",
    "subset_cols",
    "seed",
    *(name for name in EXACT_SETTINGS if name != "gamma"),
)
"""Settings that override the artifact's InferenceConfig field of the same name (`gamma` is the model's)."""


def effective_inference(stored: InferenceConfig, settings: Settings) -> InferenceConfig:
    """The artifact's inference setting with the service's overrides applied."""
    changes: dict[str, Any] = {
        k: getattr(settings, k) for k in INFERENCE_OVERRIDES if getattr(settings, k) is not None
    }
    if settings.inference_mode is not None:
        changes["mode"] = settings.inference_mode
    return replace(stored, **changes)


def check_inference(inference: InferenceConfig, n_users: int, n_items: int) -> None:
    """Refuse, before any worker starts, a setting the model cannot run (ConfigError)."""
    if inference.mode != "exact":
        return
    tables = [("DCMC_CO_RATING", inference.co_rating, n_items, "items")]
    tables.append(("DCMC_CO_RATING_USER", inference.co_rating_user, n_users, "users"))
    for variable, weight, count, what in tables:
        if weight > 0:
            try:
                exact.check_co_rating_size(count, what)
            except ConfigError as exc:
                raise ConfigError(f"{exc} (set {variable}=0)") from None


class Scorer:
    """Answers rating and similarity queries for one artifact."""

    def __init__(self, artifact: Artifact, settings: Settings, metrics: Metrics) -> None:
        self.artifact = artifact
        self.version = artifact.model_version
        config = artifact.config
        overrides = (("mf_layers", settings.mf_layers), ("gamma", settings.gamma))
        model_changes = {k: v for k, v in overrides if v is not None}
        self.model_config = replace(config, **model_changes)
        self.inference = effective_inference(artifact.inference, settings)
        self.model = artifact.scoring_model(self.model_config)
        self.levels = artifact.levels
        self.onnx = OnnxNetwork(artifact.path, threads=settings.onnx_threads)
        n, m = len(artifact.users), len(artifact.items)
        self._by_user = _Ratings(artifact.train_rows, artifact.train_cols, artifact.train_values, n, m)
        self._by_item = _Ratings(artifact.train_cols, artifact.train_rows, artifact.train_values, m, n)
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
    def warm_up(self) -> None:
        """Per-model precomputation, so that no request pays for it."""
        start = time.perf_counter()
        if self.inference.mode == "paper" and self.model_config.mf_layers > 0:
            self.model.partitions(self.inference)
        if self.inference.mode == "exact" and self.model_config.mf_layers > 0:
            stored = self.model.has_field(self.inference)
            self.model.known_field(self.inference)
            log.info("known field of the exact mode %s", "read from the artifact" if stored else "computed")
            if self.inference.baseline > 0:
                self.model.biases(self.inference)
        log.info(
            "model %s ready in %.2fs (inference %s)",
            self.version,
            time.perf_counter() - start,
            self.inference,
        )

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
    def _compute(self, kind: Kind, idx: np.ndarray) -> np.ndarray:
        """Embeddings through the ONNX row/column branch from the known ratings: (b, d) float32."""
        with self._onnx_lock:
            if kind == "user":
                return self.onnx.embed_users(self._by_user.dense(idx))
            return self.onnx.embed_items(self._by_item.dense(idx))

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
            self.model.bilinear,
            np.zeros(k, dtype=np.int64),
            np.arange(k),
        )
        # One mean-field run at a time per worker: the batches are large numpy arrays, and threads running
        # them side by side thrash memory without adding throughput (workers use the cores).
        with self._engine_lock:
            dist = predict_entries(self.model, rows, items, self.inference, query_probs=probs)
        ratings = np.clip(expected_rating(dist, self.levels), self.levels[0], self.levels[-1])
        return ratings, dist

    def similar_users(self, user: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k users with the highest scaled cosine s_r = (1 + cos) / 2 to `user`, best first."""
        (vec,) = self.store.lookup([("user", np.array([user]))])
        unit = vec[0].astype(np.float64)
        unit = unit / max(float(np.linalg.norm(unit)), 1e-12)
        scores = (1.0 + self.model.user_unit @ unit) / 2.0  # (n,)
        scores[user] = -np.inf
        k = min(k, len(scores) - 1)
        top = np.argpartition(-scores, k - 1)[:k] if k > 0 else np.empty(0, dtype=np.int64)
        top = top[np.lexsort((top, -scores[top]))]  # by score, ties by index
        return top, scores[top]
