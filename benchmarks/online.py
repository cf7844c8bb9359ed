"""Online ratings (POST /ratings) measured end to end: fold-in accuracy and cold start, freshness across
replicas, and the speed of writes next to reads.

    python benchmarks/online.py --accuracy --freshness --speed [--work /tmp/dcmc-online] [--duration 10]

Every part starts its own redis-server (harness.Redis: appendonly, fsync always) and real `dcmc serve`
processes; the shared Redis is not used.

1. --accuracy (ML-100K u1): a seeded 10% of the users with training ratings are held out of a csv dataset
   (test.csv = u1's test) trained with `dcmc train --dataset csv` and `--set` overrides that reproduce the
   `--base` artifact's training and inference. `dcmc serve` on it takes their training ratings through
   POST /ratings in u.data's timestamp order, in steps (their first 1, 2, 5, 10, 20, 50, then all); their
   u1 test ratings are scored through POST /predict after each step, against the model trained on
   everything (`--base`, Python API) and a bias-only fold-in mu + b_i + c_j. Nothing is tuned on the test.
2. --freshness: two `dcmc serve` (1 worker each) on one Redis; the time from A's 200 for a posted rating to
   B's /predict answer changing.
3. --speed: wrk against `dcmc serve --workers 2` on `--base`: /health (the floor), /predict with 100 items,
   GET /recommend/{user}?k=10 (when the route exists), POST /ratings with one random rating (conc. 1, 32).

Each part appends a record to benchmarks/results/online.jsonl; online.md (and online-cold-start.png) is
rebuilt from the latest record of each part. Needs `wrk`, `redis-server` and matplotlib (`experiments`).
"""

import sys
import tempfile
import time
from pathlib import Path

import harness as h
from online_accuracy import accuracy_section, part_accuracy, plot_cold_start, prepare
from online_serving import freshness_section, part_freshness, part_speed, speed_section

BASE = h.REPO.parent / "runs" / "base" / "ml-100k"
PARTS = ("accuracy", "freshness", "speed")


def report(results: Path, command: str) -> Path:
    """online.md (and the figure) from the latest record of each part in online.jsonl."""
    path = results / "online.jsonl"
    latest = {rec["part"]: rec for rec in h.read_jsonl(path)}  # the last record of each part
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
    return h.write_report(results / "online.md", lines)


def main(argv: list[str] | None = None) -> int:
    parser = h.parser(__doc__)
    parser.add_argument("--accuracy", action="store_true", help="part 1: fold-in accuracy and cold start")
    parser.add_argument("--freshness", action="store_true", help="part 2: replica freshness")
    parser.add_argument("--speed", action="store_true", help="part 3: wrk latencies and throughput")
    parser.add_argument("--report", action="store_true", help="only rebuild online.md from online.jsonl")
    parser.add_argument("--data-dir", default=str(h.DATA_DIR), help="holds ml-100k/u.data")
    parser.add_argument("--base", default=str(BASE), help="the ML-100K artifact trained on everything")
    work = "reduced dataset, reduced artifact and logs (outside the repository)"
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "dcmc-online"), help=work)
    parser.add_argument("--retrain", action="store_true", help="train the reduced model even if reusable")
    parser.add_argument("--train-only", action="store_true", help="part 1: prepare and train, then stop")
    parser.add_argument("--freshness-n", type=int, default=200, help="ratings posted (part 2)")
    parser.add_argument("--freshness-seconds", type=float, default=120, help="time bound of part 2")
    parser.add_argument("--duration", type=int, default=10, help="seconds per wrk run (part 3)")
    env = "a service setting for part 3's `dcmc serve` (e.g. DCMC_FOLD_IN_REFINE=new; repeatable)"
    parser.add_argument("--service-env", action="append", default=[], metavar="KEY=VALUE", help=env)
    parser.add_argument("--results", default=str(h.RESULTS))
    args = parser.parse_args(argv)
    command = h.command("online.py", argv)
    results = Path(args.results)
    chosen = [p for p in PARTS if getattr(args, p)]
    if not chosen and not args.report:
        parser.error("choose at least one of --accuracy, --freshness, --speed (or --report)")
    if args.train_only:
        h.emit({"step": "trained", **prepare(args)[-1]})
        return 0
    functions = {"accuracy": part_accuracy, "freshness": part_freshness, "speed": part_speed}
    for part in chosen:
        t0 = time.time()
        git_start = h.commit()
        record = functions[part](args)
        record.update(
            command=command,
            machine=h.machine(),
            git=h.commit(),
            git_start=git_start,
            started=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t0)),
            wall_s=round(time.time() - t0, 1),
        )
        h.append_jsonl(results / "online.jsonl", record)
        h.emit(record)
    print("report:", report(results, command), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
