"""Choose the default validation share on validation data: how many training ratings to hold out for the
automatic selection of the inference settings (training/tune.py).

Holding out more ratings gives the search more queries (less noise in what it picks) and the network
fewer ratings to train on. Both effects are measured on ML-100K u1 without touching its test split:

1. an outer validation set, a seeded 5% of u1.base (4,000 ratings), is set aside; the rest of u1.base is
   the training pool;
2. `shares`: for each share s, the default pipeline (`dcmc train` with the ML-100K default schedule, then
   the search with its default trials) runs on the pool with `val_fraction=s`, and the outer set is
   scored: the tuned inference, the base network alone, and the search's starting point;
3. `noise`: on the largest share's artifact, the search is rerun on random subsets of its validation
   ratings (the sizes the smaller shares would give), several draws each, and the outer RMSE of each
   choice is scored: the spread is what the search's own noise costs at that size.

Writes benchmarks/results/val_share.md and val_share.json. u1.test is not read.

    python benchmarks/val_share.py [--shares 0.01 0.025 0.05 0.1] [--draws 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from model.artifact import load_artifact  # noqa: E402
from model.ratings import Ratings  # noqa: E402
from training.data import load_dataset  # noqa: E402
from training.evaluate import evaluate  # noqa: E402
from training.pipeline import run_training  # noqa: E402
from training.synthetic import write_csv  # noqa: E402
from training.tune import DEFAULT_TRIALS, START, settings_of, tune, units  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
ML100K_SCHEDULE = {"epochs": "100", "lr_halve_every": "25", "beta": "0.0", "input_dropout": "0.1"}
"""The ML-100K default preset's training settings, for the `csv` reader of the same ratings."""


def prepare(data_dir: Path, work: Path, outer_share: float = 0.05, seed: int = 0) -> Path:
    """train.csv (the pool) and test.csv (the outer validation set) carved from u1's training ratings."""
    split = load_dataset("ml-100k", data_dir, split="u1")
    train = split.train
    rng = np.random.default_rng(seed)
    outer = rng.random(len(train)) < outer_share
    out = work / "data"
    triples = [
        (split.user_ids[r], split.item_ids[c], float(v))
        for r, c, v in zip(train.rows.tolist(), train.cols.tolist(), train.values.tolist(), strict=True)
    ]
    write_csv(out / "train.csv", [t for t, o in zip(triples, outer, strict=True) if not o])
    write_csv(out / "test.csv", [t for t, o in zip(triples, outer, strict=True) if o])
    return out


def flat(inference: dict[str, Any]) -> dict[str, Any]:
    """Dotted overrides of a nested `exact` (or `none`) inference dict: the groups that mode reads."""
    out: dict[str, Any] = {"mode": inference["mode"]}
    if inference["mode"] == "exact":
        for group in ("crf", "kernel", "output"):
            out.update({f"{group}.{k}": v for k, v in inference[group].items()})
    return out


