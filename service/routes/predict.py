"""POST /predict: ratings of items for one user, by the paper's test-time procedure."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException

from model.ids import UnknownIdError
from service.deps import ScorerDep, SettingsDep
from service.schemas import Prediction, PredictRequest, PredictResponse

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
def predict(body: PredictRequest, scorer: ScorerDep, settings: SettingsDep) -> PredictResponse:
    """Predict the ratings of `items` by `user`, in request order.

    A pair the user already rated in the training data is predicted like any other query (the known
    rating is not echoed back).
    """
    if len(body.items) > settings.max_items:
        raise HTTPException(
            status_code=422,
            detail=[
                {
                    "loc": ["body", "items"],
                    "type": "too_long",
                    "msg": f"items has {len(body.items)} ids; at most {settings.max_items} are allowed "
                    "(setting DCMC_MAX_ITEMS)",
                }
            ],
        )
    artifact = scorer.artifact
    unknown: dict[str, list[str]] = {}
    user_idx = items_idx = None
    try:
        user_idx = artifact.users.index(body.user)
    except UnknownIdError as exc:
        unknown["unknown_users"] = exc.missing
    try:
        items_idx = artifact.items.indices(body.items)
    except UnknownIdError as exc:
        unknown["unknown_items"] = exc.missing
    if user_idx is None or items_idx is None:
        parts = [
            f"unknown {kind.removeprefix('unknown_')[:-1]} id(s): {', '.join(map(repr, ids[:20]))}"
            + (f" (and {len(ids) - 20} more)" if len(ids) > 20 else "")
            for kind, ids in unknown.items()
        ]
        raise HTTPException(status_code=404, detail={"msg": "; ".join(parts), **unknown})
    ratings, dist = scorer.predict(user_idx, items_idx)
    with_dist = body.distribution
    predictions = [
        Prediction(item=item, rating=float(r), distribution=d.tolist() if with_dist else None)
        for item, r, d in zip(body.items, ratings, dist, strict=True)
    ]
    return PredictResponse(
        user=body.user, model_version=scorer.version, inference=scorer.inference.mode, predictions=predictions
    )
