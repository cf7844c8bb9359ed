"""What the benchmarks share: a free loopback port, wrk run and read (p50, p99, requests/s), and the
commit a run measured."""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

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
