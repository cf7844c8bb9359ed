"""Load test of `dcmc serve`: GET /health (the floor) and POST /predict with 100 items, measured with wrk.

    python benchmarks/serve_bench.py --artifacts /tmp/dcmc/ml100k [--inference paper] [--duration 10]

Starts `dcmc serve --workers 2` on the artifact with a real Redis, then runs wrk at concurrency 1 and 32
against both routes in the same run. /predict bodies are drawn at random (user and 100 distinct items)
and cycled by a wrk Lua script, so no response cache could help. Prints requests/s, p50 and p99 and the
ratio of each /predict figure to the /health floor. Needs `wrk` (Debian: apt-get install wrk).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import free_port, run_wrk


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"dcmc serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    sys.exit(f"{url} not ready after {timeout}s")


def _bodies(artifacts: Path, n_items: int, count: int, seed: int) -> list[str]:
    import numpy as np

    users = json.loads((artifacts / "user_ids.json").read_text())
    items = json.loads((artifacts / "item_ids.json").read_text())
    rng = np.random.default_rng(seed)
    return [
        json.dumps(
            {
                "user": users[rng.integers(len(users))],
                "items": [items[j] for j in rng.choice(len(items), n_items, replace=False)],
            }
        )
        for _ in range(count)
    ]


LUA = """
local bodies = {%s}
local n = 0
request = function()
  n = n + 1
  return wrk.format("POST", "/predict", {["Content-Type"] = "application/json"}, bodies[(n %% #bodies) + 1])
end
"""


def _wrk(url: str, path: str, connections: int, duration: int, script: Path | None) -> dict[str, Any]:
    result, out = run_wrk(url, path, connections, duration, script)
    if result["non_2xx"] or result["socket_errors"]:
        print(out, file=sys.stderr)
        sys.exit(f"wrk saw failed requests on {path}")
    return {k: result[k] for k in ("rps", "p50_ms", "p99_ms")}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--artifacts", required=True, type=Path, help="ML-100K artifact (dcmc train ...)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--duration", type=int, default=10, help="seconds per wrk run")
    parser.add_argument("--items", type=int, default=100)
    parser.add_argument(
        "--inference",
        choices=("artifact", "paper", "none", "exact"),
        default="artifact",
        help="artifact: the artifact's own setting; otherwise a DCMC_INFERENCE__MODE override",
    )
    parser.add_argument("--set", action="append", default=[], metavar="DCMC_X=V", help="extra service env")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk not found: apt-get install wrk")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "REDIS_URL": args.redis_url, "DCMC_LOG_LEVEL": "warning"}
    if args.inference != "artifact":
        env["DCMC_INFERENCE__MODE"] = args.inference
    env.update(kv.split("=", 1) for kv in args.set)
    dcmc = str(Path(sys.executable).with_name("dcmc"))
    argv = [
        dcmc,
        "serve",
        "--artifacts",
        str(args.artifacts),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        str(args.workers),
    ]
    print("$", " ".join(argv), f"(REDIS_URL={args.redis_url}, inference={args.inference})", flush=True)
    proc = subprocess.Popen(argv, env=env)
    try:
        _wait_ready(url, proc)
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "predict.lua"
            bodies = _bodies(args.artifacts, args.items, 500, seed=0)
            script.write_text(LUA % ",".join(json.dumps(b) for b in bodies))
            _wrk(url, "/predict", 2, 3, script)  # warm every worker's local tier
            results = {}
            for c in (1, 32):
                results[("health", c)] = _wrk(url, "/health", c, args.duration, None)
                results[("predict", c)] = _wrk(url, "/predict", c, args.duration, script)
        with urllib.request.urlopen(f"{url}/health") as r:
            print("health:", r.read().decode())
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    header = f"{'route':<10}{'conc':>5}{'req/s':>10}{'p50 ms':>9}{'p99 ms':>9}"
    print(f"\n{header}   ratio to /health (req/s, p50, p99)")
    for c in (1, 32):
        h = results[("health", c)]
        for route in ("health", "predict"):
            r = results[(route, c)]
            ratio = (
                f"{r['rps'] / h['rps']:.2f}  {r['p50_ms'] / h['p50_ms']:.1f}x  "
                f"{r['p99_ms'] / h['p99_ms']:.1f}x"
            )
            print(
                f"{route:<10}{c:>5}{r['rps']:>10.0f}{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}   "
                + (ratio if route == "predict" else "-")
            )
    print(json.dumps({f"{k[0]}@{k[1]}": v for k, v in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
