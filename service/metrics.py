"""Prometheus metrics of one app: request counts and latencies per route, online ratings, Redis errors.

With several uvicorn workers, `python -m service` sets PROMETHEUS_MULTIPROC_DIR; each worker then writes
its samples to files there and /metrics adds up every worker (prometheus_client's multi-process mode).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class Metrics:
    """The service's metric families, registered in a registry of their own."""

    def __init__(self, multiprocess_dir: Path | None = None) -> None:
        self.multiprocess_dir = multiprocess_dir
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "dcmc_http_requests",
            "HTTP requests by route template, method and status.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "dcmc_http_request_duration_seconds",
            "Time from request to the end of the response, by route.",
            ["route", "method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ratings_written = Counter(
            "dcmc_ratings_written",
            "Online ratings this worker stored in Redis (acknowledged writes).",
            registry=self.registry,
        )
        self.ratings_applied = Counter(
            "dcmc_ratings_applied",
            "Online ratings this worker folded into its model (from the Redis stream, any writer).",
            registry=self.registry,
        )
        self.user_rows = Counter(
            "dcmc_user_rows",
            "Requests answered from a user's cached catalogue row (hit; stale_hit: a row of an earlier "
            "state, within DCMC_ANSWER_STALENESS_S), or that computed one (fill).",
            ["event"],
            registry=self.registry,
        )
        self.entries_skipped = Counter(
            "dcmc_stream_entries_skipped",
            "Rating stream entries this worker could not apply (poison: copied to the dead-letter stream).",
            registry=self.registry,
        )
        self.snapshots = Counter(
            "dcmc_fold_in_snapshots",
            "Fold-in snapshots this worker wrote to Redis (written), started from (restored), or found and "
            "did not trust (ignored: another model, stream or settings, or a bad checksum).",
            ["event"],
            registry=self.registry,
        )
        self.impressions = Counter(
            "dcmc_impressions",
            "What /recommend and /similar-items answers showed, written to the impressions stream (written) "
            "or dropped because Redis was slow or down (dropped; the answer was not slowed).",
            ["outcome"],
            registry=self.registry,
        )
        self.experiment_answers = Counter(
            "dcmc_experiment_answers",
            "/recommend answers given in an experiment, by experiment and variant (DCMC_EXPERIMENTS).",
            ["experiment", "variant"],
            registry=self.registry,
        )
        self.experiment_figures = Gauge(
            "dcmc_experiment_figure",
            "An experiment's figures as GET /experiments/{id}/results last computed them, by experiment, "
            "variant, figure (click_through, hit_rate, ...; impressions, users) and part (value, low, high: "
            "its 95% interval).",
            ["experiment", "variant", "figure", "part"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.stream_gaps = Counter(
            "dcmc_stream_gaps",
            "Times a compaction trimmed the rating stream past this worker's place (recovered: the compacted "
            "head folded in) or entries were deleted that no head holds (lost).",
            ["outcome"],
            registry=self.registry,
        )
        self.fold_in_failures = Counter(
            "dcmc_fold_in_failures",
            "Rounds of the stream follower that failed (Redis, an unreadable compacted head, a fold-in "
            "failing for a reason that passes) and were tried again.",
            registry=self.registry,
        )
        self.redis_errors = Counter(
            "dcmc_redis_errors",
            "Redis calls that failed (reads went on with the model as it was).",
            registry=self.registry,
        )

    def observe_experiment(self, figures: dict[str, Any]) -> None:
        """Set the experiment's gauges from its results (model.experiments.results)."""
        experiment = figures["experiment"]
        for variant, values in figures["variants"].items():
            for name in ("users", "impressions"):
                self.experiment_figures.labels(experiment, variant, name, "value").set(values[name])
            for name, figure in values.items():
                if not isinstance(figure, dict):
                    continue
                for part in ("value", "low", "high"):
                    if figure.get(part) is not None:
                        self.experiment_figures.labels(experiment, variant, name, part).set(figure[part])

    def exposition(self) -> bytes:
        """The text format of every metric (of every worker, in multi-process mode)."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=str(self.multiprocess_dir))  # type: ignore[no-untyped-call]
        return generate_latest(registry)


class MetricsMiddleware:
    """Pure ASGI middleware: counts and times every HTTP request under its route template."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics
        self._children: dict[tuple[str, str, str], tuple[Any, Any]] = {}  # labels() once per label set

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"  # bounded label values
            method = scope.get("method", "")
            key = (template, method, str(status))
            children = self._children.get(key)
            if children is None:
                children = self.metrics.requests.labels(*key), self.metrics.latency.labels(template, method)
                self._children[key] = children
            children[0].inc()
            children[1].observe(time.perf_counter() - start)
