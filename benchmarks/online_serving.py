"""Parts 2 and 3 of benchmarks/online.py: a rating's way to a second replica (freshness), and wrk on the
routes while ratings arrive (speed), with their sections of online.md."""

import argparse
import contextlib
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import harness as h
import numpy as np
from harness import Redis, Service

# -- part 2: freshness across replicas -----------------------------------------------------------------------


def _probe(base: Path, n_query: int = 20) -> tuple[str, str, list[str]]:
    """A known user, an item it has not rated (the one posted) and n_query other unrated items (queried)."""
    from model.artifact import load_artifact

    art = load_artifact(base)
    known = art.known()
    rated = set(known.cols[known.rows == 0].tolist())
    unrated = [j for j in range(len(art.items)) if j not in rated]
    return art.users.ids[0], art.items.ids[unrated[0]], [art.items.ids[j] for j in unrated[1 : 1 + n_query]]


def part_freshness(args: argparse.Namespace) -> dict[str, Any]:
    base = Path(args.base)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    user, item, query = _probe(base)
    latencies, polls, post_ms, poll_ms = [], [], [], []
    mismatches = timeouts = 0
    with Redis() as redis_server:
        prefix = "online-freshness"
        log = work / "serve-freshness.log"
        a = Service(base, redis_server.url, prefix, 1, log)
        b = Service(base, redis_server.url, prefix, 1, log)
        try:
            a.wait_ready()
            b.wait_ready()
            for _ in range(20):  # warm both
                a.predict(user, query)
                b.predict(user, query)
            prev = b.predict(user, query)
            deadline = time.monotonic() + args.freshness_seconds
            for k in range(args.freshness_n):
                if time.monotonic() > deadline:
                    break
                rating = 1.0 if k % 2 == 0 else 5.0  # flips, so every post changes the answer
                t0 = time.perf_counter()
                a.post_ratings([(user, item, rating)])
                t1 = time.perf_counter()
                post_ms.append((t1 - t0) * 1e3)
                n = 0
                while True:
                    s = time.perf_counter()
                    cur = b.predict(user, query)
                    now = time.perf_counter()
                    poll_ms.append((now - s) * 1e3)
                    n += 1
                    if not np.array_equal(cur, prev):
                        latencies.append((now - t1) * 1e3)
                        polls.append(n)
                        break
                    if now - t1 > 10:
                        timeouts += 1
                        break
                if not np.array_equal(a.predict(user, query), cur):
                    mismatches += 1  # A and B must answer alike once B has the rating
                prev = cur
            stream = int(redis_server.client.xlen(f"{prefix}:ratings"))
            durability = redis_server.config()
        finally:
            a.stop()
            b.stop()
    return {
        "part": "freshness",
        "base": str(base),
        "servers": "2 x `dcmc serve --workers 1`, one Redis",
        "probe": {"user": user, "item": item, "query_items": len(query), "ratings": "1 and 5, alternating"},
        "posts": len(latencies) + timeouts,
        "timeouts_10s": timeouts,
        "a_b_mismatches": mismatches,
        "stream_length": stream,
        "latency": h.summarize(latencies),
        "polls_per_change": {
            "p50": float(np.median(polls)) if polls else None,
            "max": int(max(polls)) if polls else None,
        },
        "poll_latency": h.summarize(poll_ms),
        "post_latency": h.summarize(post_ms),
        "redis": durability,
        "bounds": {"n": args.freshness_n, "seconds": args.freshness_seconds},
    }


# -- part 3: speed with wrk ----------------------------------------------------------------------------------


