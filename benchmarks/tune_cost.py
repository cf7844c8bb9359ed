"""What the automatic selection of the inference settings costs, against the training it follows.

    python benchmarks/tune_cost.py --artifacts DIR [DIR ...] [--trials 100]

For each artifact (written by `dcmc train`, which already searched once): a copy in a temporary directory
is searched again with this checkout's code (`training.tune.tune_artifact`, the same trials and seed as
`dcmc train`), timed, and compared with the artifact's own record: the same best trial and validation RMSE
(the search is deterministic, so a faster implementation must choose the same settings), and the seconds
against the training's own (`metrics.json` `train_seconds`, the network's training without the search).
Writes benchmarks/results/tune_cost.md and appends to tune_cost.jsonl. Reads no test ratings: the search
reads the artifact alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from loadgen import commit_label  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"


def measure(artifact: Path, trials: int) -> dict[str, Any]:
    """Search a copy of `artifact` again; the time, the choice, and the artifact's own record."""
    from training.tune import TUNING, tune_artifact

    before = json.loads((artifact / TUNING).read_text())
    train_seconds = json.loads((artifact / "metrics.json").read_text())["train_seconds"]
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(shutil.copytree(artifact, Path(tmp) / artifact.name))
        t0 = time.perf_counter()
        tuning = tune_artifact(copy, trials=trials, seed=before["seed"], progress=False)
        total = time.perf_counter() - t0
    record = tuning.record
    return {
        "artifact": str(artifact),
        "dataset": json.loads((artifact / "config.json").read_text()).get("dataset", artifact.name),
        "trials": record["trials_run"],
        "search_s": record["seconds"],
        "with_write_s": round(total, 2),
        "train_s": train_seconds,
        "share": record["seconds"] / train_seconds,
        "best_trial": record["best_trial"],
        "best_val_rmse": record["best_val_rmse"],
        "recorded_search_s": before["seconds"],
        "recorded_best_trial": before["best_trial"],
        "recorded_best_val_rmse": before["best_val_rmse"],
        "same_choice": record["best_trial"] == before["best_trial"]
        and abs(record["best_val_rmse"] - before["best_val_rmse"]) < 1e-9,
    }


def report(records: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# The automatic selection's cost against training",
        "",
        f"- command: `{meta['command']}` at `{meta['commit']}`; {meta['machine']}; written {meta['written']}",
        "- each artifact searched again (a copy) with this code: trials and seed of its own record;"
        " `search s` = the search (`tuning.json` seconds), `+ write s` = with rewriting the artifact"
        " (the known field over every known rating); `train s` = the network's training"
        " (`metrics.json`), without the search, as that run measured it (benchmarks/resplit.py runs two"
        " side by side, so its training may have been slower than alone, and the share against a run"
        " alone higher)",
        "",
        "| artifact | trials | search s | + write s | train s | search / train | recorded search s "
        "| same choice (trial, val RMSE) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| `{r['artifact']}` | {r['trials']} | {r['search_s']:.1f} | {r['with_write_s']:.1f} | "
            f"{r['train_s']:.0f} | {r['share']:.0%} | {r['recorded_search_s']:.1f} | "
            f"{'yes' if r['same_choice'] else 'NO'} ({r['best_trial']}, {r['best_val_rmse']:.5f}) |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--artifacts", nargs="+", required=True, type=Path)
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--results", type=Path, default=RESULTS / "tune_cost", help="path stem of .md/.jsonl")
    args = parser.parse_args(argv)
    records = []
    for artifact in args.artifacts:
        records.append(measure(artifact, args.trials))
        print(json.dumps(records[-1]), flush=True)
    meta = {
        "command": "python benchmarks/tune_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": commit_label("model", "training"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}",
        "written": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    text = report(records, meta)
    print(text)
    stem = args.results
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text(text)
    with open(stem.with_suffix(".jsonl"), "a") as f:
        for r in records:
            f.write(json.dumps({**r, **meta}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
