"""GET /similar-users/{id}: nearest users by the learned user similarity."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query

from model.ids import UnknownIdError
from service.deps import ScorerDep, SettingsDep
from service.errors import check_k, unknown_ids
from service.schemas import MAX_ID_LENGTH, SimilarUser, SimilarUsersResponse

router = APIRouter(tags=["users"])


@router.get(
    "/similar-users/{user_id}",
    response_model=SimilarUsersResponse,
    responses={404: {"description": "Unknown user id"}, 422: {"description": "k out of range"}},
)
def similar_users(
    user_id: Annotated[str, Path(max_length=MAX_ID_LENGTH, description="External user id")],
    scorer: ScorerDep,
    settings: SettingsDep,
    k: Annotated[int, Query(description="How many users to return (1..DCMC_MAX_K)")] = 10,
) -> SimilarUsersResponse:
    """The k other users with the highest scaled cosine s_r of their embeddings, most similar first."""
    check_k(k, settings)
    try:
        user_idx = scorer.user_index(user_id)  # the artifact's users and those that arrived online
    except UnknownIdError as exc:
        raise unknown_ids(exc) from None
    idx, scores = scorer.similar_users(user_idx, k)
    return SimilarUsersResponse(
        user=user_id,
        model_version=scorer.version,
        similar=[
            SimilarUser(user=scorer.user_id(int(i)), score=float(s)) for i, s in zip(idx, scores, strict=True)
        ],
    )
