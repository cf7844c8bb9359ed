"""GET /recommend/{user_id}: the items a user would rate highest, among those they have not rated."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

import numpy as np
import orjson
from fastapi import APIRouter, Header, HTTPException, Path, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from starlette.concurrency import run_in_threadpool

from model.exact.explain import CannotExplain
from model.experiments import team_draft
from model.ids import UnknownIdError
from model.online import OnlineState
from service.auth import holds_write_token, require_read
from service.catalogue import Boost, Filter, both, check_shape, short_filter
from service.consistency import After, wait_applied
from service.deps import ScorerDep, SettingsDep
from service.errors import invalid, unknown_ids
from service.experiments import NO_OPTIONS, RankingOptions
from service.impressions import Served, new_id
from service.recommend import POPULAR_REASON, POPULAR_SHRINKAGE, Ranking, recommend, split_ids
from service.schemas import MAX_ID_LENGTH, Explanation
from service.scoring import ServedModel
from service.settings import Settings

router = APIRouter(tags=["recommendations"])


class Recommendation(BaseModel):
    """One recommended item."""

    item: str
    rating: float = Field(
        description="Predicted rating; with `fallback: popular`, the item's shrunk mean rating instead."
    )
    explanation: Explanation | None = Field(default=None, description="With `explain=true`.")
    boost: float | None = Field(
        default=None, description="What the boosts that hold for the item added to its ranking score"
    )
    outside_filter: bool | None = Field(
        default=None, description="true: does not pass the filter, added to fill the list (`strict: false`)"
    )


class RecommendResponse(BaseModel):
    """The top-k items, best first."""

    user: str
    model_version: str
    inference: Literal["paper", "none", "exact"]
    fallback: Literal["popular"] | None = Field(
        default=None,
        description="`popular` when the user is unknown or has no ratings: items ranked by shrunk mean "
        f"rating (sum + s * mu) / (n + s), mu the global mean, s = {POPULAR_SHRINKAGE:g}; absent otherwise.",
    )
    rules: list[str] | None = Field(
        default=None,
        description="The rules that shaped the list: `default_filter`, `boost:<name>` (moved an item of "
        "it), `min_rating`, `diversity`",
    )
    filter_notes: list[str] | None = Field(
        default=None,
        description="Clauses of the filter that match nothing because no item has what they name",
    )
    recommendations: list[Recommendation]
    recommendation_id: str = Field(
        description="This answer's id (32 hex digits): what it showed is kept in the impressions stream "
        "(service/impressions.py). Send it back with the ratings and events that follow the answer."
    )
    experiment: str | None = Field(
        default=None, description="The experiment the user takes part in (DCMC_EXPERIMENTS), if any"
    )
    variant: str | None = Field(
        default=None,
        description="The user's variant in it; `interleaved` where both variants' lists are merged",
    )


_ID_LIST = "Comma-separated external item ids, in one parameter (`{name}=i1,i2,i3`; not repeated)."


def _ids(request: Request, name: str) -> list[str] | None:
    """The ids of the comma-separated parameter `name` (None when absent); 422 when it is repeated (a
    repeated parameter would otherwise silently keep only its last value)."""
    values = request.query_params.getlist(name)
    if len(values) > 1:
        raise HTTPException(
            status_code=422,
            detail=[
                {
                    "loc": ["query", name],
                    "type": "repeated",
                    "msg": f"{name} is given {len(values)} times; pass one comma-separated list "
                    f"({name}=i1,i2)",
                }
            ],
        )
    return split_ids(values[0]) if values else None


@router.get(
    "/recommend/{user_id:path}",
    response_model=RecommendResponse,
    response_model_exclude_none=True,
    responses={
        401: {"description": "DCMC_READ_TOKEN is set and the request does not carry it"},
        404: {"description": "Unknown item ids in `items` or `exclude` (all listed in `unknown_items`)"},
        422: {"description": "k out of range, an empty or repeated `items`"},
        503: {"description": "The model is loading, or `after` was not applied in time (see Retry-After)"},
    },
)
async def recommend_items(
    request: Request,
    user_id: Annotated[str, Path(description="External user id")],
    scorer: ScorerDep,
    settings: SettingsDep,
    k: Annotated[int, Query(description="How many items to return (1..DCMC_MAX_K)")] = 10,
    items: Annotated[
        str | None,
        Query(description="Allow-list: only these are candidates. " + _ID_LIST.format(name="items")),
    ] = None,
    exclude: Annotated[
        str | None, Query(description="Removed from the candidates. " + _ID_LIST.format(name="exclude"))
    ] = None,
    category: Annotated[
        str | None,
        Query(description="Only items with one of these categories (comma-separated: `Drama,Comedy`)"),
    ] = None,
    exclude_category: Annotated[
        str | None, Query(description="No items with any of these categories (comma-separated)")
    ] = None,
    diversity: Annotated[
        float | None,
        Query(
            ge=0,
            le=1,
            description="0 = by predicted rating alone (default DCMC_DIVERSITY); up to 1: "
            "more varied (maximal marginal relevance over the learned item similarity)",
        ),
    ] = None,
    min_rating: Annotated[
        float | None, Query(allow_inf_nan=False, description="No item predicted lower than this")
    ] = None,
    after: After = None,
    explain: Annotated[
        bool,
        Query(
            description="Also say which known ratings moved each recommended item's predicted rating, by "
            "how much (`exact` inference only; 422 otherwise)"
        ),
    ] = False,
    authorization: Annotated[str | None, Header()] = None,
) -> Response:
    """The k items with the highest predicted rating that the user has not rated, best first (ties by
    item index); fewer when fewer candidates remain.

    `items` and `exclude` each take one comma-separated list of item ids (`?items=i1,i2&exclude=i2`).
    Ratings are predicted for every item in one call, so they do not depend on `items` or `exclude`.
    A user the service does not know, or one with no ratings, gets the items with the best shrunk mean
    rating instead (same exclusions and filter), marked `"fallback": "popular"`. Hidden items (the
    catalogue's) are never recommended; `category` and `exclude_category` filter by category (POST
    /recommend takes any filter).
    """
    allow_ids, exclude_ids = _ids(request, "items"), _ids(request, "exclude")
    if allow_ids is not None and not allow_ids:
        raise invalid(["query", "items"], "too_short", "items lists no item ids")
    chosen = short_filter(_ids(request, "category"), _ids(request, "exclude_category"))
    query = Asked(
        user_id, k, allow_ids, exclude_ids, chosen, True, explain, ["query"], [], min_rating, diversity
    )
    return await _recommend(scorer, settings, query, after, authorization)


class RecommendRequest(BaseModel):
    """POST /recommend: GET /recommend/{user}'s query with the full filter."""

    model_config = ConfigDict(extra="forbid")

    user: Annotated[str, StringConstraints(strict=True, min_length=1, max_length=MAX_ID_LENGTH)]
    k: int = Field(default=10, description="How many items to return (1..DCMC_MAX_K)")
    items: list[str] | None = Field(default=None, min_length=1, description="Allow-list: only these")
    exclude: list[str] | None = Field(default=None, description="Removed from the candidates")
    filter: Filter | None = Field(
        default=None,
        description="Only items it holds for (service/catalogue.py: category, eq, in, range, "
        "exists, all, any, not); hidden items are never recommended",
    )
    strict: bool = Field(
        default=True,
        description="false: when fewer than k items pass the filter, fill the list with the best others, "
        "each marked `outside_filter`",
    )
    boosts: list[Boost] = Field(
        default_factory=list,
        max_length=16,
        description="Business rules of this request: `amount` added to the ranking score of the items "
        "`filter` holds for (besides DCMC_BOOSTS)",
    )
    min_rating: float | None = Field(
        default=None, allow_inf_nan=False, description="No item predicted lower than this"
    )
    diversity: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="0 = by predicted rating alone (default DCMC_DIVERSITY); up to 1: more varied",
    )
    explain: bool = False


