"""What the benchmarks share: processes (a private redis-server, `dcmc serve` with its own settings), wrk runs
and their figures, the machine and the commit a run measured, and one JSON record per line."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DCMC = str(Path(sys.executable).with_name("dcmc"))
TOKEN = "online-bench-token"
"""The write token of the services the benchmarks start."""
NOTES_MARK = "<!-- notes: the text below this line is kept when the report is rebuilt -->"


UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}
"""wrk's latency units, in milliseconds."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_wrk(out: str) -> dict[str, Any]:
    """requests/s, p50, p99 (ms) and failed requests from `wrk --latency` output."""
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]

    def pct(p: str) -> float:
        value, unit = re.search(rf"\s{p}%\s+([\d.]+)(us|ms|s|m)\b", out).groups()  # type: ignore[union-attr]
        return float(value) * UNITS[unit]

    total = re.search(r"(\d+) requests in", out)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: (.*)", out)
    return {
        "rps": rps,
        "p50_ms": pct("50"),
        "p99_ms": pct("99"),
        "requests": int(total.group(1)) if total else 0,
        "non_2xx": int(non2xx.group(1)) if non2xx else 0,
        "socket_errors": sock.group(1).strip() if sock else "",
    }


def run_wrk(
    url: str, path: str, connections: int, duration: int, script: Path | None
) -> tuple[dict[str, Any], str]:
    """wrk on url + path (at most 2 threads, the machine's cores; a Lua `script` for bodies): its parsed
    figures and its raw output."""
    argv = ["wrk", f"-t{min(connections, 2)}", f"-c{connections}", f"-d{duration}s", "--latency"]
    argv += ["--timeout", "10s", *(["-s", str(script)] if script is not None else [])]
    out = subprocess.run([*argv, url + path], capture_output=True, text=True, check=True).stdout
    return parse_wrk(out), out


def commit_label(*paths: str) -> str:
    """The short HEAD commit, with " + uncommitted changes" when `paths` (of the repository) have any."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    status = ["git", "status", "--porcelain", "--", *paths]
    dirty = subprocess.run(status, cwd=REPO, capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + (" + uncommitted changes" if dirty else "")


def summarize(samples_ms: Iterable[float]) -> dict[str, float]:
    """n, p50, p99, max and mean of latencies in ms (linear-interpolated percentiles)."""
    x = np.asarray(list(samples_ms), dtype=np.float64)
    if len(x) == 0:
        return {"n": 0}
    return {
        "n": len(x),
        "p50_ms": float(np.percentile(x, 50)),
        "p99_ms": float(np.percentile(x, 99)),
        "max_ms": float(x.max()),
        "mean_ms": float(x.mean()),
    }


def machine() -> dict[str, Any]:
    """nproc and the CPU model."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    # `nproc --all`: plain nproc follows OMP_NUM_THREADS, which the benchmark's commands often set to 1
    nproc = subprocess.run(["nproc", "--all"], capture_output=True, text=True).stdout.strip()
    return {"nproc": int(nproc) if nproc.isdigit() else os.cpu_count(), "cpu": cpu}


def commit() -> dict[str, Any]:
    """The short HEAD commit and whether the working tree has uncommitted changes (files listed)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    status = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True)
    changed = [line for line in status.stdout.splitlines() if line.strip()]
    return {"commit": head.stdout.strip() or "unknown", "dirty": bool(changed), "changes": changed}


def describe_commit(c: dict[str, Any]) -> str:
    return f"`{c['commit']}`" + (" with uncommitted changes" if c["dirty"] else "")


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


class Redis:
    """A private redis-server: free port, temporary directory, append-only file fsynced on every write."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = Path(tempfile.mkdtemp(prefix="dcmc-online-redis-"))
        self.argv = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--dir",
            str(self.dir),
            "--daemonize",
            "no",
        ]

    def __enter__(self) -> Redis:
        import redis

        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = redis.Redis.from_url(self.url)
        for _ in range(200):
            try:
                self.client.ping()
                return self
            except redis.ConnectionError:
                time.sleep(0.05)
        self.__exit__()
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def config(self) -> dict[str, str]:
        got: Any = self.client.config_get("append*")
        return {k: str(got.get(k)) for k in ("appendonly", "appendfsync")}


