"""A folded-in user's embedding, refined by the decoder's likelihood of the user's known ratings.

The row branch maps rating rows it was not trained on less well than those it was; `refine_embedding`
keeps its embedding as a prior and moves it to where the bilinear decoder finds the user's ratings most
likely (model/online.py calls it for every user whose ratings changed, where the fold-in policy says so).
"""

from __future__ import annotations

import numpy as np
from scipy.linalg.lapack import dposv

from model.engine import softmax

FOLD_IN_PRIOR = 1.0
"""Weight lambda of the prior ||u - u_row||^2 that keeps a refined embedding near the row branch's.
Chosen on validation entries (held-out users' own training ratings, not the test split) among 0.1, 0.3,
1, 3, 10 and 100: benchmarks/results/fold_in_prior.md."""

FOLD_IN_STEPS = 8
"""Newton steps of the refinement (the objective is smooth and strongly convex: they converge)."""


def refine_embedding(
    u0: np.ndarray,
    item_emb: np.ndarray,
    bilinear: np.ndarray,
    labels: np.ndarray,
    prior: float = FOLD_IN_PRIOR,
    steps: int = FOLD_IN_STEPS,
    stacked: np.ndarray | None = None,
) -> np.ndarray:
    """argmin_u -sum_k log softmax_l(u^T B_l v_k)[y_k] + prior ||u - u0||^2 by Newton's method with a
    backtracking line search: the user embedding that the bilinear decoder finds most likely for the user's
    ratings (levels `labels` of the items with embeddings `item_emb` (K, d)), kept near the row branch's
    `u0`: (d,). `stacked`: `stacked_decoder(bilinear)`, given when the caller refines several users."""
    p, d = bilinear.shape[0], bilinear.shape[2]
    stacked = stacked_decoder(bilinear) if stacked is None else stacked
    w = (np.asarray(item_emb, dtype=np.float64) @ stacked).reshape(len(item_emb), p, d)  # w[k, l] = B_l v_k
    rows = np.arange(len(labels))
    target = np.zeros(w.shape[:2])
    target[rows, labels] = 1.0

    def objective(u: np.ndarray) -> float:
        z = w @ u
        zmax = z.max(axis=1)
        log_norm = zmax + np.log(np.exp(z - zmax[:, None]).sum(axis=1))
        return float((log_norm - z[rows, labels]).sum() + prior * ((u - u0) ** 2).sum())

    u = u0.astype(np.float64).copy()
    diagonal = np.arange(len(u))
    flat = w.reshape(-1, w.shape[2])  # (K p, d): matrix products run on BLAS
    value = objective(u)
    for _ in range(steps):
        s = softmax(w @ u)  # (K, p)
        grad = flat.T @ (s - target).ravel() + 2.0 * prior * (u - u0)
        ws = (s[:, :, None] * w).sum(axis=1)  # (K, d)
        # sum_k W_k^T (diag(s_k) - s_k s_k^T) W_k + 2 prior I: G^T G with G's rows sqrt(s) w (a symmetric
        # product, half the work of a general one), less ws^T ws
        weighted = flat * np.sqrt(s).reshape(-1, 1)
        hess = weighted.T @ weighted
        hess -= ws.T @ ws
        hess[diagonal, diagonal] += 2.0 * prior
        step = _solve_spd(hess, grad)
        if float(grad @ step) <= 1e-12 * max(1.0, abs(value)):  # Newton decrement: converged to rounding
            break
        t = 1.0
        while t > 1e-6:  # halve the step until it decreases the objective enough (Armijo)
            candidate = u - t * step
            new_value = objective(candidate)
            if new_value <= value - 1e-4 * t * float(grad @ step):
                break
            t /= 2.0
        else:
            break  # no decrease left: at the minimum to rounding
        u, value = candidate, new_value
    out: np.ndarray = u
    return out


def stacked_decoder(bilinear: np.ndarray) -> np.ndarray:
    """The decoder's (p, d, d) weights as one (d, p d) float64 matrix: item embeddings (K, d) times it
    give every B_l v_k at once, (K, p d)."""
    p, d = bilinear.shape[0], bilinear.shape[2]
    out: np.ndarray = np.ascontiguousarray(np.transpose(bilinear, (2, 0, 1)), dtype=np.float64)
    return out.reshape(d, p * d)


def _solve_spd(matrix: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """matrix^-1 rhs for a symmetric positive definite matrix (Cholesky: LAPACK's dposv), by LU where
    rounding left it not positive definite."""
    _, x, info = dposv(matrix, rhs)
    if info != 0:
        x = np.linalg.solve(matrix, rhs)
    out: np.ndarray = x
    return out
