"""A query's final distribution: its network probabilities and its message from the known field
(`posterior`), for a batch of queries or one user's whole catalogue.

The maths: the package docstring (model/exact/__init__.py) and docs/model.md."""

from __future__ import annotations

import numpy as np

from model.engine import (
    Network,
    catalogue_products,
    in_order,
    last_axis,
    log_softmax,
    row_products,
    softmax,
    softmax_inplace,
)
from model.exact.field import KnownField
from model.exact.lines import Lines
from model.exact.messages import Products
from model.types import FloatArray, IntArray


def query_distributions(
    field: KnownField,
    a: np.ndarray,
    b: np.ndarray,
    rows: np.ndarray,
    cols: np.ndarray,
    probs: np.ndarray,
    gamma: float,
    lines: Lines | None = None,
) -> np.ndarray:
    """Final distributions of queried entries attached to the known entries' field: (K, p).

    A query receives messages from every known entry and sends none back, so its update is a fixed point
    after one layer. `lines`: the same-user and same-item terms the field was computed with.
    """
    msg, _ = field.messages(a, b, rows, cols, lines)
    return softmax(np.log(np.maximum(probs, 1e-30)) - gamma * msg)


def user_distributions(
    field: KnownField,
    network: Network,
    a: np.ndarray,
    b: np.ndarray,
    user: int,
    cols: np.ndarray,
    gamma: float,
    lines: Lines | None = None,
) -> np.ndarray:
    """`query_distributions` of one user's queries (user, cols[k]) with the base network's probabilities
    read in the same pass over the item embeddings as the messages (a top-N over the catalogue reads them
    once): item_emb_j . v = |item_emb_j| sqrt(2) (b_j . [0, v]), b_j = [1, unit_j] / sqrt(2). (K, p)."""
    decoder = np.matmul(network.user_emb[user], network.bilinear)  # (p, d): scores_j = item_emb_j . decoder
    rows = np.full(len(cols), user, dtype=np.int64)
    products: Products
    similar = None
    if 4 * len(cols) > len(b):  # most of the catalogue (a top-N): one float32 product over the item table
        products = lambda v, c: catalogue_products(network, v, c, decoder)  # noqa: E731
        similar = network.user_similarities  # and the users' in float32 (the same-item term's weights)
    else:
        probe = np.sqrt(2.0) * np.hstack([np.zeros((len(decoder), 1)), decoder])  # b_j . probe = unit_j . dec

        def products(v: FloatArray, c: IntArray) -> FloatArray:
            read = row_products(b, np.vstack([v, probe]), c)
            read[:, len(v) :] *= network.item_norms[c][:, None]
            return read

    msg, scores = field.messages(a, b, rows, cols, lines, products, similar)
    assert scores is not None  # one user's queries
    # |s_u - s_v| = |e_j . (dec_u - dec_v)| <= |e_j| max |dec_u - dec_v|: only the items whose norm lets
    # two levels' scores lie further apart than the floor can have a level floored (one nat to spare for
    # the float32 products).
    spread = max(np.linalg.norm(decoder[:, None] - decoder[None], axis=-1).max(), 1e-300)
    norms = network.item_norms if in_order(cols, len(network.item_norms)) else network.item_norms[cols]
    reach = -LOG_FLOOR - np.log(len(decoder)) - 1.0
    candidates = np.flatnonzero(norms * spread >= reach)
    if similar is not None:  # a whole catalogue: level by level, the exponentials in float32
        return catalogue_posterior(scores, msg, gamma, candidates)
    # A copy of its own for the posterior to write over: the distributions a row keeps, contiguous.
    return posterior(np.array(scores, dtype=np.float64, order="C"), msg, gamma, candidates)


LOG_FLOOR = np.log(1e-30)
"""The least log-probability of the base network's that the mean-field update reads (`query_distributions`
floors the probabilities at 1e-30)."""


def posterior(
    scores: FloatArray, msg: FloatArray, gamma: float, candidates: IntArray | None = None
) -> FloatArray:
    """softmax(max(log_softmax(scores), LOG_FLOOR) - gamma msg): `query_distributions` from the decoder's
    scores (K, p). Where no level's log-probability falls below the floor (min - max of a row's scores at
    least LOG_FLOOR + log p: log_softmax >= min - max - log p), the log-softmax only shifts the row, which
    the softmax ignores: softmax(scores - gamma msg), without the exp, sum and log of the log-softmax. The
    other rows take the floor. `candidates`: the only rows that may have a level so far below (all when
    None). `scores` is overwritten (the caller's new array)."""
    floored = _floored(scores, np.arange(len(scores)) if candidates is None else candidates)
    kept = scores[floored] if len(floored) else None
    scores -= gamma * msg
    out = softmax_inplace(scores)
    if kept is not None:
        out[floored] = _at_floor(kept, msg[floored], gamma)
    return out


def _floored(scores: FloatArray, rows: IntArray) -> IntArray:
    """The `rows` of `scores` (K, p) with a level's log-probability below the floor (`posterior`)."""
    some = scores[rows]
    low = last_axis(some, np.minimum)[:, 0] - last_axis(some, np.maximum)[:, 0]
    out: IntArray = rows[low < LOG_FLOOR + np.log(scores.shape[1])]
    return out


def _at_floor(scores: FloatArray, msg: FloatArray, gamma: float) -> FloatArray:
    """The posterior of rows reaching the floor: softmax(max(log_softmax(scores), LOG_FLOOR) - gamma msg)."""
    return softmax(np.maximum(log_softmax(scores), LOG_FLOOR) - gamma * msg)


def catalogue_posterior(
    scores: FloatArray, msg: FloatArray, gamma: float, candidates: IntArray
) -> FloatArray:
    """`posterior` of one user's whole catalogue (K, p), read-only inputs, computed level by level: a (p, K)
    array whose rows are one level each, returned as its (K, p) transpose (Fortran order). Along a short
    last axis numpy's loops cost per row, and float64 exponentials several times float32's: a catalogue's
    K x p = 7e5 entries (the synthetic Epinions) took 14 ms that way. Here the p rows are contiguous, the
    exponentials of the shifted scores (all <= 0) are taken in float32 and normalised in float64: equal to
    `posterior` to about 1e-7 of each probability, as the catalogue's float32 products are to 1e-6."""
    p = scores.shape[1]
    z = np.empty((p, len(scores)))
    for u in range(p):
        np.multiply(msg[:, u], -gamma, out=z[u])
        z[u] += scores[:, u]
    z -= z.max(axis=0)
    e = z.astype(np.float32)
    np.exp(e, out=e)
    z[...] = e
    z /= z.sum(axis=0)
    out: FloatArray = z.T
    floored = _floored(scores, candidates)
    if len(floored):  # rows with a level below the floor: as `posterior` writes them
        out[floored] = _at_floor(scores[floored], msg[floored], gamma)
    return out
