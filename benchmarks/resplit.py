"""Generalisation beyond one test split: the full default pipeline against Surprise on random re-splits.

    python benchmarks/resplit.py [--datasets ...] [--seeds 0 1 2 3 4] [--jobs 2]

For each dataset and seed, the pooled ratings of its standard split are re-split at random with the same
test size (`dcmc train --split resample --split-seed S`). On each split: `dcmc train` with the default
preset (its schedule, then the automatic inference selection on validation ratings carved from the new
training part) and `dcmc evaluate` on the new test part, with the chosen inference and the base network
alone; Surprise `BaselineOnly` and `SVDpp` (defaults) fitted on the same training part, validation ratings
included, and scored on the same test part. Nothing is tuned on these splits. Results are appended to
benchmarks/results/resplit.jsonl as they finish (a run resumes) and summarised in resplit.md (mean +/- std).
"""

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import harness as h
import numpy as np

DATASETS = ("ml-100k", "douban", "flixster", "yahoo_music")


def dcmc(dataset: str, seed: int, data_dir: str, runs: Path) -> dict[str, Any]:
    """Train (default preset, automatic selection) and score one re-split."""
    out = runs / f"{dataset}-resample{seed}"
    cli = [sys.executable, "-m", "training.cli"]
    t0 = time.perf_counter()
    args = ["--dataset", dataset, "--data-dir", data_dir, "--out", str(out), "--split", "resample"]
    args += ["--split-seed", str(seed), "--seed", "0", "--threads", "1", "--no-progress"]
    train = h.run_json([*cli, "train", *args])
    seconds = time.perf_counter() - t0
    evaluate = [*cli, "evaluate", "--artifacts", str(out), "--data-dir", data_dir]
    tuned = h.run_json(evaluate)
    network = h.run_json([*evaluate, "--set", "inference.mode=none"])
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
    from surprise import BaselineOnly, SVDpp

    from training.data import load_dataset

    split = load_dataset(dataset, data_dir, split="resample", seed=seed)
    # val is None: DCMC carves its validation ratings from the training part
    scale = (float(split.levels[0]), float(split.levels[-1]))
    trainset, testset = h.surprise_data(split.train, split.test, split.user_ids, split.item_ids, scale)
    out: dict[str, Any] = {}
    for name, algo in (("baseline_only", BaselineOnly(verbose=False)), ("svdpp", SVDpp(random_state=seed))):
        t0 = time.perf_counter()
        algo.fit(trainset)
        out[name] = h.rmse(np.array([p.est for p in algo.test(testset)]), split.test.values)
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
        f"- command of the last invocation: `{command}` (each invocation runs the splits not yet in "
        f"resplit.jsonl and rebuilds this file from all of them); written {h.stamp()}",
        "- runs recorded at: " + ", ".join(f"`{c}`" for c in sorted({str(r.get("commit")) for r in records})),
        "- each split: the dataset's pooled standard split re-split at random (seeded) with the standard"
        " test size; DCMC = `dcmc train` default preset with the automatic inference selection, then"
        " `dcmc evaluate`; Surprise BaselineOnly and SVDpp with default settings on the same training part."
        " Nothing is tuned on these splits. Test RMSE, mean ± std over the splits.",
        "",
        *h.table(
            "| dataset | splits | DCMC (chosen inference) | DCMC network alone | BaselineOnly | SVDpp "
            "| DCMC < SVDpp in |"
        ),
    ]
    for ds in DATASETS:
        rs = sorted((r for r in records if r["dataset"] == ds), key=lambda r: r["seed"])
        if not rs:
            continue
        digits = 2 if ds == "yahoo_music" else 4

        def fmt(key: str, rs: list[dict[str, Any]] = rs, digits: int = digits) -> str:
            return h.mean_std([r[key] for r in rs], digits)

        wins = sum(r["dcmc"] < r["svdpp"] for r in rs)
        lines.append(
            f"| {ds} | {','.join(str(r['seed']) for r in rs)} | {fmt('dcmc')} | {fmt('dcmc_network')} | "
            f"{fmt('baseline_only')} | {fmt('svdpp')} | {wins} of {len(rs)} |"
        )
    lines += [
        "",
        "Per split:",
        "",
        *h.table("| dataset | seed | DCMC | network | BaselineOnly | SVDpp | chosen mode | train s |"),
    ]
    for r in sorted(records, key=lambda r: (DATASETS.index(r["dataset"]), r["seed"])):
        lines.append(
            f"| {r['dataset']} | {r['seed']} | {r['dcmc']:.4f} | {r['dcmc_network']:.4f} | "
            f"{r['baseline_only']:.4f} | {r['svdpp']:.4f} | {r['dcmc_mode']} | {r['train_seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = h.parser(__doc__)
    parser.add_argument("--data-dir", default=str(h.DATA_DIR))
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--runs", default=str(h.REPO / "runs" / "resplit"))
    parser.add_argument("--results", default=str(h.RESULTS / "resplit"), help="path stem of .jsonl and .md")
    args = parser.parse_args(argv)
    stem = Path(args.results)
    stem.parent.mkdir(parents=True, exist_ok=True)
    jsonl = stem.with_suffix(".jsonl")
    done = h.read_jsonl(jsonl)
    finished = {(r["dataset"], r["seed"]) for r in done}
    todo = [(d, s) for s in args.seeds for d in args.datasets if (d, s) not in finished]
    commit = h.commit()["commit"]
    print(f"{len(todo)} splits to run, {len(finished)} recorded in {jsonl}", flush=True)

    def run(job: tuple[str, int]) -> dict[str, Any]:
        record = {**one(job[0], job[1], args.data_dir, Path(args.runs)), "commit": commit}
        h.append_jsonl(jsonl, record)
        h.emit(record)
        return record

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        done += list(pool.map(run, todo))
    stem.with_suffix(".md").write_text(summarise(done, h.command("resplit.py", argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
