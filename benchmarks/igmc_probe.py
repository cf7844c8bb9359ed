"""Would a learned local-graph model help where DCMC falls short? An IGMC probe on validation entries.

IGMC (Zhang & Chen, "Inductive Matrix Completion Based on Graph Neural Networks", ICLR 2020) holds the
best published Flixster RMSE on Monti's split (0.872). It predicts a rating (u, v) from the 1-hop enclosing
subgraph of the training ratings around it: u, v, the items u rated and the users who rated v, with every
known rating among them as an edge typed by its level. Nodes carry only their role (target user, target
item, other user, other item); an R-GCN (basis decomposition, mean aggregation per relation, tanh) runs
over the graph, the target pair's concatenated layer outputs go through an MLP, and the loss is the squared
error plus the adjacent-rating regularizer on consecutive relation weights. Training removes the target
edge and drops edges at random.

This probe re-implements that with IGMC's hyperparameters as defaults (4 layers of 32, 4 bases, batch 50,
Adam 1e-3, edge dropout 0.2, ARR 0.001, 40 epochs), trains it on the ratings an artifact was trained on,
and scores the validation entries the artifact held out: IGMC alone (last epoch, and the mean of the
epoch-10, 20, 30 and 40 predictions, an ensemble over epochs in the spirit of IGMC's), the artifact's
default inference alone, and their blends (1 - w) DCMC + w IGMC. A measurement, not a product mode: it
decides whether such a model would be worth building into DCMC. Validation entries only.

    python benchmarks/igmc_probe.py --artifacts runs/val/flixster-s0 --data-dir ../shared/datasets
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from model.artifact import load_artifact  # noqa: E402
from model.engine import expected_rating  # noqa: E402
from model.ratings import LineIndex  # noqa: E402
from model.scorers import artifact_scorer, predict_distributions  # noqa: E402
from training.data import Entries, carve_validation, load_dataset  # noqa: E402
from training.evaluate import map_entries  # noqa: E402

ROLES = 4  # target user, target item, other user, other item
Graph = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # roles, user -> item edges, their levels


class Subgraphs:
    """1-hop enclosing subgraphs of queried entries in a matrix of known ratings (given as level indices)."""

    def __init__(self, known: Entries, labels: np.ndarray, n_users: int, n_items: int, cap: int) -> None:
        self.n_items, self.cap = n_items, cap
        by_user, by_item = LineIndex(known.rows, n_users), LineIndex(known.cols, n_items)
        self.u_ptr, self.u_items = by_user.indptr, known.cols[by_user.order]
        self.u_labels = labels[by_user.order]
        self.i_ptr, self.i_users = by_item.indptr, known.rows[by_item.order]

    def _neighbours(self, ptr: np.ndarray, table: np.ndarray, node: int, drop: int, rng) -> np.ndarray:
        out = table[ptr[node] : ptr[node + 1]]
        out = out[out != drop]
        if self.cap and len(out) > self.cap:
            out = rng.choice(out, self.cap, replace=False)
        return out

    def extract(self, u: int, v: int, rng: np.random.Generator) -> Graph:
        """Roles of the nodes (users first, target user at 0, target item right after the users) and the
        user -> item edges with their level indices; the edge (u, v) itself is never included."""
        users = np.concatenate([[u], self._neighbours(self.i_ptr, self.i_users, v, u, rng)])
        items = np.concatenate([[v], self._neighbours(self.u_ptr, self.u_items, u, v, rng)])
        position = np.full(self.n_items, -1)
        position[items] = np.arange(len(items))
        src, dst, typ = [], [], []
        for k, user in enumerate(users):
            span = slice(self.u_ptr[user], self.u_ptr[user + 1])
            pos = position[self.u_items[span]]
            keep = pos >= 0
            if k == 0:
                keep &= pos != 0
            src.append(np.full(int(keep.sum()), k))
            dst.append(pos[keep] + len(users))
            typ.append(self.u_labels[span][keep])
        roles = np.concatenate([[0], np.full(len(users) - 1, 2), [1], np.full(len(items) - 1, 3)])
        return roles, np.concatenate(src), np.concatenate(dst), np.concatenate(typ)


def collate(graphs: list[Graph], n_relations: int, drop: float, rng: np.random.Generator):
    """One disjoint union of subgraphs as tensors: roles, edges both ways, relation, per-relation mean
    normalisation, the target user and item node of each graph, and the node count."""
    roles, src, dst, typ, tu, ti = [], [], [], [], [], []
    offset = 0
    for r, s, d, t in graphs:
        if drop > 0:
            keep = rng.random(len(s)) >= drop
            s, d, t = s[keep], d[keep], t[keep]
        roles.append(r)
        src.append(s + offset)
        dst.append(d + offset)
        typ.append(t)
        tu.append(offset)
        ti.append(offset + int(np.flatnonzero(r == 1)[0]))
        offset += len(r)
    s, d, t = np.concatenate(src), np.concatenate(dst), np.concatenate(typ)
    s, d, t = np.concatenate([s, d]), np.concatenate([d, s]), np.concatenate([t, t])
    key = d * n_relations + t
    norm = 1.0 / np.bincount(key, minlength=offset * n_relations)[key]
    as_long = lambda x: torch.as_tensor(np.asarray(x), dtype=torch.long)  # noqa: E731
    return (
        as_long(np.concatenate(roles)),
        as_long(s),
        as_long(d),
        as_long(t),
        torch.as_tensor(norm, dtype=torch.float32),
        as_long(tu),
        as_long(ti),
        offset,
    )


class RGCNLayer(nn.Module):
    """x_i' = W_0 x_i + b + sum_r mean_{j in N_r(i)} W_r x_j with W_r = sum_b a_rb V_b."""

    def __init__(self, d_in: int, d_out: int, n_relations: int, n_bases: int) -> None:
        super().__init__()
        self.bases = nn.Parameter(torch.empty(n_bases, d_in, d_out))
        self.coef = nn.Parameter(torch.empty(n_relations, n_bases))
        nn.init.xavier_uniform_(self.bases)
        nn.init.xavier_uniform_(self.coef)
        self.root = nn.Linear(d_in, d_out)

    def relation_weights(self) -> torch.Tensor:
        return torch.einsum("rb,bio->rio", self.coef, self.bases)

    def forward(self, x, src, dst, rel, norm, n_nodes):
        xb = torch.einsum("ni,bio->nbo", x, self.bases)
        msg = torch.einsum("eb,ebo->eo", self.coef[rel], xb[src]) * norm[:, None]
        out = torch.zeros(n_nodes, msg.shape[1]).index_add_(0, dst, msg)
        return out + self.root(x)


