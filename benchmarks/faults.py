"""The fault-schedule checker: random schedules of faults against real processes on loopback, and at the end
invariants checked against a model of what was acknowledged. The project's Jepsen.

    python benchmarks/faults.py [--schedules 200] [--seed 0] [--seeds 3,17] [--flavour mixed] [--steps 6]

Each schedule starts its own world: a redis-server with an append-only file fsynced on every write (or,
flavour `cluster`, three primaries in cluster mode), two `dcmc serve` workers that reach Redis through
their own TCP proxies (single node), and a tiny artifact published as `runs/current`. One worker may be
pinned to its first artifact (no hot reload: a canary, or an older deployment). While a client writes
ratings, retractions, forgets and catalogue records (PUT /items/{id}) to the workers that say they are
ready (as a load balancer would), the schedule runs its steps, drawn from the seed:

    compact       `dcmc compact` of the published artifact
    compact2      two compactions at once (threads), of the newest run and the one before, in either order,
                  the second up to 100 ms after the first; or, where the first reaches Redis through a
                  proxy that delays every packet 50-300 ms (a slow retrainer far away), anywhere in the
                  first's run (up to 24 delays after it): between its read and its write included
    retrain       `dcmc train --online-ratings ... --publish` (the workers reload it), then often compact
    retrain2      two retrains back to back, then both runs compacted at once (compact2's way): two
                  retrainers, one slower than the other
    restart       `kill -9` of a worker and a new one
    redis-kill    `kill -9` of redis-server, a restart from its append-only file 0.5-3 s later
    outage-start  redis-server killed, then every worker killed and started while it is down, then Redis back
    delay         a worker's proxy delays every packet by 0.3-1.5 s for a while (past the Redis timeouts)
    drop          a worker's proxy cuts every connection
    partition     a worker's proxy holds every packet for 2-15 s (the next steps go on meanwhile)
    partition-compact  a worker's proxy holds every packet while a retrain is published and compacted
    primary-down  (cluster) one primary killed, restarted 1-4 s later

After the last step every fault is healed and the invariants are checked:

    ready       every worker is ready and following the stream within READY_BOUND_S of the last fault
                (and none exited)
    no-500      no answer of any request was a 5xx other than 503
    truthful    every answer that said nothing was stored (503 "nothing ... stored", 4xx, refused connection)
                stored nothing: none of its ratings or records is in the stream or its compacted head
    state       every acknowledged rating is in every ready worker's state (GET /users/{id}/ratings), and
                no acknowledged retraction's pair is, unless a later write of the pair (acknowledged or
                not known) may have changed it; on a service without that route: every new user with an
                acknowledged rating is known to every worker
    agree       every ready worker of one model version answers the same ratings for the same users
    replay      ... and the same as a fresh worker that replays the stream (no fold-in snapshot) on the
                artifact it serves: a worker that skipped entries, or started from a snapshot that did,
                disagrees
    forgotten   no user whose forget was acknowledged (and never rated again) is known to any worker or
                listed as a similar user
    catalogue   every item whose last catalogue write was acknowledged (and no write of it whose fate is
                unknown may follow) has that record on every ready worker (GET /items/{id})
    retrain     the next retrain's data holds every acknowledged rating and no acknowledged retraction or
                forgotten user, and its catalogue every acknowledged record; after it is published and
                every worker reloaded, `state`, `agree`, `forgotten` and `catalogue` hold again

A schedule prints its seed first, so a failure can be replayed (`--seeds SEED`); the timing of the
processes is not replayed, only the schedule. Writes benchmarks/results/faults.md and appends the run's
record to faults.jsonl (`--no-record`: neither; the tests run it so; `--report`: only rebuild faults.md from
faults.jsonl, its latest run first). Stopped part way (SIGINT or SIGTERM),
it records the schedules that finished, marked as interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness as h
import httpx

READY_BOUND_S = 30.0
"""How long after the last fault every worker must be ready."""

TOKEN = "fault-checker-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PREFIX = "chk"
LEVELS = (1, 2, 3, 4, 5)
STEPS = {
    "single": {
        "compact": 3,
        "compact2": 2,
        "retrain": 3,
        "retrain2": 2,
        "restart": 3,
        "redis-kill": 3,
        "outage-start": 1,
        "delay": 2,
        "drop": 2,
        "partition": 3,
        "partition-compact": 2,
    },
    "cluster": {"compact": 2, "compact2": 2, "retrain": 3, "retrain2": 1, "restart": 2, "primary-down": 4},
}
"""The steps a schedule draws from, with their weights, per flavour."""


# -- processes -----------------------------------------------------------------------------------------
class Proxy:
    """A TCP proxy on loopback in front of one port, whose faults the schedule sets: `delay_s` holds every
    chunk that long, `held` holds every packet (a partition: connections stay open, nothing passes), and
    `drop()` cuts every connection."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = h.free_port()
        self.delay_s = 0.0
        self._open = threading.Event()  # cleared while held
        self._open.set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port)
        )
        started.set()
        self._loop.run_forever()

    async def _wait_open(self) -> None:
        while not self._open.is_set():
            await asyncio.sleep(0.02)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._wait_open()
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    if self.delay_s:
                        await asyncio.sleep(self.delay_s)
                    await self._wait_open()
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError, asyncio.CancelledError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    dst.close()

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        except asyncio.CancelledError:  # the proxy stops
            pass
        finally:
            self._writers -= {writer, up_writer}

    def hold(self, held: bool) -> None:
        """Hold every packet (a partition) or let them pass again."""
        if held:
            self._open.clear()
        else:
            self._open.set()

    def drop(self) -> None:
        """Cut every open connection (both sides see a reset)."""

        def cut() -> None:
            for w in list(self._writers):
                transport = w.transport
                with contextlib.suppress(Exception):
                    transport.abort()
            self._writers.clear()

        self._loop.call_soon_threadsafe(cut)

    def heal(self) -> None:
        self.delay_s = 0.0
        self.hold(False)

    def stop(self) -> None:
        self.heal()
        self.drop()

        async def shut() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._loop.stop()

        asyncio.run_coroutine_threadsafe(shut(), self._loop)
        self._thread.join(5)


