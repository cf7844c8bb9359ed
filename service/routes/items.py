"""GET /items/{id} and GET /items: the catalogue's records (model/catalogue.py), as the artifact holds
them."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, HTTPException, Path, Query

from model.catalogue import ItemRecord
from service.auth import require_read
from service.deps import ScorerDep, SettingsDep
from service.errors import invalid
from service.recommend import split_ids
from service.schemas import MAX_ID_LENGTH

router = APIRouter(tags=["items"])

MAX_PAGE = 1000
"""Most records one GET /items page holds."""


def _shown(item: str, record: ItemRecord | None, in_model: bool) -> dict[str, Any]:
    shown = record.model_dump() if record is not None else ItemRecord().model_dump()
    return {"item": item, **shown, "in_catalogue": record is not None, "in_model": in_model}


@router.get(
    "/items/{item_id:path}",
    responses={
        401: {"description": "DCMC_READ_TOKEN is set and the request does not carry it"},
        404: {"description": "Neither the catalogue nor the model knows the item"},
    },
)
def get_item(
    item_id: Annotated[str, Path(max_length=MAX_ID_LENGTH, description="External item id")],
    scorer: ScorerDep,
    settings: SettingsDep,
    authorization: Annotated[str | None, Header()] = None,
) -> dict[str, Any]:
    """The item's record (title, categories, attributes, hidden), `in_catalogue` (it has a record) and
    `in_model` (it has ratings the model knows: it can be predicted and recommended). An item rated but
    not in the catalogue has an empty record."""
    require_read(settings, authorization)
    record = scorer.catalogue.get(item_id)
    in_model = bool((scorer.fold.item_indices([item_id]) >= 0).all())
    if record is None and not in_model:
        raise HTTPException(
            status_code=404,
            detail={"msg": f"unknown item id {item_id!r}: not in the catalogue and never rated"},
        )
    return _shown(item_id, record, in_model)


@router.get(
    "/items",
    responses={
        401: {"description": "DCMC_READ_TOKEN is set and the request does not carry it"},
        422: {"description": "A cursor or limit out of range"},
    },
)
def list_items(
    scorer: ScorerDep,
    settings: SettingsDep,
    cursor: Annotated[int, Query(description="Where the page starts (the `next` of the previous page)")] = 0,
    limit: Annotated[int, Query(description=f"Records per page (1..{MAX_PAGE})")] = 100,
    category: Annotated[
        str | None, Query(description="Only items with one of these categories (comma-separated)")
    ] = None,
    exclude_category: Annotated[
        str | None, Query(description="No items with any of these categories (comma-separated)")
    ] = None,
    hidden: Annotated[
        bool | None, Query(description="Only hidden (true) or only visible (false) items")
    ] = None,
    authorization: Annotated[str | None, Header()] = None,
) -> dict[str, Any]:
    """The catalogue's records in its order, a page at a time: `items`, `total` (the records that match),
    and `next`, the cursor of the next page (absent on the last)."""
    require_read(settings, authorization)
    if not 1 <= limit <= MAX_PAGE:
        raise invalid(["query", "limit"], "out_of_range", f"limit must lie in 1..{MAX_PAGE}, got {limit}")
    if cursor < 0:
        raise invalid(["query", "cursor"], "out_of_range", f"cursor must be 0 or more, got {cursor}")
    wanted, unwanted = set(split_ids(category) or []), set(split_ids(exclude_category) or [])
    matching = [
        (item, record)
        for item, record in scorer.catalogue.items()
        if (not wanted or wanted.intersection(record.categories))
        and not unwanted.intersection(record.categories)
        and (hidden is None or record.hidden == hidden)
    ]
    page = matching[cursor : cursor + limit]
    known = scorer.fold.item_indices([item for item, _ in page]) >= 0
    out: dict[str, Any] = {
        "items": [_shown(item, record, bool(k)) for (item, record), k in zip(page, known, strict=True)],
        "total": len(matching),
    }
    if cursor + limit < len(matching):
        out["next"] = cursor + limit
    return out