@router.post(
    "/recommend",
    response_model=RecommendResponse,
    response_model_exclude_none=True,
    responses={
        401: {"description": "DCMC_READ_TOKEN is set and the request does not carry it"},
        404: {"description": "Unknown item ids in `items` or `exclude` (all listed in `unknown_items`)"},
        422: {"description": "k out of range; a bad filter (the error names the part)"},
        503: {"description": "The model is loading, or `after` was not applied in time (see Retry-After)"},
    },
)
async def recommend_post(
    body: RecommendRequest,
    scorer: ScorerDep,
    settings: SettingsDep,
    after: After = None,
    authorization: Annotated[str | None, Header()] = None,
) -> Response:
    """GET /recommend/{user}, the query in the body, with a full filter: for example
    `{"user": "7", "k": 10, "filter": {"op": "all", "of": [{"op": "category", "any_of": ["Comedy"]},
    {"op": "range", "attribute": "year", "gte": 1990, "lt": 2000}]}}`."""
    if body.filter is not None:
        check_shape(body.filter, ["body", "filter"])
    for n, boost in enumerate(body.boosts):
        check_shape(boost.filter, ["body", "boosts", n, "filter"])
    query = Asked(
        body.user,
        body.k,
        body.items,
        body.exclude,
        body.filter,
        body.strict,
        body.explain,
        ["body"],
        body.boosts,
        body.min_rating,
        body.diversity,
    )
    return await _recommend(scorer, settings, query, after, authorization)


