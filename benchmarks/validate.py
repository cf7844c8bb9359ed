"""Choose defaults on validation data only: train with a schedule, report validation RMSE per inference mode.

The validation entries are the ones `dcmc train` carves from the training split (5%, seeded); the test
split is never read. Prints one JSON line per run; the defaults in training/config.py come from these.

    python benchmarks/validate.py --dataset ml-100k --epochs 100 --halve-every 25
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from model.artifact import load_artifact
from training.config import TUNING_VAL_FRACTION
from training.data import carve_validation, load_dataset
from training.evaluate import predict_ratings
from training.pipeline import run_training

REPO = Path(__file__).resolve().parents[1]
SUBSETS = ((32, 64), (16, 32), (64, 128))


def main(argv: list[str] | None = None) -> int:
    """Train once and print the validation RMSE of `none` and of `paper` at several subset sizes."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--data-dir", default=str(REPO.parent / "shared" / "datasets"))
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--halve-every", type=int, required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default=str(REPO / "runs" / "validate"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    settings = dict(s.split("=", 1) for s in args.set)
    settings["lr_halve_every"] = str(args.halve_every)
    settings.setdefault("val_fraction", str(TUNING_VAL_FRACTION))  # as the default preset
    out = Path(args.out) / f"{args.dataset}-{args.epochs}-{args.halve_every}"
    t0 = time.perf_counter()
    metrics = run_training(
        args.dataset, args.data_dir, out, epochs=args.epochs, settings=settings, progress=False
    )
    result: dict[str, object] = {
        "dataset": args.dataset,
        "epochs": args.epochs,
        "settings": settings,
        "train_seconds": round(time.perf_counter() - t0),
        "val_rmse_every_5_epochs": [round(r["val_rmse"], 4) for r in metrics["history"]][4::5],
    }
    data = load_dataset(args.dataset, args.data_dir)
    train_cfg = load_artifact(out).meta["train"]
    _, val = carve_validation(data.train, train_cfg["val_fraction"], train_cfg["seed"])
    art = load_artifact(out)
    for mode, subsets in [("none", [SUBSETS[0]]), ("paper", SUBSETS)]:
        for rows, cols in subsets:
            changes = {"mode": mode}
            if mode == "paper":
                changes.update({"paper.subset_rows": rows, "paper.subset_cols": cols})
            inference = art.inference.with_overrides(changes)
            pred = predict_ratings(art, val.rows, val.cols, inference, include_held_out=False)
            key = "val_rmse_none" if mode == "none" else f"val_rmse_paper_{rows}x{cols}"
            result[key] = round(float(np.sqrt(np.mean((pred - val.values) ** 2))), 4)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
