"""Compare test-time inference settings on validation entries only (never the test split).

Takes a trained artifact, re-carves the validation entries `dcmc train` held out (same fraction and
seed), and prints one JSON line per setting with its validation RMSE and evaluation time.

    python benchmarks/validate_inference.py --artifacts runs/ml100k --data-dir ../shared/datasets
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from model.artifact import load_artifact
from training.data import carve_validation, load_dataset
from training.evaluate import predict_ratings

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    """Print the validation RMSE of `none`, `paper` and a grid of `exact` settings."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--artifacts", required=True)
    parser.add_argument("--data-dir", default=str(REPO.parent / "shared" / "datasets"))
    parser.add_argument("--gammas", nargs="+", type=float, default=[0.05, 0.2, 0.5, 1.0, 2.0])
    parser.add_argument("--scalings", nargs="+", default=["sum", "scaled", "normalized"])
    parser.add_argument("--known", nargs="+", default=["predicted", "clamped"])
    parser.add_argument("--skip-paper", action="store_true")
    args = parser.parse_args(argv)

    art = load_artifact(args.artifacts)
    ds, train_cfg = art.meta["dataset"], art.meta["train"]
    data = load_dataset(ds["name"], args.data_dir, split=ds.get("split", "u1"), seed=ds.get("seed", 0))
    if data.val is not None:
        val = data.val
    else:
        _, val = carve_validation(data.train, train_cfg["val_fraction"], train_cfg["seed"])
    settings = [{"mode": "none"}] + ([] if args.skip_paper else [{"mode": "paper"}])
    for scaling, known, gamma in itertools.product(args.scalings, args.known, args.gammas):
        settings.append({"mode": "exact", "scaling": scaling, "known": known, "gamma": gamma})
    for changes in settings:
        inference = replace(art.inference, **changes)
        t0 = time.perf_counter()
        pred = predict_ratings(art, val.rows, val.cols, inference)
        seconds = time.perf_counter() - t0
        rmse = float(np.sqrt(np.mean((pred - val.values) ** 2)))
        mae = float(np.mean(np.abs(pred - val.values)))
        out = {"dataset": ds["name"], **changes, "val_rmse": round(rmse, 4), "val_mae": round(mae, 4)}
        print(json.dumps({**out, "seconds": round(seconds, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
