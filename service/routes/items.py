"""The catalogue's records (model/catalogue.py): GET /items/{id} and GET /items read them; PUT /items/{id}
(the whole record), PATCH /items/{id} (a merge patch) and POST /items (a batch of either) change them.

A change is an entry of the rating stream, stored as ratings are (one transaction, acknowledged once
Redis has it, `last_id` to read after it) and folded in by every worker of every replica in stream order
(model/online.py), so it is covered by the fold-in snapshots and the compacted head, and a retrain
(`dcmc train --online-ratings`) takes it into the artifact's catalogue. A patch is applied to the record
as the stream has it when the patch's turn comes, not as the writing worker saw it.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, HTTPException, Path, Query
from pydantic import BaseModel, ConfigDict, Field, model_validator

from model.catalogue import ItemChange, ItemPatch, ItemRecord
from service.auth import require_read, require_write
from service.consistency import After, wait_applied
from service.deps import ScorerDep, SettingsDep
from service.errors import invalid, too_long
from service.recommend import split_ids
from service.routes.ratings import write_entries
from service.schemas import MAX_ID_LENGTH, ExternalId
from service.scoring import ServedModel

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
async def get_item(
    item_id: Annotated[str, Path(max_length=MAX_ID_LENGTH, description="External item id")],
    scorer: ScorerDep,
    settings: SettingsDep,
    after: After = None,
    authorization: Annotated[str | None, Header()] = None,
) -> dict[str, Any]:
    """The item's record (title, categories, attributes, hidden), `in_catalogue` (it has a record) and
    `in_model` (it has ratings the model knows: it can be predicted and recommended). An item rated but
    not in the catalogue has an empty record. With `after` (a write's `last_id`), once this worker has
    applied that write."""
    require_read(settings, authorization)
    await wait_applied(scorer, after, settings.read_after_timeout_s)
    state = scorer.state
    record = scorer.catalogue(state).get(item_id)
    in_model = bool((scorer.fold.item_indices([item_id], state) >= 0).all())
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
async def list_items(
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
    after: After = None,
    authorization: Annotated[str | None, Header()] = None,
) -> dict[str, Any]:
    """The catalogue's records in its order (the artifact's, then those only online changes made), a
    page at a time: `items`, `total` (the records that match), and `next`, the cursor of the next page
    (absent on the last)."""
    require_read(settings, authorization)
    await wait_applied(scorer, after, settings.read_after_timeout_s)
    if not 1 <= limit <= MAX_PAGE:
        raise invalid(["query", "limit"], "out_of_range", f"limit must lie in 1..{MAX_PAGE}, got {limit}")
    if cursor < 0:
        raise invalid(["query", "cursor"], "out_of_range", f"cursor must be 0 or more, got {cursor}")
    wanted, unwanted = set(split_ids(category) or []), set(split_ids(exclude_category) or [])
    state = scorer.state
    matching = [
        (item, record)
        for item, record in scorer.catalogue(state).items()
        if (not wanted or wanted.intersection(record.categories))
        and not unwanted.intersection(record.categories)
        and (hidden is None or record.hidden == hidden)
    ]
    page = matching[cursor : cursor + limit]
    known = scorer.fold.item_indices([item for item, _ in page], state) >= 0
    out: dict[str, Any] = {
        "items": [_shown(item, record, bool(k)) for (item, record), k in zip(page, known, strict=True)],
        "total": len(matching),
    }
    if cursor + limit < len(matching):
        out["next"] = cursor + limit
    return out


class ItemWritten(BaseModel):
    """What was stored."""

    accepted: int = Field(description="Catalogue changes stored (every worker applies them right after).")
    last_id: str = Field(
        description="Stream id of the last change in Redis: pass it as `after` to GET /items/{id}, "
        "/recommend or /similar-items for an answer that includes it."
    )
    model_version: str


class ItemWrite(BaseModel):
    """One change of POST /items: `record` (the whole record, as PUT) or `patch` (as PATCH)."""

    model_config = ConfigDict(extra="forbid")

    item: ExternalId
    record: ItemRecord | None = None
    patch: ItemPatch | None = None

    @model_validator(mode="after")
    def _one(self) -> ItemWrite:
        if (self.record is None) == (self.patch is None):
            raise ValueError("give either `record` (the whole record) or `patch` (the fields to change)")
        return self

    def change(self) -> ItemChange:
        if self.record is not None:
            return ItemChange.whole(self.record)
        assert self.patch is not None
        return ItemChange(False, self.patch)


class ItemBatch(BaseModel):
    """Catalogue changes applied in order (a later change of the same item applies after an earlier)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "items": [
                        {"item": "50", "record": {"title": "Star Wars (1977)", "categories": ["Sci-Fi"]}},
                        {"item": "181", "patch": {"hidden": True}},
                    ]
                }
            ]
        },
    )

    items: list[ItemWrite] = Field(min_length=1)


