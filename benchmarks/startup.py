"""A worker's start-up with a long online history: replaying the stream vs starting from a fold-in snapshot.

    python benchmarks/startup.py --artifacts DIR [--users 30000] [--per-user 10] [--sample 200]
                                 [--item-changes 0]

Writes `--users` new users x `--per-user` ratings of random artifact items (seeded) into the stream of a
private redis-server, in the service's own entry format, and after them `--item-changes` catalogue
changes (PUT records of the artifact's items and of new ones, and PATCHes, model/stream.py), then times:

1. replay: `dcmc serve --workers 1` with snapshots off: seconds to /ready and peak RSS; its answers for
   `--sample` of the new users are the reference;
2. snapshot: a worker with snapshots on, left running until it has stored one (service/snapshot.py),
   while another client PINGs Redis every 10 ms: the longest PING;
3. restart: a fresh worker: seconds to /ready, peak RSS (VmHWM), largest difference from the reference.

Appends the record to benchmarks/results/startup.jsonl and rewrites startup.md.
"""

import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import harness as h
import numpy as np
from harness import Redis, Service


def write_stream(redis_server: Redis, prefix: str, artifact: Path, users: int, per_user: int) -> int:
    """The history, written straight into the stream (pipelined XADDs of the service's entry format)."""
    from model.artifact import load_artifact
    from model.stream import entry_fields, stream_key

    art = load_artifact(artifact)
    rng = np.random.default_rng(0)
    items, levels = art.items.ids, art.levels
    key = stream_key(prefix)
    pipe = redis_server.client.pipeline(transaction=False)
    count = 0
    for u in range(users):
        for j in rng.choice(len(items), per_user, replace=False):
            pipe.xadd(key, entry_fields(f"new{u}", items[j], float(rng.choice(levels))))  # type: ignore[arg-type]
            count += 1
        if u % 500 == 499:
            pipe.execute()
    pipe.execute()
    return count


def write_item_changes(redis_server: Redis, prefix: str, artifact: Path, changes: int) -> int:
    """`changes` catalogue changes, written straight into the stream: every third a PATCH of `hidden`,
    the others whole records, of the artifact's items and as many new ones (seeded)."""
    from model.artifact import load_artifact
    from model.catalogue import ItemChange, ItemPatch, ItemRecord
    from model.stream import item_fields, stream_key

    items = list(load_artifact(artifact).items.ids)
    rng = np.random.default_rng(2)
    key = stream_key(prefix)
    pipe = redis_server.client.pipeline(transaction=False)
    for k in range(changes):
        j = int(rng.integers(2 * len(items)))
        item = items[j] if j < len(items) else f"catalogue-{j}"
        if k % 3 == 2:
            change = ItemChange(False, ItemPatch(hidden=bool(k % 2)))
        else:
            record = ItemRecord(categories=[f"c{k % 20}"], attributes={"year": 1950 + k % 70, "n": k})
            change = ItemChange.whole(record)
        pipe.xadd(key, item_fields(item, change))  # type: ignore[arg-type]
        if k % 5000 == 4999:
            pipe.execute()
    pipe.execute()
    return changes


class Pinger:
    """Another client's PING every 10 ms while a worker stores its snapshot: the longest one says how long
    a command of the snapshot held Redis (every other worker's commands wait as long)."""

    def __init__(self, url: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url)
        self.longest = 0.0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.01):
            began = time.perf_counter()
            self.client.ping()
            self.longest = max(self.longest, time.perf_counter() - began)

    def stop(self) -> float:
        self.done.set()
        self.thread.join()
        self.client.close()
        return round(self.longest * 1000, 1)


def start(artifact: Path, redis: Redis, prefix: str, log: Path, env: dict[str, str]) -> tuple[Service, dict]:
    """Launch a worker, wait for /ready: the service, and its seconds to ready and memory."""
    began = time.perf_counter()
    svc = Service(artifact, redis.url, prefix, 1, log, {"DCMC_LOG_LEVEL": "info", **env})
    svc.wait_ready(timeout=1800)
    ready_s = round(time.perf_counter() - began, 2)
    return svc, {"ready_s": ready_s, **(h.status_mb(svc.proc.pid, "VmHWM", "VmRSS") or {})}


