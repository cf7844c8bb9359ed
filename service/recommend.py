"""Top-k recommendation logic behind GET /recommend/{user_id}: candidates, ranking, popularity fallback.

Pure numpy over the scorer's public queries (`user_index`, `rated_items`, `predict`, `known`), so it
keeps working once users and ratings arrive online.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from model.ids import UnknownIdError
from model.online import OnlineState
from model.ranking import POOL, POOL_MIN, diversify
from model.ratings import Ratings
from service.scoring import ServedModel, top_k

POPULAR_SHRINKAGE = 10.0
"""s of the popularity fallback's shrunk mean rating (sum_j + s * mu) / (n_j + s): an item needs about s
ratings before its own mean outweighs the global mean mu, so a single 5-star rating does not top the list."""

POPULAR_REASON = (
    "popular: the user has no ratings the model can read, so items are ranked by their shrunk mean rating "
    "(no known rating of the user's shaped the list)"
)
"""What an explanation of a popular-list answer says instead of `because`."""

_popular: tuple[Ratings, np.ndarray] | None = None  # the known ratings it was computed from, the scores
_popular_lock = threading.Lock()


def split_ids(raw: str | None) -> list[str] | None:
    """The ids of a comma-separated query value, whitespace stripped, empty entries dropped, first
    occurrence kept; None when the parameter is absent."""
    if raw is None:
        return None
    return list(dict.fromkeys(part for part in (p.strip() for p in raw.split(",")) if part))


def shrunk_means(known: Ratings, n_items: int, shrinkage: float = POPULAR_SHRINKAGE) -> np.ndarray:
    """Per item (n_items,): (sum of its ratings + s * mu) / (its rating count + s), mu the global mean
    rating (an item nobody rated scores mu)."""
    if len(known) == 0:
        return np.zeros(n_items, dtype=np.float64)
    by_col = known.by_col  # each item's ratings (positions that hold none are in no line)
    values = known.values[by_col.order]
    item = np.repeat(np.arange(by_col.n_lines), by_col.count)
    sums = np.bincount(item, weights=values, minlength=n_items)[:n_items]
    counts = np.bincount(item, minlength=n_items)[:n_items]
    mu = float(values.mean())
    return (sums + shrinkage * mu) / (counts + shrinkage)


def popular_scores(scorer: ServedModel, state: OnlineState | None = None) -> np.ndarray:
    """`shrunk_means` of the known ratings of `state` (default: now; the artifact's and the online ones;
    an item first rated online counts once it has an embedding), computed once per state (read-only)."""
    global _popular
    known = (state or scorer.state).known
    cached = _popular
    if cached is not None and cached[0] is known:
        return cached[1]
    scores = shrunk_means(known, known.n_items)
    scores.flags.writeable = False
    with _popular_lock:
        _popular = (known, scores)
    return scores


def candidate_mask(
    n_items: int, rated: np.ndarray, allow: np.ndarray | None, exclude: np.ndarray | None
) -> np.ndarray:
    """Boolean (n_items,): the allow-list (every item when None) less the rated and excluded items."""
    if allow is None:
        mask = np.ones(n_items, dtype=bool)
    else:
        mask = np.zeros(n_items, dtype=bool)
        mask[allow] = True
    mask[rated] = False
    if exclude is not None:
        mask[exclude] = False
    return mask


@dataclass(frozen=True)
class Ranking:
    """How a list is cut from the predicted ratings besides the allow and exclude lists: `selected`
    ((n_items,) bool: a filter's items, None for all), `strict` (False: fill a short list from outside
    the filter), `boost` ((n_items,): added to the ranking score), `min_rating` (no item predicted
    lower), `diversity` (in [0, 1]: `diversify`), `required` ((n_items,) bool: the only items allowed at
    all, a deployment's default filter, past which a short list is not filled), `popular` (the popular
    list whoever the user: an experiment's variant)."""

    selected: np.ndarray | None = None
    strict: bool = True
    boost: np.ndarray | None = None
    min_rating: float | None = None
    diversity: float = 0.0
    required: np.ndarray | None = None
    popular: bool = False


def recommend(
    scorer: ServedModel,
    user_id: str,
    k: int,
    allow: np.ndarray | None,
    exclude: np.ndarray | None,
    state: OnlineState | None = None,
    exact: bool = False,
    ranking: Ranking = Ranking(),
) -> tuple[np.ndarray, np.ndarray, bool, np.ndarray]:
    """(items, ratings, fallback, outside): the user's top k among the candidates by predicted rating
    plus `ranking.boost`, or, for a user the scorer does not know or one with no ratings, by shrunk mean
    rating (fallback), in `state` (default: now; `allow`, `exclude`: indices valid in it); `exact`: not
    from a cached row of an earlier state (`ServedModel.predict`).

    Candidates are the items not rated, allowed, not excluded, not dismissed by the user, not hidden (the
    catalogue's) and not predicted under `ranking.min_rating`; only `ranking.selected` ones, and when
    fewer than k of those pass and not `ranking.strict`, the list is filled with the best of the rest,
    `outside` (K,) bool saying which; `ranking.diversity` re-ranks the best of each by `diversify`."""
    state = state or scorer.state  # one model state for the whole answer
    try:
        user = scorer.user_index(user_id, state)
    except UnknownIdError:
        user = None
    rated = scorer.rated_items(user, state) if user is not None else np.empty(0, dtype=np.int64)
    fallback = user is None or len(rated) == 0 or ranking.popular
    n_items = state.known.n_items  # the artifact's items, then those first rated online
    mask = candidate_mask(n_items, rated, allow, exclude)
    mask &= scorer.catalogue_index(state).visible
    dismissed = state.dismissed.get(user_id)
    if dismissed:  # `dismiss` events: never again for this user
        found = scorer.fold.item_indices(sorted(dismissed), state)
        mask[found[found >= 0]] = False
    if ranking.required is not None:
        mask &= ranking.required[:n_items]
    if not mask.any():
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float64), fallback, np.empty(0, dtype=bool)
    # Every item in one call whatever the candidates: the `paper` mode's block CRFs couple the queries that
    # share a block, so a rating must not depend on which other items were asked for.
    scores = popular_scores(scorer, state) if user is None or fallback else scorer.row(user, state, exact)
    if ranking.min_rating is not None:
        mask &= scores >= ranking.min_rating
    rank = scores if ranking.boost is None else scores + ranking.boost[: len(scores)]
    lo, hi = float(scorer.levels[0]), float(scorer.levels[-1])

    def pick(among: np.ndarray, count: int) -> np.ndarray:
        if ranking.diversity <= 0:
            return top_k(rank, among, count)
        pool = top_k(rank, among, max(POOL * count, POOL_MIN))
        relevance = (rank[pool] - lo) / max(hi - lo, 1e-12)
        return diversify(pool, relevance, state.network.item_lifted, count, ranking.diversity)

    selected = ranking.selected
    best = pick(mask if selected is None else mask & selected, k)
    outside = np.zeros(len(best), dtype=bool)
    if not ranking.strict and selected is not None and len(best) < k:
        rest = pick(mask & ~selected, k - len(best))
        best = np.concatenate([best, rest])
        outside = np.concatenate([outside, np.ones(len(rest), dtype=bool)])
    return best, scores[best], fallback, outside
