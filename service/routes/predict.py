"""POST /predict: ratings of items for one user, by the paper's test-time procedure."""

from __future__ import annotations

import numpy as np
import orjson
from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from model.exact.explain import CannotExplain
from model.ids import UnknownIdError
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
        404: {"description": "Unknown user or item ids (all listed)"},
        422: {"description": "Empty, oversized or mistyped request; `explain` in a mode that cannot explain"},
        503: {"description": "The model is loading, or `after` was not applied in time (see Retry-After)"},
    },
)
async def predict(body: PredictRequest, request: Request, after: After = None) -> Response:
    """Predict the ratings of `items` by `user`, in request order.

    A pair the user already rated in the training data is predicted like any other query (the known
    rating is not echoed back).
    """
    scorer, settings = scorer_of(request), request.app.state.settings
    await wait_applied(scorer, after, settings.read_after_timeout_s)
    if scorer.blocking:  # tens of ms of numpy: keep the event loop free
        payload = await run_in_threadpool(
            answer,
            scorer,
            settings,
            body.user,
            body.items,
            body.distribution,
            body.explain,
            after is not None,
        )
    else:  # `none` and `exact` cost well under a millisecond: a thread hop would cost more
        payload = answer(
            scorer, settings, body.user, body.items, body.distribution, body.explain, after is not None
        )
    return Response(payload, media_type="application/json")


def answer(
    scorer: ServedModel,
    settings: Settings,
    user: str,
    items: list[str],
    distribution: bool,
    explain: bool = False,
    exact: bool = False,
) -> bytes:
    """The JSON of POST /predict's 200 for a parsed body (`PredictRequest`'s fields); HTTPException for an
    oversized request (422) or unknown ids (404, all listed). The route and its fast path
    (service/fastpath.py) both answer with it."""
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
    ratings, dist, fallback = scorer.predict(user_idx, items_idx, distribution, state, exact or explain)
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
            explanations = scorer.explain(user_idx, items_idx, settings.explain_k, state)
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
    return orjson.dumps(payload)
