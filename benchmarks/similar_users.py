"""How good are the neighbours that GET /similar-users returns? Scored on validation entries only.

For each artifact, re-carves the validation entries `dcmc train` held out (same fraction and seed) and
predicts each of them with user-based kNN (Surprise's KNNBasic, k neighbours, similarity-weighted mean)
over the remaining training ratings. The neighbours come from the artifact's learned similarity, the
scaled cosine (1 + cos) / 2 of the user embeddings that /similar-users ranks by, or from Surprise's
`pearson_baseline` as a reference. A lower RMSE means the ranked users rate alike. Item-based kNN over the
item embeddings is scored too. Prints one JSON line per artifact, side and similarity.

    python benchmarks/similar_users.py --artifacts runs/a runs/b --data-dir ../shared/datasets
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from experiments import knn_rmse, learned_lookup  # noqa: E402

from model.artifact import load_artifact  # noqa: E402
from training.data import carve_validation, load_dataset  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Print the validation RMSE of user- and item-based kNN with the learned and a reference similarity."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--artifacts", nargs="+", required=True)
    parser.add_argument("--data-dir", default=str(REPO.parent / "shared" / "datasets"))
    parser.add_argument("--ks", nargs="+", type=int, default=[10, 20, 50])
    parser.add_argument("--sides", nargs="+", choices=("user", "item"), default=["user", "item"])
    parser.add_argument("--similarities", nargs="+", default=["learned", "pearson_baseline"])
    args = parser.parse_args(argv)

    for path in args.artifacts:
        art = load_artifact(path)
        ds, train_cfg = art.meta["dataset"], art.meta["train"]
        data = load_dataset(ds["name"], args.data_dir, split=ds.get("split", "u1"), seed=ds.get("seed", 0))
        if data.val is not None or float(train_cfg["val_fraction"]) <= 0:
            parser.error(f"{path}: needs an artifact trained with entries carved out for validation")
        train, val = carve_validation(data.train, float(train_cfg["val_fraction"]), int(train_cfg["seed"]))
        scale = (float(data.levels.min()), float(data.levels.max()))
        for side in args.sides:
            if side == "user":
                learned = learned_lookup(art.users, art.user_embeddings)
            else:
                learned = learned_lookup(art.items, art.item_embeddings)
            for sim in args.similarities:
                curve = knn_rmse(
                    train,
                    val,
                    data.user_ids,
                    data.item_ids,
                    scale,
                    user_based=side == "user",
                    sim=sim,
                    ks=args.ks,
                    learned=learned,
                )
                line = {"artifact": path, "side": side, "similarity": sim, "n": len(val)}
                line["val_rmse"] = {str(k): round(v, 4) for k, v in curve.items()}
                print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
