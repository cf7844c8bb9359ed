"""Probe: refine every trained embedding against the decoder's likelihood of its line's training ratings.

The online fold-in refines a user's embedding (`model.online.refine_embedding`: the row branch's
embedding moved to the argmin of -sum_k log P(y_k | u, v_k) + prior ||u - u_row||^2), but only for users
whose ratings changed online; the trained users keep the row branch's embedding. This probe applies the
same objective to every user of an artifact at once (and then, with the roles swapped, to every item),
and scores the artifact's validation ratings (`held_out_ratings.npz`: carved from the training split,
never trained on) with the base network before and after. The test split is not read.

    python benchmarks/refine_probe.py --artifacts RUN [--priors 1] [--rounds 1] [--iters 30]

Each refinement is full-batch L-BFGS over all lines at once (the objective is a sum of independent,
smooth, strongly convex terms, one per line), the ratings read `--chunk` at a time. Prints one JSON line
per stage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from model.artifact import load_artifact  # noqa: E402
from model.engine import nearest_level  # noqa: E402


def _sides(bilinear: torch.Tensor, other: torch.Tensor, transpose: bool) -> torch.Tensor:
    """B^l v for each line of `other` (refining users), or B^l^T u (refining items): (lines, p, d)."""
    if transpose:
        return torch.einsum("lde,bd->ble", bilinear, other)
    return torch.einsum("lde,be->bld", bilinear, other)


def refine(
    start: np.ndarray,
    anchor: np.ndarray,
    other: np.ndarray,
    bilinear: np.ndarray,
    mine: np.ndarray,
    theirs: np.ndarray,
    labels: np.ndarray,
    prior: float,
    iters: int,
    chunk: int,
    transpose: bool,
) -> tuple[np.ndarray, dict[str, float]]:
    """argmin_X sum_k -log softmax_l(x_{mine[k]} . W_l[theirs[k]])[labels[k]] + prior ||X - anchor||^2,
    from `start`."""
    x0 = torch.from_numpy(np.asarray(anchor, dtype=np.float32))
    sides = _sides(
        torch.from_numpy(bilinear.astype(np.float32)), torch.from_numpy(other.astype(np.float32)), transpose
    )
    x = torch.from_numpy(np.asarray(start, dtype=np.float32)).clone().requires_grad_(True)
    mine_t, theirs_t, labels_t = (torch.from_numpy(a.astype(np.int64)) for a in (mine, theirs, labels))
    opt = torch.optim.LBFGS([x], lr=1.0, max_iter=iters, history_size=10, line_search_fn="strong_wolfe")
    calls = 0

    def closure() -> torch.Tensor:
        nonlocal calls
        calls += 1
        opt.zero_grad()
        total = prior * ((x - x0) ** 2).sum()
        total.backward()
        value = float(total.detach())
        for s in range(0, len(mine_t), chunk):
            m, t, y = mine_t[s : s + chunk], theirs_t[s : s + chunk], labels_t[s : s + chunk]
            scores = torch.bmm(sides[t], x[m].unsqueeze(2)).squeeze(2)  # (K, p)
            loss = torch.nn.functional.cross_entropy(scores, y, reduction="sum")
            loss.backward()
            value += float(loss.detach())
        return torch.tensor(value)

    t0 = time.perf_counter()
    before = float(closure())
    opt.step(closure)
    after = float(closure())
    info = {"objective_before": before, "objective_after": after, "evaluations": calls, "seconds": 0.0}
    info["seconds"] = round(time.perf_counter() - t0, 1)
    return x.detach().numpy().astype(np.float64), info


def predictions(users: np.ndarray, items: np.ndarray, bilinear: np.ndarray, levels: np.ndarray, rows, cols):
    """Expected ratings of the base network at (rows[k], cols[k])."""
    out = np.empty(len(rows))
    b = torch.from_numpy(bilinear.astype(np.float32))
    u_all, v_all = torch.from_numpy(users.astype(np.float32)), torch.from_numpy(items.astype(np.float32))
    for s in range(0, len(rows), 1 << 16):
        u, v = u_all[rows[s : s + 1 << 16]], v_all[cols[s : s + 1 << 16]]
        probs = torch.softmax(torch.einsum("kd,lde,ke->kl", u, b, v), dim=-1).numpy()
        out[s : s + len(u)] = probs @ levels
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--artifacts", required=True)
    parser.add_argument("--priors", nargs="+", type=float, default=[1.0])
    parser.add_argument("--rounds", type=int, default=1, help="users then items, this many times")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--chunk", type=int, default=1 << 16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    art = load_artifact(args.artifacts)
    levels = art.levels
    train, val = art.train, art.held_out
    labels = nearest_level(train.values, levels)
    users0 = np.asarray(art.user_embeddings, dtype=np.float64)
    items0 = np.asarray(art.item_embeddings, dtype=np.float64)
    bilinear = np.asarray(art.bilinear, dtype=np.float64)

    def score(users: np.ndarray, items: np.ndarray) -> float:
        pred = predictions(users, items, bilinear, levels, val.rows, val.cols)
        return round(float(np.sqrt(np.mean((pred - val.values) ** 2))), 4)

    base = {"stage": "network", "val_rmse": score(users0, items0), "val_n": len(val), "train_n": len(train)}
    print(json.dumps(base), flush=True)
    for prior in args.priors:
        tables = {"users": users0, "items": items0}
        for r in range(args.rounds):
            for side, other, mine, theirs, start in (
                ("users", "items", train.rows, train.cols, users0),
                ("items", "users", train.cols, train.rows, items0),
            ):
                tables[side], info = refine(
                    tables[side],
                    start,
                    tables[other],
                    bilinear,
                    mine,
                    theirs,
                    labels,
                    prior,
                    args.iters,
                    args.chunk,
                    transpose=side == "items",
                )
                rmse = score(tables["users"], tables["items"])
                print(
                    json.dumps({"stage": f"{side} {r + 1}", "prior": prior, "val_rmse": rmse, **info}),
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
