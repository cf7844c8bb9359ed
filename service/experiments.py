"""The experiments a service takes part in (DCMC_EXPERIMENTS; model/experiments.py says how they are
declared, assigned and measured): which variant answers a user, the models of the variants that need one,
and their results computed from the streams.

A variant that changes the model (another `artifact`, or `inference` overrides) is served by a model of
its own, loaded with the served one (and again with it at each hot reload: service/reload.py), following
the same rating stream; a variant that changes only the ranking is the served model with other options.
While several experiments run, a user takes part in the first (in file order) whose share holds them.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from model.experiments import ExperimentError, ExperimentSpec, VariantSpec, read_experiments, results
from model.experiments import read_streams as read_experiment_streams
from service.catalogue import Boost, Filter, shape_problem

if TYPE_CHECKING:
    from model.artifact import Artifact
    from service.metrics import Metrics
    from service.scoring import ServedModel
    from service.settings import Settings

log = logging.getLogger(__name__)

RESULTS_TTL_S = 2.0
"""How long a worker answers GET /experiments/{id}/results from the figures it computed last."""


class RankingOptions(BaseModel):
    """What a variant changes in /recommend's ranking (a request's own values win where it gives them;
    a variant's filter holds besides the request's, its boosts add to the request's)."""

    model_config = ConfigDict(extra="forbid")

    diversity: float | None = Field(default=None, ge=0, le=1)
    min_rating: float | None = Field(default=None, allow_inf_nan=False)
    filter: Filter | None = None
    boosts: list[Boost] = Field(default_factory=list, max_length=16)
    popular: bool = Field(default=False, description="the popular list (shrunk mean rating) for everyone")


NO_OPTIONS = RankingOptions()
"""A variant that changes nothing in the ranking."""


@dataclass(frozen=True)
class Assignment:
    """A user's part in an experiment."""

    experiment: ExperimentSpec
    variant: str
    """The variant's name; `interleaved` for an interleaved experiment (both variants answer)."""


INTERLEAVED = "interleaved"


class Experiments:
    """The experiments of a file, with each variant's ranking options checked."""

    def __init__(self, specs: list[ExperimentSpec]) -> None:
        self.specs = specs
        self.by_id = {e.id: e for e in specs}
        self.ranking: dict[tuple[str, str], RankingOptions] = {}
        self._counters: dict[tuple[str, str], Any] = {}
        for e in specs:
            for v in e.variants:
                where = f"experiment {e.id!r}, variant {v.name!r}"
                try:
                    options = RankingOptions.model_validate(v.ranking)
                except ValidationError as exc:
                    problems = "; ".join(
                        f"ranking.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
                        for err in exc.errors()[:3]
                    )
                    raise ExperimentError(f"{where}: {problems}") from None
                for clause, loc in [(options.filter, "filter")] + [
                    (b.filter, f"boosts.{n}.filter") for n, b in enumerate(options.boosts)
                ]:
                    problem = None if clause is None else shape_problem(clause, ["ranking", loc])
                    if problem is not None:
                        raise ExperimentError(f"{where}: ranking.{loc}: {problem[2]}")
                self.ranking[(e.id, v.name)] = options

    def assigned(self, user: str, now: float | None = None) -> Assignment | None:
        """The user's part: in the first running experiment whose share holds them, or None."""
        now = time.time() if now is None else now
        for e in self.specs:
            if not e.active(now):
                continue
            variant = e.assign(user)
            if variant is not None:
                return Assignment(e, INTERLEAVED if e.method == "interleave" else variant)
        return None

    def answered(self, experiment: str, variant: str, metrics: Metrics) -> None:
        """Count an answer given in the variant (`dcmc_experiment_answers_total`)."""
        counter = self._counters.get((experiment, variant))
        if counter is None:
            counter = self._counters[(experiment, variant)] = metrics.experiment_answers.labels(
                experiment, variant
            )
        counter.inc()

    def model_variants(self) -> list[tuple[ExperimentSpec, VariantSpec]]:
        """The variants served by a model of their own."""
        return [(e, v) for e in self.specs for v in e.variants if v.changes_model]


def load_experiments(settings: Settings) -> Experiments | None:
    """The experiments of DCMC_EXPERIMENTS (None without it); ExperimentError saying what is wrong."""
    if settings.experiments is None:
        return None
    experiments = Experiments(read_experiments(settings.experiments))
    log.info(
        "experiments from %s: %s",
        settings.experiments,
        ", ".join(f"{e.id} ({e.method}, {len(e.variants)} variants)" for e in experiments.specs) or "none",
    )
    return experiments


def _nested(dotted: dict[str, Any]) -> dict[str, Any]:
    """{"crf.gamma": 2} -> {"crf": {"gamma": 2}} (as Settings.inference holds them)."""
    out: dict[str, Any] = {}
    for name, value in dotted.items():
        parts = name.lower().split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def variant_settings(settings: Settings, variant: VariantSpec) -> Settings:
    """The settings a variant's model is made with: the service's, its inference overrides added, no
    impressions of its own (the served model writes them)."""
    from service.settings import inference_overrides

    overrides = {**inference_overrides(settings), **{k.lower(): v for k, v in variant.inference.items()}}
    return settings.model_copy(update={"inference": _nested(overrides), "impressions_max": 0})


def variant_models(
    artifact: Artifact, settings: Settings, metrics: Metrics, experiments: Experiments | None
) -> dict[tuple[str, str], ServedModel]:
    """The models of the variants that change the model, by (experiment, variant): of `artifact` (the
    served one) with the variant's inference overrides, or of the variant's own artifact. Not started."""
    from model.artifact import load_artifact
    from service.scoring import ServedModel

    out: dict[tuple[str, str], ServedModel] = {}
    for e, v in experiments.model_variants() if experiments is not None else []:
        own = load_artifact(v.artifact) if v.artifact is not None else artifact
        try:
            out[(e.id, v.name)] = ServedModel(own, variant_settings(settings, v), metrics, experiments=None)
        except Exception:
            for model in out.values():
                model.close()
            raise
    return out


class ResultsCache:
    """GET /experiments/{id}/results: the figures, computed from the streams at most every
    RESULTS_TTL_S per worker (reading the streams costs a scan of the impressions)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, tuple[float, dict[str, Any]]] = {}

    def get(self, scorer: ServedModel, spec: ExperimentSpec) -> dict[str, Any]:
        """The experiment's results (model.experiments.results); redis.RedisError when Redis fails."""
        with self._lock:
            held = self._held.get(spec.id)
            if held is not None and time.monotonic() - held[0] < RESULTS_TTL_S:
                return held[1]
        figures = compute_results(scorer, spec)
        with self._lock:
            self._held[spec.id] = (time.monotonic(), figures)
        return figures


def compute_results(scorer: ServedModel, spec: ExperimentSpec) -> dict[str, Any]:
    """`model.experiments.results` of the streams as Redis holds them now, for the served model's levels
    and its artifact's item count (what `dcmc experiment report` reads too)."""
    assert scorer.ratings is not None
    impressions, feedback = read_experiment_streams(
        scorer.ratings.bulk_client, scorer.settings.redis_key_prefix
    )
    figures = results(spec, impressions, feedback, scorer.levels.tolist(), scorer.artifact.config.n_items)
    scorer.metrics.observe_experiment(figures)
    return figures
