"""POST /predict: ratings of items for one user, by the paper's test-time procedure."""

from __future__ import annotations

from typing import Annotated

import numpy as np
import orjson
from fastapi import APIRouter, Header, Request, Response
from starlette.concurrency import run_in_threadpool

from model.calibration import tempered
from model.exact.explain import CannotExplain
from model.ids import UnknownIdError
from service.auth import holds_write_token, require_read
from service.consistency import After, wait_applied
from service.deps import scorer_of
from service.errors import invalid, too_long, unknown_ids
from service.schemas import PredictRequest, PredictResponse
from service.scoring import ServedModel
from service.settings import Settings

router = APIRouter(tags=["predictions"])


@router.post(
    "/predict",
    response_model=PredictResponse,
    response_model_exclude_none=True,
    responses={
        401: {"description": "DCMC_READ_TOKEN is set and the request does not carry it"},
        404: {"description": "Unknown user or item ids (all listed)"},
        422: {
            "description": "Empty, oversized or mistyped request; `explain` in a mode that cannot explain, "
            "or of more than DCMC_MAX_EXPLAIN_ITEMS items"
        },
        503: {"description": "The model is loading, or `after` was not applied in time (see Retry-After)"},
    },
)
async def predict(
    body: PredictRequest,
    request: Request,
    after: After = None,
    authorization: Annotated[str | None, Header()] = None,
) -> Response:
    """Predict the ratings of `items` by `user`, in request order.

    A pair the user already rated in the training data is predicted like any other query (the known
    rating is not echoed back). With `explain`, at most DCMC_MAX_EXPLAIN_ITEMS items; other users'
    ratings in an explanation are named only for a caller with the write token (service/auth.py).
    """
    scorer, settings = scorer_of(request), request.app.state.settings
    require_read(settings, authorization)
    tracked: dict[str, str] | None = None
    if body.track:
        tracked = {}
        assignment = scorer.experiments.assigned(body.user) if scorer.experiments is not None else None
        if assignment is not None and assignment.experiment.method == "ab":
            tracked = {"experiment": assignment.experiment.id, "variant": assignment.variant}
            scorer = scorer.variant_model(assignment.experiment.id, assignment.variant)
    if body.explain and len(body.items) > settings.max_explain_items:
        raise too_long(
            "items", len(body.items), settings.max_explain_items, "DCMC_MAX_EXPLAIN_ITEMS", "ids to explain"
        )
    reveal = body.explain and holds_write_token(settings, authorization)
    await wait_applied(scorer, after, settings.read_after_timeout_s)
    args = (
        scorer,
        settings,
        body.user,
        body.items,
        body.distribution,
        body.explain,
        after is not None,
        reveal,
        tracked,
    )
    if scorer.blocking or body.explain:  # tens of ms of numpy: keep the event loop free
        payload = await run_in_threadpool(answer, *args)
    else:  # `none` and `exact` cost well under a millisecond: a thread hop would cost more
        payload = answer(*args)
    return Response(payload, media_type="application/json")


def answer(
    scorer: ServedModel,
    settings: Settings,
    user: str,
    items: list[str],
    distribution: bool,
    explain: bool = False,
    exact: bool = False,
    reveal: bool = False,
    tracked: dict[str, str] | None = None,
) -> bytes:
    """The JSON of POST /predict's 200 for a parsed body (`PredictRequest`'s fields); HTTPException for an
    oversized request (422) or unknown ids (404, all listed). The route and its fast path
    (service/fastpath.py) both answer with it. `tracked` (asked with `track`: {} or the experiment and
    variant): the answer gets a recommendation id, and its impression is queued with the distributions."""
    if len(items) > settings.max_items:
        raise too_long("items", len(items), settings.max_items, "DCMC_MAX_ITEMS", "ids")
    state = scorer.state  # every part of the answer from this one model state
    unknown: list[UnknownIdError] = []
    user_idx = items_idx = None
    try:
        user_idx = scorer.user_index(user, state)  # the artifact's users and those that arrived online
    except UnknownIdError as exc:
        unknown.append(exc)
    try:
        items_idx = scorer.item_indices(items, state)  # the artifact's items and those first rated online
    except UnknownIdError as exc:
        unknown.append(exc)
    if user_idx is None or items_idx is None:
        raise unknown_ids(*unknown)
    # Explained, or read after a write (`after`): of the newest state, not from an earlier state's row.
    ratings, dist, fallback = scorer.predict(
        user_idx, items_idx, distribution or tracked is not None, state, exact or explain
    )
    if dist is not None and (distribution or tracked is not None):  # what the answer or impression shows
        dist = tempered(dist, scorer.temperature)  # calibrated on validation ratings; `rating` is untempered
    # Serialised here rather than through PredictResponse (which documents the shape in OpenAPI): building
    # and validating 1000 pydantic objects would cost more than the prediction itself.
    if distribution:
        assert dist is not None
        predictions = [
            {"item": item, "rating": r, "distribution": d}
            for item, r, d in zip(items, ratings.tolist(), dist.tolist(), strict=True)
        ]
    else:
        predictions = [{"item": item, "rating": r} for item, r in zip(items, ratings.tolist(), strict=True)]
    for k in np.flatnonzero(fallback).tolist():  # a new item the network cannot embed yet
        predictions[k]["fallback"] = "baseline"
    if explain:
        try:
            explanations = scorer.explain(user_idx, items_idx, settings.explain_k, state, reveal)
        except CannotExplain as exc:
            raise invalid(["body", "explain"], "cannot_explain", str(exc)) from None
        for prediction, explanation in zip(predictions, explanations, strict=True):
            prediction["explanation"] = explanation
    payload = {
        "user": user,
        "model_version": scorer.version,
        "inference": scorer.inference.mode,
        "online_ratings": scorer.online_count(user_idx, state),
        "predictions": predictions,
    }
    if tracked is not None:
        assert dist is not None
        more: dict[str, object] = {**tracked, "dists": np.round(dist, 6).tolist()}
        payload.update(tracked)
        payload["recommendation_id"] = scorer.shown("/predict", {"user": user}, items, ratings.tolist(), more)
    return orjson.dumps(payload)
