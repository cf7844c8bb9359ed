"""Compare test-time inference settings on validation entries only (never the test split).

Takes a trained artifact, re-carves the validation entries `dcmc train` held out (same fraction and
seed), and prints one JSON line per setting with its validation RMSE and evaluation time: the network
alone, `paper`, then every point of a grid over inference settings (names as in docs/inference.md).

    python benchmarks/validate_inference.py --artifacts runs/ml100k --data-dir ../shared/datasets \
        --grid mode=exact --grid kernel.known=clamped --grid crf.gamma=0.5,1,2 --grid kernel.co_rating=0,1e10
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np

from model.artifact import load_artifact
from model.config import ConfigError, setting_names
from model.engine import expected_rating
from model.scorers import artifact_scorer, predict_distributions
from training.data import carve_validation, load_dataset
from training.evaluate import held_out, map_entries

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    """Print the validation RMSE of `none`, `paper` and a grid of `exact` settings."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--artifacts", required=True)
    parser.add_argument("--data-dir", default=str(REPO.parent / "shared" / "datasets"))
    parser.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="NAME=V1,V2,...",
        help="an inference setting and the values to try (repeatable; the grid is their product); "
        f"names: {', '.join(setting_names())}",
    )
    parser.add_argument("--skip-paper", action="store_true")
    parser.add_argument(
        "--score-fraction",
        type=float,
        help="score only the entries a carve of this fraction (at most the artifact's, same seed) holds out: "
        "artifacts trained with different held-out fractions are then scored on the same ratings",
    )
    args = parser.parse_args(argv)

    art = load_artifact(args.artifacts)
    ds = art.meta["dataset"]
    data = load_dataset(ds["name"], args.data_dir, split=ds.get("split", "u1"), seed=ds.get("seed", 0))
    val = held_out(art, data, "val")
    if args.score_fraction is not None:
        train_cfg = art.meta["train"]
        if data.val is not None or not 0 < args.score_fraction <= train_cfg["val_fraction"]:
            parser.error(
                f"--score-fraction must lie in (0, {train_cfg['val_fraction']}], the artifact's held-out "
                "fraction, on a dataset without its own validation split"
            )
        val = carve_validation(data.train, args.score_fraction, int(train_cfg["seed"]))[1]
    rows, cols = map_entries(art, data.user_ids, data.item_ids, val)
    axes: list[list[tuple[str, str]]] = []
    for spec in args.grid:
        name, sep, values = spec.partition("=")
        if not sep or not values:
            parser.error(f"--grid expects NAME=V1,V2,..., got {spec!r}")
        axes.append([(name.removeprefix("inference."), v) for v in values.split(",")])
    settings: list[dict[str, str]] = [{"mode": "none"}] + ([] if args.skip_paper else [{"mode": "paper"}])
    settings += [dict(point) for point in itertools.product(*axes)] if axes else []
    for changes in settings:
        try:
            inference = art.inference.with_overrides(changes)
        except ConfigError as exc:
            parser.error(str(exc))
        t0 = time.perf_counter()
        # The validation ratings it scores are not known ratings.
        network, scorer = artifact_scorer(art, inference, include_held_out=False)
        pred = expected_rating(predict_distributions(network, scorer, rows, cols), art.levels)
        seconds = time.perf_counter() - t0
        rmse = float(np.sqrt(np.mean((pred - val.values) ** 2)))
        mae = float(np.mean(np.abs(pred - val.values)))
        out = {
            "dataset": ds["name"],
            "mode": inference.mode,
            **{k: v for k, v in changes.items() if k != "mode"},
            "val_rmse": round(rmse, 4),
            "val_mae": round(mae, 4),
            "n": len(pred),
        }
        print(json.dumps({**out, "seconds": round(seconds, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
