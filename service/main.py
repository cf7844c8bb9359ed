"""The FastAPI application: `create_app(settings)` and the lifespan that loads the artifact."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from model.artifact import load_artifact
from service.metrics import Metrics, MetricsMiddleware
from service.routes import ops, predict, users
from service.scoring import Scorer
from service.settings import Settings, get_settings

log = logging.getLogger(__name__)


def _load(settings: Settings, metrics: Metrics) -> Scorer:
    """Verify and load the artifact, precompute, and seed the cache tiers (runs in a thread)."""
    artifact = load_artifact(settings.artifacts)  # ArtifactError stops start-up
    scorer = Scorer(artifact, settings, metrics)
    outcome = scorer.populate()
    log.info("embedding tiers seeded: %s", outcome)
    return scorer


def create_app(settings: Settings) -> FastAPI:
    """The service for one artifact; nothing is loaded until the lifespan starts."""
    metrics = Metrics(settings.metrics_dir)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.scorer = await run_in_threadpool(_load, settings, metrics)
        try:
            yield
        finally:
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
    app.state.scorer = None
    app.include_router(predict.router)
    app.include_router(users.router)
    app.include_router(ops.router)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app


def app_factory() -> FastAPI:
    """Uvicorn factory (`service.main:app_factory`): settings from this worker's environment."""
    settings = get_settings()
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return create_app(settings)
