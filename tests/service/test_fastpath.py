"""POST /predict's fast path (service/fastpath.py): it answers well-formed requests itself, byte for byte
as the FastAPI route would, and hands everything else to the route with the body intact."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from model.artifact import write_manifest
from service.fastpath import FastPath, StringIds
from service.routes.predict import answer
from service.schemas import PredictRequest
from tests.service.conftest import App

ITEMS = ["i1", "i2", "i30"]


def _call(fast: FastPath, body: bytes, content_type: bytes | None = b"application/json") -> list[Any]:
    """One POST /predict through `fast`: the messages it sent."""
    headers = [(b"content-type", content_type)] if content_type is not None else []
    scope = {"type": "http", "method": "POST", "path": "/predict", "headers": headers}
    chunks = [body[:5], body[5:]]  # a body in two messages, as a server may deliver it

    async def receive() -> dict[str, Any]:
        chunk = chunks.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    sent: list[Any] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(fast(scope, receive, send))
    return sent


class Downstream:
    """Stands for the FastAPI app behind the fast path: records what reaches it."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        message = await receive()
        self.bodies.append(message["body"])
        await send({"type": "http.response.start", "status": 599, "headers": []})
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture(scope="module")
def exact_app(tiny_artifact: Path) -> Any:
    with App(tiny_artifact, inference={"mode": "exact", "kernel": {"co_rating": 50.0}}) as api:
        yield api


def test_a_well_formed_request_is_answered_without_the_route(exact_app: App) -> None:
    state = exact_app.client.app.state  # type: ignore[attr-defined]
    down = Downstream()
    body = {"user": "u2", "items": ITEMS, "distribution": True}
    # The user's whole row is cached once its misses add up to the catalogue, and its numbers equal a
    # direct answer's only to rounding (test_user_rows.py): the row first, so that every answer compared
    # below comes from it.
    state.scorer.row(state.scorer.user_index("u2"))
    sent = _call(FastPath(down, state), json.dumps(body).encode())
    assert down.bodies == []
    assert sent[0]["status"] == 200
    assert sent[1]["body"] == answer(state.scorer, state.settings, "u2", ITEMS, True)
    # and through the whole app, the same answer as the route gives (the route: a `+json` type it reads)
    counted = exact_app.metric("dcmc_http_requests_total", route="/predict", method="POST", status="200")
    via_http = exact_app.client.post("/predict", json=body).json()
    assert (
        exact_app.metric("dcmc_http_requests_total", route="/predict", method="POST", status="200")
        == counted + 1
    )
    assert via_http == orjson.loads(sent[1]["body"])
    assert sent[0]["headers"] == [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(sent[1]["body"])).encode()),
    ]


