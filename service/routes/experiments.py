"""GET /experiments, GET /experiments/{id}/assignment/{user}, GET /experiments/{id}/results: the
experiments of DCMC_EXPERIMENTS (service/experiments.py), who is in which variant, and how each does."""

from __future__ import annotations

import math
from typing import Annotated, Any

import redis
from fastapi import APIRouter, Header, HTTPException, Path, Request
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from model.experiments import ExperimentSpec
from service.auth import require_read
from service.deps import ScorerDep, SettingsDep
from service.experiments import INTERLEAVED, Experiments
from service.schemas import MAX_ID_LENGTH

router = APIRouter(tags=["experiments"])


class VariantOut(BaseModel):
    """A variant as declared."""

    name: str
    weight: float
    artifact: bool = Field(description="Served by another artifact")
    inference: dict[str, Any]
    ranking: dict[str, Any]


class ExperimentOut(BaseModel):
    """An experiment as declared, and whether it runs now."""

    id: str
    description: str
    method: str
    share: float
    start: str | None
    end: str | None
    active: bool
    control: str
    hit_rating: float | None
    window_s: float
    variants: list[VariantOut]


class ExperimentsResponse(BaseModel):
    """Every experiment of DCMC_EXPERIMENTS, in file order (a user takes part in the first running one
    whose share holds them)."""

    experiments: list[ExperimentOut]


class AssignmentResponse(BaseModel):
    """A user's part in one experiment."""

    experiment: str
    user: str
    variant: str | None = Field(
        description="The user's variant (`interleaved` in an interleaved experiment); null: outside its share"
    )
    active: bool = Field(description="Whether the experiment runs now")
    answering: bool = Field(
        description="Whether /recommend answers the user as this experiment says now (it runs, the user is "
        "in its share, and no experiment earlier in the file holds them)"
    )


def _experiments(request: Request) -> Experiments:
    experiments: Experiments | None = request.app.state.experiments
    if experiments is None:
        return Experiments([])
    return experiments


def _experiment(request: Request, experiment_id: str) -> ExperimentSpec:
    spec = _experiments(request).by_id.get(experiment_id)
    if spec is None:
        raise HTTPException(status_code=404, detail=f"no experiment {experiment_id!r} (GET /experiments)")
    return spec


def _out(spec: ExperimentSpec) -> ExperimentOut:
    return ExperimentOut(
        id=spec.id,
        description=spec.description,
        method=spec.method,
        share=spec.share,
        start=spec.start.isoformat() if spec.start else None,
        end=spec.end.isoformat() if spec.end else None,
        active=spec.active(),
        control=spec.control,
        hit_rating=spec.hit_rating,
        window_s=spec.window_s,
        variants=[
            VariantOut(
                name=v.name,
                weight=v.weight,
                artifact=v.artifact is not None,
                inference=v.inference,
                ranking=v.ranking,
            )
            for v in spec.variants
        ],
    )


@router.get("/experiments", response_model=ExperimentsResponse)
async def list_experiments(
    request: Request, settings: SettingsDep, authorization: Annotated[str | None, Header()] = None
) -> ExperimentsResponse:
    """The experiments the service takes part in (none without DCMC_EXPERIMENTS). An artifact's path is
    not shown, only whether a variant has one."""
    require_read(settings, authorization)
    return ExperimentsResponse(experiments=[_out(e) for e in _experiments(request).specs])


@router.get(
    "/experiments/{experiment_id}/assignment/{user:path}",
    response_model=AssignmentResponse,
    responses={404: {"description": "No such experiment"}},
)
async def assignment(
    request: Request,
    experiment_id: str,
    user: Annotated[str, Path(min_length=1, max_length=MAX_ID_LENGTH, description="External user id")],
    settings: SettingsDep,
    authorization: Annotated[str | None, Header()] = None,
) -> AssignmentResponse:
    """The user's variant: a keyed hash of the experiment, its salt and the user id, so every worker,
    replica and restart gives the same one (model/experiments.py). Any id has one, known or not."""
    require_read(settings, authorization)
    spec = _experiment(request, experiment_id)
    variant = spec.assign(user)
    if variant is not None and spec.method == "interleave":
        variant = INTERLEAVED
    now = _experiments(request).assigned(user)
    return AssignmentResponse(
        experiment=spec.id,
        user=user,
        variant=variant,
        active=spec.active(),
        answering=now is not None and now.experiment.id == spec.id,
    )


@router.get(
    "/experiments/{experiment_id}/results",
    responses={
        404: {"description": "No such experiment"},
        503: {"description": "Redis is unavailable or not configured: the streams cannot be read"},
    },
)
async def experiment_results(
    request: Request,
    experiment_id: str,
    scorer: ScorerDep,
    settings: SettingsDep,
    authorization: Annotated[str | None, Header()] = None,
) -> dict[str, Any]:
    """Per variant: impressions, users, click-through, hit rate, mean later rating, coverage, and online
    accuracy (RMSE and log loss of what was served against the ratings that followed), each with its 95%
    interval, and each variant's difference from the control with its interval; for an interleaved
    experiment also the users' preference between the two. Computed from the impressions and rating
    streams (at most every 2 s per worker); `dcmc experiment report` computes the same from them. What
    each figure means: docs/experiments.md."""
    require_read(settings, authorization)
    spec = _experiment(request, experiment_id)
    if scorer.ratings is None:
        raise HTTPException(
            status_code=503, detail="results are computed from Redis's streams: set REDIS_URL"
        )
    try:
        figures = await run_in_threadpool(request.app.state.results.get, scorer, spec)
    except redis.RedisError:
        retry = {"Retry-After": str(max(1, math.ceil(scorer.retry_s)))}
        raise HTTPException(
            status_code=503, detail="Redis is unavailable; retry later", headers=retry
        ) from None
    return figures  # type: ignore[no-any-return]
