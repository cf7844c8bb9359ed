"""What the benchmarks share: processes (a private redis-server, `dcmc serve` with its own settings), wrk runs
and their figures, the machine and the commit a run measured, one JSON record per line, the reports, and
the small helpers several suites use (RMSE, mean ± std, Surprise's data sets, matplotlib)."""

from __future__ import annotations

import argparse
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
from datetime import datetime, timezone
from pathlib import Path
from statistics import mean, stdev
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the suites import model/, service/ and training/
RESULTS = REPO / "benchmarks" / "results"
DATA_DIR = REPO.parent / "shared" / "datasets"
DCMC = str(Path(sys.executable).with_name("dcmc"))
TOKEN = "online-bench-token"
"""The write token of the services the benchmarks start."""
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NOTES_MARK = "<!-- notes: the text below this line is kept when the report is rebuilt -->"


UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}
"""wrk's latency units, in milliseconds."""


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A suite's argument parser, its module docstring as the description."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def command(script: str, argv: Sequence[str] | None) -> str:
    """The command line of a suite's run: `python benchmarks/<script> ARGS`."""
    return f"python benchmarks/{script} {' '.join(sys.argv[1:] if argv is None else argv)}".strip()


def stamp() -> str:
    """Now, in UTC, to the minute."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (none when it does not exist)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_jsonl(path: Path, *records: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)


def last_json(out: str) -> dict[str, Any]:
    """The JSON object on the last line of a command's output."""
    return dict(json.loads(out.strip().splitlines()[-1]))


def run_json(cmd: list[str]) -> dict[str, Any]:
    """Run a command in the repository; the JSON object it printed last (RuntimeError if it failed)."""
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return last_json(proc.stdout)


def mean_std(values: Sequence[float], digits: int) -> str:
    """One value as it is, several as mean ± std."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{mean(values):.{digits}f} ± {stdev(values):.{digits}f}"


def rmse(pred: np.ndarray, truth: np.ndarray) -> float:
    """Root mean squared error."""
    err = np.asarray(pred, dtype=np.float64) - np.asarray(truth, dtype=np.float64)
    return float(np.sqrt(np.mean(err**2)))


def surprise_data(
    train: Any, test: Any, user_ids: Sequence[str], item_ids: Sequence[str], scale: tuple[float, float]
) -> tuple[Any, list[tuple[str, str, float]]]:
    """Surprise's trainset of the `train` entries and testset of the `test` ones (named by dataset ids)."""
    from surprise import Dataset, Reader

    def triples(e: Any) -> list[tuple[str, str, float]]:
        rows, cols, values = e.rows.tolist(), e.cols.tolist(), e.values.tolist()
        return [(user_ids[r], item_ids[c], float(v)) for r, c, v in zip(rows, cols, values, strict=True)]

    trainset = Dataset(Reader(rating_scale=scale)).construct_trainset([(*t, None) for t in triples(train)])
    return trainset, triples(test)


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (figures written to files)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def table(header: str) -> list[str]:
    """A markdown table's header line and the rule under it."""
    return [header, "|" + "---|" * (header.count("|") - 1)]


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


def wrk(
    url: str, path: str, connections: int, duration: int, script: Path | None, strict: bool = False
) -> dict[str, Any]:
    """wrk on url + path (at most 2 threads, the machine's cores; a Lua `script` for bodies): its parsed
    figures. Its output goes to stderr when a request failed; `strict` then exits (a fast error is no
    result)."""
    argv = ["wrk", f"-t{min(connections, 2)}", f"-c{connections}", f"-d{duration}s", "--latency"]
    argv += ["--timeout", "10s", *(["-s", str(script)] if script is not None else [])]
    out = subprocess.run([*argv, url + path], capture_output=True, text=True, check=True).stdout
    result = parse_wrk(out)
    if result["non_2xx"] or result["socket_errors"]:
        print(out, file=sys.stderr)
        if strict:
            sys.exit(f"wrk saw failed requests on {path}")
    return result


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout


def commit_label(*paths: str) -> str:
    """The short HEAD commit, with " + uncommitted changes" when `paths` (of the repository) have any."""
    dirty = _git("status", "--porcelain", "--", *paths).strip()
    return _git("rev-parse", "--short", "HEAD").strip() + (" + uncommitted changes" if dirty else "")