def main(argv: list[str] | None = None) -> int:
    parser = h.parser(__doc__)
    parser.add_argument("--artifacts", required=True, help="artifact directory (e.g. the ML-100K default)")
    parser.add_argument("--users", type=int, default=30_000)
    parser.add_argument("--per-user", type=int, default=10)
    parser.add_argument("--sample", type=int, default=200, help="new users whose answers are compared")
    parser.add_argument("--item-changes", type=int, default=0, help="catalogue changes after the ratings")
    parser.add_argument("--results", default=str(h.RESULTS))
    args = parser.parse_args(argv)
    artifact = Path(args.artifacts).resolve()
    results = Path(args.results)
    log = Path(tempfile.mkdtemp(prefix="dcmc-startup-")) / "serve.log"
    prefix = "startup"
    rng = np.random.default_rng(1)
    sample = [f"new{u}" for u in rng.choice(args.users, min(args.sample, args.users), replace=False)]
    from model.artifact import load_artifact

    art = load_artifact(artifact)
    items = list(art.items.ids[:100])
    record: dict[str, Any] = {
        "commit": h.commit_label(),
        "command": h.command("startup.py", argv),
        "machine": h.machine(),
        "artifact": str(artifact),
        # the user co-rating term (chosen or not by the artifact's search) keeps a users x users table
        "user_table": art.inference.kernel.co_rating_user > 0,
        "users": args.users,
        "per_user": args.per_user,
    }
    with Redis() as redis_server:
        began = time.perf_counter()
        record["ratings"] = write_stream(redis_server, prefix, artifact, args.users, args.per_user)
        record["item_changes"] = write_item_changes(redis_server, prefix, artifact, args.item_changes)
        record["write_s"] = round(time.perf_counter() - began, 1)
        print(f"{record['ratings']} ratings in the stream ({record['write_s']} s)", flush=True)

        svc, record["replay"] = start(artifact, redis_server, prefix, log, {"DCMC_SNAPSHOT_INTERVAL_S": "0"})
        reference = svc.answers(sample, items)
        svc.stop()
        print("replay:", record["replay"], flush=True)

        svc, _ = start(artifact, redis_server, prefix, log, {})
        pings = Pinger(redis_server.url)
        deadline = time.monotonic() + 600
        while svc.metrics_by("dcmc_fold_in_snapshots_total", "event").get("written", 0) < 1:
            if time.monotonic() > deadline:
                raise TimeoutError("no snapshot stored in 10 minutes")
            time.sleep(0.2)
        svc.stop()
        record["snapshot_ping_max_ms"] = pings.stop()
        print(
            f"the longest PING while the snapshot was stored: {record['snapshot_ping_max_ms']} ms", flush=True
        )
        snapshot = next(iter(redis_server.client.keys(f"{prefix}:ratings:snapshot:*")))
        meta = json.loads(redis_server.client.hget(snapshot, "meta"))  # type: ignore[arg-type]
        record["snapshot"] = {"bytes": meta["bytes"], "applied": meta["applied"]}

        svc, record["restart"] = start(artifact, redis_server, prefix, log, {})
        got = svc.answers(sample, items)
        record["restart"]["catalogue_changes"] = svc.client.get("/health").json().get("catalogue_changes")
        record["restart"]["restored"] = svc.metrics_by("dcmc_fold_in_snapshots_total", "event").get(
            "restored", 0
        )
        svc.stop()
        record["restart"]["max_abs_diff"] = float(np.abs(got - reference).max())
        print("restart:", record["restart"], flush=True)
    h.append_jsonl(results / "startup.jsonl", record)
    write_report(results)
    return 0


def _user_table(record: dict[str, Any]) -> str:
    """Whether the record's artifact has the user co-rating table (read from the artifact for records
    written before the benchmark recorded it; "?" when it is gone)."""
    if "user_table" in record:
        return "on" if record["user_table"] else "off"
    config = Path(record["artifact"]) / "config.json"
    if not config.exists():
        return "?"
    return "on" if json.loads(config.read_text())["inference"]["kernel"]["co_rating_user"] > 0 else "off"


def write_report(results: Path) -> Path:
    rows = h.read_jsonl(results / "startup.jsonl")
    lines = [
        "# Start-up with a long online history: replay vs fold-in snapshot",
        "",
        "Written by `benchmarks/startup.py` (its docstring says what each row measures). New users' ratings",
        "are written into the stream of a private Redis; a worker that replays the whole stream is timed,",
        "then a fresh worker that starts from the fold-in snapshot another worker stored. Ready = from",
        "launching `dcmc serve --workers 1` to /ready answering 200; peak RSS = the process's VmHWM then.",
        "",
        "The artifacts differ by what their inference search chose: with the user co-rating term on, the",
        "fold-in keeps a users x users table (dense, and copied per applied batch, up to 8,192 users; then",
        "sparse), which the replay grows to 31,000 users and the snapshot stores.",
        "",
        *h.table(
            "| commit | artifact (user table) | ratings (users x each) | catalogue changes | replay: ready s "
            "| replay: peak RSS MB | snapshot MB | longest PING while stored, ms | restart: ready s "
            "| restart: peak RSS MB "
            "| answers vs replay, max abs diff |"
        ),
    ]
    for r in rows:
        lines.append(
            f"| {r['commit']} | {Path(r['artifact']).name} ({_user_table(r)}) "
            f"| {r['ratings']:,} ({r['users']:,} x {r['per_user']}) | {r.get('item_changes', 0):,} | "
            f"{r['replay']['ready_s']} | {r['replay']['VmHWM']:.0f} | {r['snapshot']['bytes'] / 1e6:.0f} | "
            f"{r.get('snapshot_ping_max_ms', '-')} | "
            f"{r['restart']['ready_s']} | {r['restart']['VmHWM']:.0f} | {r['restart']['max_abs_diff']:.1e} |"
        )
    lines += ["", "Commands: " + "; ".join(sorted({f"`{r['command']}`" for r in rows})), ""]
    path = results / "startup.md"
    path.write_text("\n".join(lines))
    return path


if __name__ == "__main__":
    sys.exit(main())
