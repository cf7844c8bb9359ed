"""Would a sharper similarity kernel let the mean-field beat the base network? A brute-force probe.

The learned kernel s(k, l) = s_r(i, i') s_c(j, j') is flat (s_r, s_c >= ~1/2 for most pairs), so a
normalized message is close to a global average. This probe replaces s by s^q (q = 1 is the model's
kernel) and computes, exactly and densely, the update of each validation entry attached to every known
entry clamped to its observed rating:

    Q_k = softmax(log P_k - gamma * sum_l w(k,l) C[y_l] / sum_l w(k,l)),   w = s^q,

then prints the validation RMSE for a grid of q and gamma (q = 0 would be the global average). It costs
O(|val| x |known|) and is a measurement, not an inference mode: s^q is only factorizable in
(d+1)^q dimensions, so a winner here would need a low-dimensional projection to serve in linear time.
Validation entries only (re-carved as `dcmc train` held them out).

    python benchmarks/kernel_probe.py --artifacts runs/experiments/ml-100k-u1-default-base-seed0
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from model.artifact import load_artifact  # noqa: E402
from model.engine import (  # noqa: E402
    compatibility_matrix,
    expected_rating,
    lift,
    nearest_level,
    softmax,
)
from model.scorers import load_network  # noqa: E402
from training.data import load_dataset  # noqa: E402
from training.evaluate import held_out, map_entries  # noqa: E402


def messages(
    s_rows: np.ndarray,
    s_cols: np.ndarray,
    q_rows: np.ndarray,
    q_cols: np.ndarray,
    k_rows: np.ndarray,
    k_cols: np.ndarray,
    k_targets: np.ndarray,
    powers: list[float],
    chunk: int = 256,
) -> dict[float, np.ndarray]:
    """Normalized messages sum_l s^q T_l / sum_l s^q to every query, for each power q: {q: (K, cols of T)}."""
    out = {q: np.empty((len(q_rows), k_targets.shape[1])) for q in powers}
    for start in range(0, len(q_rows), chunk):
        r, c = q_rows[start : start + chunk], q_cols[start : start + chunk]
        log_s = np.log(np.maximum(s_rows[np.ix_(r, k_rows)] * s_cols[np.ix_(c, k_cols)], 1e-300))
        log_s -= log_s.max(axis=1, keepdims=True)  # the normalization cancels any per-query factor
        for q in powers:
            w = np.exp(q * log_s)
            out[q][start : start + chunk] = (w @ k_targets) / w.sum(axis=1, keepdims=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--artifacts", required=True)
    parser.add_argument("--data-dir", default=str(REPO.parent / "shared" / "datasets"))
    parser.add_argument("--powers", nargs="+", type=float, default=[1, 4, 16, 64, 256])
    parser.add_argument("--gammas", nargs="+", type=float, default=[0.03, 0.1, 0.3, 1.0])
    parser.add_argument("--tau", type=float, help="truncation of the compatibility (default: the model's)")
    args = parser.parse_args(argv)

    art = load_artifact(args.artifacts)
    ds = art.meta["dataset"]
    split = load_dataset(ds["name"], args.data_dir, split=ds.get("split", "u1"), seed=ds.get("seed", 0))
    val = held_out(art, split, "val")
    rows, cols = map_entries(art, split.user_ids, split.item_ids, val)
    levels = art.levels
    compat = compatibility_matrix(levels, art.config.tau if args.tau is None else args.tau)
    scoring = load_network(art)
    a, b = lift(scoring.user_unit), lift(scoring.item_unit)  # lifted unit embeddings: s_r = a_i . a_i'
    s_rows, s_cols = a @ a.T, b @ b.T  # the model's scaled cosines s_r, s_c
    known_compat = compat[nearest_level(art.train.values, levels)]  # clamped known entries: C[y_l]
    probs = scoring.probabilities(rows, cols)

    def rmse_of(pred: np.ndarray) -> float:
        return float(np.sqrt(np.mean((pred - val.values) ** 2)))

    def rmse(p: np.ndarray) -> float:
        return rmse_of(expected_rating(p, levels))

    base = expected_rating(probs, levels)

    print(json.dumps({"dataset": ds["name"], "n_val": len(val), "none": round(rmse(probs), 4)}), flush=True)
    t0 = time.perf_counter()
    targets = np.hstack([known_compat, art.train.values[:, None]])  # C[y_l] and y_l
    msgs = messages(s_rows, s_cols, rows, cols, art.train.rows, art.train.cols, targets, args.powers)
    for q in args.powers:
        # The weighted mean of the known ratings alone: a kNN with the same weights, for reference.
        knn = msgs[q][:, -1]
        # ... and a linear blend with the base network's expected rating: an upper bound of sorts on what
        # the neighbours add to the network, whatever the combination rule.
        blends = {
            f"blend_{alpha}": round(rmse_of(alpha * base + (1 - alpha) * knn), 4)
            for alpha in (0.15, 0.3, 0.5, 0.7, 0.85)
        }
        print(json.dumps({"power": q, "weighted_mean_rmse": round(rmse_of(knn), 4), **blends}), flush=True)
        for gamma in args.gammas:
            refined = softmax(np.log(np.maximum(probs, 1e-30)) - gamma * msgs[q][:, :-1])
            print(json.dumps({"power": q, "gamma": gamma, "val_rmse": round(rmse(refined), 4)}), flush=True)
    print(json.dumps({"seconds": round(time.perf_counter() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
