"""POST /ratings: ratings that arrive while the service runs, stored durably and folded into the model."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Protocol

import numpy as np
import redis
from fastapi import APIRouter, Header, HTTPException, Path, Query
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from model.ids import UnknownIdError
from model.stream import FORGET
from service.auth import require_write
from service.consistency import After, until_applied, wait_applied
from service.deps import ScorerDep, SettingsDep
from service.errors import too_long, unknown_ids
from service.online import NotDurable, stored_unknown
from service.schemas import MAX_ID_LENGTH, ExternalId, RecommendationId
from service.scoring import Reservation, ServedModel, TooManyNewIds
from service.settings import Settings

log = logging.getLogger(__name__)

router = APIRouter(tags=["ratings"])


class RatingIn(BaseModel):
    """One rating: `rating` must be one of the model's rating levels."""

    model_config = ConfigDict(extra="forbid")

    user: ExternalId
    item: ExternalId
    rating: float = Field(allow_inf_nan=False)
    recommendation_id: RecommendationId | None = Field(
        default=None, description="The answer this rating follows (its `recommendation_id`): for evaluation"
    )


class Rating(Protocol):
    """A parsed rating: `RatingIn`, or the fast path's (service/fastpath.py) with string ids."""

    user: str
    item: str
    rating: float
    recommendation_id: str | None


