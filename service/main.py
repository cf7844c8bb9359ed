"""The FastAPI application: `create_app(settings)` and the lifespan that loads the artifact."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from model.artifact import load_artifact
from service.experiments import Experiments, ResultsCache, load_experiments
from service.fastpath import FastPath
from service.memory import tune_allocator
from service.metrics import Metrics, MetricsMiddleware
from service.reload import Reloader
from service.routes import events, items, ops, predict, ratings, recommend, similar
from service.routes import experiments as experiment_routes
from service.scoring import ServedModel
from service.settings import Settings, get_settings

log = logging.getLogger(__name__)


def _load(
    settings: Settings, metrics: Metrics, path: Path | None = None, experiments: Experiments | None = None
) -> ServedModel:
    """Verify and load the artifact (at `path`, default the served one, its link resolved once so that
    every file comes from one directory), precompute, place it in the online ratings and follow them
    (one try at catching up now; runs in a thread)."""
    artifact = load_artifact(path or os.path.realpath(settings.artifacts))  # ArtifactError stops start-up
    scorer = ServedModel(artifact, settings, metrics, experiments)
    scorer.start()
    return scorer


def _rebuild(settings: Settings, metrics: Metrics, served: ServedModel) -> ServedModel:
    """A fresh model of the artifact `served` serves (its files are not read again), started."""
    scorer = ServedModel(served.artifact, settings, metrics, served.experiments)
    scorer.start()
    return scorer


def _finite(value: Any) -> Any:
    """`value` with non-finite floats spelt as strings, so that a 422 can echo a NaN it refused."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


async def _invalid_request(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's 422 body, but one that JSON can hold whatever the request sent (NaN, Infinity)."""
    assert isinstance(exc, RequestValidationError)
    return JSONResponse({"detail": _finite(jsonable_encoder(exc.errors()))}, status_code=422)


def create_app(settings: Settings) -> FastAPI:
    """The service for one artifact; nothing is loaded until the lifespan starts."""
    metrics = Metrics(settings.metrics_dir)
    experiments = load_experiments(settings)  # ExperimentError stops start-up (`dcmc serve` checks first)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tune_allocator()  # before the model's arrays are allocated
        app.state.scorer = await run_in_threadpool(_load, settings, metrics, None, experiments)
        reloader = Reloader(
            app.state,
            settings.artifacts,
            settings.reload_poll_s,
            lambda path: _load(settings, metrics, path, experiments),
            lambda served: _rebuild(settings, metrics, served),
        )
        app.state.reloader = reloader
        reloader.start()
        try:
            yield
        finally:
            reloader.stop()
            app.state.scorer.close()
            app.state.scorer = None

    app = FastAPI(
        title="DCMC rating service",
        summary="Deep CRF matrix completion: predicted ratings and similar users from a trained artifact.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.experiments = experiments
    app.state.results = ResultsCache()
    app.state.scorer = None
    # Routes match in this order: the most requested first (each miss costs a match per request).
    # The routes that take a body answer 413 to one over DCMC_MAX_BODY_BYTES before parsing it (by its
    # Content-Length, or while it streams in); the others do not pay for the check.
    limit = settings.max_body_bytes
    app.include_router(ops.router)
    app.include_router(predict.router, max_body_size=limit)
    app.include_router(recommend.router)
    app.include_router(similar.router)
    app.include_router(items.router)
    app.include_router(ratings.router, max_body_size=limit)
    app.include_router(events.router, max_body_size=limit)
    app.include_router(experiment_routes.router)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_middleware(FastPath, state=app.state)
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # added last: outermost, so it counts both
    return app


def app_factory() -> FastAPI:
    """Uvicorn factory (`service.main:app_factory`): settings from this worker's environment."""
    settings = get_settings()
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return create_app(settings)
