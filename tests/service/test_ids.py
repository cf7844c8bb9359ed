"""External ids in request bodies: JSON strings, or JSON integers read as their decimal strings; booleans,
floats, null and ids over MAX_ID_LENGTH characters are 422s naming the field. Responses carry strings."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from model.artifact import write_manifest
from service.schemas import ID_TYPE_MESSAGE as TYPE_MSG
from service.schemas import MAX_ID_LENGTH
from tests.service.conftest import REDIS_URL, App


def numeric(external: str) -> str:
    """The tiny artifact's ids renamed to numbers: user u7 -> "107", item i3 -> "203"."""
    return str({"u": 100, "i": 200}[external[0]] + int(external[1:]))


@pytest.fixture(scope="module")
def numeric_app(
    tiny_artifact: Path, tmp_path_factory: pytest.TempPathFactory, key_prefix: str
) -> Iterator[App]:
    """The service on a copy of the tiny artifact whose ids are numeric strings (as MovieLens ids are)."""
    copy = Path(shutil.copytree(tiny_artifact, tmp_path_factory.mktemp("numeric") / "artifact"))
    for name in ("user_ids.json", "item_ids.json"):
        ids = json.loads((copy / name).read_text())
        (copy / name).write_text(json.dumps([numeric(x) for x in ids]))
    write_manifest(copy)
    with App(copy, redis_url=REDIS_URL, redis_key_prefix=key_prefix) as api:
        yield api


ITEMS = ["i3", "i0", "i17", "i42", "i3"]


@pytest.mark.parametrize("distribution", [False, True])
def test_numeric_ids_predict_like_their_strings(numeric_app: App, app: App, distribution: bool) -> None:
    strings = {"user": "107", "items": [numeric(i) for i in ITEMS], "distribution": distribution}
    ints = {"user": 107, "items": [int(numeric(i)) for i in ITEMS], "distribution": distribution}
    mixed = {"user": 107, "items": [203, "200", 217, "242", 203], "distribution": distribution}
    expected = numeric_app.client.post("/predict", json=strings)
    assert expected.status_code == 200, expected.text
    for body in (ints, mixed):
        r = numeric_app.client.post("/predict", json=body)
        assert r.status_code == 200, r.text
        assert r.json() == expected.json()
        assert r.json()["user"] == "107"
        assert [p["item"] for p in r.json()["predictions"]] == ["203", "200", "217", "242", "203"]
    # The renamed artifact is the same model: the numbers answer what u7 and its items answer.
    original = app.client.post("/predict", json={"user": "u7", "items": ITEMS, "distribution": distribution})
    assert original.status_code == 200, original.text
    assert [p["rating"] for p in expected.json()["predictions"]] == [
        p["rating"] for p in original.json()["predictions"]
    ]


def test_unknown_numeric_ids_are_listed_as_strings(app: App) -> None:
    r = app.client.post("/predict", json={"user": 196, "items": [242, "i1", -3, 10**30, 242]})
    assert r.status_code == 404, r.text
    detail = r.json()["detail"]
    assert detail["unknown_users"] == ["196"]
    assert detail["unknown_items"] == ["242", "-3", "1" + "0" * 30]
    assert detail["msg"] == (f"unknown user id(s): '196'; unknown item id(s): '242', '-3', '{10**30}'")


LONG_MSG = f"String should have at most {MAX_ID_LENGTH} characters"


@pytest.mark.parametrize(
    ("body", "loc", "kind", "msg"),
    [
        ({"user": True, "items": ["i1"]}, ["body", "user"], "id_type", TYPE_MSG),
        ({"user": False, "items": ["i1"]}, ["body", "user"], "id_type", TYPE_MSG),
        ({"user": "u1", "items": ["i1", True]}, ["body", "items", 1], "id_type", TYPE_MSG),
        ({"user": 1.5, "items": ["i1"]}, ["body", "user"], "id_type", TYPE_MSG),
        ({"user": 1.0, "items": ["i1"]}, ["body", "user"], "id_type", TYPE_MSG),
        ({"user": "u1", "items": [2.5]}, ["body", "items", 0], "id_type", TYPE_MSG),
        ({"user": None, "items": ["i1"]}, ["body", "user"], "id_type", TYPE_MSG),
        ({"user": "u1", "items": ["i1", None]}, ["body", "items", 1], "id_type", TYPE_MSG),
        ({"user": ["u1"], "items": ["i1"]}, ["body", "user"], "id_type", TYPE_MSG),
        ({"user": {"id": 1}, "items": ["i1"]}, ["body", "user"], "id_type", TYPE_MSG),
        ({"user": "x" * 257, "items": ["i1"]}, ["body", "user"], "string_too_long", LONG_MSG),
        ({"user": "u1", "items": ["i1", "y" * 257]}, ["body", "items", 1], "string_too_long", LONG_MSG),
        ({"user": int("9" * 257), "items": ["i1"]}, ["body", "user"], "string_too_long", LONG_MSG),
        ({"user": "", "items": ["i1"]}, ["body", "user"], "string_too_short", "at least 1 character"),
        ({"user": "u1", "items": [""]}, ["body", "items", 0], "string_too_short", "at least 1 character"),
    ],
)
def test_bad_ids_are_a_422_naming_the_field(
    app: App, body: dict[str, Any], loc: list[object], kind: str, msg: str
) -> None:
    r = app.client.post("/predict", json=body)
    assert r.status_code == 422, r.text
    errors = r.json()["detail"]
    assert [e["loc"] for e in errors] == [loc]
    assert errors[0]["type"] == kind
    assert msg in errors[0]["msg"]


def test_an_id_of_max_length_is_looked_up(app: App) -> None:
    longest = "x" * MAX_ID_LENGTH
    r = app.client.post("/predict", json={"user": longest, "items": ["i1", int("9" * MAX_ID_LENGTH)]})
    assert r.status_code == 404, r.text
    assert r.json()["detail"]["unknown_users"] == [longest]
    assert r.json()["detail"]["unknown_items"] == ["9" * MAX_ID_LENGTH]


@pytest.mark.parametrize(("length", "status"), [(MAX_ID_LENGTH, 404), (MAX_ID_LENGTH + 1, 422)])
def test_path_ids_are_bounded_too(app: App, length: int, status: int) -> None:
    r = app.client.get(f"/similar-users/{'x' * length}")
    assert r.status_code == status, r.text
    if status == 422:
        (error,) = r.json()["detail"]
        assert error["loc"] == ["path", "user_id"]
        assert error["type"] == "string_too_long"
    else:
        assert r.json()["detail"]["unknown_users"] == ["x" * length]


def test_openapi_documents_ids_as_string_or_integer(app: App) -> None:
    schemas = app.client.get("/openapi.json").json()["components"]["schemas"]
    request = schemas["PredictRequest"]["properties"]
    id_schema = {
        "anyOf": [{"type": "string", "minLength": 1, "maxLength": MAX_ID_LENGTH}, {"type": "integer"}]
    }
    assert request["user"]["anyOf"] == id_schema["anyOf"]
    assert "integer" in request["user"]["description"]
    assert request["items"]["items"] == id_schema
    assert request["items"]["type"] == "array"
    # responses keep strings
    assert schemas["PredictResponse"]["properties"]["user"]["type"] == "string"
    assert schemas["Prediction"]["properties"]["item"]["type"] == "string"