def summarize(samples_ms: Iterable[float]) -> dict[str, float]:
    """n, p50, p99, max and mean of latencies in ms (linear-interpolated percentiles)."""
    x = np.asarray(list(samples_ms), dtype=np.float64)
    if len(x) == 0:
        return {"n": 0}
    p50, p99 = np.percentile(x, [50, 99])
    stats = {"p50_ms": p50, "p99_ms": p99, "max_ms": x.max(), "mean_ms": x.mean()}
    return {"n": len(x), **{k: float(v) for k, v in stats.items()}}


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


def machine_line() -> str:
    """The machine in a report's words: architecture and cores."""
    return f"{platform.machine()}, {os.cpu_count()} cores"


def commit() -> dict[str, Any]:
    """The short HEAD commit and whether the working tree has uncommitted changes (files listed)."""
    changed = [line for line in _git("status", "--porcelain").splitlines() if line.strip()]
    head = _git("rev-parse", "--short", "HEAD").strip()
    return {"commit": head or "unknown", "dirty": bool(changed), "changes": changed}


def describe_commit(c: dict[str, Any]) -> str:
    return f"`{c['commit']}`" + (" with uncommitted changes" if c["dirty"] else "")


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def stop(proc: subprocess.Popen[Any], timeout: float) -> None:
    """SIGTERM to a child process, SIGKILL if it has not exited `timeout` seconds later."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def status_mb(pid: int, *fields: str) -> dict[str, float] | None:
    """Fields of /proc/<pid>/status (VmRSS, VmHWM, ...) in MB, in the file's order; None when it is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    split = (line.partition(":") for line in lines)
    return {name: int(value.split()[0]) / 1024 for name, _, value in split if name in fields}


class Redis:
    """A private redis-server: free port, temporary directory, append-only file fsynced on every write."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = Path(tempfile.mkdtemp(prefix="dcmc-online-redis-"))
        self.argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        self.argv += ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.dir)]
        self.argv += ["--daemonize", "no"]

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
        stop(self.proc, 10)
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


def artifact_ids(artifacts: Path) -> tuple[list[str], list[str], list[Any]]:
    """An artifact's user ids, item ids and rating levels (whole levels as ints)."""
    users = json.loads((artifacts / "user_ids.json").read_text())
    items = json.loads((artifacts / "item_ids.json").read_text())
    levels = [int(x) if float(x).is_integer() else float(x) for x in np.load(artifacts / "levels.npy")]
    return users, items, levels


def bodies(artifacts: Path, n_items: int, count: int = 500, seed: int = 0) -> list[str]:
    """`count` POST /predict bodies: a random user and `n_items` distinct random items each (seeded)."""
    users, items, _ = artifact_ids(artifacts)
    rng = np.random.default_rng(seed)

    def body() -> str:
        user = users[rng.integers(len(users))]
        chosen = [items[j] for j in rng.choice(len(items), n_items, replace=False)]
        return json.dumps({"user": user, "items": chosen}, separators=(",", ":"))

    return [body() for _ in range(count)]


class Service:
    """`dcmc serve` as a child process with a private environment (Redis, prefix, write token)."""

    def __init__(
        self, artifacts: Path, redis: str, prefix: str, workers: int, log: Path, env: dict | None = None
    ) -> None:
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [DCMC, "serve", "--artifacts", str(artifacts), "--host", "127.0.0.1"]
        self.argv += ["--port", str(self.port), "--workers", str(workers)]
        clean = {k: v for k, v in os.environ.items() if not k.startswith("DCMC_") and k != "REDIS_URL"}
        self.env = {**clean, "REDIS_URL": redis, "DCMC_REDIS_KEY_PREFIX": prefix, "DCMC_WRITE_TOKEN": TOKEN}
        self.env.update({"DCMC_LOG_LEVEL": "warning", **(env or {})})
        self.log = log.open("a")
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        self.client = httpx.Client(base_url=self.url, timeout=60)
        self.last_id: str | None = None  # the stream id of the last batch written through this helper

    def wait_ready(self, timeout: float = 180) -> Service:
        wait_up(self.proc, lambda: self.client.get("/ready"), f"dcmc serve (log: {self.log.name})", timeout)
        return self

    def stop(self) -> None:
        self.client.close()
        stop(self.proc, 20)
        self.log.close()

    def post_ratings(self, batch: Sequence[tuple[str, str, float]]) -> dict[str, Any]:
        body = {"ratings": [{"user": u, "item": i, "rating": r} for u, i, r in batch]}
        r = self.client.post("/ratings", json=body, headers=AUTH)
        if r.status_code != 200:
            raise RuntimeError(f"POST /ratings answered {r.status_code}: {r.text[:500]}")
        self.last_id = str(r.json()["last_id"])
        return dict(r.json())

    def predict(self, user: str, items: Sequence[str]) -> np.ndarray:
        """Predictions that include every rating this helper wrote (`after`: read-your-writes)."""
        params = {"after": self.last_id} if self.last_id else None
        for _ in range(10):  # a 503 with Retry-After: the worker has not folded the write in yet
            r = self.client.post("/predict", json={"user": user, "items": list(items)}, params=params)
            if r.status_code != 503 or "Retry-After" not in r.headers:
                break
            time.sleep(float(r.headers["Retry-After"]))
        if r.status_code != 200:
            raise RuntimeError(f"POST /predict answered {r.status_code}: {r.text[:500]}")
        return np.array([p["rating"] for p in r.json()["predictions"]], dtype=np.float64)

    def answers(self, users: Sequence[str], items: Sequence[str]) -> np.ndarray:
        """The predictions for `items` of each of `users`, a row each."""
        return np.array([self.predict(u, items) for u in users])

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

