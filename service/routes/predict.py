"""POST /predict: ratings of items for one user, by the paper's test-time procedure."""

from __future__ import annotations

import numpy as np
import orjson
from fastapi import APIRouter, HTTPException, Response
from starlette.concurrency import run_in_threadpool

from model.ids import UnknownIdError
from service.deps import ScorerDep, SettingsDep
from service.errors import too_long
from service.schemas import PredictRequest, PredictResponse

router = APIRouter(tags=["predictions"])


@router.post(
    "/predict",
    response_model=PredictResponse,
    response_model_exclude_none=True,
    responses={
        404: {"description": "Unknown user or item ids (all listed)"},
        422: {"description": "Empty, oversized or mistyped request"},
    },
)
async def predict(body: PredictRequest, scorer: ScorerDep, settings: SettingsDep) -> Response:
    """Predict the ratings of `items` by `user`, in request order.

    A pair the user already rated in the training data is predicted like any other query (the known
    rating is not echoed back).
    """
    if len(body.items) > settings.max_items:
        raise too_long("items", len(body.items), settings.max_items, "DCMC_MAX_ITEMS", "ids")
    unknown: dict[str, list[str]] = {}
    user_idx = items_idx = None
    try:
        user_idx = scorer.user_index(body.user)  # the artifact's users and those that arrived online
    except UnknownIdError as exc:
        unknown["unknown_users"] = exc.missing
    try:
        items_idx = scorer.item_indices(body.items)  # the artifact's items and those first rated online
    except UnknownIdError as exc:
        unknown["unknown_items"] = exc.missing
    if user_idx is None or items_idx is None:
        parts = [
            f"unknown {kind.removeprefix('unknown_')[:-1]} id(s): {', '.join(map(repr, ids[:20]))}"
            + (f" (and {len(ids) - 20} more)" if len(ids) > 20 else "")
            for kind, ids in unknown.items()
        ]
        raise HTTPException(status_code=404, detail={"msg": "; ".join(parts), **unknown})
    if scorer.inference.mode == "paper":  # tens of ms of numpy: keep the event loop free
        ratings, dist, fallback = await run_in_threadpool(scorer.predict, user_idx, items_idx)
    else:  # `none` and `exact` cost well under a millisecond: a thread hop would cost more
        ratings, dist, fallback = scorer.predict(user_idx, items_idx)
    # Serialised here rather than through PredictResponse (which documents the shape in OpenAPI): building
    # and validating 1000 pydantic objects would cost more than the prediction itself.
    if body.distribution:
        predictions = [
            {"item": item, "rating": float(r), "distribution": d.tolist()}
            for item, r, d in zip(body.items, ratings, dist, strict=True)
        ]
    else:
        predictions = [
            {"item": item, "rating": float(r)} for item, r in zip(body.items, ratings, strict=True)
        ]
    for k in np.flatnonzero(fallback):  # a new item the network cannot embed yet
        predictions[k]["fallback"] = "baseline"
    payload = {
        "user": body.user,
        "model_version": scorer.version,
        "inference": scorer.inference.mode,
        "online_ratings": scorer.online_count(user_idx),
        "predictions": predictions,
    }
    return Response(orjson.dumps(payload), media_type="application/json")