class RatingsRequest(BaseModel):
    """A batch of ratings, applied in order (a later rating of the same pair replaces an earlier one)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"ratings": [{"user": "196", "item": "242", "rating": 4}]}]},
    )

    ratings: list[RatingIn] = Field(min_length=1)


class RatingsResponse(BaseModel):
    """What was stored."""

    accepted: int = Field(description="Ratings stored (every worker folds them in right after).")
    last_id: str = Field(
        description="Stream id of the batch's last rating in Redis: pass it as `after` to /predict or "
        "/recommend for an answer that includes the batch."
    )
    model_version: str


def _authorize(settings: Settings, authorization: str | None) -> None:
    """403 while writes are off, 401 without the write token (every route that writes)."""
    require_write(settings, authorization, "POST /ratings")


@router.post(
    "/ratings",
    response_model=RatingsResponse,
    responses={
        401: {"description": "Missing or wrong bearer token"},
        403: {"description": "Writes are off (no DCMC_WRITE_TOKEN)"},
        422: {
            "description": "Empty, oversized or mistyped batch, a rating off the model's levels, or more new "
            "users or items than DCMC_MAX_NEW_USERS / DCMC_MAX_NEW_ITEMS allow (nothing stored)"
        },
        503: {
            "description": "Not stored, or not known to be: Redis is unavailable (nothing stored), did not "
            "answer in time (the batch may have been stored; retrying it is safe), or is not durable while "
            "DCMC_REQUIRE_DURABLE is set (nothing stored). The detail says which; see Retry-After."
        },
    },
)
async def post_ratings(
    body: RatingsRequest,
    scorer: ScorerDep,
    settings: SettingsDep,
    authorization: Annotated[str | None, Header()] = None,
) -> RatingsResponse:
    """Store ratings durably in Redis; the answer comes once they are stored. Every worker of every replica
    on the same Redis then folds them into its model within moments: a read with `after=<last_id>` waits
    until its worker has (read-your-writes), one without answers from what it has applied. A user id the
    model has never seen becomes a user from its first rating on, and an item id it has never seen a new
    item (predicted by the bias baseline until a user the model was trained on rates it), up to
    DCMC_MAX_NEW_USERS and DCMC_MAX_NEW_ITEMS in all; a batch that would pass either is refused whole
    (422)."""
    return await store(scorer, settings, body.ratings, authorization)


async def store(
    scorer: ServedModel, settings: Settings, ratings: Sequence[Rating], authorization: str | None
) -> RatingsResponse:
    """What POST /ratings does with a parsed batch: authorize, check it, store it in Redis; HTTPException
    says why not. The route and its fast path (service/fastpath.py) both answer with it."""
    _authorize(settings, authorization)
    if len(ratings) > settings.max_ratings:
        raise too_long("ratings", len(ratings), settings.max_ratings, "DCMC_MAX_RATINGS", "entries")
    levels = scorer.levels
    off = [
        {
            "loc": ["body", "ratings", k, "rating"],
            "type": "not_a_level",
            "msg": _level_message(r.rating, levels),
        }
        for k, r in enumerate(ratings)
        if not np.isclose(levels, r.rating, rtol=0, atol=1e-9).any()
    ]
    if off:
        raise HTTPException(status_code=422, detail=off)
    reservation = _admit(scorer, ratings)
    batch = [(r.user, r.item, _snap(r.rating, levels)) for r in ratings]
    recs = [r.recommendation_id for r in ratings]
    if any(rec is not None for rec in recs):
        last = await write_entries(scorer, lambda: scorer.write(batch, recs), reservation)
    else:
        last = await _write(scorer, batch, reservation)
    return RatingsResponse(accepted=len(batch), last_id=last, model_version=scorer.version)


async def _write(
    scorer: ServedModel,
    batch: Sequence[tuple[str, str, float | None]],
    reservation: Reservation | None = None,
) -> str:
    """`ServedModel.write` off the event loop (`write_entries`)."""
    return await write_entries(scorer, lambda: scorer.write(batch), reservation)


async def write_entries(
    scorer: ServedModel, write: Callable[[], str], reservation: Reservation | None = None
) -> str:
    """A write to the stream (`write()`: `ServedModel.write` or `write_items`) off the event loop; its
    failures as HTTPExceptions that say whether anything may have been stored (a batch not stored gives
    its reserved new ids back)."""
    retry = {"Retry-After": str(max(1, math.ceil(scorer.retry_s)))}
    try:
        last = await run_in_threadpool(write)
    except (redis.RedisError, NotDurable, RuntimeError) as exc:
        if reservation is not None and not (isinstance(exc, redis.RedisError) and stored_unknown(exc)):
            scorer.release(reservation)
        raise _write_failed(scorer, exc, retry) from None
    return last


def _write_failed(scorer: ServedModel, exc: Exception, retry: dict[str, str]) -> HTTPException:
    """The 503 of a write that failed, saying whether anything may have been stored."""
    if isinstance(exc, redis.RedisError):
        if stored_unknown(exc):
            log.warning("a write: no answer from Redis (%s); the batch may have been stored", exc)
            return HTTPException(
                status_code=503,
                detail="Redis did not answer in time, or did not confirm the write (" + _short(exc) + "): "
                "this batch may or may not have been stored. Retrying it is safe (a rating of the same user "
                "and item replaces the earlier one)",
                headers=retry,
            )
        log.warning("a write: Redis failed (%s); nothing stored", exc)
        return HTTPException(
            status_code=503,
            detail="Redis is unavailable; nothing of this batch was stored, retry later",
            headers=retry,
        )
    if isinstance(exc, NotDurable):
        return HTTPException(
            status_code=503,
            detail=f"writes are refused while Redis is not durable (DCMC_REQUIRE_DURABLE): {exc}; nothing "
            "of this batch was stored",
            headers=retry,
        )
    return HTTPException(status_code=503, detail=f"{exc}; nothing of this batch was stored")


def _short(exc: Exception) -> str:
    return type(exc).__name__


def _admit(scorer: ServedModel, ratings: Sequence[Rating]) -> Reservation:
    """Reserve the batch's new users and items (`ServedModel.admit`); 422 past their limits."""
    try:
        return scorer.admit([r.user for r in ratings], [r.item for r in ratings])
    except TooManyNewIds as exc:
        errors = []
        for kind, unseen, so_far, limit, variable in exc.over:
            shown = ", ".join(map(repr, sorted(unseen)[:20])) + (" ..." if len(unseen) > 20 else "")
            errors.append(
                {
                    "loc": ["body", "ratings"],
                    "type": f"too_many_new_{kind}",
                    "msg": f"{len(unseen)} new {kind} ({shown}) would pass the limit of {limit} new {kind} "
                    f"({variable}; {so_far} so far): nothing of this batch was stored",
                }
            )
        raise HTTPException(status_code=422, detail=errors) from None


