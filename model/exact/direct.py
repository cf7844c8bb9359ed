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
So the row and column terms are both per-label sums L[k, v], and the message is b_j . vec[u] +
sum_v L[k, v] C[v, u], its normaliser b_j . vec[p] + sum_v L[k, v] + the prior, and the posterior
softmax(max(log_softmax(scores), LOG_FLOOR) - gamma msg): one loop per setting (`_member`). The products
b_j . vec of every averaged setting, and the decoder's scores, are one matrix product (`ExactScorer.
vectors`, `MeanScorer.answer`). The same numbers as `unmixed` to rounding (tests/model/test_direct.py
checks 1e-9 on random users, items and online states).

The loops are compiled with numba where it is installed (the serving image installs it); without it the
same sums run in numpy, slower, with the same results."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import scipy.sparse as sp

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
def _member(
    forms: FloatArray,
    scores: FloatArray,
    sums: FloatArray,
    table: FloatArray,
    slot: IntArray,
    patch_rows: FloatArray,
    cols: IntArray,
    items: IntArray,
    item_labels: IntArray,
    co_rating: float,
    compat: FloatArray,
    gamma: float,
    normalized: bool,
    scale: float,
    prior: float,
    floor: float,
) -> FloatArray:
    """One setting's posteriors (K, p) of the queries cols[k]: `sums` (K, p) gains the row term's per-label
    sums over the user's rated `items` (a `DenseAffinity`'s shared array, its replaced lines taking
    precedence: `DenseAffinity.block`; none when `items` is empty; the column terms' are in it already:
    `_label_rows`); the message is forms[k, u] + sum_v sums[k, v] C[v, u], over forms[k, p] + sum_v
    sums[k, v] + prior when `normalized` (else times `scale`); the posterior softmax(max(log_softmax(
    scores), floor) - gamma msg)."""
    n_base = table.shape[0]
    k_n, p = scores.shape
    for r in range(len(items)):
        j, v, sj = items[r], item_labels[r], slot[items[r]]
        for k in range(k_n):
            c = cols[k]
            sc = slot[c]
            if sc >= 0:
                w = patch_rows[sc, j]
            elif sj >= 0:
                w = patch_rows[sj, c]
            elif c < n_base and j < n_base:
                w = table[j, c]  # symmetric: the rated item's row, read along the queries
            else:
                w = 0.0
            sums[k, v] += co_rating * w
    out = np.empty((k_n, p))
    msg = np.empty(p)
    for k in range(k_n):
        for u in range(p):
            acc = forms[k, u]
            for v in range(p):
                acc += sums[k, v] * compat[v, u]
            msg[u] = acc
        if normalized:
            total = forms[k, p] + prior
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


@_jit
def _label_rows(
    sums: FloatArray, indptr: IntArray, indices: IntArray, data: FloatArray, e: FloatArray, cols: IntArray
) -> None:
    """sums[k, v] += sum of weight e[user] over the stored (user, weight) of row cols[k] p + v of a
    by-label matrix (`ColumnMajor`: the known entries of column j labelled v, weights 1, or +-1 in its
    online changes)."""
    k_n, p = sums.shape
    n_rows = len(indptr) - 1
    for k in range(k_n):
        for v in range(p):
            row = cols[k] * p + v
            if row < n_rows:
                acc = 0.0
                for i in range(indptr[row], indptr[row + 1]):
                    acc += data[i] * e[indices[i]]
                sums[k, v] += acc


NO_INTS = np.empty(0, dtype=np.int64)
NO_FLOATS = np.empty(0)
NO_TABLE = np.zeros((0, 0))


def member_answer(
    forms: FloatArray,
    scores: FloatArray,
    cols: IntArray,
    rated: tuple[Affinity, IntArray, IntArray, float] | None,
    columns: tuple[Sequence[sp.csr_matrix], FloatArray] | None,
    compat: FloatArray,
    gamma: float,
    normalized: bool,
    scale: float,
    prior: float,
) -> FloatArray:
    """One setting's posteriors (`_member`) from its forms (K, p [+ 1]: b_j . vec[u], the normaliser's last
    under `normalized`) and the decoder's scores (K, p). `rated`: (the item table, the user's rated items,
    their labels, lambda_r), None without a row term; `columns`: (the by-label matrices of the known
    entries, `ColumnMajor.by_label` and its online changes, and e), None without a column term."""
    p = len(compat)
    sums = np.zeros((len(cols), p))
    table, slot, patch_rows = NO_TABLE, NO_INTS, NO_TABLE
    items, item_labels, co_rating = NO_INTS, NO_INTS, 0.0
    if rated is not None and len(rated[1]):
        affinity, items, item_labels, co_rating = rated
        if isinstance(affinity, DenseAffinity) and COMPILED:
            table, slot, patch_rows = affinity.table, affinity._slot, affinity.patch_rows
        else:  # a sparse table (or no compiler): its block, per label
            block = affinity.block(cols, items)  # (K, rated)
            onehot = np.zeros((len(items), p))
            onehot[np.arange(len(items)), item_labels] = 1.0
            sums += co_rating * (block @ onehot)
            items = NO_INTS
    if columns is not None:
        matrices, e = columns
        for matrix in matrices:
            if COMPILED:
                _label_rows(sums, matrix.indptr, matrix.indices, matrix.data, e, cols)
                continue
            rows = (cols[:, None] * p + np.arange(p)).ravel()
            inside = np.flatnonzero(rows < matrix.shape[0])
            sums.ravel()[inside] += matrix[rows[inside]] @ e[: matrix.shape[1]]
    if COMPILED:
        out: FloatArray = _member(
            forms, scores, sums, table, slot, patch_rows, cols, items, item_labels, float(co_rating),
            compat, float(gamma), normalized, float(scale), float(prior), float(LOG_FLOOR),
        )  # fmt: skip
        return out
    msg = forms[:, :p] + sums @ compat
    if normalized:
        msg /= np.maximum(forms[:, p] + sums.sum(axis=1) + prior, 1e-12)[:, None]
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
