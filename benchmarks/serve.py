"""The serving suite: `floor`, how far `dcmc serve` is from the HTTP floor on every route, and `soak`, a
mixed load's errors, latencies and memory over a long run. Needs `redis-server` (and `wrk` for floor).

    python benchmarks/serve.py floor --artifacts DIR [--duration 8] [--workers 2]
    python benchmarks/serve.py soak --artifacts DIR [--requests 60000] [--concurrency 32]

floor starts, in this order: the floor, `uvicorn bare_app:app --workers 2` (benchmarks/bare_app.py: one
async /health route, the service's uvicorn), measured first and again last (the floor is the better of the
two per figure, so a slow moment of the machine cannot flatter the ratios); `dcmc serve --workers 2` with a
private redis-server; the same service with its per-user row cache off (`DCMC_USER_CACHE_MB=0`). wrk on
loopback measures p50/p99 at concurrency 1 and req/s at 32 for /health, POST /predict with 10 and with 100
items (500 bodies of random users and items, cycled, each sent a few times first so that most users' rows
are cached in both workers), GET /recommend/{user}?k=10 and, last (a write empties the row caches), POST
/ratings with one random rating; the share of requests answered from a cached row (from /metrics) is
printed beside each run. Prints the ratios to the floor and the issue's targets, appends the record to
benchmarks/results/serve_floor.jsonl and writes it as the first section of benchmarks/results/serve.md.
Numbers of one run compare only with numbers of the same run.

soak draws each request (seeded): 60% POST /predict (100 random items of a random user), 20% GET
/recommend/{user}?k=10, 10% GET /similar-users/{user}?k=10, 10% POST /ratings (one random rating; each
starts a new model state in both workers), sent by an asyncio + httpx client in this process (timed from
send to the end of the body). Each worker's RSS is read from /proc at rest (REST_S after the load stops)
after a warm-up of 2,000 requests and after each quarter of the run; the run fails when a worker grew by
more than --rss-bound-mb. Writes benchmarks/results/soak.md and appends to soak.jsonl.
"""

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness as h
import numpy as np
from harness import Redis, Service

# -- floor ---------------------------------------------------------------------------------------------------

TARGETS = {
    "predict100_p50_vs_floor": 2.0,
    "predict100_rps_share": 0.5,
    "predict100_p99_over_p50": 10.0,
    "health_p50_vs_floor": 1.3,
}
"""The issue's targets: /predict (100 items) p50 at conc. 1 within 2x the bare /health p50, its req/s at
conc. 32 at least half the bare /health's with p99 under 10x its p50, the service's /health within 1.3x."""


def wrk(url: str, path: str, connections: int, duration: int, script: Path | None) -> dict[str, Any]:
    """One wrk run; exits on any failed request (a fast error is no result)."""
    return h.wrk(url, path, connections, duration, script, strict=True)


def measure_bare(workers: int, duration: int) -> dict[str, Any]:
    """The floor app (bare_app.py) under uvicorn, a child process: its /health at concurrency 1 and 32."""
    import httpx

    port = h.free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "uvicorn", "bare_app:app", "--app-dir", str(Path(__file__).parent)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--workers", str(workers)]
    proc = subprocess.Popen([*argv, "--no-access-log", "--log-level", "warning"])
    try:
        h.wait_up(proc, lambda: httpx.get(url + "/health"), "the bare app", 60)
        wrk(url, "/health", 2, 2, None)
        out = {f"health@{c}": wrk(url, "/health", c, duration, None) for c in (1, 32)}
    finally:
        h.stop(proc, 20)
    h.emit({"bare": out})
    return out