class IGMC(nn.Module):
    """R-GCN over role one-hots, then an MLP on the target pair's concatenated layer outputs."""

    def __init__(self, n_relations: int, hidden: int, layers: int, bases: int) -> None:
        super().__init__()
        dims = [ROLES] + [hidden] * layers
        self.convs = nn.ModuleList(RGCNLayer(dims[k], dims[k + 1], n_relations, bases) for k in range(layers))
        self.head = nn.Sequential(
            nn.Linear(2 * hidden * layers, 128), nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, 1)
        )

    def forward(self, batch):
        roles, src, dst, rel, norm, tu, ti, n_nodes = batch
        x = nn.functional.one_hot(roles, ROLES).float()
        states = []
        for conv in self.convs:
            x = torch.tanh(conv(x, src, dst, rel, norm, n_nodes))
            states.append(x)
        h = torch.cat(states, 1)
        return self.head(torch.cat([h[tu], h[ti]], 1)).squeeze(1)

    def adjacent_rating_penalty(self) -> torch.Tensor:
        """sum over layers of sum_r ||W_{r+1} - W_r||^2 (IGMC's ARR)."""
        return sum(((w[1:] - w[:-1]) ** 2).sum() for w in (c.relation_weights() for c in self.convs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--artifacts", required=True, help="an artifact trained with a validation carve")
    parser.add_argument("--data-dir", default=str(REPO.parent / "shared" / "datasets"))
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--bases", type=int, default=4)
    parser.add_argument("--edge-dropout", type=float, default=0.2)
    parser.add_argument("--arr", type=float, default=1e-3, help="weight of the adjacent-rating penalty")
    parser.add_argument("--max-per-hop", type=int, default=200, help="neighbours sampled per side (0: all)")
    parser.add_argument("--blend", nargs="+", type=float, default=[0.1, 0.2, 0.3, 0.5])
    parser.add_argument("--seed", type=int, help="default: the artifact's training seed")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    art = load_artifact(args.artifacts)
    ds, train_cfg = art.meta["dataset"], art.meta["train"]
    fraction = float(train_cfg.get("val_fraction", 0.0))
    data = load_dataset(ds["name"], args.data_dir, split=ds.get("split", "u1"), seed=ds.get("seed", 0))
    if data.val is not None or fraction <= 0:
        parser.error("--artifacts must have been trained with a validation carve (val_fraction > 0)")
    known, val = carve_validation(data.train, fraction, int(train_cfg["seed"]))
    seed = int(train_cfg["seed"]) if args.seed is None else args.seed
    torch.set_num_threads(args.threads)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)

    levels = np.asarray(data.levels, dtype=np.float64)
    graphs = Subgraphs(
        known, np.searchsorted(levels, known.values), data.n_users, data.n_items, args.max_per_hop
    )
    t0 = time.perf_counter()
    train_graphs = [graphs.extract(u, v, rng) for u, v in zip(known.rows, known.cols, strict=True)]
    val_graphs = [graphs.extract(u, v, rng) for u, v in zip(val.rows, val.cols, strict=True)]
    extract_s = time.perf_counter() - t0

    net = IGMC(len(levels), args.hidden, args.layers, args.bases)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    targets = torch.as_tensor(known.values, dtype=torch.float32)

    def predict(batch_graphs: list[Graph]) -> np.ndarray:
        net.eval()
        with torch.no_grad():
            out = [
                net(collate(batch_graphs[k : k + 500], len(levels), 0.0, rng)).numpy()
                for k in range(0, len(batch_graphs), 500)
            ]
        net.train()
        return np.clip(np.concatenate(out), levels[0], levels[-1])

    def rmse(pred: np.ndarray) -> float:
        return round(float(np.sqrt(np.mean((pred - val.values) ** 2))), 4)

    snapshots, t0 = [], time.perf_counter()
    bar = tqdm(range(1, args.epochs + 1), desc="IGMC", unit="epoch")
    for epoch in bar:
        order = rng.permutation(len(train_graphs))
        for k in range(0, len(order), args.batch):
            idx = order[k : k + args.batch]
            pred = net(collate([train_graphs[i] for i in idx], len(levels), args.edge_dropout, rng))
            loss = ((pred - targets[idx]) ** 2).mean()
            if args.arr:
                loss = loss + args.arr * net.adjacent_rating_penalty()
            opt.zero_grad()
            loss.backward()
            opt.step()
        last = predict(val_graphs)
        if epoch % 10 == 0:
            snapshots.append(last)
        bar.set_postfix(val_rmse=rmse(last))
    train_s = time.perf_counter() - t0

    rows, cols = map_entries(art, data.user_ids, data.item_ids, val)
    network, scorer = artifact_scorer(art, include_held_out=False)
    dcmc = expected_rating(predict_distributions(network, scorer, rows, cols), art.levels)
    ensemble = np.mean(snapshots, axis=0) if snapshots else last
    result = {
        "dataset": ds["name"],
        "artifacts": str(args.artifacts),
        "n_val": len(val),
        "dcmc_default": rmse(dcmc),
        "igmc_last": rmse(last),
        "igmc_ensemble": rmse(ensemble),
        "error_correlation": round(float(np.corrcoef(dcmc - val.values, last - val.values)[0, 1]), 3),
        **{f"blend_{w}": rmse((1 - w) * dcmc + w * last) for w in args.blend},
        "extract_s": round(extract_s, 1),
        "train_s": round(train_s, 1),
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