def _snap(rating: float, levels: np.ndarray) -> float:
    """The level a rating matched (so 4 and 4.0000000001 are stored alike)."""
    return float(levels[int(np.argmin(np.abs(levels - rating)))])


def _level_message(rating: float, levels: np.ndarray) -> str:
    shown = ", ".join(f"{x:g}" for x in levels[:20]) + (
        f", ... ({len(levels)} levels)" if len(levels) > 20 else ""
    )
    return f"rating {rating:g} is not one of the model's rating levels: {shown}"


class RetractionResponse(BaseModel):
    """What was stored."""

    retracted: int = Field(description="Retractions stored (every worker folds them in right after).")
    last_id: str = Field(
        description="Stream id of the retraction in Redis: pass it as `after` to /predict or /recommend for "
        "an answer without the rating."
    )
    model_version: str


def _removal_errors(unknown: str) -> dict[int | str, dict[str, Any]]:
    """The documented errors of a route that takes ratings back (`unknown`: which ids it 404s for)."""
    return {
        401: {"description": "Missing or wrong bearer token"},
        403: {"description": "Writes are off (no DCMC_WRITE_TOKEN)"},
        404: {"description": f"{unknown} the model does not know (nothing stored)"},
        503: {"description": "Not stored, or not known to be, as for POST /ratings; see Retry-After"},
    }


async def _caught_up_unknown(scorer: ServedModel, settings: Settings, unknown: Any) -> list[UnknownIdError]:
    """The ids `unknown()` lists once this worker has applied the whole stream as it is now: an id another
    worker wrote a moment ago is known then. 503 when it cannot catch up in DCMC_READ_AFTER_TIMEOUT_S, or
    Redis cannot say how far the stream goes."""
    missing: list[UnknownIdError] = unknown()
    if not missing or scorer.ratings is None:
        return missing
    retry = {"Retry-After": str(max(1, math.ceil(scorer.retry_s)))}
    try:
        newest = await run_in_threadpool(scorer.ratings.last_generated)
    except redis.RedisError:
        raise HTTPException(
            status_code=503, detail="Redis is unavailable; nothing stored, retry later", headers=retry
        ) from None
    if newest != "0-0" and not await until_applied(scorer, newest, settings.read_after_timeout_s):
        raise HTTPException(
            status_code=503,
            detail="this worker has not caught up with the rating stream yet, so it cannot tell whether "
            "these ids are known; nothing stored, retry",
            headers=retry,
        )
    missing = unknown()
    return missing


@router.delete("/ratings", response_model=RetractionResponse, responses=_removal_errors("A user or item id"))
async def delete_rating(
    user: Annotated[str, Query(min_length=1, max_length=MAX_ID_LENGTH, description="External user id")],
    item: Annotated[str, Query(min_length=1, max_length=MAX_ID_LENGTH, description="External item id")],
    scorer: ScorerDep,
    settings: SettingsDep,
    authorization: Annotated[str | None, Header()] = None,
) -> RetractionResponse:
    """Take a user's rating of an item back: the rating the user gave online, or the one the model was
    trained with. Stored durably in the rating stream like a rating (a retraction entry); every worker then
    folds it in: the user's embedding, the CRF's known field and tables follow as if the rating had never
    been given, until the next training, which leaves it out too. Idempotent: taking back a rating that is
    not there changes nothing. A later POST /ratings of the pair rates it again. Ids this worker does not
    know yet are looked up again once it has caught up with the stream (another worker may have just
    written them); still unknown: 404."""
    _authorize(settings, authorization)

    def unknown() -> list[UnknownIdError]:
        users, items = scorer.fold.unseen([user], [item])
        return [UnknownIdError(kind, sorted(ids)) for kind, ids in (("user", users), ("item", items)) if ids]

    missing = await _caught_up_unknown(scorer, settings, unknown)
    if missing:
        raise unknown_ids(*missing)
    last = await _write(scorer, [(user, item, None)])
    return RetractionResponse(retracted=1, last_id=last, model_version=scorer.version)


