"""The fast paths of POST /predict, POST /ratings and a plain GET /recommend/{user}[?k=K][&category=..]
[&exclude_category=..]: a pure ASGI
middleware that answers a well-formed request without FastAPI's routing, dependency resolution and body
handling, which cost more per request than a prediction from a cached user row (benchmarks/serve.py
floor) and than storing a rating in Redis. GET /recommend with any other parameter (`after`, `items`,
`min_rating`, `explain`, ...), or one given twice, goes to the route; one with `k` and the category
short form of a filter alone is answered by the route's own ranking code
(`service.routes.recommend.plain`; a category list the route would refuse goes to the route, which says
why).

It parses the body with pydantic-core (string ids: `StringIds`, `StringRatings`) and answers with the
function the FastAPI route answers with (`service.routes.predict.answer`, `service.routes.ratings.store`):
their errors (unknown ids, a wrong token, a rating off the levels, Redis down) are worded by them and
sent as FastAPI sends an HTTPException. Anything else (integer ids, invalid JSON or fields, an oversized
request, a query string such as `after`, the model still loading, the `paper` mode for /predict) goes on
to the FastAPI route with the body replayed: every validation error is worded by the route, and the
route's OpenAPI entry documents both.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Annotated, Any
from urllib.parse import parse_qsl

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from service.auth import require_read
from service.catalogue import short_filter
from service.metrics import ASGIApp, Message, Receive, Scope, Send
from service.recommend import split_ids
from service.routes.predict import answer
from service.routes.ratings import store
from service.routes.recommend import plain
from service.schemas import MAX_ID_LENGTH, RecommendationId

_StringId = Annotated[str, StringConstraints(strict=True, min_length=1, max_length=MAX_ID_LENGTH)]


class StringIds(BaseModel):
    """`PredictRequest` with string ids only (what nearly every client sends), validated in a third of
    the time. What it accepts PredictRequest accepts, with the same values (tests/service/test_fastpath.py
    checks it on generated bodies); integer ids go on to the route."""

    model_config = ConfigDict(extra="forbid")

    user: _StringId
    items: list[_StringId] = Field(min_length=1)
    distribution: bool = False


class StringRating(BaseModel):
    """`RatingIn` with string ids only; what it accepts RatingIn accepts, with the same values."""

    model_config = ConfigDict(extra="forbid")

    user: _StringId
    item: _StringId
    rating: Annotated[float, Field(strict=True, allow_inf_nan=False)]
    recommendation_id: RecommendationId | None = None


class StringRatings(BaseModel):
    """`RatingsRequest` with string ids only (integer ids go on to the route)."""

    model_config = ConfigDict(extra="forbid")

    ratings: list[StringRating] = Field(min_length=1)


ROUTES = {"/predict": SimpleNamespace(path="/predict"), "/ratings": SimpleNamespace(path="/ratings")}
RECOMMEND = SimpleNamespace(path="/recommend/{user_id:path}")
PLAIN_K = re.compile(rb"^(?:k=([0-9]{1,4}))?$")
"""The query of a plain GET /recommend/{user}: nothing, or `k` alone."""
SHORT_QUERY = {"k", "category", "exclude_category"}
"""The parameters a GET /recommend/{user} answered here may have (each once): `k` and the category short
form of a filter."""
"""What the metrics middleware reads as the route template of a request answered here."""


class FastPath:
    """The fast paths in front of the app; `state` is the FastAPI app's state (scorer, settings)."""

    def __init__(self, app: ASGIApp, state: Any) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"].startswith("/recommend/"):
            if not await self._recommend(scope, send):
                await self.app(scope, receive, send)
            return
        if (
            scope["type"] != "http"
            or scope["path"] not in ROUTES
            or scope["method"] != "POST"
            or scope.get("query_string")  # `after` (read-your-writes) and anything else: the route's
        ):
            await self.app(scope, receive, send)
            return
        limit = self.state.settings.max_body_bytes
        if _content_length(scope) > limit:  # the route answers 413 without reading it
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:  # streamed past the limit: the route counts it again and answers 413
                await self.app(scope, _replay(b"".join(chunks), receive, more=True), send)
                return
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)
        scorer = getattr(self.state, "scorer", None)
        answered = None
        if scorer is not None and _json(scope):
            if scope["path"] == "/ratings":
                answered = await self._ratings(scope, raw)
            elif not scorer.blocking and self._may_read(scope):  # else the route's way (threadpool, 401)
                try:
                    ids = StringIds.model_validate_json(raw)
                    payload = answer(scorer, self.state.settings, ids.user, ids.items, ids.distribution)
                    answered = (200, payload, [])
                except (ValidationError, HTTPException):
                    answered = None
        if answered is None:
            await self.app(scope, _replay(raw, receive), send)
            return
        status, payload, extra = answered
        scope["route"] = ROUTES[scope["path"]]
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers + extra})
        await send({"type": "http.response.body", "body": payload})

    async def _recommend(self, scope: Scope, send: Send) -> bool:
        """GET /recommend/{user}[?k=K] answered here (`service.routes.recommend.plain`); False for the route
        (any other parameter, k out of range, a mode that blocks, a read not allowed, an error)."""
        query = _short_query(scope.get("query_string", b""))
        scorer, settings = getattr(self.state, "scorer", None), self.state.settings
        user = scope["path"][len("/recommend/") :]
        if query is None or scorer is None or scorer.blocking or not user or not self._may_read(scope):
            return False
        k_text = query.get("k", "10")
        if (
            not (k_text.isascii() and k_text.isdigit() and len(k_text) <= 4)
            or not 1 <= int(k_text) <= settings.max_k
        ):
            return False
        try:
            chosen = short_filter(split_ids(query.get("category")), split_ids(query.get("exclude_category")))
            payload = plain(scorer, settings, user, int(k_text), chosen)
        except (HTTPException, ValidationError):
            return False
        scope["route"] = RECOMMEND
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
        return True

    def _may_read(self, scope: Scope) -> bool:
        """Whether the request may read (DCMC_READ_TOKEN unset, or it carries it or the write token)."""
        settings = self.state.settings
        if settings.read_token is None:
            return True
        try:
            require_read(settings, _header(scope, b"authorization"))
        except HTTPException:
            return False
        return True

    async def _ratings(self, scope: Scope, raw: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]]] | None:
        """POST /ratings answered here: (status, body, more headers), or None for the route (a body that
        is not `StringRatings`). An HTTPException of `store` is sent as FastAPI sends it."""
        try:
            batch = StringRatings.model_validate_json(raw)
        except ValidationError:
            return None
        authorization = _header(scope, b"authorization")
        try:
            stored = await store(self.state.scorer, self.state.settings, batch.ratings, authorization)
        except HTTPException as exc:
            body = {"detail": exc.detail}
            more = [
                (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (exc.headers or {}).items()
            ]
            return exc.status_code, _as_fastapi(body), more
        return 200, _as_fastapi(stored.model_dump(mode="json")), []


def _as_fastapi(content: Any) -> bytes:
    """JSON as FastAPI's JSONResponse renders it."""
    return json.dumps(
        content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode()


def _header(scope: Scope, name: bytes) -> str | None:
    """The first value of a request header, as starlette reads it (latin-1), or None."""
    for key, value in scope["headers"]:
        if key == name:
            decoded: str = value.decode("latin-1")
            return decoded
    return None


def _json(scope: Scope) -> bool:
    """Whether FastAPI reads the request's body as JSON: application/json or application/*+json. Not
    without a content type (FastAPI's strict content type, against cross-site requests)."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            kind: bytes = value.split(b";", 1)[0].strip().lower()
            return kind == b"application/json" or (
                kind.startswith(b"application/") and kind.endswith(b"+json")
            )
    return False


def _content_length(scope: Scope) -> int:
    """The request's Content-Length, or 0 without a valid one."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0


def _replay(body: bytes, receive: Receive, more: bool = False) -> Receive:
    """A `receive` that hands the body read here once (`more`: the rest is still to come), then defers to
    the server's (the rest of the body, disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": more}
        return await receive()

    return replay


def _short_query(raw: bytes) -> dict[str, str] | None:
    """The parameters of a GET /recommend/{user} query the fast path answers (`SHORT_QUERY`, each once),
    or None for the route (any other parameter, one repeated, or a query that is not UTF-8)."""
    if not raw:
        return {}
    if PLAIN_K.match(raw):
        return {"k": raw[2:].decode()}
    try:
        pairs = parse_qsl(raw.decode(), keep_blank_values=True, strict_parsing=True)
    except (UnicodeDecodeError, ValueError):
        return None
    out = dict(pairs)
    if len(out) != len(pairs) or not out.keys() <= SHORT_QUERY:
        return None
    return out
