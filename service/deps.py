"""Dependencies as Annotated aliases, so handler signatures stay short.

They are `async` on purpose: FastAPI runs sync dependencies in its thread pool, one hop per request each.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request

from service.metrics import Metrics
from service.scoring import ServedModel
from service.settings import Settings


async def _settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


def scorer_of(request: Request) -> ServedModel:
    """The app's scorer, or a 503 while it loads. Hot routes call it directly: a FastAPI dependency costs
    a resolution per request."""
    scorer = getattr(request.app.state, "scorer", None)
    if scorer is None:
        raise HTTPException(status_code=503, detail="the model is not loaded yet")
    return scorer  # type: ignore[no-any-return]


async def _scorer(request: Request) -> ServedModel:
    return scorer_of(request)


async def _metrics(request: Request) -> Metrics:
    return request.app.state.metrics  # type: ignore[no-any-return]


SettingsDep = Annotated[Settings, Depends(_settings)]
ScorerDep = Annotated[ServedModel, Depends(_scorer)]
MetricsDep = Annotated[Metrics, Depends(_metrics)]
