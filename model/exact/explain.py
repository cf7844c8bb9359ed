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
most 1 - exp(-d) in total variation, so the expected rating by at most (L_p - L_1) times that, and by at
most e^(d/2) sd d / 2, sd the levels' standard deviation under the query's posterior: `Queries.bound`);
only when the bound does not clear the k-th largest effect are the others weighed (a product each) and
scored where their own bound clears it, so the list is exact either way.

The network's own use of the rating row (the row branch embeds the user from the ratings) is not
decomposed: an explanation holds the network's outputs fixed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from model.engine import expected_rating, log_softmax, softmax
from model.exact.messages import ClampedRows
from model.exact.posterior import LOG_FLOOR
from model.types import FloatArray, IntArray

if TYPE_CHECKING:
    from model.exact.scorer import ExactScorer
    from model.ratings import Ratings


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
    return explain_mean([scorer], user, items, k)


def explain_mean(scorers: Sequence[ExactScorer], user: int, items: IntArray, k: int) -> list[Explanation]:
    """`explain` for the mean of several scorers' final distributions (one network and known ratings,
    several settings: `model.scorers.MeanScorer`): its expected rating is the scorers' mean, so a known
    rating's effect is the mean of its effects, ranked and bounded the same way."""
    if any(scorer.kernel.known != "clamped" for scorer in scorers):
        raise CannotExplain(
            "explanations need known entries clamped to their ratings (inference.kernel.known=clamped): "
            "only then is each known rating's term fixed"
        )
    items = np.asarray(items, dtype=np.int64)
    if not len(items):
        return []
    queries = [Queries(s, user, items) for s in scorers]
    return (queries[0] if len(queries) == 1 else MeanQueries(queries)).explain(k)


class Ranking:
    """The k largest effects of each query, exact (module docstring): what `Queries` and `MeanQueries`
    share. A subclass gives the queries, the known ratings, the similarities, `effects` and `bound`."""

    user: int
    items: IntArray
    known: Ratings
    row: IntArray
    user_sim: FloatArray
    item_sims: FloatArray
    user_max: float
    item_max: FloatArray
    ratings: FloatArray
    network: FloatArray

    def effects(self, owner: IntArray, positions: IntArray) -> FloatArray:
        raise NotImplementedError

    def bound(self, q: int, k: FloatArray) -> FloatArray:
        raise NotImplementedError

    def column(self, q: int) -> IntArray:
        """Positions of the known ratings of query q's item."""
        item = int(self.items[q])
        return self.known.by_col.of(item) if item < self.known.n_items else np.empty(0, dtype=np.int64)

    def explain(self, k: int) -> list[Explanation]:
        known, items, queries = self.known, self.items, np.arange(len(self.items))
        # Each query's user's ratings and its item's others (a rating on both is the entry itself, never
        # listed), all queries in one pass.
        cols = [self.column(q) for q in queries.tolist()]
        row_cols = known.cols[self.row]
        owner = np.concatenate(
            [np.repeat(queries, len(self.row)), np.repeat(queries, [len(c) for c in cols])]
        )
        positions = np.concatenate([np.tile(self.row, len(items)), *cols]).astype(np.int64)
        keep = np.concatenate(
            [(row_cols[None] != items[:, None]).ravel(), *[known.rows[c] != self.user for c in cols]]
        )
        owner, positions = owner[keep], positions[keep]
        effects = self.effects(owner, positions)
        order = np.lexsort((positions, -np.abs(effects), owner))  # by query, largest |effect| first
        owner, positions, effects = owner[order], positions[order], effects[order]
        starts = np.searchsorted(owner, queries)
        counts = np.searchsorted(owner, queries, side="right") - starts
        kth = np.where(counts >= k, np.abs(effects[np.minimum(starts + k - 1, len(effects) - 1)]), 0.0)
        reach = self.user_max * self.item_max  # the largest weight off each query's row and column
        out = []
        for q in queries.tolist():
            got = slice(starts[q], starts[q] + min(k, counts[q]))
            top_pos, top_eff = positions[got], effects[got]
            if k > 0 and self.bound(q, reach[q : q + 1])[0] > kth[q]:
                top_pos, top_eff = self._widened(q, k, float(kth[q]), top_pos, top_eff)
            out.append(Explanation(float(self.ratings[q]), float(self.network[q]), top_pos, top_eff))
        return out

    def _widened(
        self, q: int, k: int, kth: float, top_pos: IntArray, top_eff: FloatArray
    ) -> tuple[IntArray, FloatArray]:
        """Query q's top k once the ratings off its row and column are weighed too (their weight is the
        field's product of similarities alone) and scored where their own bound clears the k-th effect."""
        known = self.known
        off = known.held()
        off[self.row] = off[self.column(q)] = False
        rest = np.flatnonzero(off)
        weight = self.user_sim[known.rows[rest]] * self.item_sims[q, known.cols[rest]]
        rest = rest[self.bound(q, weight) > kth]
        positions = np.concatenate([top_pos, rest])
        effects = np.concatenate([top_eff, self.effects(np.full(len(rest), q), rest)])
        top = np.lexsort((positions, -np.abs(effects)))[:k]
        return positions[top], effects[top]


