"""Is a dataset's test split like a random split of its ratings? Rating statistics only, no model.

Pools the training (and validation) and test ratings, then scores simple predictors fitted on the rest
of the pool on the real test split and on random splits of the same size: the global mean, each user's
mean and each item's mean (both shrunk towards the global mean by `--shrink` pseudo-ratings), and the
test ratings' mean. Prints one JSON line per statistic with the real value, the random splits' mean and
standard deviation, and the share of random splits at or above the real value. A test split in a far tail
is unlike the validation entries carved at random from the training ratings, so settings chosen on those
may not carry to it. Nothing here is used to choose a setting.

    python benchmarks/split_check.py --dataset flixster --data-dir ../shared/datasets
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from training.data import Entries, load_dataset

REPO = Path(__file__).resolve().parents[1]
STATISTICS = ("global_mean_rmse", "user_mean_rmse", "item_mean_rmse", "mean_rating")


def split_statistics(pool: Entries, is_test: np.ndarray, shrink: float) -> dict[str, float]:
    """The predictors' RMSE on the entries `is_test` marks, fitted on the others, and their mean rating."""
    rest, test = pool.take(~is_test), pool.take(is_test)
    n_users = int(pool.rows.max()) + 1
    n_items = int(pool.cols.max()) + 1
    g = float(rest.values.mean())

    def shrunk_means(index: np.ndarray, size: int, query: np.ndarray) -> np.ndarray:
        count = np.bincount(index, minlength=size)
        total = np.bincount(index, weights=rest.values, minlength=size)
        return (total[query] + shrink * g) / (count[query] + shrink)

    def rmse(pred: np.ndarray | float) -> float:
        return float(np.sqrt(np.mean((pred - test.values) ** 2)))

    return {
        "global_mean_rmse": rmse(g),
        "user_mean_rmse": rmse(shrunk_means(rest.rows, n_users, test.rows)),
        "item_mean_rmse": rmse(shrunk_means(rest.cols, n_items, test.cols)),
        "mean_rating": float(test.values.mean()),
    }


def main(argv: list[str] | None = None) -> int:
    """Print, per statistic, the real test split against random splits of the same size."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--data-dir", default=str(REPO.parent / "shared" / "datasets"))
    parser.add_argument("--split", default="u1")
    parser.add_argument("--splits", type=int, default=200, help="random splits to compare with")
    parser.add_argument("--shrink", type=float, default=5.0, help="pseudo-ratings of the global mean")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.splits < 2 or args.shrink < 0:
        parser.error("--splits must be at least 2 and --shrink non-negative")

    data = load_dataset(args.dataset, args.data_dir, split=args.split)
    parts = [data.train] + ([data.val] if data.val is not None else [])
    pool = Entries.concat([*parts, data.test])
    n_test = len(data.test)
    is_test = np.zeros(len(pool), dtype=bool)
    is_test[len(pool) - n_test :] = True
    real = split_statistics(pool, is_test, args.shrink)

    rng = np.random.default_rng(args.seed)
    draws = {name: [] for name in STATISTICS}
    for _ in tqdm(range(args.splits), desc="random splits", file=sys.stderr):
        mask = np.zeros(len(pool), dtype=bool)
        mask[rng.choice(len(pool), n_test, replace=False)] = True
        for name, value in split_statistics(pool, mask, args.shrink).items():
            draws[name].append(value)
    for name in STATISTICS:
        values = np.asarray(draws[name])
        out = {
            "dataset": data.name,
            "statistic": name,
            "n_test": n_test,
            "test_split": round(real[name], 4),
            "random_mean": round(float(values.mean()), 4),
            "random_std": round(float(values.std()), 4),
            "share_random_at_or_above": round(float(np.mean(values >= real[name])), 3),
        }
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
