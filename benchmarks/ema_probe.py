"""Validation probe: the live weights against moving averages of them, along one default training run.

Trains one model with the dataset's `default` preset (the trainer's own blocks, loss and schedule, weight
average off) and every 5 epochs prints the validation RMSE of the live weights, of exponential moving
averages of the weights and BatchNorm statistics with several decays (updated after every step), and of a
uniform average (SWA) over the last 40% of the epochs. Validation entries only. This is how `ema_decay`
of the default preset was chosen (benchmarks/results/validation.md).

    python benchmarks/ema_probe.py --dataset ml-100k --seed 0
    python benchmarks/ema_probe.py --dataset ml-100k --set beta=0
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from model.config import ModelConfig  # noqa: E402
from model.network import DCMC  # noqa: E402
from training.config import TUNING_VAL_FRACTION, preset, resolve_model_settings  # noqa: E402
from training.data import carve_validation, load_dataset  # noqa: E402
from training.pipeline import split_overrides  # noqa: E402
from training.trainer import (  # noqa: E402
    RatingMatrix,
    base_predictions,
    block_loss,
    embed_all,
    epoch_blocks,
    rmse_mae,
)

DECAYS = (0.99, 0.998, 0.9995)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--data-dir", help="default: ../shared/datasets/ml-100k or .../monti")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="preset override")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    shared = REPO.parent / "shared" / "datasets"
    data_dir = args.data_dir or str(shared / ("ml-100k" if args.dataset == "ml-100k" else "monti"))
    chosen = preset(args.dataset, "default")
    overrides = {"val_fraction": str(TUNING_VAL_FRACTION), **dict(kv.split("=", 1) for kv in args.set)}
    model_over, train_over, _ = split_overrides(overrides)
    cfg = replace(chosen.train, seed=args.seed, ema_decay=0.0, **train_over)
    data = load_dataset(args.dataset, data_dir, split="u1", seed=0)
    levels = tuple(float(x) for x in data.levels)
    train_entries, val = carve_validation(data.train, cfg.val_fraction, cfg.seed)
    mc = ModelConfig(
        n_users=data.n_users,
        n_items=data.n_items,
        levels=levels,
        **resolve_model_settings({**chosen.model, **model_over}, train_entries.values),
    )
    torch.manual_seed(cfg.seed)
    model = DCMC(mc)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=cfg.lr_halve_every, gamma=0.5)
    emas = {d: AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(d), use_buffers=True) for d in DECAYS}
    swa_start = int(cfg.epochs * 0.6)
    swa = AveragedModel(model, use_buffers=True)
    matrix = RatingMatrix(mc.n_users, mc.n_items, train_entries)
    lv = np.asarray(mc.levels)

    def val_rmse(net: DCMC) -> float:
        users, items = embed_all(net, matrix)
        return round(rmse_mae(base_predictions(net, users, items, val), val.values)[0], 4)

    t0 = time.time()
    for epoch in range(cfg.epochs):
        torch.manual_seed(cfg.seed * 100_003 + epoch)  # the trainer's dropout stream
        model.train()
        for block in epoch_blocks(matrix, cfg.epoch_mode, cfg.block_rows, cfg.block_cols, cfg.seed, epoch):
            loss, _ = block_loss(model, matrix, block, lv, 0, cfg.beta, cfg.sigma2, cfg.rating_mse)
            opt.zero_grad()
            loss.backward()
            opt.step()
            for ema in emas.values():
                ema.update_parameters(model)
        sched.step()
        if epoch >= swa_start:
            swa.update_parameters(model)
        if (epoch + 1) % 5 == 0 or epoch + 1 == cfg.epochs:
            record = {"epoch": epoch + 1, "live": val_rmse(model)}
            record.update({f"ema{d}": val_rmse(e.module) for d, e in emas.items()})  # type: ignore[arg-type]
            if epoch >= swa_start:
                record["swa"] = val_rmse(swa.module)  # type: ignore[arg-type]
            print(json.dumps({**record, "seconds": round(time.time() - t0)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