def _spawn_redis(port: int, directory: Path, *extra: str) -> subprocess.Popen[bytes]:
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    argv += ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(directory), *extra]
    return subprocess.Popen(
        [*argv, "--daemonize", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def _ping(port: int, timeout: float = 10.0) -> bool:
    import redis

    client = redis.Redis(port=port, socket_timeout=0.5, socket_connect_timeout=0.5)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                client.ping()
                return True
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                time.sleep(0.05)
        return False
    finally:
        client.close()


class RedisNode:
    """One redis-server on a fixed port and directory, killed with -9 and restarted from its file."""

    def __init__(self, directory: Path, port: int | None = None, extra: tuple[str, ...] = ()) -> None:
        self.port = port or h.free_port()
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = _spawn_redis(self.port, self.dir, *self.extra)
        if not _ping(self.port, 30):
            raise RuntimeError(f"redis-server on {self.port} did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    @property
    def up(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _cluster_port() -> int:
    while True:
        port = random.randrange(20_000, 30_000)
        try:
            for p in (port, port + 10_000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port


class Store:
    """The Redis of one schedule: one node behind a proxy per worker, or a three-primary cluster."""

    def __init__(self, directory: Path, cluster: bool) -> None:
        self.cluster = cluster
        if cluster:
            extra = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
            extra += ("--cluster-node-timeout", "2000")
            self.nodes = [RedisNode(directory / f"n{k}", _cluster_port(), extra) for k in range(3)]
        else:
            self.nodes = [RedisNode(directory / "redis")]
        for node in self.nodes:
            node.start()
        if cluster:
            hosts = [f"127.0.0.1:{n.port}" for n in self.nodes]
            subprocess.run(
                ["redis-cli", "--cluster", "create", *hosts, "--cluster-replicas", "0", "--cluster-yes"],
                check=True,
                capture_output=True,
            )
            self._wait_cluster_ok()
        self.proxies: list[Proxy] = []

    def _wait_cluster_ok(self, timeout: float = 30.0) -> bool:
        import redis

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                ok = all(
                    b"cluster_state:ok"
                    in redis.Redis(port=n.port, socket_timeout=0.5).execute_command("CLUSTER", "INFO")
                    for n in self.nodes
                )
                if ok:
                    return True
            except redis.RedisError:
                pass
            time.sleep(0.1)
        return False

    @property
    def url(self) -> str:
        """What the trainer and `dcmc compact` use: straight to Redis."""
        if self.cluster:
            return f"redis://127.0.0.1:{self.nodes[0].port}/0?cluster=true"
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    def worker_url(self) -> tuple[str, Proxy | None]:
        """A worker's Redis URL: through a proxy of its own (single node), or the cluster's."""
        if self.cluster:
            return self.url, None
        proxy = Proxy(self.nodes[0].port)
        self.proxies.append(proxy)
        return f"redis://127.0.0.1:{proxy.port}/0", proxy

    def client(self) -> Any:
        import redis
        from redis.cluster import RedisCluster

        if self.cluster:
            return RedisCluster(host="127.0.0.1", port=self.nodes[0].port, socket_timeout=10)
        return redis.Redis(port=self.nodes[0].port, socket_timeout=10)

    def heal(self) -> None:
        for proxy in self.proxies:
            proxy.heal()
        for node in self.nodes:
            if not node.up:
                node.start()
        if self.cluster:
            self._wait_cluster_ok()

    def stop(self) -> None:
        for proxy in self.proxies:
            proxy.stop()
        for node in self.nodes:
            node.kill()


class Worker:
    """`dcmc serve --workers 1` on the published link (or pinned to one run), its log in the world."""

    def __init__(self, name: str, world: World, redis_url: str, proxy: Proxy | None, pinned: Path | None):
        self.name, self.world, self.redis_url, self.proxy, self.pinned = name, world, redis_url, proxy, pinned
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.starts = 0

    def start(self) -> None:
        self.port = h.free_port()
        self.starts += 1
        artifacts = self.pinned or self.world.current
        env = {k: v for k, v in os.environ.items() if not k.startswith("DCMC_") and k != "REDIS_URL"}
        env.update(
            {
                "REDIS_URL": self.redis_url,
                "DCMC_REDIS_KEY_PREFIX": PREFIX,
                "DCMC_WRITE_TOKEN": TOKEN,
                "DCMC_REDIS_RETRY_S": "0.2",
                "DCMC_RELOAD_POLL_S": "0" if self.pinned else "0.5",
                "DCMC_SNAPSHOT_INTERVAL_S": "1",
                "DCMC_SNAPSHOT_EVERY": "40",
                "DCMC_REQUIRE_DURABLE": "true",
                "DCMC_INFERENCE__MODE": "exact",
                "DCMC_FOLD_IN_INTERVAL_S": "0.1",
                "DCMC_MAX_K": "200",
                "DCMC_LOG_LEVEL": "info",
            }
        )
        argv = [
            h.DCMC,
            "serve",
            "--artifacts",
            str(artifacts),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        log = (self.world.dir / f"{self.name}.log").open("ab")
        log.write(f"--- start {self.starts} at {time.monotonic() - self.world.began:.2f}s\n".encode())
        log.flush()
        self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


# -- the client and its record ---------------------------------------------------------------------------
@dataclass
class Op:
    """One write the client sent, and what came of it."""

    kind: str  # rate | retract | forget | catalogue
    entries: list[tuple[str, str, float | None]]
    """(user, item, rating); a catalogue write: ("", item, the record's `w`, unique to the write)."""
    worker: str
    sent: float
    answered: float = 0.0
    status: int = 0  # 0: no HTTP answer
    detail: str = ""
    last_id: str | None = None
    outcome: str = ""  # stored | not-stored | unknown


@dataclass
class World:
    """Everything one schedule runs."""

    dir: Path
    csv: Path
    base: Path
    cluster: bool
    began: float = field(default_factory=time.monotonic)
    runs: list[Path] = field(default_factory=list)
    workers: list[Worker] = field(default_factory=list)
    store: Store | None = None
    ops: list[Op] = field(default_factory=list)
    http: list[tuple[str, int, str]] = field(default_factory=list)  # (what, status, body) of every answer
    tool_failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def current(self) -> Path:
        return self.dir / "runs" / "current"

    def note(self, what: str, status: int, body: str) -> None:
        with self.lock:
            self.http.append((what, status, body[:300]))


def _order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class Client(threading.Thread):
    """Writes to the workers that answer /ready 200, the way a load balancer sends traffic: ratings
    (1-3 per batch, of the artifact's users and new ones), retractions, forgets, and catalogue records
    of the artifact's items and new ones (each with an attribute `w` no other write has)."""

    def __init__(self, world: World, rng: random.Random, users: list[str], items: list[str]) -> None:
        super().__init__(daemon=True)
        self.world, self.rng = world, rng
        self.users = users + [f"n{k}" for k in range(30)]
        self.items = items + [f"x{k}" for k in range(4)]
        self.stop_event = threading.Event()
        self.ready: dict[str, bool] = {}
        self.rated: list[tuple[str, str]] = []
        self.catalogued = items[:6] + [f"k{k}" for k in range(3)]
        self.written = 0

    def _probe(self, http: httpx.Client) -> list[Worker]:
        ready = []
        for worker in list(self.world.workers):
            try:
                ok = http.get(f"{worker.url}/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                ok = False
            self.ready[worker.name] = ok
            if ok:
                ready.append(worker)
        return ready

    def run(self) -> None:
        rng = self.rng
        with httpx.Client(timeout=10) as http:
            probed, ready = 0.0, []
            while not self.stop_event.is_set():
                if time.monotonic() - probed > 0.2:
                    ready, probed = self._probe(http), time.monotonic()
                if not ready:
                    time.sleep(0.05)
                    continue
                worker = rng.choice(ready)
                roll = rng.random()
                if roll < 0.1 and self.rated:
                    user, item = rng.choice(self.rated)
                    op = Op("retract", [(user, item, None)], worker.name, time.monotonic())
                    self._send(http, worker, op, "DELETE", "/ratings", params={"user": user, "item": item})
                elif roll < 0.13 and self.rated:
                    user = rng.choice(self.rated)[0]
                    op = Op("forget", [(user, "", None)], worker.name, time.monotonic())
                    self._send(http, worker, op, "DELETE", f"/users/{user}")
                elif roll < 0.2:
                    item, self.written = rng.choice(self.catalogued), self.written + 1
                    op = Op("catalogue", [("", item, float(self.written))], worker.name, time.monotonic())
                    record = {"categories": ["fault"], "attributes": {"w": self.written}}
                    self._send(http, worker, op, "PUT", f"/items/{item}", json=record)
                else:
                    batch = [
                        (rng.choice(self.users), rng.choice(self.items), float(rng.choice(LEVELS)))
                        for _ in range(rng.randint(1, 3))
                    ]
                    op = Op("rate", batch, worker.name, time.monotonic())
                    body = {"ratings": [{"user": u, "item": i, "rating": r} for u, i, r in batch]}
                    self._send(http, worker, op, "POST", "/ratings", json=body)
                    if op.outcome != "not-stored":
                        self.rated += [(u, i) for u, i, _ in batch]
                time.sleep(rng.uniform(0.01, 0.06))

    def _send(self, http: httpx.Client, worker: Worker, op: Op, method: str, path: str, **kw: Any) -> None:
        try:
            r = http.request(method, worker.url + path, headers=AUTH, **kw)
        except httpx.ConnectError:
            op.outcome, op.detail = "not-stored", "connection refused"
        except httpx.HTTPError as exc:  # sent, and no answer: perhaps stored
            op.outcome, op.detail = "unknown", f"{type(exc).__name__}"
        else:
            op.status, op.detail = r.status_code, r.text[:300]
            self.world.note(f"{method} {path}", r.status_code, r.text)
            if r.status_code == 200:
                op.outcome, op.last_id = "stored", str(r.json()["last_id"])
            elif (r.status_code == 503 and ("may or may not" in r.text or "may have been" in r.text)) or (
                r.status_code >= 500 and r.status_code != 503
            ):
                op.outcome = "unknown"
            else:  # 503 saying nothing was stored, or a 4xx
                op.outcome = "not-stored"
        op.answered = time.monotonic()
        with self.world.lock:
            self.world.ops.append(op)


# -- the model of what was acknowledged --------------------------------------------------------------------
@dataclass
class Expected:
    """What the acknowledged writes promise at the end of a schedule."""

    present: dict[tuple[str, str], float]
    """Pairs whose last write was an acknowledged rating (nothing not known to be stored may follow it)."""
    absent: set[tuple[str, str]]
    """Pairs whose last write was an acknowledged retraction or forget of the user."""
    forgotten: set[str]
    """Users whose last write was an acknowledged forget."""
    newest: str | None
    """The newest acknowledged stream id."""
    records: dict[str, int] = field(default_factory=dict)
    """Items whose last catalogue write was acknowledged (and none of unknown fate may follow): its `w`."""


def expected(ops: list[Op]) -> Expected:
    """The promises of the acknowledged writes (module docstring: `state`). A write whose fate is unknown
    (no answer, or a 503 that says it may be stored) may have landed anywhere between its send and its
    answer: a pair or user it touches is promised nothing when it might come after the last acknowledged
    write."""
    events: dict[tuple[str, str], list[tuple[tuple[int, int, int], float | None, Op]]] = {}
    user_events: dict[str, list[tuple[tuple[int, int, int], Op]]] = {}
    unknown = [op for op in ops if op.outcome == "unknown" and op.kind != "catalogue"]
    stored = [op for op in ops if op.outcome == "stored" and op.kind != "catalogue"]
    for op in stored:
        assert op.last_id is not None
        ms, seq = _order(op.last_id)
        for k, (user, item, rating) in enumerate(op.entries):
            key = (ms, seq, k)  # one batch's entries are contiguous, in order, ending at last_id
            user_events.setdefault(user, []).append((key, op))
            if op.kind != "forget":
                events.setdefault((user, item), []).append((key, rating, op))
    written = [op for op in ops if op.outcome == "stored"]  # ratings and records
    newest = max((op.last_id for op in written if op.last_id), key=_order, default=None)

    def maybe_after(op_last: Op, user: str, item: str | None) -> bool:
        for u in unknown:
            touches = any(e[0] == user and (item is None or e[1] in (item, "")) for e in u.entries)
            if touches and u.answered >= op_last.sent:  # not known to come before it
                return True
        return False

    present: dict[tuple[str, str], float] = {}
    absent: set[tuple[str, str]] = set()
    forgotten: set[str] = set()
    forgets = {u: [(k, op) for k, op in evs if op.kind == "forget"] for u, evs in user_events.items()}
    for user, evs in user_events.items():
        _, last_op = max(evs, key=lambda e: e[0])
        if last_op.kind == "forget" and not maybe_after(last_op, user, None):
            forgotten.add(user)
    for (user, item), evs in events.items():
        key, rating, op = max(evs, key=lambda e: e[0])
        later_forget = [f for f in forgets.get(user, []) if f[0] > key]
        if later_forget:
            last = max(later_forget, key=lambda f: f[0])[1]
            if not maybe_after(last, user, item):
                absent.add((user, item))
            continue
        if maybe_after(op, user, item):
            continue
        if rating is None:
            absent.add((user, item))
        else:
            present[(user, item)] = rating
    return Expected(present, absent, forgotten, newest, expected_records(ops))


def expected_records(ops: list[Op]) -> dict[str, int]:
    """The `catalogue` promises: each item's last acknowledged record (by stream id), unless a write of
    the item whose fate is unknown was answered after that one was sent."""
    last: dict[str, tuple[tuple[int, int], Op]] = {}
    for op in ops:
        if op.kind == "catalogue" and op.outcome == "stored" and op.last_id is not None:
            item = op.entries[0][1]
            if item not in last or _order(op.last_id) > last[item][0]:
                last[item] = (_order(op.last_id), op)
    unknown = [op for op in ops if op.kind == "catalogue" and op.outcome == "unknown"]
    return {
        item: int(op.entries[0][2] or 0)
        for item, (_, op) in last.items()
        if not any(u.entries[0][1] == item and u.answered >= op.sent for u in unknown)
    }


# -- the schedule ----------------------------------------------------------------------------------------
def draw_schedule(
    seed: int, flavour: str, steps: int, kinds: set[str] | None = None
) -> tuple[str, list[dict[str, Any]], bool]:
    """The flavour, steps (of `kinds` alone where given) and whether one worker is pinned, drawn from
    `seed` alone."""
    rng = random.Random(seed)
    if flavour == "mixed":
        flavour = "cluster" if rng.random() < 0.2 else "single"
    weights = {k: w for k, w in STEPS[flavour].items() if kinds is None or k in kinds}
    kinds = rng.choices(list(weights), weights=list(weights.values()), k=steps)
    out = []
    for kind in kinds:
        step: dict[str, Any] = {
            "kind": kind,
            "worker": rng.randrange(2),
            "pause": round(rng.uniform(0.2, 1.5), 2),
        }
        if kind == "retrain":
            step["compact"] = rng.random() < 0.7
        if kind in ("compact2", "retrain2"):
            step["stagger"] = round(rng.uniform(0.0, 0.1), 4)
            # Drawn apart, so that the schedules of seeds drawn before these existed stay as they were:
            # which compaction starts first, and whether its connection is slow (a retrainer far away).
            extra = random.Random(f"{seed}:{len(out)}:compact2")
            step["older_first"] = extra.random() < 0.5
            if flavour == "single" and extra.random() < 0.5:
                step["slow"] = round(extra.uniform(0.05, 0.3), 3)
                step["stagger"] = round(extra.uniform(0.0, 24.0) * step["slow"], 4)  # anywhere in its run
        if kind in ("redis-kill", "primary-down", "outage-start"):
            step["down"] = round(rng.uniform(0.5, 3.0), 2)
            step["node"] = rng.randrange(3)
        if kind == "delay":
            step["delay"] = round(rng.uniform(0.3, 1.5), 2)
            step["for"] = round(rng.uniform(1.0, 4.0), 2)
        if kind == "partition":
            step["for"] = round(rng.uniform(2.0, 15.0), 2)
        out.append(step)
    return flavour, out, rng.random() < 0.5


def _tool(world: World, argv: list[str], what: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        argv, capture_output=True, text=True, env={**os.environ, "REDIS_URL": world.store.url}
    )  # type: ignore[union-attr]
    with (world.dir / "tools.log").open("a") as log:
        log.write(f"--- {what} ({proc.returncode}) at {time.monotonic() - world.began:.2f}s\n")
        log.write(proc.stdout[-3000:] + proc.stderr[-3000:])
    if "Traceback" in proc.stderr:
        world.tool_failures.append(f"{what}: a traceback ({proc.stderr.strip().splitlines()[-1][:200]})")
    return proc


def retrain(world: World, name: str) -> Path | None:
    out = world.dir / "runs" / name
    argv = [h.DCMC, "train", "--dataset", "csv", "--data-dir", str(world.csv), "--preset", "tiny"]
    argv += ["--epochs", "2", "--no-tune", "--no-progress", "--out", str(out)]
    argv += ["--online-ratings", world.store.url, "--online-prefix", PREFIX, "--publish", str(world.current)]  # type: ignore[union-attr]
    proc = _tool(world, argv, f"retrain {name}")
    if proc.returncode != 0:
        return None
    world.runs.append(out)
    return out


def compact(world: World, run: Path) -> subprocess.Popen[str]:
    argv = [h.DCMC, "compact", "--artifacts", str(run), "--online-ratings", world.store.url]  # type: ignore[union-attr]
    argv += ["--online-prefix", PREFIX]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def compact_together(world: World, newest: Path, older: Path, step: dict[str, Any]) -> None:
    """Two compactions at once (`training.compact.compact_stream` in two threads of this process, against
    the same Redis): each run's place in the stream read from its artifact first, then one compaction
    (`newest`'s, or `older`'s where `step["older_first"]`) and the other `step["stagger"]` s later, so
    that their reads of the stream overlap. With `step["slow"]` the first one reaches Redis through a
    proxy that delays every chunk by that long (single node), so that the second may trim and write its
    head while the first is still reading."""
    from model.artifact import load_artifact
    from model.stream import stream_key
    from training.compact import compact_stream
    from training.data import DataError

    store = world.store
    assert store is not None
    client = store.client()
    try:
        raw = client.get(f"{stream_key(PREFIX)}:identity")
    finally:
        client.close()
    identity = raw.decode() if raw is not None else None
    first, second = (older, newest) if step.get("older_first") else (newest, older)
    stagger_s, slow_s = step["stagger"], step.get("slow", 0.0)
    proxy = Proxy(store.nodes[0].port) if slow_s and not store.cluster else None
    urls = [store.url, store.url]
    if proxy is not None:
        proxy.delay_s = slow_s
        urls[0] = f"redis://127.0.0.1:{proxy.port}/0"
    places = []
    for run in (first, second):
        art = load_artifact(run)
        places.append((run, art.online_snapshot(stream_key(PREFIX), identity), art.levels.tolist()))
    outcomes: list[str] = []
    start = threading.Barrier(2)

    def compact_one(run: Path, up_to: str, levels: list[float], delay: float, url: str) -> None:
        start.wait()
        time.sleep(delay)
        if up_to == "0":
            outcomes.append(f"{run.name}: the artifact read none of the stream")
            return
        try:
            outcomes.append(f"{run.name}: {compact_stream(url, PREFIX, up_to, levels)}")
        except DataError as exc:
            outcomes.append(f"{run.name}: refused: {exc}")
        except Exception as exc:  # a crash of the tool: what the user would see as a traceback
            outcomes.append(f"{run.name}: {type(exc).__name__}: {exc}")
            world.tool_failures.append(f"compact2: {type(exc).__name__}: {exc}")

    threads = [
        threading.Thread(target=compact_one, args=(*places[0], 0.0, urls[0])),
        threading.Thread(target=compact_one, args=(*places[1], stagger_s, urls[1])),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if proxy is not None:
        proxy.stop()
    with (world.dir / "tools.log").open("a") as log:
        log.write(f"--- compact2 at {time.monotonic() - world.began:.2f}s\n" + "\n".join(outcomes) + "\n")


def _finish(world: World, procs: list[subprocess.Popen[str]], what: str) -> None:
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        with (world.dir / "tools.log").open("a") as log:
            log.write(f"--- {what} ({proc.returncode}) at {time.monotonic() - world.began:.2f}s\n{out}{err}")
        if "Traceback" in err:
            world.tool_failures.append(f"{what}: a traceback ({err.strip().splitlines()[-1][:200]})")


def _wait_started(world: World, timeout: float = 60.0) -> None:
    """Until every worker answers /health (its start-up has run, ready or not)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=1) as http:
        for w in world.workers:
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if http.get(f"{w.url}/health").status_code == 200:
                        break
                time.sleep(0.1)


def run_step(world: World, step: dict[str, Any], timers: list[threading.Timer]) -> None:
    store = world.store
    assert store is not None
    kind = step["kind"]
    worker = world.workers[step["worker"] % len(world.workers)]
    if kind == "compact":
        _finish(world, [compact(world, world.current)], "compact")
    elif kind == "compact2":
        older = world.runs[-2] if len(world.runs) > 2 else world.runs[-1]  # r0 read none of the stream
        compact_together(world, world.runs[-1], older, step)
    elif kind == "retrain":
        run = retrain(world, f"r{len(world.runs)}")
        if run is not None and step.get("compact"):
            _finish(world, [compact(world, world.current)], "compact after retrain")
    elif kind == "retrain2":
        first = retrain(world, f"r{len(world.runs)}")
        second = retrain(world, f"r{len(world.runs)}")
        if first is not None and second is not None:
            compact_together(world, second, first, step)
    elif kind == "partition-compact" and worker.proxy is not None:
        worker.proxy.hold(True)
        try:
            if retrain(world, f"r{len(world.runs)}") is not None:
                _finish(world, [compact(world, world.current)], "compact in a partition")
        finally:
            worker.proxy.hold(False)
    elif kind == "restart":
        worker.kill()
        worker.start()
    elif kind == "redis-kill":
        store.nodes[0].kill()
        time.sleep(step["down"])
        store.nodes[0].start()
    elif kind == "primary-down":
        node = store.nodes[step["node"] % len(store.nodes)]
        node.kill()
        time.sleep(step["down"])
        node.start()
    elif kind == "outage-start":
        store.nodes[0].kill()
        for w in world.workers:
            w.kill()
        for w in world.workers:
            w.start()
        _wait_started(world)  # each has tried Redis once, in its start-up
        time.sleep(step["down"])
        store.nodes[0].start()
    elif kind == "delay" and worker.proxy is not None:
        proxy = worker.proxy
        proxy.delay_s = step["delay"]
        timer = threading.Timer(step["for"], lambda: setattr(proxy, "delay_s", 0.0))
        timer.start()
        timers.append(timer)
    elif kind == "drop" and worker.proxy is not None:
        worker.proxy.drop()
    elif kind == "partition" and worker.proxy is not None:
        proxy = worker.proxy
        proxy.hold(True)
        timer = threading.Timer(step["for"], lambda: proxy.hold(False))
        timer.start()
        timers.append(timer)
    time.sleep(step["pause"])


# -- the checks ------------------------------------------------------------------------------------------
def _get(world: World, http: httpx.Client, url: str, what: str, **kw: Any) -> httpx.Response | None:
    try:
        r = http.get(url, **kw)
    except httpx.HTTPError:
        return None
    world.note(what, r.status_code, r.text)
    return r


def wait_ready(
    world: World, since: float, violations: list[str], workers: list[Worker] | None = None
) -> float | None:
    """Seconds from `since` until every worker answers /ready 200 and follows the stream (/health's
    replication phase `following`, where it says: a worker that caught up once stays ready while it retries
    Redis, serving what it has, and reads with `after` wait for it); a violation past READY_BOUND_S."""
    deadline = since + READY_BOUND_S
    workers = world.workers if workers is None else workers
    with httpx.Client(timeout=2) as http:
        while True:
            exited = [w.name for w in workers if w.proc is None or w.proc.poll() is not None]
            if exited:
                violations.append(f"ready: worker {', '.join(exited)} exited")
                return None
            states = {}
            for w in workers:
                r = _get(world, http, f"{w.url}/ready", "GET /ready")
                states[w.name] = r is not None and r.status_code == 200 and _following(http, w)
            if all(states.values()):
                return time.monotonic() - since
            if time.monotonic() > deadline:
                late = [name for name, ok in states.items() if not ok]
                violations.append(
                    f"ready: {', '.join(late)} not ready {READY_BOUND_S:.0f} s after the last fault"
                )
                return None
            time.sleep(0.1)


def _following(http: httpx.Client, worker: Worker) -> bool:
    """Whether /health says the worker follows the stream (True where it does not say)."""
    try:
        replication = http.get(f"{worker.url}/health").json().get("replication")
    except (httpx.HTTPError, ValueError):
        return False
    return not isinstance(replication, dict) or replication.get("phase", "following") == "following"


def check_truthful(world: World, violations: list[str]) -> None:
    """No rating of a write that was answered 'nothing stored' is in the stream or its compacted head,
    unless another write that may have stored the same rating explains it."""
    from model.stream import Compacted, compacted_key, parse_entry, stream_key

    key = stream_key(PREFIX)
    client = world.store.client()  # type: ignore[union-attr]
    try:
        raw = client.xrange(key, "-", "+")
        head_raw = client.get(compacted_key(key))
    finally:
        client.close()
    parsed = [parse_entry(i, f) for i, f in raw]
    seen = {(e.user, e.item, e.rating) for e in parsed if hasattr(e, "rating")}
    records = {(e.item, _w(e.change)) for e in parsed if hasattr(e, "change")}
    if head_raw is not None:
        with contextlib.suppress(ValueError):
            head = Compacted.from_json(head_raw)
            seen |= set(head.ratings)
            records |= {(item, _w(change)) for item, change in head.items}
    for op in world.ops:
        if op.kind == "catalogue" and op.outcome == "not-stored":
            _, item, w = op.entries[0]
            if (item, int(w or 0)) in records:
                violations.append(
                    f"truthful: {op.status or 'no answer'} ({op.detail[:80]!r}) said nothing was stored, but "
                    f"the record w={w:g} of {item!r} is in Redis"
                )
    maybe = {t for op in world.ops if op.outcome != "not-stored" and op.kind == "rate" for t in op.entries}
    for op in world.ops:
        if op.outcome != "not-stored" or op.kind != "rate":
            continue
        for triple in op.entries:
            if triple in seen and triple not in maybe:
                violations.append(
                    f"truthful: {op.status or 'no answer'} ({op.detail[:80]!r}) said nothing was stored, but "
                    f"{triple} is in Redis"
                )


def _w(change: Any) -> int | None:
    """The `w` a catalogue change sets (a client's PUT; None for anything else)."""
    w = change.applied_to(None).attributes.get("w") if change.replace else None
    return w if isinstance(w, int) else None


def check_records(
    world: World, exp: Expected, violations: list[str], when: str, http: httpx.Client, worker: Worker
) -> None:
    """`catalogue` on one worker."""
    after = {"after": exp.newest} if exp.newest else {}
    for item, w in sorted(exp.records.items()):
        r = _get(world, http, f"{worker.url}/items/{item}", "GET /items/{id}", params=after)
        if r is None:
            violations.append(f"catalogue {when}: {worker.name} did not answer for item {item!r}")
            continue
        held = r.json().get("attributes", {}).get("w") if r.status_code == 200 else None
        if held != w:
            violations.append(
                f"catalogue {when}: {worker.name} holds w={held} for item {item!r} ({r.status_code}), "
                f"acknowledged w={w}"
            )


def _model_version(http: httpx.Client, worker: Worker) -> str | None:
    try:
        return str(http.get(f"{worker.url}/health").json()["model_version"])
    except (httpx.HTTPError, ValueError, KeyError):
        return None


def check_workers(
    world: World, exp: Expected, users: list[str], items: list[str], violations: list[str], when: str
) -> None:
    """`state`, `forgotten` and `agree` against every worker."""
    after = {"after": exp.newest} if exp.newest else {}
    probe_items = items[:8]
    answers: dict[str, dict[str, list[float]]] = {}
    versions: dict[str, str | None] = {}
    with httpx.Client(timeout=10) as http:
        has_ratings_route = False
        with contextlib.suppress(httpx.HTTPError, ValueError):
            paths = http.get(f"{world.workers[0].url}/openapi.json").json().get("paths", {})
            has_ratings_route = "/users/{user}/ratings" in paths
        by_user: dict[str, dict[str, float]] = {}
        for (u, i), r in exp.present.items():
            by_user.setdefault(u, {})[i] = r
        gone: dict[str, set[str]] = {}
        for u, i in exp.absent:
            gone.setdefault(u, set()).add(i)
        for w in world.workers:
            versions[w.name] = _model_version(http, w)
            check_records(world, exp, violations, when, http, w)
            for user in exp.forgotten:
                try:
                    r = http.post(f"{w.url}/predict", json={"user": user, "items": probe_items}, params=after)
                except httpx.HTTPError:
                    violations.append(f"forgotten {when}: {w.name} did not answer")
                    continue
                world.note("POST /predict", r.status_code, r.text)
                if r.status_code != 404:
                    violations.append(
                        f"forgotten {when}: {w.name} answered {r.status_code} for forgotten user {user!r}: "
                        f"{r.text[:160]}"
                    )
            for user in sorted(set(by_user) | set(gone)):
                if user in exp.forgotten:
                    continue
                if has_ratings_route:
                    r = _get(
                        world,
                        http,
                        f"{w.url}/users/{user}/ratings",
                        "GET /users/{user}/ratings",
                        headers=AUTH,
                        params=after,
                    )
                    if r is None:
                        violations.append(f"state {when}: {w.name} did not answer for {user!r}")
                        continue
                    held = (
                        {x["item"]: x["rating"] for x in r.json().get("ratings", [])}
                        if r.status_code == 200
                        else {}
                    )
                    if r.status_code not in (200, 404):
                        violations.append(
                            f"state {when}: {w.name} answered {r.status_code} for {user!r}: {r.text[:160]}"
                        )
                        continue
                    for item, rating in by_user.get(user, {}).items():
                        if held.get(item) != rating:
                            violations.append(
                                f"state {when}: {w.name} holds {held.get(item)} for ({user!r}, {item!r}), "
                                f"acknowledged {rating}"
                            )
                    for item in gone.get(user, ()):
                        if item in held:
                            violations.append(
                                f"state {when}: {w.name} holds ({user!r}, {item!r}) = {held[item]} after an "
                                "acknowledged retraction or forget"
                            )
                elif user.startswith("n") and by_user.get(user):
                    try:
                        r = http.post(
                            f"{w.url}/predict", json={"user": user, "items": probe_items}, params=after
                        )
                    except httpx.HTTPError:
                        violations.append(f"state {when}: {w.name} did not answer for {user!r}")
                        continue
                    world.note("POST /predict", r.status_code, r.text)
                    if r.status_code == 404:
                        violations.append(
                            f"state {when}: {w.name} does not know {user!r}, who has acknowledged ratings"
                        )
            sample = sorted(set(users[:5]) | {u for u in by_user if u not in exp.forgotten})[:25]
            answers[w.name] = {}
            for user in sample:
                try:
                    r = http.post(f"{w.url}/predict", json={"user": user, "items": probe_items}, params=after)
                except httpx.HTTPError:
                    continue
                world.note("POST /predict", r.status_code, r.text)
                if r.status_code == 200:
                    answers[w.name][user] = [p["rating"] for p in r.json()["predictions"]]
            for query in users[:3]:
                r = _get(
                    world, http, f"{w.url}/similar-users/{query}", "GET /similar-users", params={"k": 200}
                )
                if r is not None and r.status_code == 200:
                    listed = {s["user"] for s in r.json()["similar"]} & exp.forgotten
                    if listed:
                        violations.append(
                            f"forgotten {when}: {w.name} lists {sorted(listed)} as similar users"
                        )
    names = [w.name for w in world.workers]
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            x, y = names[a], names[b]
            if versions[x] is None or versions[x] != versions[y]:
                continue
            for user in set(answers[x]) & set(answers[y]):
                diff = max(abs(p - q) for p, q in zip(answers[x][user], answers[y][user], strict=True))
                if diff > 1e-6:
                    violations.append(f"agree {when}: {x} and {y} differ by {diff:.2g} for {user!r}")
                    break
            only = set(answers[x]) ^ set(answers[y])
            if only:
                violations.append(f"agree {when}: {x} and {y} disagree on who is known: {sorted(only)[:5]}")


def _answers(
    http: httpx.Client, worker: Worker, users: list[str], items: list[str], after: dict[str, str]
) -> dict[str, list[float]]:
    out = {}
    for user in users:
        try:
            r = http.post(f"{worker.url}/predict", json={"user": user, "items": items}, params=after)
        except httpx.HTTPError:
            continue
        if r.status_code == 200:
            out[user] = [p["rating"] for p in r.json()["predictions"]]
        elif r.status_code == 404:
            out[user] = []
    return out


def check_replay(
    world: World, exp: Expected, users: list[str], items: list[str], violations: list[str], when: str
) -> None:
    """`replay`: a fresh worker per artifact served, replaying the stream without a fold-in snapshot (the
    stored ones are set aside while it starts), answers as every worker of its model version."""
    from model.stream import stream_key

    store = world.store
    assert store is not None
    after = {"after": exp.newest} if exp.newest else {}
    sample = sorted({u for u, _ in exp.present} | set(users[:5]) | {f"n{k}" for k in range(30)})[:40]
    probe = items[:8]
    client = store.client()
    try:
        keys = [k for k in client.scan_iter(match=f"{stream_key(PREFIX)}:snapshot:*")]
        stored = {k: client.hgetall(k) for k in keys}
        for key in keys:
            client.delete(key)
        served = {(w.pinned or world.current) for w in world.workers}
        fresh = []
        for k, path in enumerate(sorted(served)):
            ref = Worker(f"replay{k}", world, store.url, None, path)
            ref.start()
            fresh.append(ref)
        violations_before = len(violations)
        wait_ready(world, time.monotonic(), violations, fresh)
        for key, fields in stored.items():
            if fields:
                client.hset(key, mapping=fields)
        if len(violations) > violations_before:
            for ref in fresh:
                ref.kill()
            return
        with httpx.Client(timeout=10) as http:
            for ref in fresh:
                version = _model_version(http, ref)
                truth = _answers(http, ref, sample, probe, after)
                for w in world.workers:
                    if _model_version(http, w) != version:
                        continue
                    got = _answers(http, w, sample, probe, after)
                    for user, expected_ratings in truth.items():
                        mine = got.get(user)
                        if mine is None:
                            continue
                        if (not mine) != (not expected_ratings):
                            known = "knows" if mine else "does not know"
                            violations.append(
                                f"replay {when}: {w.name} {known} {user!r}, a fresh replay the opposite"
                            )
                            break
                        diff = max(
                            (abs(p - q) for p, q in zip(mine, expected_ratings, strict=True)), default=0.0
                        )
                        if diff > 1e-6:
                            violations.append(
                                f"replay {when}: {w.name} differs from a fresh replay by {diff:.2g} "
                                f"for {user!r}"
                            )
                            break
        for ref in fresh:
            ref.kill()
    finally:
        client.close()


def check_retrain(world: World, exp: Expected, violations: list[str]) -> Path | None:
    """`retrain`: the next retrain's data against the promises; the run (published) or None."""
    from model.artifact import load_artifact

    run = retrain(world, "final")
    if run is None:
        violations.append("retrain: the final retrain failed (tools.log)")
        return None
    art = load_artifact(run)
    users, items = list(art.users.ids), list(art.items.ids)
    data: dict[tuple[str, str], float] = {}
    for part in (art.train, art.held_out):
        for r, c, v in zip(part.rows.tolist(), part.cols.tolist(), part.values.tolist(), strict=True):
            data[(users[r], items[c])] = v
    record = (art.meta.get("dataset") or {}).get("online_ratings") or {}
    for u, i, v in record.get("held_out_pairs", []):
        data[(str(u), str(i))] = float(v)
    for pair, rating in exp.present.items():
        if data.get(pair) != rating:
            violations.append(
                f"retrain: the retrain holds {data.get(pair)} for {pair}, acknowledged {rating}"
            )
    for pair in exp.absent:
        if pair in data:
            violations.append(
                f"retrain: the retrain holds {pair} = {data[pair]} after an acknowledged retraction"
            )
    rated = {u for u, _ in data}
    for user in exp.forgotten & rated:
        violations.append(f"retrain: the retrain holds ratings of the forgotten user {user!r}")
    catalogue = art.catalogue or {}
    for item, w in exp.records.items():
        held = catalogue[item].attributes.get("w") if item in catalogue else None
        if held != w:
            violations.append(
                f"retrain: the retrain's catalogue holds w={held} for {item!r}, acknowledged w={w}"
            )
    return run


def wait_version(world: World, version: str, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2) as http:
        while time.monotonic() < deadline:
            moving = [w for w in world.workers if not w.pinned]
            if all(_model_version(http, w) == version for w in moving):
                return True
            time.sleep(0.2)
    return False


# -- one schedule ----------------------------------------------------------------------------------------
def base_run(directory: Path) -> tuple[Path, Path]:
    """The dataset (a 60 x 50 synthetic CSV) and a tiny artifact trained on it, made once per run."""
    from training.synthetic import low_rank_ratings, write_csv

    csv = write_csv(directory / "ratings.csv", low_rank_ratings())
    base = directory / "base"
    argv = [h.DCMC, "train", "--dataset", "csv", "--data-dir", str(csv), "--preset", "tiny", "--epochs", "2"]
    subprocess.run([*argv, "--no-tune", "--no-progress", "--out", str(base)], check=True, capture_output=True)
    return csv, base


def run_schedule(
    seed: int,
    csv: Path,
    base: Path,
    flavour: str = "mixed",
    steps: int = 6,
    keep: Path | None = None,
    kinds: set[str] | None = None,
) -> dict[str, Any]:
    """Run the schedule of `seed`; its record (violations empty when every invariant held)."""
    from model.artifact import load_artifact, publish

    kind, schedule, pinned = draw_schedule(seed, flavour, steps, kinds)
    print(
        f"schedule seed={seed} flavour={kind} pinned={pinned} steps={[s['kind'] for s in schedule]}",
        flush=True,
    )
    directory = Path(tempfile.mkdtemp(prefix=f"dcmc-faults-{seed}-"))
    world = World(directory, csv, base, kind == "cluster")
    (directory / "runs").mkdir()
    first = directory / "runs" / "r0"
    shutil.copytree(base, first)
    publish(first, world.current)
    world.runs.append(first)
    art = load_artifact(first)
    users, items = list(art.users.ids), list(art.items.ids)
    violations: list[str] = []
    timers: list[threading.Timer] = []
    record: dict[str, Any] = {"seed": seed, "flavour": kind, "pinned": pinned, "steps": schedule}
    began = time.monotonic()
    client: Client | None = None
    try:
        world.store = Store(directory, world.cluster)
        for k in range(2):
            url, proxy = world.store.worker_url()
            world.workers.append(Worker(f"w{k}", world, url, proxy, first if (pinned and k == 1) else None))
        for w in world.workers:
            w.start()
        if wait_ready(world, time.monotonic(), violations) is None:
            violations.append("ready: the workers did not start")
            return record
        client = Client(world, random.Random(seed * 7919 + 1), users, items)
        client.start()
        time.sleep(1.0)
        for step in schedule:
            run_step(world, step, timers)
        for timer in timers:
            timer.cancel()
        world.store.heal()
        last_fault = time.monotonic()
        time.sleep(1.0)
        client.stop_event.set()
        client.join(30)
        record["ready_s"] = wait_ready(world, last_fault, violations)
        ops = list(world.ops)
        exp = expected(ops)
        record["ops"] = {o: sum(op.outcome == o for op in ops) for o in ("stored", "not-stored", "unknown")}
        check_truthful(world, violations)
        check_workers(world, exp, users, items, violations, "after the schedule")
        check_replay(world, exp, users, items, violations, "after the schedule")
        run = check_retrain(world, exp, violations)
        if run is not None:
            version = load_artifact(run).model_version
            if not wait_version(world, version):
                violations.append("retrain: the workers did not reload the final retrain")
            elif wait_ready(world, time.monotonic(), violations) is not None:
                check_workers(world, exp, users, items, violations, "after the final retrain")
                check_replay(world, exp, users, items, violations, "after the final retrain")
        violations += world.tool_failures
        errors = [
            (what, status, body) for what, status, body in world.http if status >= 500 and status != 503
        ]
        for what, status, body in errors[:5]:
            violations.append(f"no-500: {what} answered {status}: {body[:120]}")
    except Exception as exc:  # the checker itself failed: say so, as a violation to look at
        violations.append(f"checker: {type(exc).__name__}: {exc}")
    finally:
        if client is not None:
            client.stop_event.set()
        for timer in timers:
            timer.cancel()
        for w in world.workers:
            w.kill()
        if world.store is not None:
            world.store.stop()
        record["violations"] = violations
        record["wall_s"] = round(time.monotonic() - began, 1)
        if keep is not None and violations:
            with (directory / "answers.log").open("w") as out:  # every answer but the 200s, in order
                out.writelines(
                    f"{what} {status} {body}\n" for what, status, body in world.http if status != 200
                )
            with (directory / "ops.log").open("w") as out:
                out.writelines(f"{op}\n" for op in world.ops)
            shutil.copytree(directory, keep / f"seed-{seed}", dirs_exist_ok=True, symlinks=True)
        shutil.rmtree(directory, ignore_errors=True)
    status = "ok" if not violations else f"{len(violations)} violations"
    print(f"  seed={seed}: {status} in {record['wall_s']} s", flush=True)
    for v in violations:
        print(f"    {v}", flush=True)
    return record


@contextlib.contextmanager
def base_world() -> Iterator[tuple[Path, Path]]:
    directory = Path(tempfile.mkdtemp(prefix="dcmc-faults-base-"))
    try:
        yield base_run(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def report(records: list[dict[str, Any]], run: dict[str, Any], history: list[dict[str, Any]]) -> list[str]:
    """faults.md: this run's broken invariants, then every run recorded before it (`history`) and this one."""
    failing = [r for r in records if r["violations"]]
    kinds: dict[str, int] = {}
    for r in failing:
        for v in {v.split(":")[0] for v in r["violations"]}:
            kinds[v] = kinds.get(v, 0) + 1
    lines = [
        "# Fault schedules (benchmarks/faults.py)",
        "",
        f"- command: `{run['command']}` (started {run['started']}, {run['wall_s']:.0f} s)",
        f"- commit: {run['commit']}",
        f"- machine: {run['machine']['nproc']} cores, {run['machine']['cpu']}",
        "",
        f"{len(records)} schedules ({sum(r['flavour'] == 'cluster' for r in records)} on a cluster), "
        f"{len(failing)} with a broken invariant."
        + (f" Interrupted after {len(records)} of {run['of']}." if run.get("interrupted") else ""),
        "",
    ]
    if kinds:
        lines += h.table("| invariant | schedules that broke it |")
        lines += [f"| {k} | {n} |" for k, n in sorted(kinds.items())]
        lines += ["", "Failing seeds: " + ", ".join(str(r["seed"]) for r in failing), ""]
    lines += ["## Every recorded run (faults.jsonl)", ""]
    lines += h.table("| started | commit | command | schedules | failing seeds |")
    for r in [*history, run]:
        done = f"{r['schedules']} of {r['of']}" + (" (interrupted)" if r.get("interrupted") else "")
        failing_seeds = ", ".join(str(s) for s in r["failing"]) or "none"
        lines.append(f"| {r['started']} | {r['commit']} | `{r['command']}` | {done} | {failing_seeds} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = h.parser(__doc__)
    parser.add_argument("--schedules", type=int, default=200)
    parser.add_argument(
        "--seed", type=int, default=0, help="the first schedule's seed (the next ones follow)"
    )
    parser.add_argument("--seeds", help="comma-separated seeds to run instead (a replay)")
    parser.add_argument("--flavour", default="mixed", choices=("mixed", "single", "cluster"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--keep", help="copy the world of a failing schedule (logs, runs) here")
    parser.add_argument(
        "--kinds", help="comma-separated step kinds to draw from (default: all of the flavour's)"
    )
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--report", action="store_true", help="only rebuild faults.md from faults.jsonl")
    args = parser.parse_args(argv)
    if args.report:
        *history, last = h.read_jsonl(h.RESULTS / "faults.jsonl")
        h.write_report(h.RESULTS / "faults.md", report(last["records"], last, history))
        return 0
    seeds = (
        [int(s) for s in args.seeds.split(",")]
        if args.seeds
        else list(range(args.seed, args.seed + args.schedules))
    )
    keep = Path(args.keep) if args.keep else None
    started, wall = h.stamp(), time.monotonic()
    commit = h.commit_label("model", "service", "training", "benchmarks/faults.py")
    records = []
    interrupted = False
    for signum in (signal.SIGINT, signal.SIGTERM):  # also where started in the background (SIGINT ignored)
        signal.signal(signum, signal.default_int_handler)
    try:
        with base_world() as (csv, base):
            for seed in seeds:
                kinds = set(args.kinds.split(",")) if args.kinds else None
                records.append(run_schedule(seed, csv, base, args.flavour, args.steps, keep, kinds))
    except KeyboardInterrupt:  # stopped part way (Ctrl-C, SIGINT): record the schedules that finished
        interrupted = True
    run = {
        "command": h.command("faults.py", argv),
        "started": started,
        "wall_s": time.monotonic() - wall,
        "commit": commit,
        "machine": h.machine(),
        "schedules": len(records),
        "of": len(seeds),
        "interrupted": interrupted,
        "failing": [r["seed"] for r in records if r["violations"]],
    }
    print(json.dumps({k: v for k, v in run.items() if k != "machine"}), flush=True)
    if not args.no_record:
        history = h.read_jsonl(h.RESULTS / "faults.jsonl")
        h.append_jsonl(h.RESULTS / "faults.jsonl", {**run, "records": records})
        h.write_report(h.RESULTS / "faults.md", report(records, run, history))
    return 1 if run["failing"] else 0


if __name__ == "__main__":
    sys.exit(main())