_WRITE_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"description": "Missing or wrong bearer token"},
    403: {"description": "Writes are off (no DCMC_WRITE_TOKEN)"},
    422: {
        "description": "A malformed record or patch, a batch over DCMC_MAX_ITEM_CHANGES, or a patch that "
        "would leave a record past a limit (nothing stored)"
    },
    503: {"description": "Not stored, or not known to be (as POST /ratings; see Retry-After)"},
}


async def _store(
    scorer: ServedModel,
    settings: Any,
    changes: list[tuple[str, ItemChange]],
    authorization: str | None,
    what: str,
    where: list[list[str | int]],
) -> ItemWritten:
    """Authorize, check that each change leaves a valid record as this worker has the catalogue now (the
    stream applies it again in its turn), store the batch."""
    require_write(settings, authorization, what)
    state = scorer.state
    records: dict[str, ItemRecord | None] = {}
    errors = []
    for (item, change), loc in zip(changes, where, strict=True):
        before = records[item] if item in records else scorer.fold.record(item, state)
        try:
            records[item] = change.applied_to(before)
        except ValueError as exc:
            errors.append({"loc": loc, "type": "record_past_limit", "msg": f"item {item!r}: {exc}"})
    if errors:
        raise HTTPException(status_code=422, detail=errors)
    last = await write_entries(scorer, lambda: scorer.write_items(changes))
    return ItemWritten(accepted=len(changes), last_id=last, model_version=scorer.version)


ItemId = Annotated[str, Path(min_length=1, max_length=MAX_ID_LENGTH, description="External item id")]


@router.put("/items/{item_id:path}", response_model=ItemWritten, responses=_WRITE_ERRORS)
async def put_item(
    item_id: ItemId,
    body: ItemRecord,
    scorer: ScorerDep,
    settings: SettingsDep,
    authorization: Annotated[str | None, Header()] = None,
) -> ItemWritten:
    """Store the item's whole record (what it had is replaced). The item may be one nobody has rated
    yet: it is then in the catalogue but not recommended until it has ratings. `hidden: true` takes it
    out of every recommendation and similar-items list on every worker as soon as they apply it."""
    change = [(item_id, ItemChange.whole(body))]
    return await _store(scorer, settings, change, authorization, "PUT /items", [["body"]])


@router.patch("/items/{item_id:path}", response_model=ItemWritten, responses=_WRITE_ERRORS)
async def patch_item(
    item_id: ItemId,
    body: ItemPatch,
    scorer: ScorerDep,
    settings: SettingsDep,
    authorization: Annotated[str | None, Header()] = None,
) -> ItemWritten:
    """Change part of the item's record: each field given replaces the record's (null resets it), and
    `attributes` merge name by name (a null value removes that attribute); e.g. `{"hidden": true}` or
    `{"attributes": {"in_stock": false}}`. An item without a record gets one."""
    change = [(item_id, ItemChange(False, body))]
    return await _store(scorer, settings, change, authorization, "PATCH /items", [["body"]])


@router.post("/items", response_model=ItemWritten, responses=_WRITE_ERRORS)
async def post_items(
    body: ItemBatch,
    scorer: ScorerDep,
    settings: SettingsDep,
    authorization: Annotated[str | None, Header()] = None,
) -> ItemWritten:
    """Store a batch of catalogue changes (each a whole `record` or a `patch`) as one transaction, up to
    DCMC_MAX_ITEM_CHANGES: all of them or none."""
    if len(body.items) > settings.max_item_changes:
        raise too_long(
            "items", len(body.items), settings.max_item_changes, "DCMC_MAX_ITEM_CHANGES", "changes"
        )
    changes = [(w.item, w.change()) for w in body.items]
    where: list[list[str | int]] = [["body", "items", k] for k in range(len(changes))]
    return await _store(scorer, settings, changes, authorization, "POST /items", where)
