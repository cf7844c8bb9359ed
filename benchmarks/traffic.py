"""Serving as traffic looks: how far `dcmc serve` is from the HTTP floor when most users were not just here.
Needs `redis-server` and `wrk`.

    python benchmarks/traffic.py --artifacts DIR [--duration 8] [--workers 2] [--write-rate 100]

Users are drawn three ways, each request naming one and 100 distinct random items (`--items`):
- uniform: a uniformly random known user;
- zipf: known users by a Zipf law of exponent 1 over a random ranking of them (p(rank r) ~ 1/r);
- online: users first seen online: before their runs, --online-users new users post --online-ratings
  random ratings each (through POST /ratings, so every fresh process replays them), then are drawn
  uniformly.
GET /recommend/{user}?k=10 is measured for uniform users.

Each traffic is measured idle and while --write-rate single ratings a second are posted (random known users
and items; every one starts a new model state in both workers, so cached rows go stale), each time in a
fresh `dcmc serve --workers 2`:
- cold: the first --cold-requests requests of the fresh process at concurrency 1 (p50, p99) and, in a
  second fresh process, at concurrency 32 (req/s);
- warm: then wrk for --duration seconds at concurrency 1 and at 32.
The floor is a bare two-worker FastAPI /health (benchmarks/bare_app.py, the same uvicorn), measured first
and last; the better of the two per figure. Each worker's RSS is read at the end of every service's runs.
Appends the record to benchmarks/results/traffic.jsonl and writes benchmarks/results/traffic.md. Numbers
of one run compare only with numbers of the same run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import harness as h
import numpy as np
from harness import Redis, Service
from serve import floor, measure_bare, worker_rss_mb

TARGETS = {
    ("uniform", "idle", "p50"): 2.0,
    ("uniform", "idle", "rps"): 0.5,
    ("uniform", "writes", "p50"): 3.0,
    ("uniform", "writes", "rps"): 0.35,
    ("recommend", "idle", "p50"): 3.0,
}
"""Issue 57's targets, as ratios to the floor: p50 at concurrency 1 at most, req/s at 32 at least (cold and
warm alike); Zipf and online users no slower than uniform ones (`compare`)."""

STOP_LUA = """
local counter = 0
setup = function(thread)
  counter = counter + 1
  thread:set("id", counter)
end
local done = 0
response = function(status, headers, body)
  done = done + 1
  if %(limit)d > 0 and done == %(limit)d then
    local f = io.open("%(marker)s" .. id, "w")
    f:close()
    wrk.thread:stop()
  end
