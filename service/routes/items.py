"""GET /similar-items/{id}: nearest items by the learned item similarity (the mirror of /similar-users)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query

from model.ids import UnknownIdError
from service.deps import ScorerDep, SettingsDep
from service.errors import check_k, unknown_ids
from service.schemas import MAX_ID_LENGTH, SimilarItem, SimilarItemsResponse

router = APIRouter(tags=["items"])


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
    try:
        item_idx = int(scorer.item_indices([item_id])[0])
    except UnknownIdError as exc:
        raise unknown_ids(exc) from None
    idx, scores = scorer.similar_items(item_idx, k)
    return SimilarItemsResponse(
        item=item_id,
        model_version=scorer.version,
        similar=[
            SimilarItem(item=scorer.item_id(int(i)), score=float(s)) for i, s in zip(idx, scores, strict=True)
        ],
    )