@pytest.fixture(scope="module")
def numeric_app(tiny_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny artifact with decimal ids ("3" for u3, "30" for i30): a body with integer ids is one the
    fast path hands to the route (its ids are strict strings), which answers it as the decimal strings.
    No cached rows, so that every answer is computed afresh by the same code."""
    copy = Path(shutil.copytree(tiny_artifact, tmp_path_factory.mktemp("numeric") / "artifact"))
    for name in ("user_ids.json", "item_ids.json"):
        ids = json.loads((copy / name).read_text())
        (copy / name).write_text(json.dumps([i[1:] for i in ids]))
    write_manifest(copy)
    with App(copy, inference={"mode": "exact", "kernel": {"co_rating": 50.0}}, user_cache_mb=0) as api:
        yield api


@pytest.mark.parametrize(
    ("user", "items", "distribution"),
    [(2, [1, 2, 30], True), (0, [49], False), (17, list(range(0, 50, 3)), True), (59, [5, 5, 4], False)],
)
def test_the_fast_path_answers_byte_for_byte_as_the_fastapi_route(
    numeric_app: App, user: int, items: list[int], distribution: bool
) -> None:
    state = numeric_app.client.app.state  # type: ignore[attr-defined]
    as_ints = json.dumps({"user": user, "items": items, "distribution": distribution}).encode()
    as_strings = json.dumps({"user": str(user), "items": list(map(str, items)), "distribution": distribution})
    down = Downstream()
    _call(FastPath(down, state), as_ints)
    assert down.bodies == [as_ints]  # integer ids: handed to the route
    by_route = numeric_app.client.post(
        "/predict", content=as_ints, headers={"content-type": "application/json"}
    )
    assert by_route.status_code == 200, by_route.text
    down = Downstream()
    sent = _call(FastPath(down, state), as_strings.encode())
    assert down.bodies == [] and sent[0]["status"] == 200  # answered by the fast path itself
    assert sent[1]["body"] == by_route.content
    assert len(by_route.json()["predictions"]) == len(items)
    assert dict(sent[0]["headers"])[b"content-type"] == by_route.headers["content-type"].encode()


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b'{"user": "u2", "items": ["i1"]', b"application/json"),  # invalid JSON
        (b'{"user": "u2", "items": ["i1", "nope"]}', b"application/json"),  # an unknown item
        (b'{"user": "nobody", "items": ["i1"]}', b"application/json"),  # an unknown user
        (b'{"user": "u2", "items": []}', b"application/json"),  # too short
        (b'{"user": "u2", "items": ["i1"], "x": 1}', b"application/json"),  # an extra field
        (b'{"user": "u2", "items": ["i1"]}', b"text/plain"),  # not a JSON content type
        (b'{"user": "u2", "items": ["i1"]}', None),  # no content type: FastAPI does not read it as JSON
        (b'{"user": "u2", "items": [1, "i2"]}', b"application/json"),  # an integer id: the route's
    ],
)
def test_anything_else_reaches_the_route_with_its_body(
    exact_app: App, body: bytes, content_type: bytes
) -> None:
    down = Downstream()
    sent = _call(FastPath(down, exact_app.client.app.state), body, content_type)  # type: ignore[attr-defined]
    assert down.bodies == [body]
    assert sent[0]["status"] == 599


def test_the_route_words_the_errors_and_reads_json_content_types(exact_app: App) -> None:
    ok = {"user": "u2", "items": ITEMS}
    r = exact_app.client.post("/predict", content=json.dumps(ok), headers={"content-type": "text/plain"})
    assert r.status_code == 422  # as FastAPI: a body that is not declared JSON is not read as JSON
    assert exact_app.client.post("/predict", content=json.dumps(ok)).status_code == 422  # nor one without
    r = exact_app.client.post(
        "/predict",
        content=json.dumps(ok),
        headers={"content-type": "application/vnd.api+json; charset=utf-8"},
    )
    assert r.status_code == 200 and len(r.json()["predictions"]) == 3
    r = exact_app.client.post("/predict", json={"user": "u2", "items": ["i1", "nope"]})
    assert r.status_code == 404 and r.json()["detail"]["unknown_items"] == ["nope"]


_ID = st.one_of(
    st.text(max_size=300),
    st.integers(min_value=-(10**300), max_value=10**300),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False),
    st.just("x" * 256),
    st.just("x" * 257),
)


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries(
        {"user": _ID, "items": st.lists(_ID, max_size=4)},
        optional={
            "distribution": st.one_of(st.booleans(), st.integers(-1, 2), st.text(max_size=5)),
            "x": _ID,
        },
    )
)
def test_string_ids_accept_only_what_the_route_accepts_with_the_same_values(body: dict[str, Any]) -> None:
    raw = json.dumps(body).encode()
    try:
        fast = StringIds.model_validate_json(raw)
    except ValidationError:
        return
    full = PredictRequest.model_validate(json.loads(raw))  # as FastAPI reads it; raises if it disagrees
    assert (fast.user, fast.items, fast.distribution) == (full.user, full.items, full.distribution)


def test_an_oversized_body_gets_413_through_the_fast_path_too(exact_app: App) -> None:
    body = json.dumps({"user": "u2", "items": ["i1"] * 300_000}).encode()  # ~2 MB > DCMC_MAX_BODY_BYTES
    headers = {"content-type": "application/json"}
    assert exact_app.client.post("/predict", content=body, headers=headers).status_code == 413

    def chunks() -> Iterator[bytes]:  # no Content-Length: the fast path counts what streams in
        for k in range(0, len(body), 100_000):
            yield body[k : k + 100_000]

    assert exact_app.client.post("/predict", content=chunks(), headers=headers).status_code == 413
    assert exact_app.client.post("/predict", json={"user": "u2", "items": ITEMS}).status_code == 200


# -- POST /ratings ------------------------------------------------------------------------------------------

TOKEN = "fast-token"


def _post(fast: FastPath, body: bytes, authorization: bytes | None) -> list[Any]:
    """One POST /ratings through `fast`: the messages it sent."""
    headers = [(b"content-type", b"application/json")]
    if authorization is not None:
        headers.append((b"authorization", authorization))
    scope = {"type": "http", "method": "POST", "path": "/ratings", "headers": headers}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    sent: list[Any] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(fast(scope, receive, send))
    return sent


@pytest.fixture()
def writing_app(tiny_artifact: Path) -> Iterator[App]:
    from tests.service.conftest import RedisServer

    server = RedisServer().start()
    try:
        with App(tiny_artifact, redis_url=server.url, write_token=TOKEN, max_new_users=1) as api:
            yield api
    finally:
        server.kill()


def test_a_well_formed_rating_batch_is_stored_without_the_route(writing_app: App) -> None:
    state = writing_app.client.app.state  # type: ignore[attr-defined]
    down = Downstream()
    body = json.dumps({"ratings": [{"user": "u2", "item": "i3", "rating": 4}]}).encode()
    sent = _post(FastPath(down, state), body, f"Bearer {TOKEN}".encode())
    assert down.bodies == [] and sent[0]["status"] == 200
    answer = orjson.loads(sent[1]["body"])
    assert answer["accepted"] == 1 and answer["model_version"] == state.scorer.version
    stream = state.scorer.ratings
    assert [(e.id, e.user, e.item, e.rating) for e in stream.read("0").entries] == [
        (answer["last_id"], "u2", "i3", 4.0)
    ]
    # integer ids and anything not strictly typed: the route's, with the body intact
    for raw in (
        b'{"ratings": [{"user": 2, "item": "i3", "rating": 4}]}',
        b'{"ratings": [{"user": "u2", "item": "i3", "rating": "4"}]}',
        b'{"ratings": []}',
    ):
        down = Downstream()
        assert _post(FastPath(down, state), raw, f"Bearer {TOKEN}".encode())[0]["status"] == 599
        assert down.bodies == [raw]


@pytest.mark.parametrize(
    ("ratings", "authorization"),
    [
        ([{"user": "u2", "item": "i3", "rating": 5}], f"Bearer {TOKEN}"),
        ([{"user": "u2", "item": "i3", "rating": 5}], None),
        ([{"user": "u2", "item": "i3", "rating": 5}], "Bearer wrong"),
        (
            [{"user": "u2", "item": "i3", "rating": 4.5}, {"user": "u4", "item": "i1", "rating": 0}],
            f"Bearer {TOKEN}",
        ),
        (
            [{"user": "new-1", "item": "i3", "rating": 5}, {"user": "new-2", "item": "i3", "rating": 5}],
            f"Bearer {TOKEN}",
        ),
    ],
)
def test_the_ratings_fast_path_answers_as_the_route(
    writing_app: App, ratings: list[dict[str, Any]], authorization: str | None
) -> None:
    # A query string sends the same request to the FastAPI route: status, body and headers must agree.
    headers = {"authorization": authorization} if authorization else {}
    fast = writing_app.client.post("/ratings", json={"ratings": ratings}, headers=headers)
    route = writing_app.client.post("/ratings?via=route", json={"ratings": ratings}, headers=headers)
    assert fast.status_code == route.status_code
    a, b = fast.json(), route.json()
    if fast.status_code == 200:
        assert a.pop("last_id") < b.pop("last_id")
    assert a == b
    for name in ("www-authenticate", "retry-after", "content-type"):
        assert fast.headers.get(name) == route.headers.get(name)


@pytest.mark.parametrize(("user", "query"), [("u2", "?k=7"), ("u5", ""), ("nobody-yet", "?k=3")])
def test_a_plain_recommend_is_answered_here_as_the_route_answers_it(
    exact_app: App, user: str, query: str
) -> None:
    from service.routes.recommend import plain

    state = exact_app.client.app.state  # type: ignore[attr-defined]
    k = int(query[3:]) if query else 10
    counted = exact_app.metric(
        "dcmc_http_requests_total", route="/recommend/{user_id:path}", method="GET", status="200"
    )
    fast = exact_app.client.get(f"/recommend/{user}{query}")
    assert _same_but_id(fast.content, plain(state.scorer, state.settings, user, k))
    assert (
        exact_app.metric(
            "dcmc_http_requests_total", route="/recommend/{user_id:path}", method="GET", status="200"
        )
        == counted + 1
    )
    # The route (reached with a parameter the fast path leaves to it) answers the same.
    via_route = exact_app.client.get(f"/recommend/{user}?k={k}&exclude=")
    assert _same_but_id(via_route.content, fast.content)
    assert exact_app.client.get(f"/recommend/{user}?k=0").status_code == 422  # the route's error


def _same_but_id(a: bytes, b: bytes) -> bool:
    """Two /recommend answers alike but for their recommendation ids (new for each answer)."""
    x, y = json.loads(a), json.loads(b)
    first, second = x.pop("recommendation_id"), y.pop("recommendation_id")
    return bool(x == y and first != second and len(first) == len(second) == 32)
