"""Online catalogue changes (PUT / PATCH /items/{id}, POST /items): stored in the rating stream, folded in
by every worker, read back with `after`, obeyed by /recommend and /similar-items at once, kept by the
fold-in snapshot and the compacted head; in process over `create_app` with the shared Redis."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from model.artifact import Artifact
from model.catalogue import ItemRecord
from tests.service.conftest import REDIS_URL, App
from tests.service.test_catalogue import artifact, catalogued, record  # noqa: F401 (fixtures)

TOKEN = "catalogue-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture()
def prefix(key_prefix: str) -> str:
    return f"{key_prefix}:items-{uuid.uuid4().hex[:6]}"


def served(catalogued: Path, prefix: str, **settings: Any) -> App:  # noqa: F811
    options = {"redis_url": REDIS_URL, "redis_key_prefix": prefix, "write_token": TOKEN, **settings}
    return App(catalogued, **options)


@pytest.fixture()
def api(catalogued: Path, prefix: str) -> Iterator[App]:  # noqa: F811
    with served(catalogued, prefix) as app:
        yield app


def put(api: App, item: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    r = api.client.put(f"/items/{item}", json=body, headers=AUTH)
    assert r.status_code == status, r.text
    return dict(r.json())


def patch(api: App, item: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    r = api.client.patch(f"/items/{item}", json=body, headers=AUTH)
    assert r.status_code == status, r.text
    return dict(r.json())


def read(api: App, item: str, after: str | None = None) -> dict[str, Any]:
    r = api.client.get(f"/items/{item}", params={"after": after} if after else {})
    assert r.status_code == 200, r.text
    return dict(r.json())


def recommended(api: App, user: str, after: str, **params: Any) -> list[str]:
    r = api.client.get(f"/recommend/{user}", params={"k": 40, "after": after, **params})
    assert r.status_code == 200, r.text
    return [x["item"] for x in r.json()["recommendations"]]


def test_put_and_patch_change_the_record_read_back_with_after(api: App, artifact: Artifact) -> None:  # noqa: F811
    item = artifact.items.ids[2]
    whole = {"title": "renamed", "categories": ["new"], "attributes": {"year": 2001, "lang": "de"}}
    done = put(api, item, whole)
    assert done["accepted"] == 1
    assert read(api, item, done["last_id"]) == {
        "item": item,
        **ItemRecord.model_validate(whole).model_dump(),
        "in_catalogue": True,
        "in_model": True,
    }
    done = patch(api, item, {"attributes": {"lang": None, "in_stock": True}, "title": None})
    got = read(api, item, done["last_id"])
    assert got["attributes"] == {"year": 2001, "in_stock": True}
    assert got["title"] is None and got["categories"] == ["new"]
    untouched = artifact.items.ids[3]
    assert read(api, untouched)["title"] == record(3).title  # the artifact's records stay
    listed = api.client.get("/items", params={"category": "new", "after": done["last_id"]}).json()
    assert [r["item"] for r in listed["items"]] == [item]


def test_writes_need_the_token_and_bad_bodies_are_422s_that_store_nothing(
    api: App,
    artifact: Artifact,  # noqa: F811
) -> None:
    item = artifact.items.ids[4]
    assert api.client.put(f"/items/{item}", json={"hidden": True}).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert api.client.patch(f"/items/{item}", json={"hidden": True}, headers=wrong).status_code == 401
    bad = [
        (api.client.put, {"categories": "Drama"}, "categories"),
        (api.client.put, {"attributes": {"1bad": 1}}, "attributes"),
        (api.client.put, {"colour": "red"}, "colour"),
        (api.client.patch, {"attributes": None}, "attributes"),
        (api.client.patch, {"hidden": "maybe"}, "hidden"),
    ]
    for call, body, where in bad:
        r = call(f"/items/{item}", json=body, headers=AUTH)
        assert r.status_code == 422, (body, r.text)
        assert where in str(r.json()["detail"][0]["loc"])
    many = {"attributes": {f"a{k}": k for k in range(64)}}
    read(api, item, put(api, item, many)["last_id"])  # checked against the record as this worker has it
    r = api.client.patch(f"/items/{item}", json={"attributes": {"one_more": 1}}, headers=AUTH)
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "record_past_limit"
    both = {"items": [{"item": item, "record": {}, "patch": {}}]}
    assert api.client.post("/items", json=both, headers=AUTH).status_code == 422
    assert api.client.post("/items", json={"items": []}, headers=AUTH).status_code == 422


def test_a_batch_is_stored_whole_up_to_its_limit(catalogued: Path, prefix: str, artifact: Artifact) -> None:  # noqa: F811
    with served(catalogued, prefix, max_item_changes=5) as api:
        writes = [{"item": f"new-{k}", "record": {"categories": ["batch"]}} for k in range(5)]
        writes.append({"item": "new-0", "patch": {"hidden": True}})
        r = api.client.post("/items", json={"items": writes}, headers=AUTH)
        assert r.status_code == 422 and "DCMC_MAX_ITEM_CHANGES" in r.text
        r = api.client.post("/items", json={"items": writes[1:]}, headers=AUTH)
        assert r.status_code == 200 and r.json()["accepted"] == 5
        last = r.json()["last_id"]
        listed = api.client.get("/items", params={"category": "batch", "after": last}).json()["items"]
        assert [x["item"] for x in listed] == [f"new-{k}" for k in range(1, 5)]
        patched = read(api, "new-0")  # its record came in the refused batch; the patch made one
        assert patched["hidden"] is True and patched["categories"] == []
        assert all(x["in_model"] is False for x in listed)  # in the catalogue before anyone rated them


def test_hiding_an_item_takes_it_out_of_every_list_and_showing_it_puts_it_back(
    api: App,
    artifact: Artifact,  # noqa: F811
) -> None:
    user = artifact.users.ids[0]
    first = api.client.get(f"/recommend/{user}", params={"k": 40}).json()["recommendations"]
    top = first[0]["item"]
    similar_to = next(x for x in artifact.items.ids if x != top)
    done = patch(api, top, {"hidden": True})
    assert top not in recommended(api, user, done["last_id"])
    similar = api.client.get(f"/similar-items/{similar_to}", params={"k": 60, "after": done["last_id"]})
    assert top not in {s["item"] for s in similar.json()["similar"]}
    done = patch(api, top, {"hidden": False})
    assert recommended(api, user, done["last_id"])[0] == top


def test_a_category_change_moves_the_item_between_filters(api: App, artifact: Artifact) -> None:  # noqa: F811
    user = artifact.users.ids[1]
    odd = recommended(api, user, "0", category="odd")
    moved = odd[0]
    done = put(api, moved, {"categories": ["even"], "attributes": {"year": 1800}})
    assert moved not in recommended(api, user, done["last_id"], category="odd")
    assert moved in recommended(api, user, done["last_id"], category="even")
    body = {"user": user, "k": 5, "filter": {"op": "range", "attribute": "year", "lt": 1900}}
    got = api.client.post("/recommend", json=body, params={"after": done["last_id"]}).json()
    assert [r["item"] for r in got["recommendations"]] == [moved]


def test_an_item_rated_before_it_is_in_the_catalogue_and_one_catalogued_before_it_is_rated(
    api: App,
    artifact: Artifact,  # noqa: F811
) -> None:
    user = artifact.users.ids[2]
    rated = {"ratings": [{"user": user, "item": "arrives-rated", "rating": 5}]}
    done = api.client.post("/ratings", json=rated, headers=AUTH).json()
    first = read(api, "arrives-rated", done["last_id"])
    assert first["in_model"] is True and first["in_catalogue"] is False
    done = put(api, "arrives-rated", {"categories": ["late"]})
    assert read(api, "arrives-rated", done["last_id"])["categories"] == ["late"]
    done = put(api, "arrives-catalogued", {"categories": ["early"]})
    assert read(api, "arrives-catalogued", done["last_id"])["in_model"] is False
    rated = {"ratings": [{"user": user, "item": "arrives-catalogued", "rating": 4}]}
    done = api.client.post("/ratings", json=rated, headers=AUTH).json()
    assert read(api, "arrives-catalogued", done["last_id"]) | {"in_model": True} == read(
        api, "arrives-catalogued"
    )
    index = api.client.app.state.scorer.catalogue_index()  # type: ignore[attr-defined]
    j = int(api.client.app.state.scorer.item_indices(["arrives-catalogued"])[0])  # type: ignore[attr-defined]
    assert index.has_record[j] and "early" in index.categories and j in index.categories["early"]


def test_a_fresh_worker_starts_from_the_snapshot_with_the_changes(
    catalogued: Path,  # noqa: F811
    prefix: str,
    artifact: Artifact,  # noqa: F811
) -> None:
    items = artifact.items.ids
    with served(catalogued, prefix, snapshot_every=1, snapshot_interval_s=0.1) as api:
        writes = [{"item": items[k], "patch": {"hidden": True}} for k in range(1, 6)]
        writes.append({"item": "catalogue-only", "record": {"title": "only here"}})
        last = api.client.post("/items", json={"items": writes}, headers=AUTH).json()["last_id"]
        read(api, "catalogue-only", last)
        scorer = api.client.app.state.scorer  # type: ignore[attr-defined]
        deadline = time.monotonic() + 20
        while api.metric("dcmc_fold_in_snapshots_total", event="written") < 1:  # after a round
            assert time.monotonic() < deadline, "no snapshot written"
            time.sleep(0.05)
    with served(catalogued, prefix) as fresh:
        scorer = fresh.client.app.state.scorer  # type: ignore[attr-defined]
        assert fresh.metric("dcmc_fold_in_snapshots_total", event="restored") == 1
        assert read(fresh, "catalogue-only")["title"] == "only here"
        assert all(read(fresh, items[k])["hidden"] for k in range(1, 6))
        assert scorer.catalogue_index().hidden[1:6].all()
