"""POST /ratings: ratings that arrive while the service runs, stored durably and folded into the model."""

from __future__ import annotations

import hmac
import logging
import math
from typing import Annotated

import numpy as np
import redis
from fastapi import APIRouter, Header, HTTPException
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from service.deps import ScorerDep, SettingsDep
from service.errors import too_long
from service.schemas import ExternalId

log = logging.getLogger(__name__)

router = APIRouter(tags=["ratings"])


class RatingIn(BaseModel):
    """One rating: `rating` must be one of the model's rating levels."""

    model_config = ConfigDict(extra="forbid")

    user: ExternalId
    item: ExternalId
    rating: float = Field(allow_inf_nan=False)


class RatingsRequest(BaseModel):
    """A batch of ratings, applied in order (a later rating of the same pair replaces an earlier one)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"ratings": [{"user": "196", "item": "242", "rating": 4}]}]},
    )

    ratings: list[RatingIn] = Field(min_length=1)


class RatingsResponse(BaseModel):
    """What was stored."""

    accepted: int = Field(description="Ratings stored and folded into the model.")
    last_id: str = Field(description="Stream id of the batch's last rating in Redis.")
    model_version: str


def _authorize(token: str | None, authorization: str | None) -> None:
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
        404: {"description": "Unknown item ids (all listed)"},
        422: {"description": "Empty, oversized or mistyped batch, or a rating off the model's levels"},
        503: {"description": "Redis is unavailable: nothing of the batch was stored (see Retry-After)"},
    },
)
async def post_ratings(
    body: RatingsRequest,
    scorer: ScorerDep,
    settings: SettingsDep,
    authorization: Annotated[str | None, Header()] = None,
) -> RatingsResponse:
    """Store ratings durably in Redis, then fold them into the model: every later answer for these users,
    from any worker of any replica on the same Redis, includes them. A user id never seen before becomes
    a user from its first rating on; items must be the model's."""
    token = settings.write_token.get_secret_value() if settings.write_token is not None else None
    _authorize(token, authorization)
    ratings = body.ratings
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
    batch = [(r.user, r.item, _snap(r.rating, levels)) for r in ratings]
    try:
        last = await run_in_threadpool(scorer.write, batch)
    except redis.RedisError as exc:
        log.warning("POST /ratings: Redis failed (%s); nothing stored", exc)
        raise HTTPException(
            status_code=503,
            detail="Redis is unavailable; nothing of this batch was stored, retry later",
            headers={"Retry-After": str(max(1, math.ceil(scorer.retry_s)))},
        ) from None
    except RuntimeError as exc:
        raise HTTPException(status_code=503, detail=str(exc)) from None
    return RatingsResponse(accepted=len(batch), last_id=last, model_version=scorer.version)


def _snap(rating: float, levels: np.ndarray) -> float:
    """The level a rating matched (so 4 and 4.0000000001 are stored alike)."""
    return float(levels[int(np.argmin(np.abs(levels - rating)))])


def _level_message(rating: float, levels: np.ndarray) -> str:
    shown = ", ".join(f"{x:g}" for x in levels[:20]) + (
        f", ... ({len(levels)} levels)" if len(levels) > 20 else ""
    )
    return f"rating {rating:g} is not one of the model's rating levels: {shown}"
