"""GET /similar-users/{id} and GET /similar-items/{id}: the nearest users (items) by the learned
similarity of their embeddings, the scaled cosine s_r (s_c) of the paper's entry similarity."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path, Query

from model.ids import UnknownIdError
from service.auth import require_read
from service.catalogue import short_filter
from service.consistency import After, wait_applied
from service.deps import ScorerDep, SettingsDep
from service.errors import check_k, unknown_ids
from service.recommend import split_ids
from service.schemas import (
    MAX_ID_LENGTH,
    SimilarItem,
    SimilarItemsResponse,
    SimilarUser,
    SimilarUsersResponse,
)

router = APIRouter()

K = Annotated[int, Query(description="How many to return (1..DCMC_MAX_K)")]


@router.get(
    "/similar-users/{user_id:path}",
    tags=["users"],
    response_model=SimilarUsersResponse,
    responses={
        401: {"description": "DCMC_READ_TOKEN is set and the request does not carry it"},
        404: {"description": "Unknown user id"},
        422: {"description": "k out of range"},
    },
)
def similar_users(
    user_id: Annotated[str, Path(max_length=MAX_ID_LENGTH, description="External user id")],
    scorer: ScorerDep,
    settings: SettingsDep,
    k: K = 10,
    authorization: Annotated[str | None, Header()] = None,
) -> SimilarUsersResponse:
    """The k other users with the highest scaled cosine s_r of their embeddings, most similar first."""
    require_read(settings, authorization)
    check_k(k, settings)
    try:
        index = scorer.user_index(user_id)  # the artifact's users and those that arrived online
    except UnknownIdError as exc:
        raise unknown_ids(exc) from None
    found, scores = scorer.similar_users(index, k)
    return SimilarUsersResponse(
        user=user_id,
        model_version=scorer.version,
        similar=[
            SimilarUser(user=scorer.user_id(int(i)), score=float(s))
            for i, s in zip(found, scores, strict=True)
        ],
    )


@router.get(
    "/similar-items/{item_id:path}",
    tags=["items"],
    response_model=SimilarItemsResponse,
    response_model_exclude_none=True,
    responses={
        401: {"description": "DCMC_READ_TOKEN is set and the request does not carry it"},
        404: {"description": "Unknown item id"},
        422: {"description": "k out of range"},
    },
)
async def similar_items(
    item_id: Annotated[str, Path(max_length=MAX_ID_LENGTH, description="External item id")],
    scorer: ScorerDep,
    settings: SettingsDep,
    k: K = 10,
    category: Annotated[
        str | None, Query(description="Only items with one of these categories (comma-separated)")
    ] = None,
    exclude_category: Annotated[
        str | None, Query(description="No items with any of these categories (comma-separated)")
    ] = None,
    after: After = None,
    authorization: Annotated[str | None, Header()] = None,
) -> SimilarItemsResponse:
    """The k other items with the highest scaled cosine s_c of their embeddings, most similar first;
    never a hidden item (the catalogue's), and only those of `category`, none of `exclude_category`. With
    `after` (a write's `last_id`), once this worker has applied that write."""
    require_read(settings, authorization)
    check_k(k, settings)
    await wait_applied(scorer, after, settings.read_after_timeout_s)
    state = scorer.state
    try:  # the artifact's items and those that arrived online
        index = int(scorer.item_indices([item_id], state)[0])
    except UnknownIdError as exc:
        raise unknown_ids(exc) from None
    catalogue = scorer.catalogue_index(state)
    allowed = catalogue.visible
    notes: list[str] = []
    chosen = short_filter(split_ids(category), split_ids(exclude_category))
    if chosen is not None:
        selected, notes = catalogue.select(chosen, ["query"])
        allowed = allowed & selected
    if settings.default_filter is not None:
        selected, more = catalogue.select(settings.default_filter, ["default_filter"])
        allowed = allowed & selected
        notes += [f"default filter: {note}" for note in more]
    found, scores = scorer.similar_items(index, k, allowed)
    similar = [
        SimilarItem(item=scorer.item_id(int(i)), score=float(s)) for i, s in zip(found, scores, strict=True)
    ]
    shown = scorer.shown(
        "/similar-items", {"item": item_id}, [s.item for s in similar], [s.score for s in similar]
    )
    return SimilarItemsResponse(
        item=item_id,
        model_version=scorer.version,
        similar=similar,
        filter_notes=notes or None,
        recommendation_id=shown,
    )