end
"""
"""With a limit, each wrk thread stops after that many answers and leaves a marker file (`limited_wrk`
then ends wrk: a stopped thread does not end wrk's run)."""

RECOMMEND_LUA = """
local paths = {%s}
local n = 0
request = function()
  n = n + 1
  return wrk.format("GET", paths[(n %% #paths) + 1])
end
"""
"""GET /recommend over the paths in order."""


def limited_wrk(
    url: str, route: str, connections: int, script_path: Path, limit_s: float = 600
) -> dict[str, Any]:
    """wrk until each of its threads has had its limit of answers (their marker files exist), then
    SIGINT (wrk prints its figures over what it measured); strict like `h.wrk`."""
    threads = min(connections, 2)
    marker = Path(str(script_path) + ".done")
    for k in range(1, threads + 1):
        Path(f"{marker}{k}").unlink(missing_ok=True)
    argv = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{int(limit_s)}s", "--latency", "--timeout", "10s"]
    proc = subprocess.Popen([*argv, "-s", str(script_path), url + route], stdout=subprocess.PIPE, text=True)
    while proc.poll() is None and not all(Path(f"{marker}{k}").exists() for k in range(1, threads + 1)):
        time.sleep(0.01)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    result = h.parse_wrk(out)
    if result["non_2xx"] or result["socket_errors"]:
        print(out, file=sys.stderr)
        sys.exit(f"wrk saw failed requests on {route}")
    return result


def draw_users(
    kind: str, users: list[str], online: list[str], count: int, rng: np.random.Generator
) -> list[str]:
    """`count` users of the traffic `kind` (module docstring)."""
    if kind == "online":
        return [online[k] for k in rng.integers(len(online), size=count)]
    if kind == "zipf":
        ranking = rng.permutation(len(users))
        p = 1.0 / np.arange(1, len(users) + 1)
        return [users[ranking[r]] for r in rng.choice(len(users), size=count, p=p / p.sum())]
    return [users[k] for k in rng.integers(len(users), size=count)]


def script(
    directory: Path,
    name: str,
    route: str,
    who: list[str],
    items: list[str],
    n_items: int,
    limit: int,
    seed: int,
) -> Path:
    """A wrk script of one request per user of `who`, in order; each thread stops after `limit` answers
    when it is positive (`limited_wrk`)."""
    rng = np.random.default_rng(seed)
    if route == "recommend":
        text = RECOMMEND_LUA % h.lua_list(f"/recommend/{u}?k=10" for u in who)
    else:
        bodies = (
            json.dumps(
                {"user": u, "items": [items[j] for j in rng.choice(len(items), n_items, replace=False)]},
                separators=(",", ":"),
            )
            for u in who
        )
        text = h.PREDICT_LUA % h.lua_list(bodies)
    path = directory / f"{name}.lua"
    # The response hook costs wrk a little per answer (against the service, not the floor): cold runs only.
    path.write_text(text + (STOP_LUA % {"limit": limit, "marker": f"{path}.done"} if limit > 0 else ""))
    return path


class Writer:
    """Single ratings posted at `rate` a second in all on fixed schedules (random known users and items),
    by WRITER_THREADS threads of this process (a write waits for Redis's fsync: one thread alone falls
    behind), while its `with` block runs."""

    def __init__(
        self, svc: Service, users: list[str], items: list[str], levels: list[Any], rate: float
    ) -> None:
        self.svc, self.users, self.items, self.levels, self.rate = svc, users, items, levels, rate
        self.stopped = threading.Event()
        self.sent = [0] * WRITER_THREADS
        self.threads = [
            threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(WRITER_THREADS)
        ]

    def _run(self, k: int) -> None:
        import httpx

        rng = np.random.default_rng(7 + k)
        rate = self.rate / WRITER_THREADS
        with httpx.Client(base_url=self.svc.url, timeout=30) as client:
            start = time.monotonic() + k / self.rate  # the threads' schedules interleaved
            while not self.stopped.is_set():
                wait = start + self.sent[k] / rate - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                rating = {
                    "user": self.users[rng.integers(len(self.users))],
                    "item": self.items[rng.integers(len(self.items))],
                    "rating": self.levels[rng.integers(len(self.levels))],
                }
                r = client.post("/ratings", json={"ratings": [rating]}, headers=h.AUTH)
                if r.status_code != 200:
                    raise RuntimeError(f"POST /ratings answered {r.status_code}: {r.text[:300]}")
                self.sent[k] += 1

    def __enter__(self) -> Writer:
        self.began = time.monotonic()
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        for thread in self.threads:
            thread.join(30)
        self.achieved = sum(self.sent) / max(time.monotonic() - self.began, 1e-9)


WRITER_THREADS = 4


def create_online_users(
    svc: Service, items: list[str], levels: list[Any], n_users: int, each: int
) -> list[str]:
    """`n_users` new users with `each` random ratings each, posted in batches; returns their ids once the
    service answers for them (read-your-writes)."""
    rng = np.random.default_rng(11)
    names = [f"traffic-online-{k}" for k in range(n_users)]
    batch: list[tuple[str, str, float]] = []
    for name in names:
        for j in rng.choice(len(items), each, replace=False):
            batch.append((name, items[j], levels[rng.integers(len(levels))]))
            if len(batch) == 200:
                svc.post_ratings(batch)
                batch = []
    if batch:
        svc.post_ratings(batch)
    for _ in range(8):  # both workers have folded them in
        svc.predict(names[-1], items[:3])
    return names


def hits(svc: Service) -> float:
    """Requests answered from a cached row so far (fresh and stale, /metrics)."""
    return sum(svc.metric(f'dcmc_user_rows_total{{event="{e}"}}') for e in ("hit", "stale_hit"))


def measured(svc: Service, run: Any) -> dict[str, Any]:
    """`run()`'s wrk figures with the share of its requests answered from a cached row."""
    before = hits(svc)
    out: dict[str, Any] = run()
    out["row_hits"] = (hits(svc) - before) / max(out["requests"], 1)
    return out


def run_kind(
    args: argparse.Namespace,
    redis_url: str,
    kind: str,
    load: str,
    scripts: dict[str, Path],
    ids: tuple[list[str], list[str], list[Any]],
) -> dict[str, Any]:
    """One traffic under one load: cold at 1 and warm at 1 and 32 in a fresh service, then cold at 32 in
    another (module docstring)."""
    users, items, levels = ids
    route = "/recommend" if kind == "recommend" else "/predict"
    out: dict[str, Any] = {}
    for phase in ("first", "second"):
        svc = Service(args.artifacts, redis_url, "traffic", args.workers, args.work / "serve.log")
        try:
            svc.wait_ready()
            writer = Writer(svc, users, items, levels, args.write_rate) if load == "writes" else None
            if writer is not None:
                writer.__enter__()
            try:
                if phase == "first":
                    warm = scripts[f"{kind}-warm"]
                    cold = partial(limited_wrk, svc.url, route, 1, scripts[f"{kind}-cold1"])
                    out["cold@1"] = measured(svc, cold)
                    for c in (1, 32):
                        run = partial(h.wrk, svc.url, route, c, args.duration, warm, strict=True)
                        out[f"warm@{c}"] = measured(svc, run)
                else:
                    out["cold@32"] = measured(
                        svc, partial(limited_wrk, svc.url, route, 32, scripts[f"{kind}-cold32"])
                    )
            finally:
                if writer is not None:
                    writer.__exit__()
                    out.setdefault("writes_per_s", []).append(round(writer.achieved, 1))
            if phase == "first":
                out["rss_mb"] = sorted(round(v, 1) for v in worker_rss_mb(svc.proc.pid).values())
        finally:
            svc.stop()
    h.emit({"kind": kind, "load": load, **out})
    return out


def ratios(record: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each run's p50 (concurrency 1) over the floor's and req/s (32) as a share of the floor's."""
    f1, f32 = record["bare"]["health@1"], record["bare"]["health@32"]
    out = {}
    for key, runs in record["runs"].items():
        out[key] = {
            "cold_p50": runs["cold@1"]["p50_ms"] / f1["p50_ms"],
            "warm_p50": runs["warm@1"]["p50_ms"] / f1["p50_ms"],
            "cold_rps": runs["cold@32"]["rps"] / f32["rps"],
            "warm_rps": runs["warm@32"]["rps"] / f32["rps"],
        }
    return out


def targets(r: dict[str, dict[str, float]]) -> list[tuple[str, float, str, bool]]:
    """(what, value, target, met) of every target, cold and warm, of the kinds and loads that ran."""
    out = []
    for (kind, load, what), target in TARGETS.items():
        key = f"{kind}/{load}"
        if key not in r:
            continue
        for phase in ("cold", "warm"):
            v = r[key][f"{phase}_{what}"]
            met = v <= target if what == "p50" else v >= target
            sign = "<=" if what == "p50" else ">="
            out.append(
                (
                    f"{key} {phase} {'p50 vs floor' if what == 'p50' else 'req/s share'}",
                    v,
                    f"{sign} {target}",
                    met,
                )
            )
    for kind in ("zipf", "online"):  # no slower than uniform: within 10% (the run-to-run noise of wrk here)
        for load in ("idle", "writes"):
            if f"{kind}/{load}" not in r or f"uniform/{load}" not in r:
                continue
            for phase in ("cold", "warm"):
                v, u = r[f"{kind}/{load}"][f"{phase}_p50"], r[f"uniform/{load}"][f"{phase}_p50"]
                out.append((f"{kind}/{load} {phase} p50 over uniform's", v / u, "<= 1.1", v / u <= 1.1))
    return out


def report(record: dict[str, Any]) -> str:
    f1, f32 = record["bare"]["health@1"], record["bare"]["health@32"]
    r = ratios(record)
    lines = [
        f"## Traffic as it comes ({record['written']})",
        "",
        *h.record_header(record),
        f"- artifact `{record['artifacts']}` ({record['settings']}); {record['workers']} workers; "
        f"{record['items']} random items a request; cold: the first {record['cold_requests']:,} requests "
        f"of a fresh process; warm: wrk {record['duration_s']} s after them; writes: "
        f"{record['write_rate']} single ratings/s posted meanwhile",
        f"- floor (bare FastAPI /health, the better of first and last): p50 {f1['p50_ms']:.3f} ms at "
        f"concurrency 1, {f32['rps']:,.0f} req/s at 32",
        "",
        *h.table(
            "| traffic | load | cold p50 / p99 ms (1) | vs floor | warm p50 / p99 ms (1) | vs floor "
            "| cold req/s (32) | share | warm req/s (32) | share | from a cached row (c1 / w1 / c32 / w32) "
            "| worker RSS MB | writes/s achieved |"
        ),
    ]
    for key, runs in record["runs"].items():
        kind, load = key.split("/")
        c1, w1, c32, w32 = runs["cold@1"], runs["warm@1"], runs["cold@32"], runs["warm@32"]
        x = r[key]
        cached = " / ".join(f"{run.get('row_hits', 0):.0%}" for run in (c1, w1, c32, w32))
        lines.append(
            f"| {kind} | {load} | {c1['p50_ms']:.2f} / {c1['p99_ms']:.2f} | {x['cold_p50']:.2f}x | "
            f"{w1['p50_ms']:.2f} / {w1['p99_ms']:.2f} | {x['warm_p50']:.2f}x | {c32['rps']:,.0f} | "
            f"{x['cold_rps']:.0%} | {w32['rps']:,.0f} | {x['warm_rps']:.0%} | "
            f"{cached} | "
            f"{' / '.join(f'{v:.0f}' for v in runs['rss_mb'])} | "
            f"{' / '.join(str(v) for v in runs.get('writes_per_s', [])) or '-'} |"
        )
    lines += ["", "Targets (issue 57), this run:", ""]
    for what, value, target, met in targets(r):
        lines.append(f"- {what}: {value:.2f} (target {target}): {'met' if met else 'NOT met'}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifacts", type=Path, required=True)
    p.add_argument("--duration", type=int, default=8, help="seconds of each warm wrk run")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--items", type=int, default=100, help="items a /predict names")
    p.add_argument("--cold-requests", type=int, default=10_000)
    p.add_argument("--write-rate", type=float, default=100.0, help="ratings/s posted under writes")
    p.add_argument("--online-users", type=int, default=300)
    p.add_argument("--online-ratings", type=int, default=20, help="ratings each online user posts")
    p.add_argument("--kinds", default="uniform,zipf,online,recommend")
    p.add_argument("--loads", default="idle,writes")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "dcmc-traffic")
    p.add_argument("--results", type=Path, default=h.RESULTS)
    p.add_argument("--no-record", action="store_true", help="print only; write nothing under results/")
    args = p.parse_args(argv)
    for tool in ("wrk", "redis-server"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} not found (Debian: apt-get install wrk redis-server)")
    args.work.mkdir(parents=True, exist_ok=True)
    started, began, git_start = h.stamp(), time.monotonic(), h.commit()
    ids = h.artifact_ids(args.artifacts)
    users, items, levels = ids
    kinds, loads = args.kinds.split(","), args.loads.split(",")
    record: dict[str, Any] = {"runs": {}}
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp, Redis() as redis_server:
        record["redis"] = redis_server.config()
        record["bare_first"] = measure_bare(args.workers, args.duration)
        online: list[str] = []
        for kind in kinds:
            if kind == "online" and not online:
                svc = Service(
                    args.artifacts, redis_server.url, "traffic", args.workers, args.work / "serve.log"
                )
                try:
                    online = create_online_users(
                        svc.wait_ready(), items, levels, args.online_users, args.online_ratings
                    )
                finally:
                    svc.stop()
            route = "recommend" if kind == "recommend" else "predict"
            draw = "uniform" if kind == "recommend" else kind
            scripts = {}
            for name, limit in (
                ("cold1", args.cold_requests),
                ("cold32", args.cold_requests // 2),
                ("warm", 0),
            ):
                # cold32: wrk's two threads each stop after half the requests
                who = draw_users(draw, users, online, args.cold_requests if name != "warm" else 5000, rng)
                scripts[f"{kind}-{name}"] = script(
                    Path(tmp),
                    f"{kind}-{name}",
                    route,
                    who,
                    items,
                    args.items,
                    limit,
                    int(rng.integers(1 << 30)),
                )
            for load in loads:
                record["runs"][f"{kind}/{load}"] = run_kind(args, redis_server.url, kind, load, scripts, ids)
        record["bare_last"] = measure_bare(args.workers, args.duration)
    record["bare"] = floor(record["bare_first"], record["bare_last"])
    config = json.loads((args.artifacts / "config.json").read_text())
    searches = config.get("averaged") or []
    record.update(
        started=started,
        written=h.stamp(),
        wall_s=time.monotonic() - began,
        command=h.command("traffic.py", argv),
        machine=h.machine(),
        git=h.commit(),
        git_start=git_start,
        artifacts=str(args.artifacts),
        settings=f"inference {config['inference']['mode']}"
        + (f", {len(searches) + 1} settings averaged" if searches else ""),
        workers=args.workers,
        duration_s=args.duration,
        cold_requests=args.cold_requests,
        items=args.items,
        write_rate=args.write_rate,
    )
    record["ratios"] = ratios(record)
    text = report(record)
    print("\n" + text)
    if not args.no_record:
        h.append_jsonl(args.results / "traffic.jsonl", record)
        h.write_report(
            args.results / "traffic.md",
            ["# Traffic: `dcmc serve` for users who were not just here", "", text],
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
