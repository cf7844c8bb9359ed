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
from model.engine import expected_rating, predict_entries
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
    parser.add_argument("--gammas", nargs="+", type=float, default=[0.05, 0.2, 0.5, 1.0, 2.0])
    parser.add_argument("--scalings", nargs="+", default=["sum", "scaled", "normalized"])
    parser.add_argument("--known", nargs="+", default=["predicted", "clamped"])
    parser.add_argument(
        "--taus", nargs="+", type=float, help="exact: compatibility truncations (default: the model's)"
    )
    for flag, default, what in (
        ("--same-user", 0.0, "same-user term weights"),
        ("--same-item", 0.0, "same-item term weights"),
        ("--co-rating", 0.0, "co-rating term weights"),
        ("--co-rating-powers", 2.0, "co-rating exponents q"),
        ("--co-rating-user", 0.0, "user-based co-rating weights"),
        ("--co-rating-shrinks", 10.0, "co-rating shrinkages s"),
        ("--co-rating-priors", 0.0, "co-rating pseudo-counts c"),
        ("--baselines", 0.0, "weights w of the bias baseline"),
        ("--baseline-user-shrinks", 2.0, "ridge penalties of the baseline's user biases"),
        ("--baseline-item-shrinks", 5.0, "ridge penalties of the baseline's item biases"),
    ):
        parser.add_argument(flag, nargs="+", type=float, default=[default], help=f"exact: {what}")
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
    # One model whose caches (known fields, partitions) serve every setting; the validation ratings it
    # scores are not known ratings.
    model = art.scoring_model(include_held_out=False)
    settings: list[dict[str, object]] = [{"mode": "none"}] + ([] if args.skip_paper else [{"mode": "paper"}])
    grid = itertools.product(
        args.scalings,
        args.known,
        args.taus or [None],
        args.same_user,
        args.same_item,
        args.co_rating,
        args.co_rating_user,
        args.co_rating_powers,
        args.co_rating_priors,
        args.co_rating_shrinks,
        args.gammas,
        args.baselines,
        args.baseline_user_shrinks,
        args.baseline_item_shrinks,
    )
    for (
        scaling,
        known,
        tau,
        same_user,
        same_item,
        co_rating,
        co_user,
        power,
        prior,
        shrink,
        gamma,
        baseline,
        user_shrink,
        item_shrink,
    ) in grid:
        exact: dict[str, object] = {"mode": "exact", "scaling": scaling, "known": known, "gamma": gamma}
        exact.update(baseline=baseline, baseline_user_shrink=user_shrink, baseline_item_shrink=item_shrink)
        if tau is not None:
            exact["tau"] = tau
        if same_user or same_item:
            exact.update(same_user=same_user, same_item=same_item)
        if co_rating or co_user:
            exact.update(co_rating=co_rating, co_rating_user=co_user, co_rating_power=power)
            exact.update(co_rating_prior=prior, co_rating_shrink=shrink)
        settings.append(exact)
    for changes in settings:
        inference = replace(art.inference, **changes)
        t0 = time.perf_counter()
        pred = expected_rating(predict_entries(model, rows, cols, inference), art.levels)
        seconds = time.perf_counter() - t0
        rmse = float(np.sqrt(np.mean((pred - val.values) ** 2)))
        mae = float(np.mean(np.abs(pred - val.values)))
        out = {
            "dataset": ds["name"],
            **changes,
            "val_rmse": round(rmse, 4),
            "val_mae": round(mae, 4),
            "n": len(pred),
        }
        print(json.dumps({**out, "seconds": round(seconds, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