@dataclass(frozen=True)
class Asked:
    """What both routes ask: the user, k, the allow and exclude lists, the filter, strictness, explain,
    and where in the request they came from (errors name it)."""

    user: str
    k: int
    allow: list[str] | None
    exclude: list[str] | None
    filter: Filter | None
    strict: bool
    explain: bool
    loc: list[str | int]
    boosts: list[Boost]
    min_rating: float | None
    diversity: float | None


async def _recommend(
    scorer: ServedModel, settings: Settings, q: Asked, after: str | None, authorization: str | None
) -> Response:
    require_read(settings, authorization)
    if not 1 <= q.k <= settings.max_k:
        msg = f"k must lie in 1..{settings.max_k} (setting DCMC_MAX_K), got {q.k}"
        raise invalid([*q.loc, "k"], "out_of_range", msg)
    await wait_applied(scorer, after, settings.read_after_timeout_s)
    exact = after is not None or q.explain  # of the newest state, not from an earlier state's row
    if scorer.blocking:  # tens of ms of numpy: keep the event loop free
        listed = await run_in_threadpool(ranked, scorer, settings, q, exact)
    else:
        listed = ranked(scorer, settings, q, exact)
    payload, used = listed
    if q.explain:  # off the event loop: tens of milliseconds
        reveal = holds_write_token(settings, authorization)
        whys = await run_in_threadpool(
            _explanations, used.model, used.state, q.user, used.best, used.fallback, reveal, q.loc
        )
        for rec, why in zip(payload["recommendations"], whys, strict=True):
            rec["explanation"] = why
    return Response(orjson.dumps(payload), media_type="application/json")


def plain(scorer: ServedModel, settings: Settings, user: str, k: int, chosen: Filter | None = None) -> bytes:
    """The JSON of GET /recommend/{user}?k=K with nothing else asked but the category short form
    (`chosen`; 1 <= k <= DCMC_MAX_K, the read allowed): what the route answers, without FastAPI's
    parameter handling (service/fastpath.py)."""
    asked = Asked(user, k, None, None, chosen, True, False, ["query"], [], None, None)
    return orjson.dumps(ranked(scorer, settings, asked, False)[0])


@dataclass(frozen=True)
class Listed:
    """One model's list: the answer's JSON object (without its id), the model and state it came from,
    the items (indices in that state), their scores, and whether it is the popular list."""

    payload: dict[str, Any]
    model: ServedModel
    state: OnlineState
    best: np.ndarray
    scores: np.ndarray
    fallback: bool


