"""Choose the fold-in refinement's prior weight on validation entries (never the test split).

Takes the reduced ML-100K artifact that `benchmarks/online.py --accuracy` trains (a seeded 10% of the users'
training ratings left out), folds in 80% of those users' training ratings (seeded), and scores the other
20% of their training ratings: with the row branch's embedding alone, and refined with each prior weight
(model/online.py `refine_embedding`). Prints one JSON line per setting.

    python benchmarks/fold_in_prior.py --artifacts /tmp/dcmc-online/reduced --priors 0.1 0.3 1 3 10 100
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from model.artifact import load_artifact  # noqa: E402
from model.engine import Network, OnnxNetwork, expected_rating, nearest_level  # noqa: E402
from model.online import FoldIn, refine_embedding  # noqa: E402
from model.scorers import build_scorer  # noqa: E402
from training.data import load_dataset  # noqa: E402


def held_out_users(user_rows: np.ndarray, fraction: float = 0.1, seed: int = 0) -> np.ndarray:
    """The seeded share of the users with training ratings that benchmarks/online.py holds out."""
    users = np.unique(user_rows)
    return np.random.default_rng(seed).choice(users, size=round(fraction * len(users)), replace=False)


def main(argv: list[str] | None = None) -> int:
    """Print the validation RMSE of the fold-in with the row branch alone and with each prior."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--artifacts", required=True, help="the reduced artifact of benchmarks/online.py")
    parser.add_argument("--data-dir", default=str(REPO.parent / "shared" / "datasets"))
    parser.add_argument("--priors", nargs="+", type=float, default=[0.1, 0.3, 1.0, 3.0, 10.0, 100.0])
    parser.add_argument("--val-share", type=float, default=0.2)
    args = parser.parse_args(argv)

    art = load_artifact(args.artifacts)
    split = load_dataset("ml-100k", args.data_dir, split="u1")
    train = split.train
    held = held_out_users(train.rows)
    postable = np.isin(train.rows, held) & np.array([split.item_ids[c] in art.items for c in train.cols])
    idx = np.flatnonzero(postable)
    val = np.random.default_rng(1).random(len(idx)) < args.val_share
    posted, scored = idx[~val], idx[val]
    onnx = OnnxNetwork(art.path)
    fold = FoldIn(art, art.inference, onnx.embed_users, onnx.embed_items)
    ratings = zip(train.rows[posted], train.cols[posted], train.values[posted], strict=True)
    fold.apply([(split.user_ids[r], split.item_ids[c], float(v)) for r, c, v in ratings])
    state, levels = fold.state, art.levels
    rows = np.array([fold.user_index(split.user_ids[r]) for r in train.rows[scored]])
    cols = np.array([fold.item_index(split.item_ids[c]) for c in train.cols[scored]])
    y = train.values[scored]

    def rmse(dist: np.ndarray) -> float:
        return round(float(np.sqrt(np.mean((expected_rating(dist, levels) - y) ** 2))), 4)

    # The row branch's embeddings, before any refinement: embed each user's updated row again.
    row_emb = state.network.user_emb.copy()
    users = np.unique(rows)
    dense = np.zeros((len(users), art.config.n_items), dtype=np.float32)
    for k, u in enumerate(users):
        items, values = fold._ratings_of(int(u))
        dense[k, items[items < art.config.n_items]] = values[items < art.config.n_items]
    row_emb[users] = np.asarray(onnx.embed_users(dense), np.float32).astype(np.float64)
    settings: list[tuple[str, float | None]] = [("row branch", None)] + [("refined", p) for p in args.priors]
    for name, prior in settings:
        emb = row_emb.copy()
        if prior is not None:
            for u in users:
                items, values = fold._ratings_of(int(u))
                labels = nearest_level(values, levels)
                emb[u] = refine_embedding(
                    row_emb[u], state.network.item_emb[items], state.network.bilinear, labels, prior
                )
        network = Network(state.network.config, emb, state.network.item_emb, state.network.bilinear)
        probs = network.probabilities(rows, cols)
        scorer = build_scorer(network, state.known, art.inference)
        line = {"fold_in": name, "prior": prior, "val_rmse_network": rmse(probs)}
        line["val_rmse_default_inference"] = rmse(scorer.predict(rows, cols, probs))
        print(json.dumps({**line, "n": len(y), "users": len(users)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
