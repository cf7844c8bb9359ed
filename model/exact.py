"""Exact mean-field messages over every known entry in linear time (numpy).

With unit embeddings, the scaled cosine is an inner product of lifted vectors:
(1 + u_i . u_i') / 2 = a_i . a_i' with a_i = [1, u_i] / sqrt(2) (D = d + 1 numbers), and likewise
s_c(j, j') = b_j . b_j'. So for nodes k = (i, j) and l = (i', j'),

    s(k, l) = (a_i . a_i') (b_j . b_j')   and   m_k[u] = sum_l s(k, l) Q'_l[u] = a_i^T G_u b_j,

with G_u = sum_l Q'_l[u] a_{i_l} b_{j_l}^T, a D x D matrix per level. Building every G_u costs
O(K D p + n D^2 p) and reading one message O(D^2 p) per distinct user plus O(D p) per entry, instead of the
O(K^2 p) of the dense similarity matrix. Nothing is approximated: the sums run over every node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

Scaling = Literal["sum", "scaled", "normalized"]
KnownMode = Literal["predicted", "clamped"]


def lift(unit: np.ndarray) -> np.ndarray:
    """a = [1, u] / sqrt(2) for unit rows u, so that a . a' = (1 + u . u') / 2: (n, d) -> (n, d + 1)."""
    return np.hstack([np.ones((len(unit), 1)), unit]) / np.sqrt(2.0)


class FactorizedGraph:
    """A fully connected CRF over the nodes (rows[k], cols[k]) with s(k, l) = (a_i . a_i') (b_j . b_j')."""

    def __init__(self, a: np.ndarray, b: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> None:
        self.a, self.b = a, b  # (n, D), (m, D)
        self.rows, self.cols = rows, cols
        # Nodes sorted by user, so a sum over each user's nodes is one np.add.reduceat.
        self.order = np.argsort(rows, kind="stable")
        sorted_rows = rows[self.order]
        self.starts = np.flatnonzero(np.r_[True, sorted_rows[1:] != sorted_rows[:-1]]) if len(rows) else []
        self.users = sorted_rows[self.starts] if len(rows) else np.empty(0, dtype=np.int64)
        self.a_users = a[self.users]  # (distinct users, D)
        self.b_nodes = b[cols[self.order]]  # (K, D), in user order

    def aggregate(self, weights: np.ndarray) -> np.ndarray:
        """G_u = sum_l weights[l, u] a_{i_l} b_{j_l}^T for every column u of weights (K, p): (p, D, D)."""
        out = np.zeros((weights.shape[1], self.a.shape[1], self.b.shape[1]))
        if len(self.rows) == 0:
            return out
        w = weights[self.order]
        for u in range(weights.shape[1]):
            per_user = np.add.reduceat(w[:, u, None] * self.b_nodes, self.starts, axis=0)  # (users, D)
            out[u] = self.a_users.T @ per_user
        return out

    def total(self) -> np.ndarray:
        """H = sum_l a_{i_l} b_{j_l}^T, so that sum_l s(k, l) = a_i^T H b_j: (D, D)."""
        return self.aggregate(np.ones((len(self.rows), 1)))[0]


def read_messages(
    g: np.ndarray, a: np.ndarray, b: np.ndarray, rows: np.ndarray, cols: np.ndarray
) -> np.ndarray:
    """m[k, u] = a_{rows[k]}^T G_u b_{cols[k]}: (K, p)."""
    users, inverse = np.unique(rows, return_inverse=True)
    ag = np.einsum("id,ude->iue", a[users], g)  # (distinct users, p, D)
    return np.einsum("kue,ke->ku", ag[inverse], b[cols])


def normalizer(h: np.ndarray, a: np.ndarray, b: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """sum_l s(k, l) for the entries (rows[k], cols[k]): (K,)."""
    return read_messages(h[None], a, b, rows, cols)[:, 0]


def dense_similarity(a: np.ndarray, b: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """The K x K similarity matrix the factorisation avoids (tests and small graphs only)."""
    return (a[rows] @ a[rows].T) * (b[cols] @ b[cols].T)


@dataclass(frozen=True)
class KnownField:
    """The converged messages of the known entries: what a query needs, precomputable per model version.

    g: (p, D, D) per-level aggregates of the known entries' compatibility-transformed distributions;
    h: (D, D) aggregate of ones (the normaliser); scale: the constant factor of the `scaled` mode.
    """

    g: np.ndarray
    h: np.ndarray
    scaling: str
    scale: float


def softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis."""
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def scaled_messages(
    g: np.ndarray,
    h: np.ndarray,
    scaling: str,
    scale: float,
    a: np.ndarray,
    b: np.ndarray,
    rows: np.ndarray,
    cols: np.ndarray,
) -> np.ndarray:
    """Messages to (rows, cols) under a scaling: `sum` as is, `scaled` times `scale`, `normalized` divided
    by sum_l s(k, l): (K, p)."""
    msg = read_messages(g, a, b, rows, cols)
    if scaling == "scaled":
        return msg * scale
    if scaling == "normalized":
        return msg / np.maximum(normalizer(h, a, b, rows, cols), 1e-12)[:, None]
    return msg


def known_field(
    a: np.ndarray,
    b: np.ndarray,
    known_rows: np.ndarray,
    known_cols: np.ndarray,
    known_probs: np.ndarray,
    known_labels: np.ndarray,
    compat: np.ndarray,
    gamma: float,
    layers: int,
    scaling: str,
    scale: float,
    known: str,
) -> KnownField:
    """Run the mean-field layers over all known entries and return their converged field.

    `predicted`: the known entries start from the base network's distributions and are updated T times
    with exact messages from every known entry. `clamped`: the known entries are fixed to their observed
    labels (a CRF conditioned on the observations), so no iteration is needed.
    """
    graph = FactorizedGraph(a, b, known_rows, known_cols)
    h = graph.total()
    if known == "clamped":
        q = np.zeros_like(known_probs)
        q[np.arange(len(known_labels)), known_labels] = 1.0
    else:
        q = known_probs
        unary = np.log(np.maximum(known_probs, 1e-30))
        for _ in range(layers):
            g = graph.aggregate(q @ compat.T)
            msg = scaled_messages(g, h, scaling, scale, a, b, known_rows, known_cols)
            q = softmax(unary - gamma * msg)
    return KnownField(g=graph.aggregate(q @ compat.T), h=h, scaling=scaling, scale=scale)


def query_distributions(
    field: KnownField,
    a: np.ndarray,
    b: np.ndarray,
    rows: np.ndarray,
    cols: np.ndarray,
    probs: np.ndarray,
    gamma: float,
) -> np.ndarray:
    """Final distributions of queried entries attached to the known entries' field: (K, p).

    A query receives messages from every known entry and sends none back, so its update is a fixed point
    after one layer.
    """
    msg = scaled_messages(field.g, field.h, field.scaling, field.scale, a, b, rows, cols)
    return softmax(np.log(np.maximum(probs, 1e-30)) - gamma * msg)
