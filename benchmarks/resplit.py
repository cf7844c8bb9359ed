"""Generalisation beyond one test split: the full default pipeline against Surprise on random re-splits.

For each dataset and seed, the pooled ratings of its standard split are re-split at random with the same
test size (`dcmc train --split resample --split-seed S`). On each split:

- DCMC: `dcmc train` with the default preset (its schedule, then the automatic selection of the inference
  settings on the validation ratings carved from the new training part), then `dcmc evaluate` on the new
  test part, with the chosen inference and with the base network alone;
- Surprise `BaselineOnly` and `SVDpp` with their default settings, fitted on the same training part
  (DCMC's validation ratings included: DCMC knows them at test time too) and scored on the same test part.

Nothing is tuned on these splits: every setting is a default. Results are appended to
benchmarks/results/resplit.jsonl as they finish (an interrupted run resumes) and summarised in
resplit.md (mean +/- std over the splits).

    python benchmarks/resplit.py [--datasets ...] [--seeds 0 1 2 3 4] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from statistics import mean, stdev
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RESULTS = REPO / "benchmarks" / "results"
DATASETS = ("ml-100k", "douban", "flixster", "yahoo_music")


def _json_line(cmd: list[str]) -> dict[str, Any]:
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def dcmc(dataset: str, seed: int, data_dir: str, runs: Path) -> dict[str, Any]:
    """Train (default preset, automatic selection) and score one re-split."""
    out = runs / f"{dataset}-resample{seed}"
    cli = [sys.executable, "-m", "training.cli"]
    t0 = time.perf_counter()
    args = ["--dataset", dataset, "--data-dir", data_dir, "--out", str(out), "--split", "resample"]
    args += ["--split-seed", str(seed), "--seed", "0", "--threads", "1", "--no-progress"]
    train = _json_line([*cli, "train", *args])
    seconds = time.perf_counter() - t0
    evaluate = [*cli, "evaluate", "--artifacts", str(out), "--data-dir", data_dir]
    tuned = _json_line(evaluate)
    network = _json_line([*evaluate, "--set", "inference.mode=none"])
    return {
        "dcmc": tuned["rmse"],
        "dcmc_network": network["rmse"],
        "dcmc_mode": tuned["inference"],
        "n_test": tuned["n"],
        "train_seconds": round(seconds, 1),
        "tuning": train.get("tuning"),
    }


def surprise(dataset: str, seed: int, data_dir: str) -> dict[str, Any]:
    """Surprise BaselineOnly and SVDpp (defaults) on the same re-split."""
    from surprise import BaselineOnly, Dataset, Reader, SVDpp

    from training.data import load_dataset

    split = load_dataset(dataset, data_dir, split="resample", seed=seed)
    levels = split.levels
    reader = Reader(rating_scale=(float(levels[0]), float(levels[-1])))
    train = split.train  # val is None: DCMC carves its validation ratings from this part
    trainset = Dataset(reader).construct_trainset(
        [
            (split.user_ids[r], split.item_ids[c], float(v), None)
            for r, c, v in zip(train.rows.tolist(), train.cols.tolist(), train.values.tolist(), strict=True)
        ]
    )
    test = split.test
    testset = [
        (split.user_ids[r], split.item_ids[c], float(v))
        for r, c, v in zip(test.rows.tolist(), test.cols.tolist(), test.values.tolist(), strict=True)
    ]
    out: dict[str, Any] = {}
    for name, algo in (("baseline_only", BaselineOnly(verbose=False)), ("svdpp", SVDpp(random_state=seed))):
        t0 = time.perf_counter()
        algo.fit(trainset)
        est = np.array([p.est for p in algo.test(testset)])
        out[name] = float(np.sqrt(np.mean((est - test.values) ** 2)))
        out[f"{name}_seconds"] = round(time.perf_counter() - t0, 1)
    return out


def one(dataset: str, seed: int, data_dir: str, runs: Path) -> dict[str, Any]:
    return {
        "dataset": dataset,
        "seed": seed,
        **dcmc(dataset, seed, data_dir, runs),
        **surprise(dataset, seed, data_dir),
    }


def summarise(records: list[dict[str, Any]], command: str) -> str:
    lines = [
        "# Random re-splits: the default pipeline against Surprise",
        "",
        f"- command of the last invocation: `{command}` (each invocation runs the splits not yet in"
        " resplit.jsonl and rebuilds this file from all of them); written"
        f" {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        "- runs recorded at: " + ", ".join(f"`{c}`" for c in sorted({str(r.get("commit")) for r in records})),
        "- each split: the dataset's pooled standard split re-split at random (seeded) with the standard"
        " test size; DCMC = `dcmc train` default preset with the automatic inference selection, then"
        " `dcmc evaluate`; Surprise BaselineOnly and SVDpp with default settings on the same training part."
        " Nothing is tuned on these splits. Test RMSE, mean ± std over the splits.",
        "",
        "| dataset | splits | DCMC (chosen inference) | DCMC network alone | BaselineOnly | SVDpp "
        "| DCMC < SVDpp in |",
        "|---|---|---|---|---|---|---|",
    ]
    for ds in DATASETS:
        rs = sorted((r for r in records if r["dataset"] == ds), key=lambda r: r["seed"])
        if not rs:
            continue
        digits = 2 if ds == "yahoo_music" else 4

        def fmt(key: str, rs: list[dict[str, Any]] = rs, digits: int = digits) -> str:
            values = [r[key] for r in rs]
            return (
                f"{values[0]:.{digits}f}"
                if len(values) == 1
                else f"{mean(values):.{digits}f} ± {stdev(values):.{digits}f}"
            )

        wins = sum(r["dcmc"] < r["svdpp"] for r in rs)
        lines.append(
            f"| {ds} | {','.join(str(r['seed']) for r in rs)} | {fmt('dcmc')} | {fmt('dcmc_network')} | "
            f"{fmt('baseline_only')} | {fmt('svdpp')} | {wins} of {len(rs)} |"
        )
    lines += [
        "",
        "Per split:",
        "",
        "| dataset | seed | DCMC | network | BaselineOnly | SVDpp | chosen mode | train s |",
    ]
    lines += ["|---|---|---|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: (DATASETS.index(r["dataset"]), r["seed"])):
        lines.append(
            f"| {r['dataset']} | {r['seed']} | {r['dcmc']:.4f} | {r['dcmc_network']:.4f} | "
            f"{r['baseline_only']:.4f} | {r['svdpp']:.4f} | {r['dcmc_mode']} | {r['train_seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data-dir", default=str(REPO.parent / "shared" / "datasets"))
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--runs", default=str(REPO / "runs" / "resplit"))
    parser.add_argument("--results", default=str(RESULTS / "resplit"), help="path stem of .jsonl and .md")
    args = parser.parse_args(argv)
    stem = Path(args.results)
    stem.parent.mkdir(parents=True, exist_ok=True)
    jsonl = stem.with_suffix(".jsonl")
    done = [json.loads(x) for x in jsonl.read_text().splitlines() if x.strip()] if jsonl.exists() else []
    finished = {(r["dataset"], r["seed"]) for r in done}
    todo = [(d, s) for s in args.seeds for d in args.datasets if (d, s) not in finished]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    print(f"{len(todo)} splits to run, {len(finished)} recorded in {jsonl}", flush=True)

    def run(job: tuple[str, int]) -> dict[str, Any]:
        record = {**one(job[0], job[1], args.data_dir, Path(args.runs)), "commit": commit.stdout.strip()}
        with open(jsonl, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)
        return record

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        done += list(pool.map(run, todo))
    command = "python benchmarks/resplit.py " + " ".join(argv if argv is not None else sys.argv[1:])
    stem.with_suffix(".md").write_text(summarise(done, command.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
