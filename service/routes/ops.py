"""Operations: /health, /ready, /metrics."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from service.deps import MetricsDep
from service.schemas import Health, Ready

router = APIRouter(tags=["operations"])


def _json(body: Health | Ready, status_code: int = 200) -> Response:
    return Response(orjson.dumps(body.model_dump()), status_code, media_type="application/json")


# Both are `async` and answer without a thread hop (a sync route runs in the thread pool): they are what
# load balancers and orchestrators poll.
@router.get("/health", response_model=Health)
async def health(request: Request) -> Response:
    """Liveness; `degraded` while Redis is configured but failing, or the stream cannot be followed (the
    service still answers). `replication` says where this worker's replica stands
    (service/replication.py)."""
    scorer = getattr(request.app.state, "scorer", None)
    if scorer is None:
        return _json(Health(status="starting", model_version=None, redis="unknown"))
    replica = scorer.replica
    # While Redis fails, redis_state() probes it (a blocking call, at most once per retry): off the loop.
    failing = replica is not None and replica.redis_down
    redis = await run_in_threadpool(scorer.redis_state) if failing else scorer.redis_state()
    settings = request.app.state.settings
    if scorer.ratings is None:
        writes = "off: no Redis (REDIS_URL)"
    else:
        writes = "enabled" if settings.write_token is not None else "off: no DCMC_WRITE_TOKEN"
    reloader = request.app.state.reloader
    degraded = redis == "down" or (replica is not None and replica.phase.value == "degraded")
    # A dict in Health's shape (its OpenAPI entry documents it): the pydantic model costs more than the rest
    # of this route, and load balancers poll it.
    body = {
        "status": "degraded" if degraded else "ok",
        "model_version": scorer.version,
        "redis": redis,
        "durable": scorer.durability.durable,
        "durability": scorer.durability.detail,
        "writes": writes,
        "ready": scorer.ready,
        "replication": replica.describe() if replica is not None else None,
        "online_ratings": scorer.fold.state.applied,
        "catalogue_changes": scorer.fold.state.records_applied,
        "skipped_entries": replica.skipped if replica is not None else 0,
        "last_skipped_entry": (
            {"id": last.id, "reason": last.reason}
            if replica is not None and (last := replica.last_skipped) is not None
            else None
        ),
        "loading_model_version": reloader.loading if reloader is not None else None,
        "reload_error": reloader.last_error if reloader is not None else None,
    }
    return Response(orjson.dumps(body), media_type="application/json")


@router.get("/ready", response_model=Ready, responses={503: {"model": Ready}})
async def ready(request: Request) -> Response:
    """200 once the artifact is loaded and this worker has caught up with the online ratings (its replica
    decides: service/replication.py), else 503."""
    scorer = getattr(request.app.state, "scorer", None)
    ready = scorer is not None and scorer.ready
    body = Ready(ready=ready, model_version=scorer.version if scorer else None)
    return _json(body, 200 if ready else 503)


@router.get("/metrics", response_class=Response)
def metrics(metrics: MetricsDep) -> Response:
    """Prometheus text format: requests and latency per route, embedding-cache hits and misses."""
    return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
