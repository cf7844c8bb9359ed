"""What one fold-in batch costs a worker as the known ratings grow: in process, one BLAS thread.

    python benchmarks/fold_in_cost.py apply --artifacts DIR [--batch 10 500] [--batches 20]
        `FoldIn.apply` (model/online.py) on the artifact, as a worker folds in its stream: batches of
        random (known user, known item, random level) ratings, each batch timed (two warm-up batches
        first); the artifact's fold-in refine choice, as `dcmc serve` reads it.
    python benchmarks/fold_in_cost.py ratings --known 100000 8000000 [--batch 10 500] [--batches 40]
        `Ratings.changed` alone on a chain of changes (as the fold-in makes), on random ratings of a
        70,000 x 10,677 matrix (ml-10m's shape): each batch half re-ratings of known pairs, half new pairs.
    python benchmarks/fold_in_cost.py report

Each run appends its records to benchmarks/results/fold_in_cost.jsonl (with the commit of the code
measured: run it from a clean worktree, PYTHONPATH that worktree, to measure another commit); `report`
writes fold_in_cost.md from every record.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import harness as h
import numpy as np

RECORDS_NAME = "fold_in_cost.jsonl"
SHAPE = (70_000, 10_677)  # users x items of the `ratings` part's matrix


def _stats(seconds: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds) * 1e3
    return {
        "median_ms": round(float(np.median(ms)), 2),
        "p90_ms": round(float(np.percentile(ms, 90)), 2),
        "max_ms": round(float(ms.max()), 2),
    }


def part_apply(artifacts: Path, batches: list[int], count: int) -> list[dict[str, Any]]:
    from model.artifact import load_artifact
    from model.engine import OnnxNetwork
    from model.online import FoldIn
    from service.scoring import fold_in_refine
    from service.settings import Settings

    art = load_artifact(artifacts)
    onnx = OnnxNetwork(art.path)
    refine = fold_in_refine(art, Settings()) == "all"
    records = []
    for batch in batches:
        fold = FoldIn(art, art.inference, onnx.embed_users, onnx.embed_items, refine_trained=refine)
        rng = np.random.default_rng(batch)
        n, m = art.config.n_users, art.config.n_items
        levels = np.asarray(art.config.levels, dtype=np.float64)
        work = []
        for _ in range(count + 2):
            users, items, values = (
                rng.integers(0, n, batch),
                rng.integers(0, m, batch),
                rng.choice(levels, batch),
            )
            work.append(
                [
                    (art.users.external(int(u)), art.items.external(int(i)), float(v))
                    for u, i, v in zip(users, items, values, strict=True)
                ]
            )
        for ratings_batch in work[:2]:
            fold.apply(ratings_batch)
        seconds = []
        for ratings_batch in work[2:]:
            start = time.perf_counter()
            fold.apply(ratings_batch)
            seconds.append(time.perf_counter() - start)
        records.append(
            {
                "part": "apply",
                "artifacts": str(artifacts),
                "model": art.model_version,
                "known": len(fold.state.known),
                "users": fold.n_users,
                "items": len(fold.state.embedded),
                "refine_trained": refine,
                "batch": batch,
                "batches": count,
                **_stats(seconds),
            }
        )
        h.emit(records[-1])
    return records


def part_ratings(sizes: list[int], batches: list[int], count: int) -> list[dict[str, Any]]:
    from model.ratings import Ratings

    n, m = SHAPE
    records = []
    for size in sizes:
        for batch in batches:
            rng = np.random.default_rng(0)
            keys = np.unique(rng.integers(0, n * m, int(size * 1.01)))[:size]
            rng.shuffle(keys)
            known = Ratings(keys // m, keys % m, rng.integers(1, 6, size).astype(float), n, m)
            known.labels(np.arange(1.0, 6.0))  # carried forward, as the fold-in's are
            seconds = []
            for _ in range(count):
                held = known.by_row.members(rng.integers(0, n, batch // 2))[0]  # positions holding ratings
                at = np.unique(rng.choice(held, min(len(held), batch // 2), replace=False))
                users, items = rng.integers(0, n, batch - len(at)), rng.integers(0, m, batch - len(at))
                values, added = rng.integers(1, 6, len(at)).astype(float), rng.integers(1, 6, len(users))
                start = time.perf_counter()
                known = known.changed(at, values, users, items, added.astype(float), n, m)
                seconds.append(time.perf_counter() - start)
            records.append(
                {"part": "ratings", "known": size, "batch": batch, "batches": count, **_stats(seconds)}
            )
            h.emit(records[-1])
    return records


def report(results: Path) -> Path:
    records = h.read_jsonl(results / RECORDS_NAME)
    lines = [
        "# Fold-in cost per batch",
        "",
        f"Written by `python benchmarks/fold_in_cost.py report` from `{RECORDS_NAME}` (every record). In "
        "process, one BLAS thread (`OMP_NUM_THREADS=1`); the first batch of a chain (which copies the "
        "arrays into their growable stores) is among the warm-up batches of `apply`, and in the max of "
        "`ratings`.",
        "",
        "## `FoldIn.apply`: random ratings of known users and items",
        "",
        "| when | commit | artifact | known ratings | users x items | refine trained | batch | median ms "
        "| p90 ms | max ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if r["part"] == "apply":
            lines.append(
                f"| {r['when']} | `{r['commit']}` | `{Path(r['artifacts']).name}` (model `{r['model']}`) | "
                f"{r['known']:,} | "
                f"{r['users']:,} x {r['items']:,} | {r['refine_trained']} | {r['batch']} | "
                f"{r['median_ms']} | {r['p90_ms']} | {r['max_ms']} |"
            )
    lines += [
        "",
        "## `Ratings.changed` alone: a chain of changes, half re-ratings, on a 70,000 x 10,677 matrix",
        "",
        "| when | commit | known ratings | batch | batches | median ms | p90 ms | max ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if r["part"] == "ratings":
            lines.append(
                f"| {r['when']} | `{r['commit']}` | {r['known']:,} | {r['batch']} | {r['batches']} | "
                f"{r['median_ms']} | {r['p90_ms']} | {r['max_ms']} |"
            )
    return h.write_report(results / "fold_in_cost.md", lines)


def main(argv: list[str] | None = None) -> int:
    parser = h.parser(__doc__)
    parser.add_argument("part", choices=["apply", "ratings", "report"])
    parser.add_argument("--artifacts", type=Path, help="the artifact (part `apply`)")
    parser.add_argument("--known", type=int, nargs="+", default=[100_000, 8_000_000])
    parser.add_argument("--batch", type=int, nargs="+", default=[10, 500])
    parser.add_argument("--batches", type=int, default=None, help="timed batches (20 apply, 40 ratings)")
    parser.add_argument("--results", type=Path, default=h.RESULTS)
    args = parser.parse_args(argv)
    if args.part == "report":
        print("report:", report(args.results))
        return 0
    code = h.commit_label("model", "service", "benchmarks/fold_in_cost.py")
    if args.part == "apply":
        if args.artifacts is None:
            parser.error("apply needs --artifacts")
        records = part_apply(args.artifacts, args.batch, args.batches or 20)
    else:
        records = part_ratings(args.known, args.batch, args.batches or 40)
    when = datetime.now(timezone.utc).isoformat(timespec="minutes")
    command = h.command("fold_in_cost.py", argv)
    for r in records:
        h.append_jsonl(args.results / RECORDS_NAME, {"when": when, "commit": code, "command": command, **r})
    print("report:", report(args.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
