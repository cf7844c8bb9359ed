"""POST /predict's fast path: a pure ASGI middleware that answers a well-formed request for known ids
without FastAPI's routing, dependency resolution and body handling, which cost more per request than a
prediction from a cached user row (benchmarks/serve_floor.py).

It parses the body with pydantic-core (string ids: `StringIds`) and answers with
`service.routes.predict.answer`, the function the FastAPI route answers with. Anything else (integer ids,
invalid JSON or fields, unknown ids, an oversized request, a query string such as `after`, the model still
loading, the `paper` mode) goes
on to the FastAPI route with the body replayed: every error is worded by the route, and the route's
OpenAPI entry documents both.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Annotated, Any

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from service.metrics import ASGIApp, Message, Receive, Scope, Send
from service.routes.predict import answer
from service.schemas import MAX_ID_LENGTH

_StringId = Annotated[str, StringConstraints(strict=True, min_length=1, max_length=MAX_ID_LENGTH)]


class StringIds(BaseModel):
    """`PredictRequest` with string ids only (what nearly every client sends), validated in a third of
    the time. What it accepts PredictRequest accepts, with the same values (tests/service/test_fastpath.py
    checks it on generated bodies); integer ids go on to the route."""

    model_config = ConfigDict(extra="forbid")

    user: _StringId
    items: list[_StringId] = Field(min_length=1)
    distribution: bool = False


ROUTE = SimpleNamespace(path="/predict")
"""What the metrics middleware reads as the route template of a request answered here."""


class FastPredict:
    """The fast path in front of the app; `state` is the FastAPI app's state (scorer, settings)."""

    def __init__(self, app: ASGIApp, state: Any) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["path"] != "/predict"
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
        payload = None
        if scorer is not None and scorer.inference.mode != "paper" and _json(scope):
            try:
                ids = StringIds.model_validate_json(raw)
                payload = answer(scorer, self.state.settings, ids.user, ids.items, ids.distribution)
            except (ValidationError, HTTPException):
                payload = None
        if payload is None:
            await self.app(scope, _replay(raw, receive), send)
            return
        scope["route"] = ROUTE
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


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