class ForgetResponse(BaseModel):
    """What was stored, and what was deleted."""

    forgotten: str = Field(description="The user id forgotten.")
    last_id: str = Field(
        description="Stream id of the request in Redis: pass it as `after` to a read that must not see the "
        "user's ratings any more."
    )
    model_version: str
    purged_entries: int | None = Field(
        description="The user's earlier entries deleted from the rating stream now (null: Redis failed "
        "after the request was stored; the next compaction removes them)."
    )
    purged_dead_letters: int | None = Field(
        description="Copies of the user's entries deleted from the dead-letter stream (null: as above)."
    )


@router.delete("/users/{user:path}", response_model=ForgetResponse, responses=_removal_errors("A user id"))
async def forget_user(
    user: Annotated[str, Path(min_length=1, max_length=MAX_ID_LENGTH, description="External user id")],
    scorer: ScorerDep,
    settings: SettingsDep,
    authorization: Annotated[str | None, Header()] = None,
) -> ForgetResponse:
    """Forget a user (a privacy request): every rating of theirs, online or the ones the model was trained
    with, is taken back in the served model, and the user is unknown to queries (/predict and
    /similar-users answer 404, /recommend the popular items, as for any user it does not know) and never
    listed as someone's similar user. Stored durably in the rating stream; the user's earlier entries are
    then deleted from the stream and the dead-letter stream, and the next `dcmc train --online-ratings`
    drops every rating of the user, the dataset's included, and records the user as forgotten, so that
    no later model knows them. A later POST /ratings by the same id starts a new history. Ids with `/`
    are taken as they are (`/users/a/b` forgets `a/b`)."""
    _authorize(settings, authorization)

    def unknown() -> list[UnknownIdError]:
        known = (
            scorer.fold.user_index(user) is not None
            or scorer.pending_user(user)
            or user in scorer.state.dismissed
        )
        return [] if known else [UnknownIdError("user", [user])]

    missing = await _caught_up_unknown(scorer, settings, unknown)
    if missing:
        raise unknown_ids(*missing)
    assert scorer.ratings is not None
    last = await _write(scorer, [(user, FORGET, None)])
    entries: int | None
    copies: int | None
    try:
        entries, copies = await run_in_threadpool(scorer.ratings.purge_user, user, last)
    except redis.RedisError as exc:
        log.warning("forgetting a user: stored, but their entries could not be deleted now (%s)", exc)
        entries = copies = None
    return ForgetResponse(
        forgotten=user,
        last_id=last,
        model_version=scorer.version,
        purged_entries=entries,
        purged_dead_letters=copies,
    )


class UserRating(BaseModel):
    """One rating a user has given, as the served model knows it."""

    item: str
    rating: float
    online: bool = Field(description="Given online (else the artifact's: training or validation ratings).")


class UserRatingsResponse(BaseModel):
    """A user's ratings in this worker's current model state."""

    user: str
    model_version: str
    ratings: list[UserRating]


@router.get(
    "/users/{user:path}/ratings",
    response_model=UserRatingsResponse,
    responses={
        401: {"description": "Missing or wrong bearer token (the write token)"},
        403: {"description": "Writes are off (no DCMC_WRITE_TOKEN): nobody may read a person's ratings"},
        404: {"description": "A user the model does not know (or forgot)"},
    },
)
async def user_ratings(
    user: Annotated[str, Path(min_length=1, max_length=MAX_ID_LENGTH, description="External user id")],
    scorer: ScorerDep,
    settings: SettingsDep,
    after: After = None,
    authorization: Annotated[str | None, Header()] = None,
) -> UserRatingsResponse:
    """Every rating the user has given that this worker's model holds: the artifact's (less those taken
    back or re-rated) and the online ones, by item. A person's ratings: it needs the write token."""
    require_write(settings, authorization, "GET /users/{id}/ratings")
    await wait_applied(scorer, after, settings.read_after_timeout_s)
    state = scorer.state
    try:
        index = scorer.user_index(user, state)
    except UnknownIdError as exc:
        raise unknown_ids(exc) from None
    held = scorer.user_ratings(index, state)
    return UserRatingsResponse(
        user=user,
        model_version=scorer.version,
        ratings=[UserRating(item=item, rating=r, online=online) for item, r, online in held],
    )