class Writer:
    """Threads that POST one random known rating each, `per_s` in all, until `stop()`: several senders
    (`senders`), each paced at per_s / senders, so that a write waiting behind the readers does not hold
    the rate back (one sender got 26-69 of 100/s acknowledged while 32 connections read). Each sender
    writes prepared HTTP/1.1 requests on one kept-alive socket and reads the status line and body: the
    load generator shares the service's 2 cores, and an httpx client spent a fifth of a core at 100/s
    (2 ms of CPU a request against 0.3 ms for these senders, 100/s for 10 s against the ML-100K service,
    in a `/tmp` probe) that the readers then lacked."""

    def __init__(
        self,
        svc: Service,
        users: list[str],
        items: list[str],
        levels: list[Any],
        per_s: float,
        senders: int = 8,
    ) -> None:
        import threading

        self.svc, self.users, self.items, self.levels, self.per_s = svc, users, items, levels, per_s
        self.done = threading.Event()
        self.written = [0] * senders
        pace = per_s / senders
        self.threads = [
            threading.Thread(target=self._run, args=(k, pace), daemon=True) for k in range(senders)
        ]
        for thread in self.threads:
            thread.start()

    def _request(self, rng: np.random.Generator, host: str) -> bytes:
        u, i, v = (rng.integers(len(x)) for x in (self.users, self.items, self.levels))
        rating = {"user": self.users[u], "item": self.items[i], "rating": self.levels[v]}
        body = json.dumps({"ratings": [rating]}).encode()
        head = (
            f"POST /ratings HTTP/1.1\r\nHost: {host}\r\nAuthorization: {h.AUTH['Authorization']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body

    def _run(self, k: int, per_s: float) -> None:
        import socket

        rng = np.random.default_rng(3 + k)
        host_port = self.svc.url.removeprefix("http://")
        host, _, port = host_port.partition(":")
        started, sent = time.monotonic(), 0
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            reader = conn.makefile("rb")
            while not self.done.is_set():
                conn.sendall(self._request(rng, host_port))
                status = int(reader.readline().split()[1])
                length = 0
                while (line := reader.readline()) not in (b"\r\n", b""):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                reader.read(length)
                sent += 1
                self.written[k] += status == 200
                pause = started + sent / per_s - time.monotonic()
                if pause > 0:
                    self.done.wait(pause)

    def stop(self) -> int:
        """Stop; returns the ratings acknowledged."""
        self.done.set()
        for thread in self.threads:
            thread.join()
        return sum(self.written)


def first_rating_everywhere(svc: Service, item: str, level: Any, runs: int = 20) -> dict[str, Any]:
    """A new user's first rating, then /predict for that user on fresh connections (each may reach either
    worker) until `runs` in a row answer 200: the seconds from the write's 200 to the first of them."""
    import httpx

    user = f"newcomer-{time.time_ns()}"
    rating = {"user": user, "item": item, "rating": level}
    r = svc.client.post("/ratings", json={"ratings": [rating]}, headers=h.AUTH)
    acknowledged = time.monotonic()
    streak, streak_start = 0, acknowledged
    fresh_connections = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(base_url=svc.url, timeout=30, limits=fresh_connections) as fresh:
        while streak < runs and time.monotonic() - acknowledged < 120:
            started = time.monotonic()
            ok = fresh.post("/predict", json={"user": user, "items": [item]}).status_code == 200
            if ok and streak == 0:
                streak_start = started
            streak = streak + 1 if ok else 0
    return {
        "write_status": r.status_code,
        "answered_everywhere_s": round(streak_start - acknowledged, 3) if streak >= runs else None,
        "fresh_connections_in_a_row": runs,
    }


def recommend_state(svc: Service, user: str) -> dict[str, Any]:
    """Whether GET /recommend/{user}?k=10 exists: a route 404 says `Not Found`."""
    r = svc.client.get(f"/recommend/{user}", params={"k": 10})
    body: Any = None
    with contextlib.suppress(ValueError):
        body = r.json()
    exists = not (r.status_code == 404 and isinstance(body, dict) and body.get("detail") == "Not Found")
    return {"exists": exists, "status": r.status_code, "ok": r.status_code == 200}


WHILE = "{}@32 while 100 ratings/s are written"


def part_speed(args: argparse.Namespace) -> dict[str, Any]:
    base = Path(args.base)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    users, items, levels = h.artifact_ids(base)
    results: dict[str, Any] = {}
    with Redis() as redis_server, tempfile.TemporaryDirectory() as tmp:
        prefix = "online-speed"
        service_env = dict(pair.split("=", 1) for pair in args.service_env)
        svc = Service(base, redis_server.url, prefix, 2, work / "serve-speed.log", service_env)
        try:
            svc.wait_ready()
            scripts = h.lua_scripts(Path(tmp), base, (100,))
            scripts["predict"] = scripts["predict100"]
            rec = recommend_state(svc, users[0])
            d = args.duration
            h.wrk(svc.url, "/predict", 2, 3, scripts["predict"])  # warm both workers
            if rec["exists"]:
                h.wrk(svc.url, "/recommend", 2, 3, scripts["recommend"])
            plan: list[tuple[str, str, int, Path | None]] = [
                ("health@1", "/health", 1, None),
                ("predict@1", "/predict", 1, scripts["predict"]),
            ]
            if rec["exists"]:
                plan.append(("recommend@1", "/recommend", 1, scripts["recommend"]))
            plan += [
                ("health@32", "/health", 32, None),
                ("predict@32", "/predict", 32, scripts["predict"]),
                (WHILE.format("health"), "/health", 32, None),
                (WHILE.format("predict"), "/predict", 32, scripts["predict"]),
                ("ratings@1", "/ratings", 1, scripts["ratings"]),
                ("ratings@32", "/ratings", 32, scripts["ratings"]),
                ("predict@1 after writes", "/predict", 1, scripts["predict"]),
            ]
            if rec["exists"]:
                plan.append(("recommend@1 after writes", "/recommend", 1, scripts["recommend"]))
            for name, path, conns, script in plan:
                writer = Writer(svc, users, items, levels, per_s=100) if "while" in name else None
                cache_before = svc.metrics_by("dcmc_user_rows_total", "event")
                results[name] = h.wrk(svc.url, path, conns, d, script)
                if writer is not None:
                    results[name]["ratings_written_during"] = writer.stop()
                if path == "/predict":  # how the answers were made: cached rows, row parts, computed
                    cache_after = svc.metrics_by("dcmc_user_rows_total", "event")
                    results[name]["user_rows"] = {
                        k: cache_after[k] - cache_before.get(k, 0.0) for k in sorted(cache_after)
                    }
                if name.startswith("ratings"):
                    results[name]["stream_length_after"] = int(redis_server.client.xlen(f"{prefix}:ratings"))
                h.emit({"part": "speed", "run": name, **results[name]})
                if name == "ratings@32":  # right after the burst: a new user's first rating, everywhere
                    newcomer = first_rating_everywhere(svc, items[0], levels[-1])
                    h.emit({"part": "speed", "run": "newcomer after the burst", **newcomer})
            time.sleep(1.0)  # the other worker's tail (200 ms reads) catches up
            stream = int(redis_server.client.xlen(f"{prefix}:ratings"))
            written = svc.metric("dcmc_ratings_written_total")
            applied = svc.metric("dcmc_ratings_applied_total")
            redis_errors = svc.metric("dcmc_redis_errors_total")
            health = svc.client.get("/health").json()
            durability = redis_server.config()
        finally:
            svc.stop()
    return {
        "part": "speed",
        "base": str(base),
        "service_env": service_env,
        "workers": 2,
        "duration_s": args.duration,
        "recommend": rec,
        "results": results,
        "newcomer_after_burst": newcomer,
        "stream_length": stream,
        "ratings_written_metric": written,
        "ratings_applied_metric": applied,
        "redis_errors_metric": redis_errors,
        "health": health,
        "redis": durability,
    }


# -- report --------------------------------------------------------------------------------------------------


def freshness_section(r: dict[str, Any]) -> list[str]:
    lat, poll, post = r["latency"], r["poll_latency"], r["post_latency"]
    return [
        "## 2. Freshness across replicas",
        "",
        *h.record_header(r),
        f"- {r['servers']} on `{r['base']}`. {r['posts']} times (bounds: {r['bounds']['n']} posts, "
        f"{r['bounds']['seconds']:g} s): POST one rating of user {r['probe']['user']} for item "
        f"{r['probe']['item']} (unrated in training; {r['probe']['ratings']}) to server A, then poll server "
        f"B's /predict for that user ({r['probe']['query_items']} other unrated items) until the answer "
        "changes. Measured: from A's 200 to B's changed answer (B's answer received), so it includes at "
        f"least one /predict round trip (B's poll: p50 {poll['p50_ms']:.2f} ms).",
        "",
        *h.table("| | n | p50 ms | p99 ms | max ms |"),
        f"| A's 200 -> B's changed answer | {lat['n']} | {lat['p50_ms']:.2f} | {lat['p99_ms']:.2f} | "
        f"{lat['max_ms']:.2f} |",
        f"| POST /ratings to A (1 rating) | {post['n']} | {post['p50_ms']:.2f} | {post['p99_ms']:.2f} | "
        f"{post['max_ms']:.2f} |",
        f"| one /predict poll of B | {poll['n']} | {poll['p50_ms']:.2f} | {poll['p99_ms']:.2f} | "
        f"{poll['max_ms']:.2f} |",
        "",
        f"Polls of B per change: median {r['polls_per_change']['p50']:g}, max "
        f"{r['polls_per_change']['max']}. "
        f"Timeouts (no change within 10 s): {r['timeouts_10s']}. Times A's answer differed from B's changed "
        f"answer: {r['a_b_mismatches']}. Stream entries at the end: {r['stream_length']}.",
        "",
    ]


LABELS = {
    "health": "GET /health",
    "predict": "POST /predict (100 items)",
    "recommend": "GET /recommend/{user}?k=10",
    "ratings": "POST /ratings (1 rating)",
}
EVENTS = ("hit", "stale_hit", "fill", "parts_hit", "parts_fill")
"""The events of dcmc_user_rows_total: how /predict answers were made."""


def speed_section(r: dict[str, Any]) -> list[str]:
    res, rec = r["results"], r["recommend"]
    skipped = f"**skipped**, the route answers {rec['status']} `Not Found` in this service (not registered)."
    lines = [
        "## 3. Speed (wrk)",
        "",
        *h.record_header(r),
        f"- `dcmc serve --workers {r['workers']}` on `{r['base']}`, wrk `-d{r['duration_s']}s --latency`, "
        "threads = min(connections, 2), all runs in this order in one run against one service. /predict: 500 "
        "random bodies (user + 100 distinct items, seed 0) cycled; POST /ratings: one rating per request, a "
        "random known user, item and level per request (wrk Lua, bearer token), so every request stores one "
        "rating durably and both workers fold it in.",
        "- GET /recommend/{user}?k=10: " + ("random known user per request." if rec["exists"] else skipped),
        "",
        *h.table(
            "| route | conc. | req/s | p50 ms | p99 ms | requests | non-2xx | ratings in the stream after |"
        ),
    ]
    for name, x in res.items():
        route, _, rest = name.partition("@")
        conc, _, note = rest.partition(" ")
        label = LABELS[route]
        if "ratings_written_during" in x:
            note += f" ({x['ratings_written_during']} acknowledged)"
        lines.append(
            f"| {label}{' ' + note if note else ''} | {conc} | {x['rps']:.0f} | {x['p50_ms']:.2f} | "
            f"{x['p99_ms']:.2f} | {x['requests']} | {x['non_2xx']}"
            f"{' (socket errors: ' + x['socket_errors'] + ')' if x['socket_errors'] else ''} | "
            f"{x.get('stream_length_after', '')} |"
        )
    lines.append("")
    floor = res.get("health@32")
    for run, against in (("predict@32", "health@32"), (WHILE.format("predict"), WHILE.format("health"))):
        x, same = res.get(run), res.get(against)
        if x and floor:
            line = (
                f"- {run}: {100 * x['rps'] / floor['rps']:.0f}% of health@32's req/s, p50 "
                f"{x['p50_ms'] / floor['p50_ms']:.1f}x"
            )
            if same and against != "health@32":
                share, slower = 100 * x["rps"] / same["rps"], x["p50_ms"] / same["p50_ms"]
                line += f" ({share:.0f}% and {slower:.1f}x of {against})"
            lines.append(line + ".")
    lines.append("")
    made = [(n, x["user_rows"]) for n, x in res.items() if x.get("user_rows")]
    if made:
        lines += [
            "How the /predict answers were made (dcmc_user_rows_total by event, both workers): `hit` from a "
            "cached row of the state, `stale_hit` from a row of an earlier state (DCMC_ANSWER_STALENESS_S), "
            "`fill` a row computed, `parts_hit` from the user's row parts (read with the state's field and "
            "column terms), `parts_fill` parts computed.",
            "",
            *h.table("| run | hit | stale_hit | fill | parts_hit | parts_fill |"),
            *(f"| {n} | " + " | ".join(f"{u.get(k, 0):.0f}" for k in EVENTS) + " |" for n, u in made),
            "",
        ]
    lines += [
        f"After the runs: {r['stream_length']} ratings in the stream; dcmc_ratings_written_total "
        f"{r['ratings_written_metric']:.0f}, dcmc_ratings_applied_total {r['ratings_applied_metric']:.0f} "
        f"(summed over both workers: each worker applies every rating), dcmc_redis_errors_total "
        f"{r['redis_errors_metric']:.0f}.",
        "",
    ]
    newcomer = r.get("newcomer_after_burst")
    if newcomer:
        took = newcomer["answered_everywhere_s"]
        lines += [
            "Right after the POST /ratings burst at concurrency 32, a new user's first rating: its /predict "
            f"answered 200 on {newcomer['fresh_connections_in_a_row']} fresh connections in a row (either "
            "worker) "
            + (f"from {took:.2f} s after the write's 200." if took is not None else "not within 120 s."),
            "",
        ]
    return lines
