"""Online catalogue changes (model/catalogue.py `ItemChange`, model/stream.py entries, model/online.py
`FoldIn`): a run of changes composes into one that does what they did in turn; the stream's entries parse
back to the change or are poison saying why; a fold-in snapshot keeps the records."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model.artifact import load_artifact
from model.catalogue import ItemChange, ItemPatch, ItemRecord
from model.online import FoldIn
from model.stream import Compacted, ItemEntry, Poison, item_fields, parse_entry
from tests.model.test_online import EXACT, _fold

NAMES = st.sampled_from(["year", "lang", "tags", "price", "in_stock"])
VALUES = st.one_of(
    st.integers(-5, 5), st.booleans(), st.sampled_from(["en", "fr"]), st.lists(st.sampled_from(["a", "b"]))
)
RECORDS = st.builds(
    ItemRecord,
    categories=st.lists(st.sampled_from(["x", "y", "z"]), max_size=3),
    attributes=st.dictionaries(NAMES, VALUES, max_size=4),
    hidden=st.booleans(),
    title=st.one_of(st.none(), st.sampled_from(["A", "B"])),
)


@st.composite
def patches(draw: Any) -> ItemPatch:
    fields: dict[str, Any] = {}
    if draw(st.booleans()):
        fields["categories"] = draw(st.one_of(st.none(), st.lists(st.sampled_from(["x", "w"]), max_size=2)))
    if draw(st.booleans()):
        fields["attributes"] = draw(st.dictionaries(NAMES, st.one_of(st.none(), VALUES), max_size=3))
    if draw(st.booleans()):
        fields["hidden"] = draw(st.one_of(st.none(), st.booleans()))
    if draw(st.booleans()):
        fields["title"] = draw(st.one_of(st.none(), st.just("C")))
    return ItemPatch.model_validate(fields)


CHANGES = st.one_of(RECORDS.map(ItemChange.whole), patches().map(lambda p: ItemChange(False, p)))


@settings(max_examples=300, deadline=None)
@given(start=st.one_of(st.none(), RECORDS), changes=st.lists(CHANGES, min_size=1, max_size=5))
def test_changes_compose_into_one_that_does_what_they_did_in_turn(
    start: ItemRecord | None, changes: list[ItemChange]
) -> None:
    in_turn = start
    for change in changes:
        in_turn = change.applied_to(in_turn)
    composed = changes[0]
    for change in changes[1:]:
        composed = composed.then(change)
    assert composed.applied_to(start) == in_turn
    again = ItemChange.from_json(composed.to_json())  # as the compacted head and a snapshot keep it
    assert again.applied_to(start) == in_turn


def test_a_patch_merges_attributes_and_resets_what_it_sets_to_null() -> None:
    record = ItemRecord(categories=["x"], attributes={"year": 1990, "lang": "en"}, hidden=True, title="T")
    patch = ItemPatch.model_validate({"attributes": {"lang": None, "price": 3}, "hidden": None})
    after = ItemChange(False, patch).applied_to(record)
    assert after == ItemRecord(categories=["x"], attributes={"year": 1990, "price": 3}, title="T")
    with pytest.raises(ValueError, match="attributes"):
        ItemPatch.model_validate({"attributes": None})
    full = ItemRecord(attributes={f"a{k}": k for k in range(64)})
    with pytest.raises(ValueError, match="attributes"):
        ItemChange(False, ItemPatch.model_validate({"attributes": {"b": 1}})).applied_to(full)


def test_catalogue_entries_parse_back_or_are_poison_saying_why() -> None:
    change = ItemChange.whole(ItemRecord(categories=["x"], title="é"))
    fields = item_fields("it", change)
    assert parse_entry("1-1", fields) == ItemEntry("1-1", "it", change)
    raw = {k.encode(): v.encode() for k, v in fields.items()}  # as Redis returns them
    assert parse_entry(b"1-1", raw) == ItemEntry("1-1", "it", change)
    bad = [
        ({"item": "it", "patch": "{not json"}, "catalogue patch"),
        ({"item": "it", "record": '{"hidden": "maybe"}'}, "hidden"),
        ({"item": "it", "record": "{}", "patch": "{}"}, "one of record, patch"),
        ({"user": "u", "item": "it", "patch": "{}"}, "nothing else"),
        ({"patch": "{}"}, "item id"),
        ({"item": "x" * 300, "patch": "{}"}, "item id"),
    ]
    for entry, reason in bad:
        parsed = parse_entry("2-1", entry)
        assert isinstance(parsed, Poison) and reason in parsed.reason, (entry, parsed)


def test_the_compacted_head_keeps_each_items_change() -> None:
    changes = (
        ("a", ItemChange.whole(ItemRecord(hidden=True))),
        ("b", ItemChange(False, ItemPatch.model_validate({"attributes": {"x": None}}))),
    )
    head = Compacted("5-0", "id", (("u", "i", 4.0),), (), (), changes)
    assert Compacted.from_json(head.to_json()) == head
    older = '{"format": 1, "last": "5-0", "identity": null, "ratings": [], "retracted": [], "forgotten": []}'
    assert Compacted.from_json(older).items == ()


def test_a_fold_in_applies_changes_over_the_artifacts_records_and_its_snapshot_keeps_them(
    tiny_artifact: Path,
) -> None:
    artifact = load_artifact(tiny_artifact)
    item = artifact.items.ids[0]
    fold, onnx = _fold(artifact, EXACT)
    first = ItemChange.whole(ItemRecord(categories=["x"]))
    fold.apply([], [(item, first), ("new", ItemChange.whole(ItemRecord()))])
    fold.apply(
        [(artifact.users.ids[0], item, 5.0)],
        [(item, ItemChange(False, ItemPatch.model_validate({"hidden": True})))],
    )
    state = fold.state
    assert state.records[item] == ItemRecord(categories=["x"], hidden=True)
    assert state.records_applied == 3 and state.applied == 1 and state.writes == 4
    assert state.record_versions == {item: 3, "new": 2}  # the count after the batch that changed it
    assert fold.record("new") == ItemRecord() and fold.record("unknown") is None
    full = ItemChange.whole(ItemRecord(attributes={f"a{k}": 1 for k in range(64)}))
    one_more = ItemChange(False, ItemPatch.model_validate({"attributes": {"b": 1}}))
    with pytest.raises(ValueError, match="item 'z'"):
        fold.apply([], [("z", full), ("z", one_more)])
    assert fold.state is state  # nothing applied
    writes, payload = fold.snapshot()
    fresh = FoldIn(artifact, artifact.inference.with_overrides(EXACT), onnx.embed_users, onnx.embed_items)
    assert writes == 4 and fresh.restore(payload) == 4
    assert dict(fresh.state.records) == dict(state.records)
    assert fresh.state.record_versions == state.record_versions and fresh.state.records_applied == 3
