"""POST /events: interactions that are not ratings (`click`, `view`, `dismiss`, ...), stored durably in the
rating stream as ratings are (model/stream.py), for evaluation (model/experiments.py); `dismiss` also keeps
the item out of the user's lists."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from model.stream import DISMISS, EVENT_KIND
from service.auth import require_write
from service.deps import ScorerDep, SettingsDep
from service.errors import too_long
from service.routes.ratings import write_entries
from service.schemas import ExternalId, RecommendationId

router = APIRouter(tags=["ratings"])


class EventIn(BaseModel):
    """One interaction of a user with an item."""

    model_config = ConfigDict(extra="forbid")

    user: ExternalId
    item: ExternalId
    type: Annotated[str, StringConstraints(strict=True, pattern=EVENT_KIND.pattern)] = Field(
        description=f"What happened: `click`, `view`, `{DISMISS}` (keeps the item out of the user's lists "
        "from then on), or any other name of 1 to 32 of a-z, 0-9, _ and -"
    )
    recommendation_id: RecommendationId | None = Field(
        default=None, description="The answer the event follows (its `recommendation_id`), for evaluation"
    )


class EventsRequest(BaseModel):
    """A batch of events, stored in order, all or nothing."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"events": [{"user": "196", "item": "242", "type": "click"}]}]},
    )

    events: list[EventIn] = Field(min_length=1)


class EventsResponse(BaseModel):
    """What was stored."""

    accepted: int = Field(description="Events stored.")
    last_id: str = Field(
        description="Stream id of the batch's last event: pass it as `after` to /recommend for a list that "
        "takes a dismissal into account."
    )
    model_version: str


@router.post(
    "/events",
    response_model=EventsResponse,
    responses={
        401: {"description": "Missing or wrong bearer token"},
        403: {"description": "Writes are off (no DCMC_WRITE_TOKEN)"},
        422: {"description": "Empty, oversized or mistyped batch (nothing stored)"},
        503: {"description": "Not stored, or not known to be, as for POST /ratings; see Retry-After"},
    },
)
async def post_events(
    body: EventsRequest,
    scorer: ScorerDep,
    settings: SettingsDep,
    authorization: Annotated[str | None, Header()] = None,
) -> EventsResponse:
    """Store interactions durably in the rating stream, acknowledged once stored, as POST /ratings stores
    ratings. They do not change the model's predictions: ratings do. A `dismiss` keeps the item out of
    that user's /recommend lists from then on (every worker, once it has folded it in; until the user is
    forgotten). Events, with their `recommendation_id`, are what experiments' results are computed from
    (GET /experiments/{id}/results). Items and users need not be known to the model."""
    require_write(settings, authorization, "POST /events")
    if len(body.events) > settings.max_ratings:
        raise too_long("events", len(body.events), settings.max_ratings, "DCMC_MAX_RATINGS", "entries")
    batch = [(e.user, e.item, e.type, e.recommendation_id) for e in body.events]
    last = await write_entries(scorer, lambda: scorer.write_events(batch))
    return EventsResponse(accepted=len(batch), last_id=last, model_version=scorer.version)
