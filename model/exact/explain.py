"""Which known ratings moved a prediction of the exact CRF, and by exactly how much.

A query (i, j) receives from every known entry l a term k_l t_l (t_l = C[label_l] for clamped entries),
its weight

    k_l = s_r(i, i_l) s_c(j, j_l)                          (the field: every known entry)
        + [i_l = i] (lambda_u s_c(j, j_l) + lambda_r w(j, j_l))   (the user's own ratings)
        + [j_l = j] (lambda_i s_r(i, i_l) + lambda_c w_u(i, i_l)) (the item's other ratings)

and the message is msg = sum_l k_l t_l, divided by sum_l k_l + prior under `normalized` (times `scale`
under `scaled`). The prediction is the posterior softmax(max(log_softmax(scores), floor) - gamma msg),
mixed with the bias baseline and read as an expected rating. The effect of one known rating is the
prediction minus the prediction with its term taken out of both sums, the network's scores, the tables
and every other term held: exact, not a linearisation.

Every known rating reaches every query through the field's product of similarities, but those off the
query's row and column weigh at most max s_r(i, .) max s_c(j, .) <= 1 each, against lambda_u ~ 10-100
for the user's own ratings. `explain` scores the ratings on the query's row and column exactly, then
bounds what any other can move the answer (a logit shift of oscillation d moves the distribution by at
most 1 - exp(-d) in total variation, so the expected rating by at most (L_p - L_1) times that); only when
the bound does not clear the k-th largest effect are the others weighed (a product each) and scored where
their own bound clears it, so the list is exact either way.

The network's own use of the rating row (the row branch embeds the user from the ratings) is not
decomposed: an explanation holds the network's outputs fixed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from model.engine import expected_rating, log_softmax, softmax
from model.exact.messages import ClampedRows
from model.exact.posterior import LOG_FLOOR
from model.types import FloatArray, IntArray

if TYPE_CHECKING:
    from model.exact.scorer import ExactScorer


NO_TERMS = (
    "inference mode {mode!r} cannot explain its predictions: only `exact` sums one term per known rating "
    "(DCMC_INFERENCE__MODE=exact)"
)


class CannotExplain(ValueError):
    """The scorer's answers are not a sum of one term per known rating (another mode, or known entries
    whose distributions are iterated with the queries)."""


@dataclass(frozen=True)
class Explanation:
    """One query's prediction and the known ratings that moved it most."""

    rating: float
    """The prediction (expected rating, clipped to the scale)."""
    network: float
    """The base network's expected rating of the entry (clipped), without any CRF term."""
    known: IntArray
    """Positions in the scorer's known ratings of the `because` ratings, largest |effect| first."""
    effects: FloatArray
    """rating minus the rating without that known rating's terms, aligned with `known`."""


def explain(scorer: ExactScorer, user: int, items: IntArray, k: int) -> list[Explanation]:
    """The `k` known ratings of largest |effect| on each prediction (user, items[q]) (module docstring);
    the entry itself, when it is a known rating, never explains itself. Raises CannotExplain where the
    scorer's messages are not such a sum."""
    if scorer.kernel.known != "clamped":
        raise CannotExplain(
            "explanations need known entries clamped to their ratings (inference.kernel.known=clamped): "
            "only then is each known rating's term fixed"
        )
    items = np.asarray(items, dtype=np.int64)
    if not len(items):
        return []
    shared = _User(scorer, user, items)
    return [_Query(shared, q).explain(k) for q in range(len(items))]


class _User:
    """What one user's queries share: the similarities to the user, the whole messages' sums of every
    query (read the scorer's way, in one pass), the decoder's scores."""

    def __init__(self, scorer: ExactScorer, user: int, items: IntArray) -> None:
        self.s, self.user, self.items = scorer, user, items
        net, known, lines = scorer.network, scorer.known, scorer.lines
        self.levels, self.compat, self.gamma = net.levels, scorer.compat, scorer.crf.gamma
        self.labels = known.labels(net.levels)
        a, b = scorer.user_lifted, scorer.item_lifted
        self.user_sim = a[: known.n_users] @ a[user]  # s_r(i, .)
        self.item_sims = b[: known.n_items] @ b[items].T  # (m, K): s_c(j, .) of each query's item
        top2 = (
            -np.partition(-self.item_sims, 1, axis=0)[:2] if known.n_items > 1 else np.zeros((2, len(items)))
        )
        own = self.item_sims[np.minimum(items, known.n_items - 1), np.arange(len(items))]
        # the largest s_c(j, j') over j' != j: the second largest where the largest is j's own
        self.item_max = np.where((items < known.n_items) & (top2[0] == own), top2[1], top2[0])
        self.row = known.by_row.of(user) if user < known.n_users else np.empty(0, dtype=np.int64)
        others = np.delete(self.user_sim, user) if user < len(self.user_sim) else self.user_sim
        self.user_max = float(others.max(initial=0.0))
        self.user_line = np.zeros(known.n_users)  # w_u(i, .)
        if lines is not None and lines.co_rating_user > 0 and lines.user_affinity is not None:
            lines.user_affinity.add_line(self.user_line, user, 1.0)
        f = scorer.field
        self.normalized = scorer.kernel.scaling == "normalized"
        forms = b[items] @ np.matmul(a[user], f.stacked(self.normalized)).T  # (K, p [+ 1])
        p = len(self.compat)
        if lines is not None and lines.active:
            t = ClampedRows(self.labels, self.compat)
            forms = forms + lines.messages(t, a, b, np.full(len(items), user), items, self.normalized)
        self.num = forms[:, :p]
        self.den = np.ones(len(items))
        if self.normalized:
            self.den = forms[:, p] + (lines.prior_weight if lines is not None else 0.0)
        self.scale = f.scale if scorer.kernel.scaling == "scaled" else 1.0
        decoder = np.matmul(net.user_emb[user], net.bilinear)  # (p, d)
        scores = np.asarray(net.item_emb[items], dtype=np.float64) @ decoder.T  # (K, p)
        self.floored = np.maximum(log_softmax(scores), LOG_FLOOR)
        lo, hi = self.levels[0], self.levels[-1]
        self.network = np.clip(expected_rating(softmax(scores), self.levels), lo, hi)
        self.weight = scorer.baseline_weight if scorer.biases is not None else 0.0
        self.baseline = np.zeros(len(items))
        if scorer.biases is not None:
            self.baseline = np.clip(scorer.biases.predict(user, items), lo, hi)


