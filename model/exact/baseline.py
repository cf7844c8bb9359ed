"""The bias baseline mu + b_user + c_item (ridge-regularised, fitted to the known ratings) and its mixture
with the CRF's distributions.

The maths: the package docstring (model/exact/__init__.py) and docs/model.md."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from model.types import FloatArray, IntArray

BIAS_SWEEPS = 500
"""Most alternating sweeps of `bias_baseline` (it stops earlier once the biases settle)."""


def bias_baseline(
    rows: np.ndarray,
    cols: np.ndarray,
    values: np.ndarray,
    n_users: int,
    n_items: int,
    user_shrink: float,
    item_shrink: float,
    tol: float = 1e-10,
) -> tuple[float, np.ndarray, np.ndarray]:
    """Ridge-regularised biases of the known ratings: (mu, b (n,), c (m,)).

    mu is the mean rating; b and c minimise sum_k (M_k - mu - b_i - c_j)^2 + user_shrink |b|^2 +
    item_shrink |c|^2. Alternating exact updates (b given c, then c given b) converge to the unique
    minimiser; they stop when no bias moves by more than `tol`. A user or item without known ratings
    gets bias 0.
    """
    values = np.asarray(values, dtype=np.float64)
    mu = float(values.mean()) if len(values) else 0.0
    user_count = np.bincount(rows, minlength=n_users) + user_shrink
    item_count = np.bincount(cols, minlength=n_items) + item_shrink
    b, c = np.zeros(n_users), np.zeros(n_items)
    residual = values - mu
    for _ in range(BIAS_SWEEPS):
        b_new = np.bincount(rows, residual - c[cols], n_users) / user_count
        c_new = np.bincount(cols, residual - b_new[rows], n_items) / item_count
        moved = max(np.abs(b_new - b).max(initial=0.0), np.abs(c_new - c).max(initial=0.0))
        b, c = b_new, c_new
        if moved < tol:
            break
    return mu, b, c


Ratings = Callable[[int], tuple[IntArray, FloatArray]]
"""A line's known ratings: (the other side's indexes, the values), e.g. a user's (items, ratings)."""


@dataclass(frozen=True)
class BiasModel:
    """The bias baseline mu + b_user + c_item with its ridge penalties: fitted to known ratings (`fit`),
    refitted for the users or items whose ratings changed (`with_users`, `with_items`: one exact ridge
    step each, given the other side's biases), read as predictions (`predict`, which `baseline_mixture`
    mixes into distributions). One definition for the export, the exact scorer, the fold-in and the
    service."""

    mu: float
    users: FloatArray
    items: FloatArray
    user_shrink: float
    item_shrink: float

    @classmethod
    def fit(
        cls,
        rows: IntArray,
        cols: IntArray,
        values: FloatArray,
        n_users: int,
        n_items: int,
        user_shrink: float,
        item_shrink: float,
    ) -> BiasModel:
        """`bias_baseline` of these ratings."""
        mu, users, items = bias_baseline(rows, cols, values, n_users, n_items, user_shrink, item_shrink)
        return cls(mu, users, items, user_shrink, item_shrink)

    def predict(self, users: IntArray | int, items: IntArray) -> FloatArray:
        """mu + b_user + c_item of (users[k], items[k]) (or of one user's items): (K,)."""
        out: FloatArray = self.items[items] + (self.mu + self.users[users])
        return out

    def grown(self, n_users: int, n_items: int) -> BiasModel:
        """With zero biases for the users and items added up to these counts (copies)."""
        users, items = np.zeros(n_users), np.zeros(n_items)
        users[: len(self.users)], items[: len(self.items)] = self.users, self.items
        return BiasModel(self.mu, users, items, self.user_shrink, self.item_shrink)

    def with_users(self, users: Iterable[int], ratings_of: Ratings) -> BiasModel:
        """The users' biases refitted to their ratings (`ratings_of(user)`: items, values) given the item
        biases: b = sum (r - mu - c_j) / (n + user_shrink). The arrays are copies."""
        b = self.users.copy()
        for user in users:
            cols, values = ratings_of(int(user))
            b[user] = (values - self.mu - self.items[cols]).sum() / (len(values) + self.user_shrink)
        return BiasModel(self.mu, b, self.items, self.user_shrink, self.item_shrink)

    def with_items(self, items: Iterable[int], ratings_of: Ratings) -> BiasModel:
        """The items' biases refitted to their ratings (`ratings_of(item)`: users, values) given the user
        biases."""
        c = self.items.copy()
        for item in items:
            rows, values = ratings_of(int(item))
            c[item] = (values - self.mu - self.users[rows]).sum() / (len(values) + self.item_shrink)
        return BiasModel(self.mu, self.users, c, self.user_shrink, self.item_shrink)


def _level_split(values: np.ndarray, levels: np.ndarray) -> tuple[IntArray, FloatArray]:
    """For `level_distribution`: each value's lower level (its weight 1 - frac; the next level's frac)."""
    v = np.clip(np.asarray(values, dtype=np.float64), levels[0], levels[-1])
    step = levels[1] - levels[0] if len(levels) > 1 else 0.0
    if step > 0 and np.array_equal(np.diff(levels), np.full(len(levels) - 1, step)):
        # Evenly spaced levels (most scales): arithmetic instead of a search and gathers over the levels,
        # several times as fast over a catalogue's 1e5 values.
        x = (v - levels[0]) / step
        lower_even = np.minimum(x.astype(np.intp), len(levels) - 2)  # x >= 0: truncation is floor
        return lower_even, x - lower_even
    upper = np.clip(np.searchsorted(levels, v, side="right"), 1, len(levels) - 1)
    lower = upper - 1
    frac: FloatArray = (v - levels[lower]) / (levels[upper] - levels[lower])
    return lower, frac


def level_distribution(values: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Distributions over the levels whose expectations are `values` clipped to [L_1, L_p]: each value's
    weight sits on the two levels around it, split linearly: (K, p)."""
    lower, frac = _level_split(values, levels)
    out = np.zeros((len(lower), len(levels)))
    k = np.arange(len(lower))
    out[k, lower] = 1.0 - frac
    out[k, lower + 1] += frac
    return out


def baseline_mixture(
    dist: np.ndarray, prediction: np.ndarray, levels: np.ndarray, weight: float
) -> np.ndarray:
    """(1 - weight) dist + weight B, with B the level distribution of the baseline's prediction: (K, p),
    written over `dist` (the caller's new array). B's two non-zero levels per row are added where they
    fall (a catalogue's rows: no (K, p) B)."""
    lower, frac = _level_split(prediction, levels)
    out: np.ndarray = dist
    out *= 1.0 - weight
    if not out.flags.c_contiguous:  # (a flat view would be a copy)
        k = np.arange(len(lower))
        out[k, lower] += weight * (1.0 - frac)
        out[k, lower + 1] += weight * frac
        return out
    flat = out.reshape(-1)
    at = np.arange(len(lower)) * len(levels) + lower
    flat[at] += weight * (1.0 - frac)
    flat[at + 1] += weight * frac
    return out
