"""GET /similar-items/{id}: nearest items by the learned item similarity (the mirror of /similar-users)."""

from __future__ import annotations

from typing import Annotated

import numpy as np
from fastapi import APIRouter, HTTPException, Path, Query

from model.ids import UnknownIdError
from service.deps import ScorerDep, SettingsDep
from service.routes.users import check_k
from service.schemas import MAX_ID_LENGTH, SimilarItem, SimilarItemsResponse

router = APIRouter(tags=["items"])


def nearest(unit: np.ndarray, row: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k rows of `unit` other than `row` with the highest scaled cosine (1 + cos) / 2 to it, best
    first, ties by index (at the cut too): (indices, scores)."""
    scores = (1.0 + unit @ unit[row]) / 2.0
    scores[row] = -np.inf
    k = min(k, len(scores) - 1)
    if k <= 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float64)
    cut = -np.partition(-scores, k - 1)[k - 1]  # the k-th best score
    above = np.flatnonzero(scores > cut)
    tied = np.flatnonzero(scores == cut)[: k - len(above)]  # the lowest indices among those at the cut
    top = np.concatenate([above, tied])
    top = top[np.lexsort((top, -scores[top]))]  # by score, ties by index
    return top, scores[top]


@router.get(
    "/similar-items/{item_id}",
    response_model=SimilarItemsResponse,
    responses={404: {"description": "Unknown item id"}, 422: {"description": "k out of range"}},
)
def similar_items(
    item_id: Annotated[str, Path(max_length=MAX_ID_LENGTH, description="External item id")],
    scorer: ScorerDep,
    settings: SettingsDep,
    k: Annotated[int, Query(description="How many items to return (1..DCMC_MAX_K)")] = 10,
) -> SimilarItemsResponse:
    """The k other items with the highest scaled cosine s_c of their embeddings, most similar first."""
    check_k(k, settings)
    items = scorer.artifact.items
    try:
        item_idx = items.index(item_id)
    except UnknownIdError as exc:
        raise HTTPException(status_code=404, detail={"msg": str(exc), "unknown_items": exc.missing}) from None
    # item embeddings stay the artifact's (online ratings re-embed users only); read the current state
    idx, scores = nearest(scorer.fold.state.network.item_unit, item_idx, k)
    return SimilarItemsResponse(
        item=item_id,
        model_version=scorer.version,
        similar=[
            SimilarItem(item=items.external(int(i)), score=float(s)) for i, s in zip(idx, scores, strict=True)
        ],
    )