class _Query:
    """One query's sums, from which removing any known rating's term is read exactly."""

    def __init__(self, shared: _User, q: int) -> None:
        self.u, self.q = shared, q
        self.item = int(shared.items[q])
        known = shared.s.known
        self.col = known.by_col.of(self.item) if self.item < known.n_items else np.empty(0, dtype=np.int64)
        self.item_sim = shared.item_sims[:, q]
        lines = shared.s.lines
        self.item_line = np.zeros(known.n_items)  # w(j, .), the item co-rating weights
        if lines is not None and lines.co_rating > 0 and lines.affinity is not None:
            lines.affinity.add_line(self.item_line, self.item, 1.0)
        self.rating = float(self.read(shared.num[q], shared.den[q])[0])

    def weights(self, positions: IntArray) -> FloatArray:
        """k_l of the known entries at `positions` (module docstring)."""
        u = self.u
        known, lines = u.s.known, u.s.lines
        rows, cols = known.rows[positions], known.cols[positions]
        k = u.user_sim[rows] * self.item_sim[cols]
        if lines is not None:
            on_row, on_col = rows == u.user, cols == self.item
            k += on_row * (lines.same_user * self.item_sim[cols] + lines.co_rating * self.item_line[cols])
            k += on_col * (lines.same_item * u.user_sim[rows] + lines.co_rating_user * u.user_line[rows])
        out: FloatArray = k
        return out

    def _ratings(self, k: FloatArray, labels: IntArray) -> FloatArray:
        """The predictions with the terms of weights `k` and labels `labels` taken out, one each: (K,)."""
        u, q = self.u, self.q
        return self.read(u.num[q][None] - k[:, None] * u.compat[labels], u.den[q] - k)

    def read(self, num: FloatArray, den: FloatArray | float) -> FloatArray:
        """The predictions of messages with these sums: numerators (K, p) (or (p,)), and normalisers (K,)
        (read under `normalized` alone): the posterior, mixed with the baseline, as a clipped rating."""
        u, q = self.u, self.q
        num = np.atleast_2d(num)
        msg = num / np.reshape(den, (-1, 1)) if u.normalized else num * u.scale
        expected = expected_rating(softmax(u.floored[q][None] - u.gamma * msg), u.levels)
        if u.weight:
            expected = (1.0 - u.weight) * expected + u.weight * u.baseline[q]
        out: FloatArray = np.clip(expected, u.levels[0], u.levels[-1])
        return out

    def _effects(self, positions: IntArray) -> FloatArray:
        return self.rating - self._ratings(self.weights(positions), self.u.labels[positions])

    def _bound(self, k: FloatArray) -> FloatArray:
        """The most a known rating of weight `k` off the query's row and column can move the prediction,
        whatever its label: (len(k),), increasing in k."""
        u, q = self.u, self.q
        # Removing weight k of label v shifts the logits by gamma c (t_v - msg), c = k / (den - k) (or k
        # scale, and gamma c t_v, unnormalised): at most 1 - exp(-oscillation) in total variation.
        if u.normalized:
            c, spread = k / np.maximum(u.den[q] - k, 1e-300), u.compat - (u.num[q] / u.den[q])[None]
        else:
            c, spread = k * u.scale, u.compat
        osc = float((spread.max(axis=1) - spread.min(axis=1)).max()) * u.gamma * c
        out: FloatArray = (1.0 - u.weight) * float(u.levels[-1] - u.levels[0]) * -np.expm1(-osc)
        return out

    def explain(self, k: int) -> Explanation:
        known, u = self.u.s.known, self.u
        # The user's ratings and the item's others: a rating on both is the entry itself, never listed.
        row, col = u.row[known.cols[u.row] != self.item], self.col[known.rows[self.col] != u.user]
        candidates = np.concatenate([row, col])
        effects = self._effects(candidates)
        kth = (
            float(np.partition(np.abs(effects), len(effects) - k)[len(effects) - k])
            if len(effects) >= k
            else 0.0
        )
        reach = u.user_max * float(u.item_max[self.q])  # the largest weight off the row and column
        if k > 0 and float(self._bound(np.array([reach]))[0]) > kth:
            # Some rating off the row and column might rank: weigh them all (their weight is the field's
            # product of similarities alone) and score exactly those whose bound clears the k-th effect.
            off = np.ones(len(known), dtype=bool)
            off[u.row] = off[self.col] = False
            rest = np.flatnonzero(off)
            weight = u.user_sim[known.rows[rest]] * self.item_sim[known.cols[rest]]
            rest = rest[self._bound(weight) > kth]
            candidates = np.concatenate([candidates, rest])
            effects = np.concatenate([effects, self._effects(rest)])
        top = np.lexsort((candidates, -np.abs(effects)))[:k]  # largest |effect| first, ties by position
        network = float(u.network[self.q])
        return Explanation(self.rating, network, candidates[top], effects[top])
