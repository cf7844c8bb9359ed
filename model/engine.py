"""Torch-free DCMC scoring: bilinear decoder, similarities, mean-field and the test-time procedure.

The offline evaluator and the online service both call `predict_entries`, so for the same inputs and
seed they return the same numbers. Shapes: n users, m items, d embedding size, p rating levels.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model.config import InferenceConfig, ModelConfig


def compatibility_matrix(levels: np.ndarray, tau: float) -> np.ndarray:
    """C[u, v] = min((L_u - L_v)^2, tau)."""
    diff = levels[:, None] - levels[None, :]
    return np.minimum(diff * diff, tau)


def normalize_rows(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (zero rows stay zero)."""
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norm, 1e-12)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax."""
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def label_probabilities(
    user_emb: np.ndarray, item_emb: np.ndarray, bilinear: np.ndarray, rows: np.ndarray, cols: np.ndarray
) -> np.ndarray:
    """P(M_ij = L_u) for the entries (rows[k], cols[k]): (K, p)."""
    out = np.empty((len(rows), bilinear.shape[0]), dtype=np.float64)
    step = 8192  # bounds the (chunk, p, d) temporary
    for start in range(0, len(rows), step):
        r, c = rows[start : start + step], cols[start : start + step]
        ub = np.einsum("kd,pde->kpe", user_emb[r], bilinear)  # (k, p, d)
        scores = np.einsum("kpe,ke->kp", ub, item_emb[c])  # (k, p)
        out[start : start + step] = softmax(scores)
    return out


def mean_field(
    probs: np.ndarray, sim: np.ndarray, compat: np.ndarray, gamma: float, layers: int
) -> np.ndarray:
    """T mean-field iterations: Q <- softmax(-(Phi + gamma S (Q C^T))), Phi = -ln P. Returns (K, p)."""
    unary = -np.log(np.maximum(probs, 1e-30))  # (K, p)
    q = probs
    for _ in range(layers):
        messages = sim @ (q @ compat.T)  # (K, p)
        q = softmax(-(unary + gamma * messages))
    return q


@dataclass
class ScoringModel:
    """What test-time inference needs: embeddings, decoder weights and the known ratings."""

    config: ModelConfig
    user_emb: np.ndarray  # (n, d) float64
    item_emb: np.ndarray  # (m, d) float64
    bilinear: np.ndarray  # (p, d, d) float64
    known_rows: np.ndarray  # (N,) int64
    known_cols: np.ndarray  # (N,) int64

    def __post_init__(self) -> None:
        self.levels = np.asarray(self.config.levels, dtype=np.float64)
        self.compat = compatibility_matrix(self.levels, self.config.tau)
        self.user_unit = normalize_rows(self.user_emb)
        self.item_unit = normalize_rows(self.item_emb)
        self._known_probs: np.ndarray | None = None

    @property
    def known_probs(self) -> np.ndarray:
        """Base-network probabilities of every known entry, computed once: (N, p)."""
        if self._known_probs is None:
            self._known_probs = label_probabilities(
                self.user_emb, self.item_emb, self.bilinear, self.known_rows, self.known_cols
            )
        return self._known_probs

    def probabilities(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Base-network probabilities of arbitrary entries: (K, p)."""
        return label_probabilities(self.user_emb, self.item_emb, self.bilinear, rows, cols)

    def entry_similarity(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """s(k, l) = s_r(i_k, i_l) s_c(j_k, j_l) with scaled cosines: (K, K)."""
        u = self.user_unit[rows]
        v = self.item_unit[cols]
        return ((1.0 + u @ u.T) / 2.0) * ((1.0 + v @ v.T) / 2.0)


def _partition(size: int, subset: int, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """Random partition of range(size) into groups of `subset`: (group of each index, number of groups)."""
    group = np.empty(size, dtype=np.int64)
    group[rng.permutation(size)] = np.arange(size) // subset
    return group, -(-size // subset)


def predict_entries(
    model: ScoringModel, rows: np.ndarray, cols: np.ndarray, inference: InferenceConfig
) -> np.ndarray:
    """Final label distributions of the queried entries (rows[k], cols[k]): (K, p).

    `none`: the base network's probabilities. `paper`: rows and columns are split at random into
    subsets; in each block (row subset x column subset) that holds a query, a CRF over the block's
    known entries and its queried entries runs the mean-field layers; the distributions from
    `inference.repeats` random partitions are averaged.
    """
    rows = np.asarray(rows, dtype=np.int64)
    cols = np.asarray(cols, dtype=np.int64)
    query_probs = model.probabilities(rows, cols)
    if inference.mode == "none" or model.config.mf_layers == 0 or len(rows) == 0:
        return query_probs
    cfg = model.config
    known_probs = model.known_probs
    n, m = len(model.user_emb), len(model.item_emb)
    rng = np.random.default_rng(inference.seed)
    total = np.zeros_like(query_probs)
    for _ in range(inference.repeats):
        row_group, _ = _partition(n, inference.subset_rows, rng)
        col_group, n_col_groups = _partition(m, inference.subset_cols, rng)
        known_block = row_group[model.known_rows] * n_col_groups + col_group[model.known_cols]
        query_block = row_group[rows] * n_col_groups + col_group[cols]
        known_order = np.argsort(known_block, kind="stable")
        known_sorted = known_block[known_order]
        query_order = np.argsort(query_block, kind="stable")
        blocks, starts = np.unique(query_block[query_order], return_index=True)
        ends = np.append(starts[1:], len(query_order))
        lo = np.searchsorted(known_sorted, blocks, side="left")
        hi = np.searchsorted(known_sorted, blocks, side="right")
        for b in range(len(blocks)):
            known = known_order[lo[b] : hi[b]]
            queries = query_order[starts[b] : ends[b]]
            node_rows = np.concatenate([model.known_rows[known], rows[queries]])
            node_cols = np.concatenate([model.known_cols[known], cols[queries]])
            probs = np.concatenate([known_probs[known], query_probs[queries]])
            sim = model.entry_similarity(node_rows, node_cols)
            final = mean_field(probs, sim, model.compat, cfg.gamma, cfg.mf_layers)
            total[queries] += final[len(known) :]
    return total / inference.repeats


def expected_rating(probs: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """R* = sum_u L_u P_u: (K,)."""
    return probs @ levels


class OnnxNetwork:
    """The exported base network run by ONNX Runtime: row branch, column branch and decoder."""

    FILES = ("row_branch.onnx", "col_branch.onnx", "decoder.onnx")

    def __init__(self, directory: str | Path, threads: int = 1) -> None:
        import onnxruntime as ort  # imported here so pure-numpy users of this module do not need it

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        providers = ["CPUExecutionProvider"]
        directory = Path(directory)
        self.row = ort.InferenceSession(str(directory / self.FILES[0]), opts, providers=providers)
        self.col = ort.InferenceSession(str(directory / self.FILES[1]), opts, providers=providers)
        self.decoder = ort.InferenceSession(str(directory / self.FILES[2]), opts, providers=providers)

    def embed_users(self, rating_rows: np.ndarray) -> np.ndarray:
        """User embeddings from dense rating rows: (b, m) -> (b, d) float32."""
        return self.row.run(None, {"ratings": rating_rows.astype(np.float32)})[0]

    def embed_items(self, rating_cols: np.ndarray) -> np.ndarray:
        """Item embeddings from dense rating columns: (b, n) -> (b, d) float32."""
        return self.col.run(None, {"ratings": rating_cols.astype(np.float32)})[0]

    def probabilities(self, user_emb: np.ndarray, item_emb: np.ndarray) -> np.ndarray:
        """Label probabilities of paired embeddings: (K, d), (K, d) -> (K, p) float32."""
        feeds = {"user": user_emb.astype(np.float32), "item": item_emb.astype(np.float32)}
        return self.decoder.run(None, feeds)[0]