class Queries(Ranking):
    """One user's queries: their messages' whole sums (read the scorer's way, in one pass), from which
    taking out any known rating's term is read exactly, for all the queries at once."""

    def __init__(self, scorer: ExactScorer, user: int, items: IntArray) -> None:
        self.s, self.user, self.items = scorer, user, items
        net, known, lines = scorer.network, scorer.known, scorer.lines
        self.known, self.lines = known, lines
        self.levels, self.compat, self.gamma = net.levels, scorer.compat, scorer.crf.gamma
        self.labels = known.labels(net.levels)
        a, b = scorer.user_lifted, scorer.item_lifted
        n, m, queries = known.n_users, known.n_items, np.arange(len(items))
        self.user_sim = a[:n] @ a[user]  # s_r(i, .)
        self.item_sims = b[items] @ b[:m].T  # (K, m): s_c(j, .) of each query's item
        # the largest similarity to another user, to another item (what reaches off the row and column)
        others = self.user_sim.copy()
        others[user if user < n else slice(0, 0)] = -np.inf
        self.user_max = float(others.max(initial=0.0))
        inside = items < m
        saved = self.item_sims[queries[inside], items[inside]].copy()
        self.item_sims[queries[inside], items[inside]] = -np.inf
        self.item_max = self.item_sims.max(axis=1, initial=0.0)
        self.item_sims[queries[inside], items[inside]] = saved
        self.user_line = np.zeros(n)  # w_u(i, .)
        self.item_lines = np.zeros((len(items), m))  # w(j, .) of each query's item
        if lines is not None and lines.co_rating_user > 0 and lines.user_affinity is not None:
            lines.user_affinity.add_line(self.user_line, user, 1.0)
        if lines is not None and lines.co_rating > 0 and lines.affinity is not None:
            for q in queries[inside].tolist():
                lines.affinity.add_line(self.item_lines[q], int(items[q]), 1.0)
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
        self.row = known.by_row.of(user) if user < n else np.empty(0, dtype=np.int64)
        self.ratings = self.read(queries, self.num, self.den)
        # The standard deviation of the levels under each query's posterior (what `bound` scales by).
        msg = self.num / self.den[:, None] if self.normalized else self.num * self.scale
        posterior = softmax(self.floored - self.gamma * msg)
        mean = posterior @ self.levels
        self.level_sd = np.sqrt(np.maximum(posterior @ self.levels**2 - mean**2, 0.0))

    def weights(self, owner: IntArray, positions: IntArray) -> FloatArray:
        """k_l of the known entries at `positions` for the queries `owner` (module docstring)."""
        known, lines = self.known, self.lines
        rows, cols = known.rows[positions], known.cols[positions]
        item_sim = self.item_sims[owner, cols]
        k = self.user_sim[rows] * item_sim
        if lines is not None:
            on_row, on_col = rows == self.user, cols == self.items[owner]
            k += on_row * (lines.same_user * item_sim + lines.co_rating * self.item_lines[owner, cols])
            k += on_col * (
                lines.same_item * self.user_sim[rows] + lines.co_rating_user * self.user_line[rows]
            )
        out: FloatArray = k
        return out

    def read(self, owner: IntArray, num: FloatArray, den: FloatArray) -> FloatArray:
        """The predictions of the queries `owner` from messages with these sums: numerators (K, p) and
        normalisers (K,) (read under `normalized` alone): the posterior, mixed with the baseline, as a
        clipped rating."""
        msg = num / den[:, None] if self.normalized else num * self.scale
        expected = expected_rating(softmax(self.floored[owner] - self.gamma * msg), self.levels)
        if self.weight:
            expected = (1.0 - self.weight) * expected + self.weight * self.baseline[owner]
        out: FloatArray = np.clip(expected, self.levels[0], self.levels[-1])
        return out

    def effects(self, owner: IntArray, positions: IntArray) -> FloatArray:
        """Each query's prediction minus its prediction without the term of the rating at `positions`."""
        k = self.weights(owner, positions)
        num = self.num[owner] - k[:, None] * self.compat[self.labels[positions]]
        out: FloatArray = self.ratings[owner] - self.read(owner, num, self.den[owner] - k)
        return out

    def bound(self, q: int, k: FloatArray) -> FloatArray:
        """The most a known rating of weight `k` off query q's row and column can move its prediction,
        whatever its label: increasing in k."""
        # Removing weight k of label v shifts the logits by gamma c (t_v - msg), c = k / (den - k) (or k
        # scale, and gamma c t_v, unnormalised): at most 1 - exp(-oscillation) in total variation.
        if self.normalized:
            c, spread = k / np.maximum(self.den[q] - k, 1e-300), self.compat - self.num[q] / self.den[q]
        else:
            c, spread = k * self.scale, self.compat
        widest = float((spread.max(axis=1) - spread.min(axis=1)).max())
        # Two bounds of the expected rating's move under a logit shift of oscillation d, the smaller
        # taken: (L_p - L_1) (1 - e^-d) from total variation, and e^(d/2) sd d / 2, sd the levels'
        # standard deviation under the query's posterior: along the path pi_s ~ pi exp(s delta) (delta
        # centred, |delta| <= d/2), dE/ds = Cov_s(L, delta) <= sd_s(L) d/2 and pi_s <= pi e^(s d), so
        # sd_s(L) <= e^(s d/2) sd. The second is what keeps a confident query off the full scan.
        d = self.gamma * c * widest
        total_variation = float(self.levels[-1] - self.levels[0]) * -np.expm1(-d)
        spread_bound = np.exp(np.minimum(d / 2, 700.0)) * self.level_sd[q] * d / 2
        out: FloatArray = (1.0 - self.weight) * np.minimum(total_variation, spread_bound)
        return out


class MeanQueries(Ranking):
    """The same queries of several scorers of one network and known ratings (several settings): the
    prediction, each effect and each bound are the members' means (a mean of bounds increasing in the
    weight is one too)."""

    def __init__(self, members: Sequence[Queries]) -> None:
        first = members[0]
        self.members = members
        self.user, self.items, self.known, self.row = first.user, first.items, first.known, first.row
        self.user_sim, self.item_sims = first.user_sim, first.item_sims
        self.user_max, self.item_max = first.user_max, first.item_max
        self.network = first.network
        self.ratings = np.mean([m.ratings for m in members], axis=0)

    def effects(self, owner: IntArray, positions: IntArray) -> FloatArray:
        out: FloatArray = np.mean([m.effects(owner, positions) for m in self.members], axis=0)
        return out

    def bound(self, q: int, k: FloatArray) -> FloatArray:
        out: FloatArray = np.mean([m.bound(q, k) for m in self.members], axis=0)
        return out
