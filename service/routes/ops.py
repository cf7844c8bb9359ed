"""Operations: /health, /ready, /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from service.deps import MetricsDep
from service.schemas import Health, Ready

router = APIRouter(tags=["operations"])


@router.get("/health", response_model=Health)
def health(request: Request) -> Health:
    """Liveness; `degraded` while Redis is configured but failing (the service still answers)."""
    scorer = getattr(request.app.state, "scorer", None)
    if scorer is None:
        return Health(status="starting", model_version=None, redis="unknown")
    redis = scorer.redis_state()
    return Health(status="degraded" if redis == "down" else "ok", model_version=scorer.version, redis=redis)


@router.get("/ready", response_model=Ready, responses={503: {"model": Ready}})
def ready(request: Request) -> Response:
    """200 once the artifact is loaded and warmed up, else 503."""
    scorer = getattr(request.app.state, "scorer", None)
    body = Ready(ready=scorer is not None, model_version=scorer.version if scorer else None)
    return JSONResponse(body.model_dump(), status_code=200 if scorer is not None else 503)


@router.get("/metrics", response_class=Response)
def metrics(metrics: MetricsDep) -> Response:
    """Prometheus text format: requests and latency per route, embedding-cache hits and misses."""
    return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