def floor(first: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
    """The floor of the run: the better of the bare app's two measurements (before and after the service),
    per figure (lower p50 and p99, higher req/s), so that a slow moment of the machine does not lower it."""
    better = {"rps": max, "p50_ms": min, "p99_ms": min}
    return {key: {f: pick(first[key][f], last[key][f]) for f, pick in better.items()} for key in first}


def rows_hits(svc: Service) -> float:
    return svc.metric('dcmc_user_rows_total{event="hit"}')


def measure_service(svc: Service, scripts: dict[str, Path], duration: int, writes: bool) -> dict[str, Any]:
    """wrk over the service's routes (module docstring), /metrics' row-cache hits around each run."""
    for name in ("predict10", "predict100", "recommend"):  # every user's row, in both workers
        path = "/recommend" if name == "recommend" else "/predict"
        wrk(svc.url, path, 2, 4, scripts[name])
    plan: list[tuple[str, str, Path | None]] = [
        ("health", "/health", None),
        ("predict10", "/predict", scripts["predict10"]),
        ("predict100", "/predict", scripts["predict100"]),
        ("recommend", "/recommend", scripts["recommend"]),
    ]
    if writes:
        plan.append(("ratings", "/ratings", scripts["ratings"]))
    out: dict[str, Any] = {}
    for name, path, script in plan:
        for conns in (1, 32):
            before = rows_hits(svc)
            r = wrk(svc.url, path, conns, duration, script)
            r["row_hits"] = (rows_hits(svc) - before) / max(r["requests"], 1)
            out[f"{name}@{conns}"] = r
            h.emit({"run": f"{name}@{conns}", **r})
    return out


def report(record: dict[str, Any]) -> str:
    """The markdown section of one run."""
    floor1, floor32 = record["bare"]["health@1"], record["bare"]["health@32"]
    lines = [
        f"## Serving floor: `dcmc serve` against a bare FastAPI /health ({record['written']})",
        "",
        f"- command: `{record['command']}` at `{record['commit']}`; {record['machine']}; artifact "
        f"`{record['artifacts']}` (inference `{record['inference']}`); {record['workers']} workers each; wrk "
        f"{record['duration_s']} s per row; a private redis-server (AOF, fsync always)",
        "- `cached rows`: share of the run's requests answered from the user's cached row (the warm-up sent "
        "every body first); `no row cache`: the same service with `DCMC_USER_CACHE_MB=0`",
        "",
        *h.table(
            "| server | route | p50 ms, conc. 1 | p99 ms, conc. 1 | req/s, conc. 32 | p50 / p99 ms, conc. 32 "
            "| p50 vs floor | req/s vs floor | cached rows (1 / 32) |"
        ),
    ]

    def row(server: str, name: str, runs: dict[str, Any]) -> None:
        a, b = runs[f"{name}@1"], runs[f"{name}@32"]
        hits = f"{a['row_hits']:.0%} / {b['row_hits']:.0%}" if "row_hits" in a else "-"
        lines.append(
            f"| {server} | {name} | {a['p50_ms']:.2f} | {a['p99_ms']:.2f} | {b['rps']:.0f} | "
            f"{b['p50_ms']:.2f} / {b['p99_ms']:.2f} | {a['p50_ms'] / floor1['p50_ms']:.2f}x | "
            f"{b['rps'] / floor32['rps']:.2f} | {hits} |"
        )

    for server, key in (("bare FastAPI, first", "bare_first"), ("bare FastAPI, last", "bare_last")):
        row(server, "health", record[key])
    row("floor (the better of the two)", "health", record["bare"])
    for server, key in (("dcmc serve", "dcmc"), ("dcmc serve, no row cache", "cold")):
        for name in ROUTES:
            if f"{name}@1" in record[key]:
                row(server, name, record[key])
    lines += ["", "Targets (issue 22), this run:", ""]
    for key, (value, target, met) in record["targets"].items():
        lines.append(
            f"- {key}: {value:.2f} (target {'<=' if 'share' not in key else '>='} {target}): "
            f"{'met' if met else 'NOT met'}"
        )
    return "\n".join(lines) + "\n"


ROUTES = ("health", "predict10", "predict100", "recommend", "ratings")


def targets(record: dict[str, Any]) -> dict[str, tuple[float, float, bool]]:
    bare, dcmc = record["bare"], record["dcmc"]
    p100_1, p100_32 = dcmc["predict100@1"], dcmc["predict100@32"]
    values = {
        "predict100_p50_vs_floor": p100_1["p50_ms"] / bare["health@1"]["p50_ms"],
        "predict100_rps_share": p100_32["rps"] / bare["health@32"]["rps"],
        "predict100_p99_over_p50": p100_32["p99_ms"] / p100_32["p50_ms"],
        "health_p50_vs_floor": dcmc["health@1"]["p50_ms"] / bare["health@1"]["p50_ms"],
    }
    return {
        k: (v, TARGETS[k], v >= TARGETS[k] if k == "predict100_rps_share" else v <= TARGETS[k])
        for k, v in values.items()
    }


def floor_run(args: argparse.Namespace, argv: list[str]) -> int:
    for tool in ("wrk", "redis-server"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} not found (Debian: apt-get install wrk redis-server)")
    args.work.mkdir(parents=True, exist_ok=True)
    art = args.artifacts
    inference = json.loads((art / "config.json").read_text())["inference"]["mode"]
    record: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        scripts = h.lua_scripts(Path(tmp), art, (10, 100))
        record["bare_first"] = measure_bare(args.workers, args.duration)
        for key, env, writes in (("dcmc", {}, True), ("cold", {"DCMC_USER_CACHE_MB": "0"}, False)):
            with Redis() as redis_server:
                svc = Service(art, redis_server.url, "floor", args.workers, args.work / "serve.log", env)
                try:
                    svc.wait_ready()
                    record[key] = measure_service(svc, scripts, args.duration, writes)
                finally:
                    svc.stop()
        record["bare_last"] = measure_bare(args.workers, args.duration)
    record["bare"] = floor(record["bare_first"], record["bare_last"])
    record.update(
        written=h.stamp(),
        command=h.command("serve.py", argv),
        commit=h.commit_label("service", "model"),
        machine=h.machine_line(),
        artifacts=str(art),
        inference=inference,
        workers=args.workers,
        duration_s=args.duration,
    )
    record["targets"] = targets(record)
    text = report(record)
    print("\n" + text)
    if not args.no_report:
        h.append_jsonl(args.results / "serve_floor.jsonl", record)
        md = args.results / "serve.md"
        old = (
            md.read_text() if md.exists() else "# Serving benchmark: `dcmc serve` on the default artifacts\n"
        )
        title, _, rest = old.partition("\n")
        md.write_text(f"{title}\n\n{text}\n{rest.lstrip()}")
    return 0


# -- soak ----------------------------------------------------------------------------------------------------

CLIENT_ERRORS: list[str] = []
"""Requests that got no HTTP answer (status 0), with the client's exception."""
REST_S = 2.0
"""RSS is read at rest: this long after the load stopped (the last fold-in done and its memory handed
back), so that a sample does not land on a fold's transient arrays."""
MIX = (("predict", 0.6), ("recommend", 0.2), ("similar-users", 0.1), ("ratings", 0.1))


def worker_rss_mb(pid: int) -> dict[int, float]:
    """RSS (MB) of each uvicorn worker: the children of `pid` started by multiprocessing's spawn (not its
    resource tracker)."""
    pgrep = ["pgrep", "-P", str(pid), "-f", "multiprocessing.spawn"]
    found = subprocess.run(pgrep, capture_output=True, text=True)
    status = {child: h.status_mb(child, "VmRSS") for child in map(int, found.stdout.split())}
    return {child: m.get("VmRSS", 0.0) for child, m in status.items() if m is not None}


def plan(n: int, users: list[str], items: list[str], levels: list[float], seed: int) -> list[tuple[str, Any]]:
    """`n` requests of the mix: (route, what it needs)."""
    rng = np.random.default_rng(seed)
    routes = rng.choice([r for r, _ in MIX], size=n, p=[p for _, p in MIX])
    out: list[tuple[str, Any]] = []
    for route in routes:
        user = users[rng.integers(len(users))]
        if route == "predict":
            chosen = [items[j] for j in rng.choice(len(items), 100, False)]
            out.append((route, {"user": user, "items": chosen}))
        elif route == "ratings":
            item, level = items[rng.integers(len(items))], levels[rng.integers(len(levels))]
            out.append((route, {"ratings": [{"user": user, "item": item, "rating": level}]}))
        else:
            out.append((route, user))
    return out


async def drive(url: str, requests: list[tuple[str, Any]], concurrency: int) -> list[tuple[str, int, float]]:
    """Send every request, `concurrency` at a time: (route, status, seconds) each (status 0: no answer)."""
    import httpx

    results: list[tuple[str, int, float]] = []
    queue = iter(requests)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def one() -> None:
            for route, arg in queue:
                t0 = time.perf_counter()
                try:
                    auth = h.AUTH if route == "ratings" else None
                    if route in ("predict", "ratings"):  # a body; the others: GET /<route>/{user}?k=10
                        r = await client.post(f"/{route}", json=arg, headers=auth)
                    else:
                        r = await client.get(f"/{route}/{arg}", params={"k": 10})
                    status = r.status_code
                except httpx.HTTPError as exc:
                    status = 0
                    CLIENT_ERRORS.append(f"{route}: {type(exc).__name__}: {exc}")
                results.append((route, status, time.perf_counter() - t0))

        await asyncio.gather(*(one() for _ in range(concurrency)))
    return results


def soak_run(args: argparse.Namespace, argv: list[str]) -> int:
    args.work.mkdir(parents=True, exist_ok=True)
    art = args.artifacts
    users, items, levels = h.artifact_ids(art)
    with Redis() as server:
        svc = Service(art, server.url, "soak", 2, args.work / "serve.log")
        try:
            svc.wait_ready()
            asyncio.run(drive(svc.url, plan(2000, users, items, levels, seed=1), args.concurrency))
            time.sleep(REST_S)
            before = worker_rss_mb(svc.proc.pid)
            stream_before = int(server.client.xlen("soak:ratings"))
            requests = plan(args.requests, users, items, levels, 0)
            quarter = -(-len(requests) // 4)
            results: list[tuple[str, int, float]] = []
            samples = []
            t0 = time.perf_counter()
            for k in range(0, len(requests), quarter):  # RSS sampled after each quarter
                results += asyncio.run(drive(svc.url, requests[k : k + quarter], args.concurrency))
                time.sleep(REST_S)
                samples.append(worker_rss_mb(svc.proc.pid))
            seconds = time.perf_counter() - t0
            after = samples[-1]
            stream = int(server.client.xlen("soak:ratings")) - stream_before
        finally:
            svc.stop()
    routes: dict[str, Any] = {}
    for route, _ in MIX:
        rs = [(s, t) for r, s, t in results if r == route]
        times = h.summarize(t * 1e3 for _, t in rs)
        routes[route] = {
            "requests": len(rs),
            "errors": sum(s != 200 for s, _ in rs),
            "statuses": {str(k): sum(s == k for s, _ in rs) for k in sorted({s for s, _ in rs})},
            "p50_ms": times.get("p50_ms"),
            "p99_ms": times.get("p99_ms"),
        }
    record = {
        "command": h.command("serve.py", argv),
        "commit": h.commit_label("service", "model"),
        "machine": h.machine_line(),
        "written": h.stamp(),
        "artifacts": str(art),
        "requests": len(results),
        "seconds": round(seconds, 1),
        "routes": routes,
        "rss_before_mb": before,
        "rss_after_mb": after,
        "rss_growth_mb": {pid: after[pid] - before[pid] for pid in before if pid in after},
        "rss_quarters_mb": samples,
        "no_answer": CLIENT_ERRORS,
        "ratings_acknowledged": sum(s == 200 for r, s, _ in results if r == "ratings"),
        "stream_length": stream,
        "rss_bound_mb": args.rss_bound_mb,
    }
    ok, text = soak_report(record, seconds)
    print(text)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.with_suffix(".md").write_text(text)
    h.append_jsonl(args.results.with_suffix(".jsonl"), record)
    return 0 if ok else 1


def soak_report(r: dict[str, Any], seconds: float | None = None) -> tuple[bool, str]:
    """The verdict of a soak record and its soak.md (`seconds`: the run's, unrounded)."""
    routes, growth, bound = r["routes"], r["rss_growth_mb"], r["rss_bound_mb"]
    acked, stream, errors = r["ratings_acknowledged"], r["stream_length"], r["no_answer"]
    before, samples, seconds = r["rss_before_mb"], r["rss_quarters_mb"], seconds or r["seconds"]
    ok = all(x["errors"] == 0 for x in routes.values()) and stream == acked and bool(growth)
    ok = ok and max(growth.values()) <= bound
    lines = [
        "# Soak: a mixed load at concurrency 32",
        "",
        f"- command: `{r['command']}` at `{r['commit']}`; {r['machine']}; artifact "
        f"`{r['artifacts']}`; 2 workers, a private redis-server (AOF, fsync always); written {r['written']}",
        f"- {r['requests']} requests in {seconds:.0f} s ({r['requests'] / seconds:.0f} req/s) from an "
        f"asyncio httpx client in one process (which shares the 2 cores); mix: "
        + ", ".join(f"{int(p * 100)}% {route}" for route, p in MIX),
        "",
        *h.table("| route | requests | errors | statuses | p50 ms | p99 ms |"),
        *(
            f"| {route} | {x['requests']} | {x['errors']} | {x['statuses']} | {x['p50_ms']:.1f} | "
            f"{x['p99_ms']:.1f} |"
            for route, x in routes.items()
        ),
        "",
        "Worker RSS at rest (MB), before and after each quarter of the run: "
        + "; ".join(
            " -> ".join(f"{x:.0f}" for x in [before[p], *(q.get(p, float("nan")) for q in samples)])
            for p in before
        )
        + f" (bound: {bound:.0f} MB growth per worker).",
        f"Ratings acknowledged during the run: {acked}; added to the stream: {stream} (lost: "
        f"{acked - stream}).",
        "Requests without an answer (status 0): " + ("; ".join(errors) if errors else "none") + ".",
        f"Verdict: {'pass' if ok else 'FAIL'}.",
    ]
    return ok, "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = h.parser(__doc__)
    sub = parser.add_subparsers(dest="suite", required=True)
    f = sub.add_parser("floor", help="every route against a bare FastAPI /health")
    f.add_argument("--artifacts", required=True, type=Path, help="an artifact written by `dcmc train`")
    f.add_argument("--duration", type=int, default=8, help="seconds per wrk run")
    f.add_argument("--workers", type=int, default=2)
    f.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "dcmc-serve-floor")
    f.add_argument("--results", type=Path, default=h.RESULTS, help="directory of serve.md and the .jsonl")
    f.add_argument("--no-report", action="store_true", help="print only; write nothing to --results")
    s = sub.add_parser("soak", help="a mixed load at concurrency 32: errors, latencies, worker memory")
    s.add_argument("--artifacts", required=True, type=Path)
    s.add_argument("--requests", type=int, default=60_000)
    s.add_argument("--concurrency", type=int, default=32)
    s.add_argument("--rss-bound-mb", type=float, default=150.0, help="most growth per worker")
    s.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "dcmc-soak")
    s.add_argument("--results", type=Path, default=h.RESULTS / "soak", help="path stem of .md/.jsonl")
    args = parser.parse_args(argv)
    return floor_run(args, argv) if args.suite == "floor" else soak_run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
