"""What an experiment costs /recommend: requests per second and memory with none, with an A/B experiment
whose second variant has a model of its own, and with an interleaved one (two lists per answer).

    python benchmarks/experiments_cost.py --artifacts DIR [--duration 8] [--rounds 2]

`dcmc serve --workers 2` on DIR (an ML-100K artifact) with a private Redis (appendfsync always), once per
configuration and round, the configurations alternating: wrk at concurrency 32 on GET /recommend/{a
uniformly random user}?k=10 for 3 s (a warm-up: the users' rows computed; its rate is reported as `cold`),
then `--duration` s (`warm`); then the resident memory of the two workers (VmRSS summed). Configurations:

- `none`: no DCMC_EXPERIMENTS;
- `aa`: an experiment whose two variants change nothing (what the experiment itself costs: assignment,
  the answer's labels, the impressions' distributions);
- `ab`: docker/experiments.toml as shipped (every user in it; `exact` against `inference.mode = none`,
  which is a second model in each worker);
- `artifact`: an A/B experiment whose second variant is another artifact (DIR again, loaded a second time:
  what a second artifact costs in memory);
- `interleave`: exact and the popular list interleaved (each answer ranks twice and merges).

The target (issue: experiments): an experiment keeps at least 90% of `none`'s warm requests per second
(`aa` measures it: `ab`'s second variant is cheaper than exact). Writes
benchmarks/results/experiments-cost.md and appends to experiments-cost.jsonl.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import harness as h
import numpy as np

INTERLEAVE = """
[[experiment]]
id = "mix"
salt = "cost"
method = "interleave"

[[experiment.variant]]
name = "exact"

[[experiment.variant]]
name = "popular"
ranking = { popular = true }
"""

AA = """
[[experiment]]
id = "aa"
salt = "cost"

[[experiment.variant]]
name = "a"

[[experiment.variant]]
name = "b"
"""

ARTIFACT = """
[[experiment]]
id = "two-artifacts"
salt = "cost"

[[experiment.variant]]
name = "served"

[[experiment.variant]]
name = "other"
artifact = "{artifact}"
"""


def worker_rss(pid: int) -> float:
    """VmRSS of the worker processes under the server `pid` (its children), MB summed."""
    total = 0.0
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        got = h.status_mb(int(child), "VmRSS")
        total += got["VmRSS"] if got else 0.0
    return total


def measure(artifacts: Path, files: dict[str, Path | None], duration: int, rounds: int) -> dict[str, Any]:
    out: dict[str, dict[str, list[float]]] = {name: {"cold": [], "warm": [], "rss_mb": []} for name in files}
    with tempfile.TemporaryDirectory() as tmp:
        script = h.lua_scripts(Path(tmp), artifacts, [])["recommend"]
        for _ in range(rounds):
            for name, path in files.items():
                env = {"DCMC_EXPERIMENTS": str(path)} if path is not None else {}
                with h.Redis() as redis:
                    svc = h.Service(artifacts, redis.url, "bench-exp", 2, Path(tmp) / f"{name}.log", env)
                    try:
                        svc.wait_ready()
                        out[name]["cold"].append(h.wrk(svc.url, "/", 32, 3, script, strict=True)["rps"])
                        out[name]["warm"].append(
                            h.wrk(svc.url, "/", 32, duration, script, strict=True)["rps"]
                        )
                        out[name]["rss_mb"].append(worker_rss(svc.proc.pid))
                    finally:
                        svc.stop()
                print(name, {k: v[-1] for k, v in out[name].items()}, flush=True)
    return {name: {k: [round(x, 1) for x in v] for k, v in figures.items()} for name, figures in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = h.parser(__doc__)
    p.add_argument("--artifacts", type=Path, required=True)
    p.add_argument("--duration", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--results", type=Path, default=h.RESULTS)
    args = p.parse_args(argv)
    started, began, git = h.stamp(), time.perf_counter(), h.commit()
    work = Path(tempfile.mkdtemp(prefix="dcmc-exp-cost-"))
    (work / "interleave.toml").write_text(INTERLEAVE)
    (work / "aa.toml").write_text(AA)
    (work / "artifact.toml").write_text(ARTIFACT.format(artifact=args.artifacts.resolve()))
    files = {
        "none": None,
        "aa": work / "aa.toml",
        "ab": h.REPO / "docker" / "experiments.toml",
        "artifact": work / "artifact.toml",
        "interleave": work / "interleave.toml",
    }
    figures = measure(args.artifacts, files, args.duration, args.rounds)
    base = float(np.mean(figures["none"]["warm"]))
    record = {
        "command": h.command("experiments_cost.py", argv),
        "started": started,
        "wall_s": round(time.perf_counter() - began),
        "machine": h.machine(),
        "git": git,
        "figures": figures,
        "share": {name: round(float(np.mean(f["warm"])) / base, 3) for name, f in figures.items()},
        "rss_extra_mb": {
            name: round(float(np.mean(f["rss_mb"])) - float(np.mean(figures["none"]["rss_mb"])), 1)
            for name, f in figures.items()
        },
    }
    h.append_jsonl(args.results / "experiments-cost.jsonl", record)
    m = record["machine"]
    lines = [
        "# What an experiment costs /recommend",
        "",
        f"- command: `{record['command']}` (started {started}, {record['wall_s']} s)",
        f"- machine: {m['nproc']} cores (`nproc`), {m['cpu']}",
        f"- commit: {h.describe_commit(git)}",
        "- `dcmc serve --workers 2`, a private Redis (appendfsync always), wrk -c32 on GET "
        "/recommend/{uniform random user}?k=10; each configuration a fresh service, alternating; cold: the "
        "first 3 s, warm: the next; memory: the two workers' VmRSS summed after the run.",
        "",
        "| configuration | cold req/s | warm req/s | share of `none` (warm) | workers' RSS, MB | "
        "more than `none` |",
        "|---|---|---|---|---|---|",
    ]
    for name, f in figures.items():
        cold, warm = (" / ".join(f"{x:.0f}" for x in f[part]) for part in ("cold", "warm"))
        share, rss, extra = record["share"][name], np.mean(f["rss_mb"]), record["rss_extra_mb"][name]
        lines.append(f"| {name} | {cold} | {warm} | {share:.3f} | {rss:.0f} | {extra:+.0f} |")
    lines += [
        "",
        f"Target: an experiment keeps at least 90% of `none`'s requests per second: `aa` "
        f"{record['share']['aa']:.1%} ({'met' if record['share']['aa'] >= 0.9 else '**not met**'}), `ab` "
        f"{record['share']['ab']:.1%} (its second variant is cheaper than exact).",
    ]
    h.write_report(args.results / "experiments-cost.md", lines)
    print(record["share"], record["rss_extra_mb"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
