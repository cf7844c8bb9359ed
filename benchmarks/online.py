"""Online ratings (POST /ratings) measured end to end: fold-in accuracy and cold start, freshness across
replicas, and the speed of writes next to reads.

    python benchmarks/online.py --accuracy --freshness --speed [--work /tmp/dcmc-online] [--duration 10]

Every part starts its own redis-server (a free port, a temporary directory, `--appendonly yes
--appendfsync always`, stopped by its pid) and real `dcmc serve` processes; the shared Redis is not used.

1. --accuracy (ML-100K u1). A seeded 10% of the users with training ratings (seed 0) are held out: a csv
   dataset whose train.csv lacks every u1 training rating of theirs (test.csv = u1's test) is trained with
   `dcmc train --dataset csv` and the `--set` overrides that reproduce the ml-100k `default` preset's
   training and inference. `dcmc serve` on it takes the held-out users' training ratings through
   POST /ratings, in u.data's timestamp order, in steps (their first 1, 2, 5, 10, 20, 50, then all), and
   their u1 test ratings are scored through POST /predict after each step. Compared on the same test
   entries with the model trained on everything (`--base`, scored with the Python API) and with a
   bias-only fold-in mu + b_i + c_j. The test split only reports this comparison; nothing is tuned on it.
2. --freshness: two `dcmc serve` (1 worker each) on one Redis; a rating POSTed to A, B's /predict polled
   until its answer changes; the time from A's 200 to B's changed answer.
3. --speed: wrk against `dcmc serve --workers 2` on `--base`: /health (the floor), /predict with 100 items,
   GET /recommend/{user}?k=10 (when the route exists), POST /ratings with one random rating (conc. 1, 32).

Each part appends one JSON record to benchmarks/results/online.jsonl (and prints JSON lines); the report
benchmarks/results/online.md (and online-cold-start.png) is rebuilt from the latest record of each part.
Needs `wrk`, `redis-server` and matplotlib (the `experiments` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, commit, emit, machine, write_report
from online_accuracy import (
    accuracy_section,
    artifact_overrides,
    part_accuracy,
    plot_cold_start,
    select_users,
    train_reduced,
    write_dataset,
)
from online_serving import freshness_section, part_freshness, part_speed, speed_section

RESULTS = REPO / "benchmarks" / "results"
DATA_DIR = REPO.parent / "shared" / "datasets"
BASE = REPO.parent / "runs" / "base" / "ml-100k"
PARTS = ("accuracy", "freshness", "speed")


def report(results: Path, command: str) -> Path:
    """online.md (and the figure) from the latest record of each part in online.jsonl."""
    latest: dict[str, dict[str, Any]] = {}
    path = results / "online.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                latest[rec["part"]] = rec
    lines = [
        "# Online ratings: fold-in accuracy, freshness, speed",
        "",
        "Measured by `benchmarks/online.py` (each section from the latest run of its part, in "
        f"`{path.name}`; report rebuilt by `{command}`). Every part runs its own redis-server with "
        "`--appendonly yes --appendfsync always` and real `dcmc serve` processes.",
        "",
    ]
    if "accuracy" in latest:
        figure = plot_cold_start(latest["accuracy"], results / "online-cold-start.png")
        lines += accuracy_section(latest["accuracy"], figure)
    if "freshness" in latest:
        lines += freshness_section(latest["freshness"])
    if "speed" in latest:
        lines += speed_section(latest["speed"])
    return write_report(results / "online.md", lines)


# -- main ----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--accuracy", action="store_true", help="part 1: fold-in accuracy and cold start")
    parser.add_argument("--freshness", action="store_true", help="part 2: replica freshness")
    parser.add_argument("--speed", action="store_true", help="part 3: wrk latencies and throughput")
    parser.add_argument("--report", action="store_true", help="only rebuild online.md from online.jsonl")
    parser.add_argument("--data-dir", default=str(DATA_DIR), help="holds ml-100k/u.data")
    parser.add_argument("--base", default=str(BASE), help="the ML-100K artifact trained on everything")
    parser.add_argument(
        "--work",
        default=str(Path(tempfile.gettempdir()) / "dcmc-online"),
        help="reduced dataset, reduced artifact and logs (outside the repository)",
    )
    parser.add_argument("--retrain", action="store_true", help="train the reduced model even if reusable")
    parser.add_argument("--train-only", action="store_true", help="part 1: prepare and train, then stop")
    parser.add_argument("--freshness-n", type=int, default=200, help="ratings posted (part 2)")
    parser.add_argument("--freshness-seconds", type=float, default=120, help="time bound of part 2")
    parser.add_argument("--duration", type=int, default=10, help="seconds per wrk run (part 3)")
    parser.add_argument(
        "--service-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a service setting for part 3's `dcmc serve` (e.g. DCMC_FOLD_IN_REFINE=new; repeatable)",
    )
    parser.add_argument("--results", default=str(RESULTS))
    args = parser.parse_args(argv)
    command = "python benchmarks/online.py " + " ".join(argv if argv is not None else sys.argv[1:])
    results = Path(args.results)
    chosen = [p for p in PARTS if getattr(args, p)]
    if not chosen and not args.report:
        parser.error("choose at least one of --accuracy, --freshness, --speed (or --report)")
    if args.train_only:
        from training.config import TrainConfig, preset
        from training.data import load_dataset

        split = load_dataset("ml-100k", args.data_dir, split="u1")
        held = select_users(split.train.rows)
        work = Path(args.work)
        write_dataset(work / "data", split, held)
        overrides = artifact_overrides(Path(args.base), preset("csv"), TrainConfig)
        emit({"step": "trained", **train_reduced(work / "data", work / "reduced", overrides, args.retrain)})
        return 0
    functions = {"accuracy": part_accuracy, "freshness": part_freshness, "speed": part_speed}
    for part in chosen:
        t0 = time.time()
        git_start = commit()
        record = functions[part](args)
        record.update(
            command=command,
            machine=machine(),
            git=commit(),
            git_start=git_start,
            started=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t0)),
            wall_s=round(time.time() - t0, 1),
        )
        results.mkdir(parents=True, exist_ok=True)
        with (results / "online.jsonl").open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        emit(record)
    print("report:", report(results, command), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
