"""POST /ratings: ratings that arrive while the service runs, stored durably and folded into the model."""

from __future__ import annotations

import hmac
import logging
import math
from collections.abc import Sequence
from typing import Annotated, Any, Protocol

import numpy as np
import redis
from fastapi import APIRouter, Header, HTTPException, Path, Query
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from model.ids import UnknownIdError
from model.stream import FORGET
from service.deps import ScorerDep, SettingsDep
from service.errors import too_long, unknown_ids
from service.online import stored_unknown
from service.schemas import MAX_ID_LENGTH, ExternalId
from service.scoring import NotDurable, ServedModel
from service.settings import Settings

log = logging.getLogger(__name__)

router = APIRouter(tags=["ratings"])


class RatingIn(BaseModel):
    """One rating: `rating` must be one of the model's rating levels."""

    model_config = ConfigDict(extra="forbid")

    user: ExternalId
    item: ExternalId
    rating: float = Field(allow_inf_nan=False)


class Rating(Protocol):
    """A parsed rating: `RatingIn`, or the fast path's (service/fastpath.py) with string ids."""

    user: str
    item: str
    rating: float


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
    token = settings.write_token.get_secret_value() if settings.write_token is not None else None
    if token is None:
        raise HTTPException(
            status_code=403,
            detail="writes are off: set DCMC_WRITE_TOKEN on the service to turn POST /ratings on",
        )
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise HTTPException(
            status_code=401,
            detail="POST /ratings needs the header `Authorization: Bearer <DCMC_WRITE_TOKEN>`",
            headers={"WWW-Authenticate": "Bearer"},
        )


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
    _check_new_ids(scorer, settings, ratings)
    batch = [(r.user, r.item, _snap(r.rating, levels)) for r in ratings]
    last = await _write(scorer, batch)
    return RatingsResponse(accepted=len(batch), last_id=last, model_version=scorer.version)


async def _write(scorer: ServedModel, batch: Sequence[tuple[str, str, float | None]]) -> str:
    """`ServedModel.write` off the event loop; its failures as HTTPExceptions that say whether anything may
    have been stored."""
    retry = {"Retry-After": str(max(1, math.ceil(scorer.retry_s)))}
    try:
        last = await run_in_threadpool(scorer.write, batch)
    except redis.RedisError as exc:
        if stored_unknown(exc):
            log.warning("a write: no answer from Redis (%s); the batch may have been stored", exc)
            raise HTTPException(
                status_code=503,
                detail="Redis did not answer in time: this batch may or may not have been stored. Retrying "
                "it is safe (a rating of the same user and item replaces the earlier one)",
                headers=retry,
            ) from None
        log.warning("a write: Redis failed (%s); nothing stored", exc)
        raise HTTPException(
            status_code=503,
            detail="Redis is unavailable; nothing of this batch was stored, retry later",
            headers=retry,
        ) from None
    except NotDurable as exc:
        raise HTTPException(
            status_code=503,
            detail=f"writes are refused while Redis is not durable (DCMC_REQUIRE_DURABLE): {exc}; nothing "
            "of this batch was stored",
            headers=retry,
        ) from None
    except RuntimeError as exc:
        raise HTTPException(status_code=503, detail=str(exc)) from None
    return last


def _check_new_ids(scorer: ServedModel, settings: Settings, ratings: Sequence[Rating]) -> None:
    """422 when the batch would take the users or items the model did not have past their limits."""
    users, items, new_users, new_items = scorer.new_ids([r.user for r in ratings], [r.item for r in ratings])
    errors = []
    for kind, unseen, so_far, limit, variable in (
        ("users", users, new_users, settings.max_new_users, "DCMC_MAX_NEW_USERS"),
        ("items", items, new_items, settings.max_new_items, "DCMC_MAX_NEW_ITEMS"),
    ):
        if unseen and so_far + len(unseen) > limit:
            shown = ", ".join(map(repr, sorted(unseen)[:20])) + (" ..." if len(unseen) > 20 else "")
            errors.append(
                {
                    "loc": ["body", "ratings"],
                    "type": f"too_many_new_{kind}",
                    "msg": f"{len(unseen)} new {kind} ({shown}) would pass the limit of {limit} new {kind} "
                    f"({variable}; {so_far} so far): nothing of this batch was stored",
                }
            )
    if errors:
        raise HTTPException(status_code=422, detail=errors)


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
    not there changes nothing. A later POST /ratings of the pair rates it again."""
    _authorize(settings, authorization)
    users, items, _, _ = scorer.new_ids([user], [item])
    if users or items:
        unknown = [
            UnknownIdError(kind, sorted(ids)) for kind, ids in (("user", users), ("item", items)) if ids
        ]
        raise unknown_ids(*unknown)
    last = await _write(scorer, [(user, item, None)])
    return RetractionResponse(retracted=1, last_id=last, model_version=scorer.version)


class ForgetResponse(BaseModel):
    """What was stored."""

    forgotten: str = Field(description="The user id forgotten.")
    last_id: str = Field(
        description="Stream id of the request in Redis: pass it as `after` to a read that must not see the "
        "user's ratings any more."
    )
    model_version: str


@router.delete("/users/{user}", response_model=ForgetResponse, responses=_removal_errors("A user id"))
async def forget_user(
    user: Annotated[str, Path(min_length=1, max_length=MAX_ID_LENGTH, description="External user id")],
    scorer: ScorerDep,
    settings: SettingsDep,
    authorization: Annotated[str | None, Header()] = None,
) -> ForgetResponse:
    """Forget a user (a privacy request): every rating of theirs, online or the ones the model was trained
    with, is taken back in the served model, and the user is unknown to queries (/predict and
    /similar-users answer 404, /recommend the popular items, as for any user it does not know) and never
    listed as someone's similar user. Stored durably in the rating stream;
    the next `dcmc train --online-ratings` drops every rating of the user, the dataset's included. A later
    POST /ratings by the same id starts a new history."""
    _authorize(settings, authorization)
    if scorer.fold.user_index(user) is None and not scorer.pending_user(user):
        raise unknown_ids(UnknownIdError("user", [user]))
    last = await _write(scorer, [(user, FORGET, None)])
    return ForgetResponse(forgotten=user, last_id=last, model_version=scorer.version)