def wait_up(proc: subprocess.Popen[Any], probe: Callable[[], Any], what: str, timeout: float) -> None:
    """Poll `probe()` (an HTTP request) until it answers 200; RuntimeError if `proc` exits first,
    TimeoutError after `timeout` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if probe().status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{what} not ready after {timeout}s")


def bodies(artifacts: Path, n_items: int, count: int = 500, seed: int = 0) -> list[str]:
    """`count` POST /predict bodies: a random user and `n_items` distinct random items each (seeded)."""
    users = json.loads((artifacts / "user_ids.json").read_text())
    items = json.loads((artifacts / "item_ids.json").read_text())
    rng = np.random.default_rng(seed)
    return [
        json.dumps(
            {
                "user": users[rng.integers(len(users))],
                "items": [items[j] for j in rng.choice(len(items), n_items, replace=False)],
            },
            separators=(",", ":"),
        )
        for _ in range(count)
    ]


class Service:
    """`dcmc serve` as a child process with a private environment (Redis, prefix, write token)."""

    def __init__(
        self,
        artifacts: Path,
        redis_url: str,
        prefix: str,
        workers: int,
        log: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [
            DCMC,
            "serve",
            "--artifacts",
            str(artifacts),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            str(workers),
        ]
        clean = {k: v for k, v in os.environ.items() if not k.startswith("DCMC_") and k != "REDIS_URL"}
        self.env = {
            **clean,
            "REDIS_URL": redis_url,
            "DCMC_REDIS_KEY_PREFIX": prefix,
            "DCMC_WRITE_TOKEN": TOKEN,
            "DCMC_LOG_LEVEL": "warning",
            **(env or {}),
        }
        self.log = log.open("a")
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        self.client = httpx.Client(base_url=self.url, timeout=60)
        self.last_id: str | None = None  # the stream id of the last batch written through this helper

    def wait_ready(self, timeout: float = 180) -> Service:
        wait_up(self.proc, lambda: self.client.get("/ready"), f"dcmc serve (log: {self.log.name})", timeout)
        return self

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()

    def post_ratings(self, batch: Sequence[tuple[str, str, float]]) -> dict[str, Any]:
        body = {"ratings": [{"user": u, "item": i, "rating": r} for u, i, r in batch]}
        r = self.client.post("/ratings", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
        if r.status_code != 200:
            raise RuntimeError(f"POST /ratings answered {r.status_code}: {r.text[:500]}")
        self.last_id = str(r.json()["last_id"])
        return dict(r.json())

    def predict(self, user: str, items: Sequence[str]) -> np.ndarray:
        """Predictions that include every rating this helper wrote (`after`: read-your-writes)."""
        params = {"after": self.last_id} if self.last_id else None
        r = self.client.post("/predict", json={"user": user, "items": list(items)}, params=params)
        if r.status_code != 200:
            raise RuntimeError(f"POST /predict answered {r.status_code}: {r.text[:500]}")
        return np.array([p["rating"] for p in r.json()["predictions"]], dtype=np.float64)

    def metric(self, name: str) -> float:
        for line in self.client.get("/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rpartition(" ")[2])
        return 0.0

    def metrics_by(self, name: str, label: str) -> dict[str, float]:
        """A labelled counter's values by that label (summed over the workers)."""
        out: dict[str, float] = {}
        pattern = re.compile(rf'^{re.escape(name)}{{.*{re.escape(label)}="([^"]*)".*}} (\S+)$')
        for line in self.client.get("/metrics").text.splitlines():
            match = pattern.match(line)
            if match:
                out[match.group(1)] = out.get(match.group(1), 0.0) + float(match.group(2))
        return out


PREDICT_LUA = """
local bodies = {%s}
local n = 0
request = function()
  n = n + 1
  return wrk.format("POST", "/predict", {["Content-Type"] = "application/json"}, bodies[(n %% #bodies) + 1])
end
"""

RATINGS_LUA = """
local users = {%s}
local items = {%s}
local levels = {%s}
local counter = 0
setup = function(thread)
  counter = counter + 1
  thread:set("id", counter)
end
init = function(args)
  math.randomseed(1000 + (id or 0))
end
request = function()
  local body = '{"ratings":[{"user":"' .. users[math.random(#users)] .. '","item":"'
    .. items[math.random(#items)] .. '","rating":' .. levels[math.random(#levels)] .. '}]}'
  return wrk.format("POST", "/ratings",
    {["Content-Type"] = "application/json", ["Authorization"] = "Bearer %s"}, body)
end
"""

RECOMMEND_LUA = """
local users = {%s}
local counter = 0
setup = function(thread)
  counter = counter + 1
  thread:set("id", counter)
end
init = function(args)
  math.randomseed(2000 + (id or 0))
end
request = function()
  return wrk.format("GET", "/recommend/" .. users[math.random(#users)] .. "?k=10")
end
"""


def lua_list(values: Iterable[Any]) -> str:
    return ",".join(json.dumps(v) for v in values)


def record_header(r: dict[str, Any]) -> list[str]:
    m, g = r["machine"], r["git"]
    return [
        f"- command: `{r['command']}` (started {r['started']}, {r['wall_s']:.0f} s)",
        f"- machine: {m['nproc']} cores (`nproc`), {m['cpu']}",
        f"- commit: {describe_commit(g)}"
        + (
            f" ({len(g['changes'])} paths in `git status --porcelain`: "
            + ", ".join(f"`{c.strip()}`" for c in g["changes"][:12])
            + (", ..." if len(g["changes"]) > 12 else "")
            + ")"
            if g["dirty"]
            else ""
        ),
        *(
            [
                f"- **the code changed during the run**: it started at {describe_commit(r['git_start'])} "
                f"({', '.join(c.strip() for c in r['git_start']['changes']) or 'clean'})"
            ]
            if "git_start" in r
            and (r["git_start"]["commit"], r["git_start"]["changes"])
            != (
                g["commit"],
                g["changes"],
            )
            else []
        ),
        f"- Redis: a private redis-server, appendonly={r['redis']['appendonly']}, "
        f"appendfsync={r['redis']['appendfsync']}",
    ]


def write_report(path: Path, lines: list[str]) -> Path:
    """Write a report of `lines`, then the notes below NOTES_MARK of the report it replaces (kept as they
    are: what was measured by hand, why a record looks as it does)."""
    notes = ""
    if path.is_file() and NOTES_MARK in (text := path.read_text()):
        notes = text.split(NOTES_MARK, 1)[1].strip("\n")
    path.write_text("\n".join([*lines, NOTES_MARK, "", notes]).rstrip("\n") + "\n")
    return path