def ranked(scorer: ServedModel, settings: Settings, q: Asked, exact: bool) -> tuple[dict[str, Any], Listed]:
    """The answer's JSON object (without explanations) and the list behind it (for the explanations);
    HTTPException for unknown ids and bad filters. A user in an experiment (service/experiments.py) gets
    their variant's list, or both variants' interleaved; the answer says which."""
    assignment = scorer.experiments.assigned(q.user) if scorer.experiments is not None else None
    if assignment is None:
        listed = _listed(scorer, settings, q, exact)
        listed.payload["recommendation_id"] = scorer.shown(
            "/recommend", {"user": q.user}, _items(listed), listed.scores.tolist()
        )
        return listed.payload, listed
    experiment = assignment.experiment
    assert scorer.experiments is not None
    scorer.experiments.answered(experiment.id, assignment.variant, scorer.metrics)
    if experiment.method == "ab":
        options = scorer.experiments.ranking[(experiment.id, assignment.variant)]
        model = scorer.variant_model(experiment.id, assignment.variant)
        listed = _listed(model, settings, _with(q, options), exact, options.popular)
        more: dict[str, Any] = {
            "experiment": experiment.id,
            "variant": assignment.variant,
            "dists": _dists(q.user, listed),
        }
        payload = {**listed.payload, "experiment": experiment.id, "variant": assignment.variant}
        payload["recommendation_id"] = scorer.shown(
            "/recommend", {"user": q.user}, _items(listed), listed.scores.tolist(), more
        )
        return payload, listed
    # Interleaved: each variant's list, merged by team draft (model/experiments.py).
    lists = []
    for variant in experiment.variants:
        options = scorer.experiments.ranking[(experiment.id, variant.name)]
        model = scorer.variant_model(experiment.id, variant.name)
        lists.append(_listed(model, settings, _with(q, options), exact, options.popular))
    recommendation_id = new_id()
    items, teams = team_draft(_items(lists[0]), _items(lists[1]), q.k, recommendation_id)
    entries: list[dict[str, tuple[dict[str, Any], float, list[float] | None]]] = []
    for one in lists:
        served = _dists(q.user, one)
        dists: list[list[float] | None] = [None] * len(one.best)
        if served is not None:
            dists = list(served.dists())
        recs, scores = one.payload["recommendations"], one.scores.tolist()
        entries.append({rec["item"]: (rec, s, d) for rec, s, d in zip(recs, scores, dists, strict=True)})
    chosen = [entries[team][item] for item, team in zip(items, teams, strict=True)]
    control = lists[0]
    payload = {
        **control.payload,
        "recommendations": [rec for rec, _, _ in chosen],
        "experiment": experiment.id,
        "variant": assignment.variant,
    }
    if not all(one.fallback for one in lists):
        payload.pop("fallback", None)
    more = {
        "experiment": experiment.id,
        "variant": assignment.variant,
        "teams": [experiment.variants[team].name for team in teams],
        "dists": [dist for _, _, dist in chosen],
    }
    payload["recommendation_id"] = scorer.shown(
        "/recommend", {"user": q.user}, items, [score for _, score, _ in chosen], more, recommendation_id
    )
    try:  # the control's model explains an interleaved list
        best = control.model.item_indices(items, control.state) if items else control.best[:0]
    except UnknownIdError:
        if q.explain:
            msg = "this interleaved list holds items the control variant's model does not know"
            raise invalid([*q.loc, "explain"], "cannot_explain", msg) from None
        best = control.best[:0]
    return payload, Listed(payload, control.model, control.state, best, control.scores, control.fallback)


def _items(listed: Listed) -> list[str]:
    """The external ids of a list's items, as its answer names them."""
    return [rec["item"] for rec in listed.payload["recommendations"]]


def _with(q: Asked, options: RankingOptions) -> Asked:
    """The query with a variant's ranking options: the request's own values win, the variant's filter
    holds besides the request's and its boosts add to them."""
    if options == NO_OPTIONS:
        return q
    return replace(
        q,
        filter=both(q.filter, options.filter),
        boosts=[*q.boosts, *options.boosts],
        min_rating=q.min_rating if q.min_rating is not None else options.min_rating,
        diversity=q.diversity if q.diversity is not None else options.diversity,
    )


