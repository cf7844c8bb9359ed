"""Probe (validation only): should the online fold-in refine the embeddings of users the network was
trained on, or only those of new users?

For every trained user with at least 2 validation ratings (the artifact's held_out_ratings.npz, carved
from the training split, never trained on), a seeded half of them arrives online (A) and the rest is
scored (B). The fold-in starts from the artifact without any validation rating known, takes A in batches,
and B is scored by the served inference (the exact CRF): once with every touched user refined (today),
once with only new users refined. Also timed: the fold-in of A. The test split is not read.

    python benchmarks/fold_in_policy.py --artifacts DIR [--batch 100] [--seed 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.artifact import load_artifact  # noqa: E402
from model.engine import OnnxNetwork, expected_rating  # noqa: E402
from model.exact import ExactScorer  # noqa: E402
from model.online import FoldIn  # noqa: E402
from model.ratings import Ratings  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--artifacts", required=True)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    art = load_artifact(args.artifacts)
    held = art.held_out
    rng = np.random.default_rng(args.seed)
    a_pos, b_pos = [], []
    for user in range(art.config.n_users):
        pos = held.by_row.of(user)
        if len(pos) < 2:
            continue
        pos = rng.permutation(pos)
        half = len(pos) // 2
        a_pos.append(pos[:half])
        b_pos.append(pos[half:])
    a, b = np.concatenate(a_pos), np.concatenate(b_pos)
    order = rng.permutation(len(a))  # A arrives in a random order, in batches
    a = a[order]
    empty = Ratings(np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0), held.n_users, held.n_items)
    base = dataclasses.replace(art, held_out=empty, known_field=None)
    onnx = OnnxNetwork(art.files)
    levels = art.levels
    out = {"artifact": str(args.artifacts), "online": int(len(a)), "scored": int(len(b)), "batch": args.batch}

    def score(fold: FoldIn) -> float:
        state = fold.state
        assert isinstance(state.scorer, ExactScorer)
        dist = state.scorer.predict(held.rows[b], held.cols[b])
        pred = np.clip(expected_rating(dist, levels), levels[0], levels[-1])
        return float(np.sqrt(np.mean((pred - held.values[b]) ** 2)))

    fold = FoldIn(base, art.inference, onnx.embed_users, onnx.embed_items)
    out["rmse_before_fold_in"] = score(fold)
    for refine_trained in (True, False):
        fold = FoldIn(base, art.inference, onnx.embed_users, onnx.embed_items, refine_trained=refine_trained)
        started = time.perf_counter()
        for k in range(0, len(a), args.batch):
            pos = a[k : k + args.batch]
            fold.apply(
                [
                    (art.users.external(int(r)), art.items.external(int(c)), float(v))
                    for r, c, v in zip(held.rows[pos], held.cols[pos], held.values[pos], strict=True)
                ]
            )
        seconds = time.perf_counter() - started
        key = "refine_all" if refine_trained else "refine_new_only"
        out[key] = {"rmse": score(fold), "fold_in_s": round(seconds, 2)}
        print(json.dumps({key: out[key]}), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