def reused(out: Path) -> dict[str, Any]:
    """The training metrics `run_training` returned for an artifact written earlier."""
    art = load_artifact(out)
    trained = json.loads((out / "metrics.json").read_text())
    record = json.loads((out / "tuning.json").read_text())
    tuning = {
        "mode": record["chosen"]["mode"],
        "trials": record["trials_run"],
        "seconds": record["seconds"],
        "best_val_rmse": record["best_val_rmse"],
        "base_network_val_rmse": record["base_network_val_rmse"],
    }
    return {"n_val": len(art.held_out), "n_train": len(art.train), "train_seconds": trained["train_seconds"],
            "tuning": tuning, "reused": True}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data-dir", default=str(REPO.parent / "shared" / "datasets"))
    parser.add_argument("--work", default="/tmp/dcmc-val-share")
    parser.add_argument("--shares", nargs="+", type=float, default=[0.01, 0.025, 0.05, 0.1])
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--trials", type=int, default=DEFAULT_TRIALS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--reuse", action="store_true", help="keep the artifacts (and their searches) of an earlier run"
    )
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    data = prepare(Path(args.data_dir), work)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True)
    report: dict[str, Any] = {
        "command": "python benchmarks/val_share.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": head.stdout.strip() + (" (dirty)" if dirty.stdout.strip() else ""),
        "started": started,
        "shares": [],
        "noise": [],
    }
    artifacts: dict[float, Path] = {}
    for share in args.shares:
        out = work / f"share-{share:g}"
        settings = {**ML100K_SCHEDULE, "val_fraction": str(share)}
        if args.reuse and (out / "tuning.json").is_file():
            metrics = reused(out)
        else:
            metrics = run_training(
                "csv", data, out, split="u1", preset_name="default", settings=settings, progress=False,
                tune_trials=args.trials,
            )  # fmt: skip
        artifacts[share] = out
        row = {
            "share": share,
            "n_val": metrics["n_val"],
            "n_train": metrics["n_train"],
            "train_seconds": metrics["train_seconds"],
            "tuning": metrics["tuning"],
            "outer_tuned": evaluate(out, data)["rmse"],
            "outer_network": evaluate(out, data, overrides={"mode": "none"})["rmse"],
        }
        art = load_artifact(out)
        start = settings_of(START, units(art.levels, art.config.n_users, art.config.n_items))
        row["outer_start"] = evaluate(out, data, overrides=start)["rmse"]
        report["shares"].append(row)
        print(json.dumps(row), flush=True)
    largest = artifacts[max(args.shares)]
    art = load_artifact(largest)
    val = art.held_out
    for share in args.shares:
        size = round(share / max(args.shares) * len(val))
        for draw in range(args.draws if size < len(val) else 1):
            pick = np.sort(np.random.default_rng(100 + draw).choice(len(val), size=size, replace=False))
            subset = Ratings(val.rows[pick], val.cols[pick], val.values[pick], val.n_users, val.n_items)
            result = tune(dataclasses.replace(art, held_out=subset), trials=args.trials, progress=False)
            outer = evaluate(largest, data, overrides=flat(result.chosen.to_dict()))["rmse"]
            row = {"share_equivalent": share, "n_queries": size, "draw": draw, "outer": outer,
                   "val_rmse": result.record["best_val_rmse"], "mode": result.chosen.mode}  # fmt: skip
            report["noise"].append(row)
            print(json.dumps(row), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "val_share.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "val_share.md").write_text(markdown(report))
    return 0


def markdown(r: dict[str, Any]) -> str:
    lines = [
        "# Validation share for the automatic inference selection (ML-100K u1, outer validation set)",
        "",
        f"- command: `{r['command']}` (started {r['started']}, commit `{r['commit']}`)",
        "- outer set: a seeded 5% of u1.base; the pool: the other 95%; u1.test is not read.",
        "",
        "## 1. The whole pipeline per share (train on the pool less the share, search, score the outer set)",
        "",
        "| share | validation ratings | training ratings | train s | search s | outer RMSE tuned "
        "| network alone | search start |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in r["shares"]:
        t = s["tuning"]
        lines.append(
            f"| {s['share']:g} | {s['n_val']} | {s['n_train']} | {s['train_seconds']:.0f} | "
            f"{t.get('seconds', float('nan')):.1f} | {s['outer_tuned']:.4f} | {s['outer_network']:.4f} | "
            f"{s['outer_start']:.4f} |"
        )
    lines += [
        "",
        "## 2. The search's own noise: searches on subsets of the largest share's validation ratings",
        "",
        "| as with share | queries | draws | outer RMSE of the choice (each draw) | mean |",
        "|---|---|---|---|---|",
    ]
    by: dict[float, list[dict[str, Any]]] = {}
    for row in r["noise"]:
        by.setdefault(row["share_equivalent"], []).append(row)
    for share, rows in by.items():
        values = [x["outer"] for x in rows]
        lines.append(
            f"| {share:g} | {rows[0]['n_queries']} | {len(rows)} | {', '.join(f'{v:.4f}' for v in values)} | "
            f"{np.mean(values):.4f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
