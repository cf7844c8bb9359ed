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

from model.engine import in_order, log_softmax, softmax_inplace
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


WIDE = 3
"""Queries over 1 / WIDE of the catalogue or more are answered in matrix products over whole lines
(`wide_answer`): on ML-100K in process (two settings averaged) the loops cost about 0.085 ms a call and
2.1 us an item, the products about 1.3 ms whatever the items, even from about 600 items (1,682 in all)."""


@_jit
def _rated_sums(
    sums: FloatArray,
    table: FloatArray,
    slot: IntArray,
    patch_rows: FloatArray,
    cols: IntArray,
    items: IntArray,
    item_labels: IntArray,
    co_rating: float,
) -> None:
    """sums[k, v] += lambda_r sum over the user's rated `items` labelled v of w(items[r], cols[k]): the
    row term's per-label sums, from a `DenseAffinity`'s shared array `table` and its replaced lines
    (`patch_rows`, by `slot`; they take precedence: `DenseAffinity.block`). Rated item by rated item, each
    reading its line along the queries (in order for a whole catalogue: the line as it lies)."""
    n_base = table.shape[0]
    k_n = len(cols)
    plain = patch_rows.shape[0] == 0
    ordered = True  # 0, 1, ..., k_n - 1: a whole catalogue, each line read as it lies
    for k in range(k_n):
        plain = plain and cols[k] < n_base
        ordered = ordered and cols[k] == k
    p = sums.shape[1]
    acc = np.zeros((p, k_n))  # per label, along the queries: contiguous adds
    for r in range(len(items)):
        j, v, sj = items[r], item_labels[r], slot[items[r]]
        if plain and j < n_base:
            line = table[j]
            mine = acc[v]
            if ordered:
                for k in range(k_n):
                    mine[k] += line[k]
            else:
                for k in range(k_n):
                    mine[k] += line[cols[k]]
            continue
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
            acc[v, k] += w
    for k in range(k_n):
        for v in range(p):
            sums[k, v] += co_rating * acc[v, k]


@_jit
def _member(
    forms: FloatArray,
    scores: FloatArray,
    sums: FloatArray,
    compat: FloatArray,
    gamma: float,
    normalized: bool,
    scale: float,
    prior: float,
    floor: float,
) -> FloatArray:
    """One setting's posteriors (K, p) of the queries from their per-label sums (K, p) of the row and
    column terms (`_rated_sums`, `_label_rows`): the message is forms[k, u] + sum_v sums[k, v] C[v, u],
    over forms[k, p] + sum_v sums[k, v] + prior when `normalized` (else times `scale`); the posterior
    softmax(max(log_softmax(scores), floor) - gamma msg)."""
    k_n, p = scores.shape
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
    size: int = 0,
    log_scores: FloatArray | None = None,
) -> FloatArray:
    """One setting's posteriors (`_member`) from its forms (K, p [+ 1]: b_j . vec[u], the normaliser's last
    under `normalized`) and the decoder's scores (K, p). `rated`: (the item table, the user's rated items,
    their labels, lambda_r), None without a row term; `columns`: (the by-label matrices of the known
    entries, `ColumnMajor.by_label` and its online changes, and e), None without a column term.

    Queries reaching 1 / WIDE of the `size` items or more (a user's row over the catalogue) are answered
    by `wide_answer` instead: whole lines and columns in matrix products, the same sums. `log_scores`:
    max(log_softmax(scores), LOG_FLOOR), when the caller has it (a mean of settings shares it)."""
    p = len(compat)
    if WIDE * len(cols) >= size > 0 or not COMPILED:
        if log_scores is None:
            log_scores = np.maximum(log_softmax(scores), LOG_FLOOR)
        return wide_answer(forms, log_scores, cols, rated, columns, compat, gamma, normalized, scale, prior)
    sums = np.zeros((len(cols), p))
    if rated is not None and len(rated[1]):
        affinity, items, item_labels, co_rating = rated
        if isinstance(affinity, DenseAffinity):
            table, slot, patch = affinity.table, affinity._slot, affinity.patch_rows
            _rated_sums(sums, table, slot, patch, cols, items, item_labels, float(co_rating))
        else:  # a sparse table: its block, per label
            block = affinity.block(cols, items)  # (K, rated)
            onehot = np.zeros((len(items), p))
            onehot[np.arange(len(items)), item_labels] = 1.0
            sums += co_rating * (block @ onehot)
    if columns is not None:
        matrices, e = columns
        for matrix in matrices:
            _label_rows(sums, matrix.indptr, matrix.indices, matrix.data, e, cols)
    out: FloatArray = _member(
        forms, scores, sums, compat, float(gamma), normalized, float(scale), float(prior), float(LOG_FLOOR)
    )
    return out


def wide_answer(
    forms: FloatArray,
    log_scores: FloatArray,
    cols: IntArray,
    rated: tuple[Affinity, IntArray, IntArray, float] | None,
    columns: tuple[Sequence[sp.csr_matrix], FloatArray] | None,
    compat: FloatArray,
    gamma: float,
    normalized: bool,
    scale: float,
    prior: float,
) -> FloatArray:
    """`member_answer` in matrix products, for queries over much of the catalogue: the row term's
    per-label sums over the rated items' whole lines (`_rated_sums`, `weighted_lines`), the column
    terms' as the by-label matrices times e, then the message and the posterior over every query at once.
    The same sums as the loops (in another order: the same numbers to rounding)."""
    p = len(compat)
    k_n = len(cols)
    whole = in_order(cols, k_n)  # 0, 1, ..., k_n - 1: the lines as they are, no gather
    sums = np.zeros((k_n, p))
    if rated is not None and len(rated[1]):
        affinity, items, item_labels, co_rating = rated
        if isinstance(affinity, DenseAffinity) and COMPILED:  # its lines read in place, not copied
            table, slot, patch = affinity.table, affinity._slot, affinity.patch_rows
            _rated_sums(sums, table, slot, patch, cols, items, item_labels, float(co_rating))
        else:
            weights = np.zeros((len(items), p))
            weights[np.arange(len(items)), item_labels] = co_rating
            lines = affinity.weighted_lines(items, weights)  # (size, p)
            sums += lines[:k_n] if whole else lines[cols]
    if columns is not None:
        matrices, e = columns
        reach = max([(int(cols.max()) + 1) * p if k_n else 0, *(m.shape[0] for m in matrices)])
        flat = np.zeros(reach)
        for matrix in matrices:
            flat[: matrix.shape[0]] += matrix @ e[: matrix.shape[1]]
        per_label = flat.reshape(-1, p)
        sums += per_label[:k_n] if whole else per_label[cols]
    msg = forms[:, :p] + sums @ compat
    if normalized:
        msg /= np.maximum(forms[:, p] + prior + sums.sum(axis=1), 1e-12)[:, None]
    else:
        msg *= scale
    z = log_scores - gamma * msg
    return softmax_inplace(z)