def _dists(user: str, listed: Listed) -> Served | None:
    """The served distributions of a list's items (made into the impression's by its writing thread:
    calibrated as /predict serves them), None for the popular list."""
    if listed.fallback or not len(listed.best):
        return None
    model = listed.model
    index = model.user_index(user, listed.state)
    _, dists, _ = model.predict(index, listed.best, True, listed.state)
    assert dists is not None
    return Served(dists, model.temperature)


def _listed(scorer: ServedModel, settings: Settings, q: Asked, exact: bool, popular: bool = False) -> Listed:
    """One model's list for the query (`ranked`)."""
    try:
        scorer.item_indices((q.allow or []) + (q.exclude or []))  # one 404 listing every unknown id
    except UnknownIdError as exc:
        raise unknown_ids(exc) from None
    allow = scorer.item_indices(q.allow) if q.allow is not None else None
    excluded = scorer.item_indices(q.exclude) if q.exclude is not None else None
    state = scorer.state  # one model state for the ranking and its explanations
    catalogue = scorer.catalogue_index(state)
    selected = required = None
    notes: list[str] = []
    rules: list[str] = []
    if q.filter is not None:
        selected, notes = catalogue.select(q.filter, [*q.loc, "filter"])
    if settings.default_filter is not None:  # a deployment's: holds even where `strict: false` fills
        required, more = catalogue.select(settings.default_filter, ["default_filter"])
        notes += [f"default filter: {note}" for note in more]
        rules.append("default_filter")
    boosts = [*settings.boosts, *q.boosts]
    boost, boosted = None, []
    for n, rule in enumerate(boosts):
        where = (
            ["settings", "boosts", n]
            if n < len(settings.boosts)
            else [*q.loc, "boosts", n - len(settings.boosts)]
        )
        holds, more = catalogue.select(rule.filter, [*where, "filter"])
        notes += [f"boost {rule.name}: {note}" for note in more]
        boost = np.zeros(catalogue.n_items) if boost is None else boost
        boost += rule.amount * holds
        boosted.append((rule.name, holds))
    diversity = scorer.diversity if q.diversity is None else q.diversity
    ranking = Ranking(selected, q.strict, boost, q.min_rating, diversity, required, popular)
    best, scores, fallback, outside = recommend(scorer, q.user, q.k, allow, excluded, state, exact, ranking)
    # Serialised by the caller rather than through RecommendResponse (which documents the shape in
    # OpenAPI), as POST /predict does.
    payload: dict[str, Any] = {
        "user": q.user,
        "model_version": scorer.version,
        "inference": scorer.inference.mode,
    }
    if fallback:
        payload["fallback"] = "popular"
    if notes:
        payload["filter_notes"] = notes
    rules += [f"boost:{name}" for name, holds in boosted if holds[best].any()]
    if q.min_rating is not None:
        rules.append("min_rating")
    if diversity > 0:
        rules.append("diversity")
    if rules:
        payload["rules"] = rules
    recommendations: list[dict[str, object]] = [
        {"item": scorer.item_id(int(i)), "rating": float(s)} for i, s in zip(best, scores, strict=True)
    ]
    for rec, out in zip(recommendations, outside.tolist(), strict=True):
        if out:
            rec["outside_filter"] = True
    if boost is not None:
        for rec, amount in zip(recommendations, boost[best].tolist(), strict=True):
            if amount:
                rec["boost"] = amount
    payload["recommendations"] = recommendations
    return Listed(payload, scorer, state, best, scores, fallback)


def _explanations(
    scorer: ServedModel,
    state: OnlineState,
    user_id: str,
    best: np.ndarray,
    fallback: bool,
    reveal: bool,
    loc: list[str | int],
) -> list[dict[str, Any]]:
    """`ServedModel.explain` of the recommended items (422 where the mode cannot explain), or, for the
    popular list, a reason each."""
    try:
        if fallback:
            state.scorer.explain(0, np.empty(0, dtype=np.int64), 1)  # a mode that cannot explain says so
            return [{"reason": POPULAR_REASON} for _ in best]
        user = scorer.user_index(user_id, state)
        return scorer.explain(user, best, scorer.settings.explain_k, state, reveal)
    except CannotExplain as exc:
        raise invalid([*loc, "explain"], "cannot_explain", str(exc)) from None
