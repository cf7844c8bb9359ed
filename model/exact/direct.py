"""One user's exact answers for a few items, fused: what `ExactScorer.unmixed` computes for the queries
(user, cols[k]) with the known entries clamped to their labels, in one pass per query instead of a dozen
numpy passes over (K, p) arrays.

Every term of a clamped field's message is a sum over known ratings of a weight times compat[label]:
- the field and the same-user term: b_j . vec[u], vec = a_user^T G_u (+ lambda_u sum over the user's l
  of C[label_l, u] b_{j_l}), read per query;
- the item co-rating term (the user's row): sum over the user's rated items i_r of lambda_r w(j, i_r)
  C[label_r];
- the column terms (same-item, user co-rating): sum over the known l on column j of e(user_l) C[label_l],
  e = `Lines.column_weights`.
So the row and column terms are both per-label sums L[k, v] (`_row_label_sums`, `_column_label_sums`),
and the message is b_j . vec[u] + sum_v L[k, v] C[v, u], its normaliser b_j . vec[p] + sum_v L[k, v] + the
prior (`_finish`, with the posterior softmax(max(log_softmax(scores), LOG_FLOOR) - gamma msg)). The same
numbers as `unmixed` to rounding (tests/model/test_direct.py checks 1e-9 on random users, items and
online states).

The loops are compiled with numba where it is installed (the serving image installs it); without it the
same sums run in numpy, slower, with the same results."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from model.exact.affinity import Affinity, DenseAffinity
from model.exact.posterior import LOG_FLOOR
from model.types import FloatArray, IntArray

try:  # pragma: no cover - which branch runs depends on the environment
    import numba

    def _jit(f: Callable[..., Any]) -> Callable[..., Any]:
        jitted: Callable[..., Any] = numba.njit(cache=True, nogil=True)(f)
        return jitted

    COMPILED = True
except ImportError:  # pragma: no cover
    COMPILED = False

    def _jit(f: Callable[..., Any]) -> Callable[..., Any]:
        return f


@_jit
def _dense_row_sums(
    out: FloatArray,
    table: FloatArray,
    slot: IntArray,
    patch_rows: FloatArray,
    cols: IntArray,
    items: IntArray,
    labels: IntArray,
    weight: float,
) -> None:
    """out[k, labels[r]] += weight w(cols[k], items[r]) for a `DenseAffinity` (its shared array, the lines
    replaced since taking precedence: `DenseAffinity.block`)."""
    n = table.shape[0]
    for r in range(len(items)):
        j, v, sj = items[r], labels[r], slot[items[r]]
        for k in range(len(cols)):
            c = cols[k]
            sc = slot[c]
            if sc >= 0:
                w = patch_rows[sc, j]
            elif sj >= 0:
                w = patch_rows[sj, c]
            elif c < n and j < n:
                w = table[j, c]  # symmetric: the rated item's row, read along the queries
            else:
                w = 0.0
            out[k, v] += weight * w


@_jit
def _column_label_sums(
    out: FloatArray,
    buffer: IntArray,
    start: IntArray,
    count: IntArray,
    known_rows: IntArray,
    labels: IntArray,
    e: FloatArray,
    cols: IntArray,
) -> None:
    """out[k, label_l] += e[user_l] over the known l on column cols[k] (a `LineIndex` by column)."""
    n_lines = len(start)
    for k in range(len(cols)):
        c = cols[k]
        if c >= n_lines:
            continue
        s = start[c]
        for i in range(count[c]):
            pos = buffer[s + i]
            out[k, labels[pos]] += e[known_rows[pos]]


@_jit
def _finish(
    b: FloatArray,
    vec: FloatArray,
    cols: IntArray,
    sums: FloatArray,
    compat: FloatArray,
    scores: FloatArray,
    gamma: float,
    normalized: bool,
    scale: float,
    prior: float,
    floor: float,
) -> FloatArray:
    """The posteriors (K, p): message b_j . vec[u] + sum_v sums[k, v] C[v, u], divided by its normaliser
    b_j . vec[p] + sum_v sums[k, v] + prior when `normalized`, else times `scale`; then
    softmax(max(log_softmax(scores), floor) - gamma msg)."""
    k_n, p = scores.shape
    d = b.shape[1]
    out = np.empty((k_n, p))
    msg = np.empty(p)
    for k in range(k_n):
        j = cols[k]
        for u in range(p):
            acc = 0.0
            for x in range(d):
                acc += b[j, x] * vec[u, x]
            for v in range(p):
                acc += sums[k, v] * compat[v, u]
            msg[u] = acc
        if normalized:
            total = prior
            for x in range(d):
                total += b[j, x] * vec[p, x]
            for v in range(p):
                total += sums[k, v]
            total = max(total, 1e-12)
            for u in range(p):
                msg[u] /= total
        else:
            for u in range(p):
                msg[u] *= scale
        top = scores[k, 0]
        for u in range(1, p):
            top = max(top, scores[k, u])
        z = 0.0
        for u in range(p):
            z += np.exp(scores[k, u] - top)
        log_z = top + np.log(z)
        best = -np.inf
        for u in range(p):
            out[k, u] = max(scores[k, u] - log_z, floor) - gamma * msg[u]
            best = max(best, out[k, u])
        z = 0.0
        for u in range(p):
            out[k, u] = np.exp(out[k, u] - best)
            z += out[k, u]
        for u in range(p):
            out[k, u] /= z
    return out


def row_label_sums(
    out: FloatArray, affinity: Affinity, cols: IntArray, items: IntArray, labels: IntArray, weight: float
) -> None:
    """out[k, labels[r]] += weight w(cols[k], items[r]): the item co-rating term over the user's rated
    items, per label. A dense table in the compiled loop; a sparse one through its `block`."""
    if not len(items):
        return
    if isinstance(affinity, DenseAffinity) and COMPILED:
        _dense_row_sums(out, affinity.table, affinity._slot, affinity.patch_rows, cols, items, labels, weight)
        return
    block = affinity.block(cols, items)  # (K, rated)
    onehot = np.zeros((len(items), out.shape[1]))
    onehot[np.arange(len(items)), labels] = 1.0
    out += weight * (block @ onehot)


def column_label_sums(
    out: FloatArray,
    buffer: IntArray,
    start: IntArray,
    count: IntArray,
    known_rows: IntArray,
    labels: IntArray,
    e: FloatArray,
    cols: IntArray,
) -> None:
    """out[k, label_l] += e[user_l] over the known l on column cols[k]."""
    if COMPILED:
        _column_label_sums(out, buffer, start, count, known_rows, labels, e, cols)
        return
    inside = cols < len(start)
    k = np.flatnonzero(inside)
    c = cols[inside]
    owner = np.repeat(k, count[c])
    from model.ratings import ranges

    _, pos = ranges(start[c], count[c])
    members = buffer[pos]
    p = out.shape[1]
    out += np.bincount(
        owner * p + labels[members], weights=e[known_rows[members]], minlength=out.size
    ).reshape(out.shape)


def finish(
    b: FloatArray,
    vec: FloatArray,
    cols: IntArray,
    sums: FloatArray,
    compat: FloatArray,
    scores: FloatArray,
    gamma: float,
    normalized: bool,
    scale: float,
    prior: float,
) -> FloatArray:
    """`_finish`: the posteriors of the queries from their per-label sums."""
    if COMPILED:
        out: FloatArray = _finish(
            b, vec, cols, sums, compat, scores, float(gamma), normalized, float(scale), float(prior),
            float(LOG_FLOOR),
        )  # fmt: skip
        return out
    p = len(compat)
    forms = np.take(b, cols, axis=0) @ vec.T
    msg = forms[:, :p] + sums @ compat
    if normalized:
        total = forms[:, p] + sums.sum(axis=1) + prior
        msg /= np.maximum(total, 1e-12)[:, None]
    else:
        msg *= scale
    z = scores - scores.max(axis=1, keepdims=True)
    z -= np.log(np.exp(z).sum(axis=1, keepdims=True))
    z = np.maximum(z, LOG_FLOOR) - gamma * msg
    z -= z.max(axis=1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=1, keepdims=True)
    result: FloatArray = z
    return result