SEEDED_LUA = """
local counter = 0
setup = function(thread)
  counter = counter + 1
  thread:set("id", counter)
end
init = function(args)
  math.randomseed(%d + (id or 0))
end
"""
"""The per-thread seeding of the scripts that draw at random."""

RATINGS_LUA = (
    """
local users = {%s}
local items = {%s}
local levels = {%s}"""
    + SEEDED_LUA % 1000
    + """request = function()
  local body = '{"ratings":[{"user":"' .. users[math.random(#users)] .. '","item":"'
    .. items[math.random(#items)] .. '","rating":' .. levels[math.random(#levels)] .. '}]}'
  return wrk.format("POST", "/ratings",
    {["Content-Type"] = "application/json", ["Authorization"] = "Bearer %s"}, body)
end
"""
)

RECOMMEND_LUA = (
    """
local users = {%s}"""
    + SEEDED_LUA % 2000
    + """request = function()
  return wrk.format("GET", "/recommend/" .. users[math.random(#users)] .. "?k=10")
end
"""
)


def lua_list(values: Iterable[Any]) -> str:
    return ",".join(json.dumps(v) for v in values)


def lua_scripts(directory: Path, artifacts: Path, predict_items: Sequence[int]) -> dict[str, Path]:
    """wrk scripts in `directory`: `predict<n>` for each n of `predict_items` (500 bodies of n items each,
    cycled), `recommend` (a random user each) and `ratings` (one random rating each)."""
    users, items, levels = artifact_ids(artifacts)
    texts = {f"predict{n}": PREDICT_LUA % lua_list(bodies(artifacts, n)) for n in predict_items}
    texts["recommend"] = RECOMMEND_LUA % lua_list(users)
    texts["ratings"] = RATINGS_LUA % (lua_list(users), lua_list(items), lua_list(levels), TOKEN)
    for name, text in texts.items():
        (directory / f"{name}.lua").write_text(text)
    return {name: directory / f"{name}.lua" for name in texts}


def record_header(r: dict[str, Any]) -> list[str]:
    m, g, start, redis = r["machine"], r["git"], r.get("git_start"), r["redis"]
    ch = g["changes"]
    changes = ", ".join(f"`{c.strip()}`" for c in ch[:12]) + (", ..." if len(ch) > 12 else "")
    lines = [
        f"- command: `{r['command']}` (started {r['started']}, {r['wall_s']:.0f} s)",
        f"- machine: {m['nproc']} cores (`nproc`), {m['cpu']}",
        f"- commit: {describe_commit(g)}"
        + (f" ({len(ch)} paths in `git status --porcelain`: {changes})" if g["dirty"] else ""),
    ]
    if start is not None and (start["commit"], start["changes"]) != (g["commit"], g["changes"]):
        began = ", ".join(c.strip() for c in start["changes"]) or "clean"
        lines.append(
            f"- **the code changed during the run**: it started at {describe_commit(start)} ({began})"
        )
    appended = f"appendonly={redis['appendonly']}, appendfsync={redis['appendfsync']}"
    return [*lines, f"- Redis: a private redis-server, {appended}"]


def write_report(path: Path, lines: list[str], mark: str = NOTES_MARK) -> Path:
    """Write a report of `lines`, then the notes below `mark` of the report it replaces (kept as they
    are: what was measured by hand, why a record looks as it does)."""
    notes = ""
    if path.is_file() and mark in (text := path.read_text()):
        notes = text.split(mark, 1)[1].strip("\n")
    path.write_text("\n".join([*lines, mark, "", notes]).rstrip("\n") + "\n")
    return path
