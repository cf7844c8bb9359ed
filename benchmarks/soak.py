"""A soak run: a fixed count of mixed requests at concurrency 32 against `dcmc serve --workers 2` and a
real Redis, with errors, p50/p99 per route and the workers' memory before and after.

    python benchmarks/soak.py --artifacts DIR [--requests 60000] [--concurrency 32]

The mix, drawn per request (seeded): 60% POST /predict (100 random items of a random user), 20% GET
/recommend/{user}?k=10, 10% GET /similar-users/{user}?k=10, 10% POST /ratings (one random rating by a
random user; each one starts a new model state in both workers). The client is asyncio + httpx in this
process, timing each request from send to the end of its body. RSS of each worker (children of the uvicorn
process) is read from /proc at rest (REST_S after the load stops) before the run (after a warm-up of 2,000
requests) and after each quarter of it; the run fails when a worker grew by more than --rss-bound-mb.
Writes benchmarks/results/soak.md and appends to soak.jsonl. Needs redis-server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import TOKEN, Redis, Service, commit_label

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
CLIENT_ERRORS: list[str] = []
"""Requests that got no HTTP answer (status 0), with the client's exception."""
REST_S = 2.0
"""RSS is read at rest: this long after the load stopped (the last fold-in done and its memory handed
back), so that a sample does not land on a fold's transient arrays."""
MIX = (("predict", 0.6), ("recommend", 0.2), ("similar-users", 0.1), ("ratings", 0.1))


def worker_rss_mb(pid: int) -> dict[int, float]:
    """RSS (MB) of each uvicorn worker: the children of `pid` started by multiprocessing's spawn (not its
    resource tracker)."""
    found = subprocess.run(
        ["pgrep", "-P", str(pid), "-f", "multiprocessing.spawn"], capture_output=True, text=True
    )
    out = found.stdout.split()
    rss = {}
    for child in map(int, out):
        try:
            status = Path(f"/proc/{child}/status").read_text()
        except OSError:
            continue
        kb = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
        rss[child] = kb / 1024
    return rss


def plan(n: int, users: list[str], items: list[str], levels: list[float], seed: int) -> list[tuple[str, Any]]:
    """`n` requests of the mix: (route, what it needs)."""
    rng = np.random.default_rng(seed)
    routes = rng.choice([r for r, _ in MIX], size=n, p=[p for _, p in MIX])
    out: list[tuple[str, Any]] = []
    for route in routes:
        user = users[rng.integers(len(users))]
        if route == "predict":
            out.append(
                (route, {"user": user, "items": [items[j] for j in rng.choice(len(items), 100, False)]})
            )
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
    auth = {"Authorization": f"Bearer {TOKEN}"}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def one() -> None:
            for route, arg in queue:
                t0 = time.perf_counter()
                try:
                    if route == "predict":
                        r = await client.post("/predict", json=arg)
                    elif route == "ratings":
                        r = await client.post("/ratings", json=arg, headers=auth)
                    elif route == "recommend":
                        r = await client.get(f"/recommend/{arg}", params={"k": 10})
                    else:
                        r = await client.get(f"/similar-users/{arg}", params={"k": 10})
                    status = r.status_code
                except httpx.HTTPError as exc:
                    status = 0
                    CLIENT_ERRORS.append(f"{route}: {type(exc).__name__}: {exc}")
                results.append((route, status, time.perf_counter() - t0))

        await asyncio.gather(*(one() for _ in range(concurrency)))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--artifacts", required=True, type=Path)
    parser.add_argument("--requests", type=int, default=60_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rss-bound-mb", type=float, default=150.0, help="most growth per worker")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "dcmc-soak")
    parser.add_argument("--results", type=Path, default=RESULTS / "soak", help="path stem of .md/.jsonl")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    art = args.artifacts
    users = json.loads((art / "user_ids.json").read_text())
    items = json.loads((art / "item_ids.json").read_text())
    levels = [float(x) for x in np.load(art / "levels.npy")]
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
        times = np.array([t for _, t in rs]) * 1e3
        routes[route] = {
            "requests": len(rs),
            "errors": sum(s != 200 for s, _ in rs),
            "statuses": {str(k): sum(s == k for s, _ in rs) for k in sorted({s for s, _ in rs})},
            "p50_ms": float(np.percentile(times, 50)) if len(times) else None,
            "p99_ms": float(np.percentile(times, 99)) if len(times) else None,
        }
    growth = {pid: after[pid] - before[pid] for pid in before if pid in after}
    acknowledged = sum(s == 200 for r, s, _ in results if r == "ratings")
    record = {
        "command": "python benchmarks/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": commit_label("service", "model"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "written": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "artifacts": str(art),
        "requests": len(results),
        "seconds": round(seconds, 1),
        "routes": routes,
        "rss_before_mb": before,
        "rss_after_mb": after,
        "rss_growth_mb": growth,
        "rss_quarters_mb": samples,
        "no_answer": CLIENT_ERRORS,
        "ratings_acknowledged": acknowledged,
        "stream_length": stream,
        "rss_bound_mb": args.rss_bound_mb,
    }
    ok = (
        all(r["errors"] == 0 for r in routes.values())
        and stream == acknowledged
        and bool(growth)
        and max(growth.values()) <= args.rss_bound_mb
    )
    lines = [
        "# Soak: a mixed load at concurrency 32",
        "",
        f"- command: `{record['command']}` at `{record['commit']}`; {record['machine']}; artifact "
        f"`{art}`; 2 workers, a private redis-server (AOF, fsync always); written {record['written']}",
        f"- {len(results)} requests in {seconds:.0f} s ({len(results) / seconds:.0f} req/s) from an asyncio "
        f"httpx client in one process (which shares the 2 cores); mix: "
        + ", ".join(f"{int(p * 100)}% {r}" for r, p in MIX),
        "",
        "| route | requests | errors | statuses | p50 ms | p99 ms |",
        "|---|---|---|---|---|---|",
    ]
    for route, r in routes.items():
        lines.append(
            f"| {route} | {r['requests']} | {r['errors']} | {r['statuses']} | {r['p50_ms']:.1f} | "
            f"{r['p99_ms']:.1f} |"
        )
    lines += [
        "",
        "Worker RSS at rest (MB), before and after each quarter of the run: "
        + "; ".join(
            " -> ".join(f"{x:.0f}" for x in [before[p], *(q.get(p, float("nan")) for q in samples)])
            for p in before
        )
        + f" (bound: {args.rss_bound_mb:.0f} MB growth per worker).",
        f"Ratings acknowledged during the run: {acknowledged}; added to the stream: {stream} (lost: "
        f"{acknowledged - stream}).",
        "Requests without an answer (status 0): "
        + ("; ".join(CLIENT_ERRORS) if CLIENT_ERRORS else "none")
        + ".",
        f"Verdict: {'pass' if ok else 'FAIL'}.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.with_suffix(".md").write_text(text)
    with open(args.results.with_suffix(".jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
