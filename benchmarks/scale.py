"""How DCMC's cost grows with the data, on this machine: training, the artifact, serving, accuracy.

Phases (each appends its records to benchmarks/results/scale.jsonl, stamped with the commit; `report`
writes scale.md and scale-curve.png from every record):

    python benchmarks/scale.py train --name epinions-synth --dataset csv --data DIR/ratings.csv \
        --split random [--epochs 10 --halve-every 4] [--runs runs/scale]
        `dcmc train` under /usr/bin/time (peak RSS, wall), its per-epoch seconds and the search's, the
        artifact's size; then the test split scored ONCE: `dcmc evaluate` (the tuned inference and the
        network alone) beside Surprise `SVD` (defaults, fitted on the same training and validation
        ratings). Every look at a test split is this record.
    python benchmarks/scale.py serve --name epinions-synth --artifacts runs/scale/epinions-synth
        `dcmc serve` (2 workers, private redis-server): seconds to /ready, RSS and PSS per worker at rest,
        `/predict` (100 random items, a random user each time) and `/recommend?k=10` p50/p99 over
        sequential requests.
    python benchmarks/scale.py curve --ratings 100000 300000 1000000 [--shape epinions] [--max-steps 300]
    python benchmarks/scale.py curve --shape ml-10m --csv DIR/ratings.csv   (a CSV already generated)
        For each size, `dcmc data synth --shape SHAPE --ratings N`, then the default training loop of the
        csv preset (its blocks sized to the density) in a child process under /usr/bin/time: an epoch's
        steps, seconds per step, peak RSS. An epoch of more than --max-steps steps is timed over its
        first --max-steps steps and its epoch time extrapolated (said so in the record and the table).
    python benchmarks/scale.py report
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
RESULTS = REPO / "benchmarks" / "results"
RECORDS = RESULTS / "scale.jsonl"
DCMC = [sys.executable, "-m", "training.cli"]


def _code() -> str:
    """The commit of the code measured (this file's own results, written as it runs, do not count)."""
    from harness import commit_label

    return commit_label(
        "model",
        "service",
        "training",
        "benchmarks/scale.py",
        "benchmarks/harness.py",
    )


def _append(record: dict[str, Any], code: str | None = None) -> None:
    """Append a record; `code`: the commit read when the measurement started (a long run outlasts commits)."""
    record = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": code or _code(),
        **record,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    with RECORDS.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record), flush=True)


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[str, float, float]:
    """Run `cmd` under /usr/bin/time -v: (stdout, wall seconds, peak RSS in MB)."""
    proc = subprocess.run(
        ["/usr/bin/time", "-v", *cmd],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rss = float(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1)) / 1024  # type: ignore[union-attr]
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", proc.stderr).group(1)  # type: ignore[union-attr]
    seconds = sum(float(x) * 60**i for i, x in enumerate(reversed(wall.split(":"))))
    return proc.stdout, seconds, rss


def _last_json(out: str) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return found


def _size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def surprise_svd(dataset: str, data: str, split: str) -> dict[str, Any]:
    """Surprise SVD (defaults, seeded) fitted on the training and validation ratings, RMSE on the test."""
    from surprise import SVD, Dataset, Reader

    from training.data import Entries, load_dataset

    s = load_dataset(dataset, data, split=split, seed=0)
    known = s.train if s.val is None else Entries.concat([s.train, s.val])
    reader = Reader(rating_scale=(float(s.levels[0]), float(s.levels[-1])))
    triples = zip(known.rows.tolist(), known.cols.tolist(), known.values.tolist(), strict=True)
    trainset = Dataset(reader).construct_trainset([(f"u{r}", f"i{c}", v, None) for r, c, v in triples])
    t0 = time.perf_counter()
    algo = SVD(random_state=0)
    algo.fit(trainset)
    fit = time.perf_counter() - t0
    test = s.test
    est = np.array([algo.predict(f"u{r}", f"i{c}").est for r, c in zip(test.rows, test.cols, strict=True)])
    return {"svd_rmse": float(np.sqrt(np.mean((est - test.values) ** 2))), "svd_fit_seconds": round(fit, 1)}


def cmd_train(args: argparse.Namespace) -> None:
    code = _code()
    out = Path(args.runs) / args.name
    argv = [
        *DCMC,
        "train",
        "--dataset",
        args.dataset,
        "--data-dir",
        args.data,
        "--split",
        args.split,
        "--out",
        str(out),
        "--no-progress",
    ]
    if args.epochs:
        argv += ["--epochs", str(args.epochs)]
    if args.halve_every:
        argv += ["--set", f"lr_halve_every={args.halve_every}"]
    if args.tune_timeout:
        argv += ["--tune-timeout", str(args.tune_timeout)]
    stdout, wall, rss = timed(argv)
    metrics = _last_json(stdout)
    history = metrics.get("history") or json.loads((out / "metrics.json").read_text()).get("history", [])
    epoch_seconds = [round(float(e["seconds"]), 1) for e in history]
    config = json.loads((out / "config.json").read_text())
    record: dict[str, Any] = {
        "phase": "train",
        "name": args.name,
        "command": " ".join(["python", *argv[1:]]),
        "ratings_train": metrics["n_train"],
        "ratings_val": metrics["n_val"],
        "users": config["model"]["n_users"],
        "items": config["model"]["n_items"],
        "blocks": [config["train"]["block_rows"], config["train"]["block_cols"]],
        "epochs": metrics["epochs"],
        "epoch_seconds": epoch_seconds,
        "train_seconds": metrics["train_seconds"],
        "val_rmse": metrics["val_rmse"],
        "tuning": metrics.get("tuning"),
        "wall_seconds": round(wall, 1),
        "peak_rss_mb": round(rss, 1),
        "artifact_mb": round(_size_mb(out), 1),
    }
    evaluate = [*DCMC, "evaluate", "--artifacts", str(out), "--data-dir", args.data]
    tuned = _last_json(subprocess.run(evaluate, cwd=REPO, capture_output=True, text=True, check=True).stdout)
    network = _last_json(
        subprocess.run(
            [*evaluate, "--set", "inference.mode=none"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout
    )
    record.update(
        test_rmse=tuned["rmse"],
        test_rmse_network=network["rmse"],
        test_n=tuned["n"],
        inference=tuned.get("inference"),
        **surprise_svd(args.dataset, args.data, args.split),
    )
    _append(record, code)


def _worker_memory(pid: int) -> list[dict[str, float]]:
    """RSS and PSS (MB) of the service's worker processes (the children of the supervisor)."""
    out = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        rollup = Path(f"/proc/{child}/smaps_rollup").read_text()
        rss = float(re.search(r"^Rss:\s+(\d+)", rollup, re.M).group(1)) / 1024  # type: ignore[union-attr]
        pss = float(re.search(r"^Pss:\s+(\d+)", rollup, re.M).group(1)) / 1024  # type: ignore[union-attr]
        out.append({"rss_mb": round(rss, 1), "pss_mb": round(pss, 1)})
    return out


def _percentiles(seconds: list[float]) -> dict[str, float]:
    ms = np.array(seconds) * 1000
    return {
        "p50_ms": round(float(np.percentile(ms, 50)), 2),
        "p99_ms": round(float(np.percentile(ms, 99)), 2),
        "n": len(ms),
    }


def cmd_serve(args: argparse.Namespace) -> None:
    from harness import Redis, Service

    from model.artifact import load_artifact

    art = load_artifact(args.artifacts)
    users, items = art.users.ids, art.items.ids
    rng = np.random.default_rng(0)
    log = Path(tempfile.mkdtemp(prefix="dcmc-scale-")) / "serve.log"
    with Redis() as redis:
        t0 = time.perf_counter()
        svc = Service(
            Path(args.artifacts), redis.url, "scale", args.workers, log, env={"OMP_NUM_THREADS": "1"}
        )
        try:
            svc.wait_ready(timeout=1800)
            startup = time.perf_counter() - t0
            memory = _worker_memory(svc.proc.pid)
            timings: dict[str, list[float]] = {"predict100": [], "recommend": []}
            for k in range(args.requests + 20):  # the first 20 of each warm the workers, not counted
                body = {
                    "user": users[rng.integers(len(users))],
                    "items": [items[j] for j in rng.choice(len(items), 100, replace=False)],
                }
                t = time.perf_counter()
                r = svc.client.post("/predict", json=body)
                if r.status_code != 200:
                    raise RuntimeError(f"/predict answered {r.status_code}: {r.text[:300]}")
                if k >= 20:
                    timings["predict100"].append(time.perf_counter() - t)
            for k in range(args.requests // 3 + 20):
                t = time.perf_counter()
                r = svc.client.get(f"/recommend/{users[rng.integers(len(users))]}", params={"k": 10})
                if r.status_code != 200:
                    raise RuntimeError(f"/recommend answered {r.status_code}: {r.text[:300]}")
                if k >= 20:
                    timings["recommend"].append(time.perf_counter() - t)
            after = _worker_memory(svc.proc.pid)
        finally:
            svc.stop()
    _append(
        {
            "phase": "serve",
            "name": args.name,
            "artifacts": str(args.artifacts),
            "workers": args.workers,
            "startup_seconds": round(startup, 1),
            "workers_at_rest": memory,
            "workers_after": after,
            **{k: _percentiles(v) for k, v in timings.items()},
        }
    )


def cmd_steps(args: argparse.Namespace) -> None:
    """(child of `curve`) The csv preset's training loop on one CSV: an epoch, or its first max_steps."""
    import torch
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from model.config import ModelConfig
    from model.network import DCMC as Net
    from training.config import preset, resolve_model_settings, sized_blocks, sized_network
    from training.data import load_dataset
    from training.trainer import RatingMatrix, epoch_blocks, make_optimizers, train_step

    t0 = time.perf_counter()
    data = load_dataset("csv", args.data, split="random", seed=0)
    chosen = preset("csv")
    sized_model, sized_train = sized_network(len(data.train))
    cfg = dataclasses.replace(chosen.train, **sized_train)
    rows, cols = sized_blocks(cfg.block_rows, cfg.block_cols, data.n_users, data.n_items, len(data.train))
    model_cfg = ModelConfig(
        n_users=data.n_users,
        n_items=data.n_items,
        levels=tuple(float(x) for x in data.levels),
        **resolve_model_settings({**chosen.model, **sized_model}, data.train.values),
    )
    torch.manual_seed(0)
    model = Net(model_cfg)
    optimizers = make_optimizers(model, cfg.lr, cfg.weight_decay)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(cfg.ema_decay or 0.99), use_buffers=True)
    matrix = RatingMatrix(data.n_users, data.n_items, data.train)
    blocks = epoch_blocks(matrix, cfg.epoch_mode, rows, cols, cfg.seed, 0)
    load = time.perf_counter() - t0
    levels = np.asarray(model_cfg.levels)
    run = blocks[: args.max_steps]
    t0 = time.perf_counter()
    for block in run:
        train_step(model, model, matrix, block, levels, 0, cfg, optimizers, ema)  # the trainer's own step
    seconds = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "users": data.n_users,
                "items": data.n_items,
                "ratings_train": len(data.train),
                "blocks": [rows, cols],
                "steps_per_epoch": len(blocks),
                "steps_timed": len(run),
                "seconds_per_step": seconds / len(run),
                "load_seconds": round(load, 1),
                "epoch_seconds": seconds / len(run) * len(blocks),
                "extrapolated": len(run) < len(blocks),
            }
        )
    )


def cmd_curve(args: argparse.Namespace) -> None:
    if args.csv:  # a CSV already written by `dcmc data synth --shape SHAPE` (its full size)
        child = [sys.executable, __file__, "_steps", "--data", args.csv, "--max-steps", str(args.max_steps)]
        stdout, wall, rss = timed(child, env={"OMP_NUM_THREADS": str(args.threads)})
        found = _last_json(stdout)
        _append(
            {
                "phase": "curve",
                "shape": args.shape,
                "ratings": found["ratings_train"],
                "csv": args.csv,
                **found,
                "peak_rss_mb": round(rss, 1),
                "wall_seconds": round(wall, 1),
            }
        )
        return
    for n in args.ratings:
        data = Path(tempfile.mkdtemp(prefix="dcmc-curve-"))
        subprocess.run(
            [*DCMC, "data", "synth", "--shape", args.shape, "--out", str(data), "--ratings", str(n)],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        child = [
            sys.executable,
            __file__,
            "_steps",
            "--data",
            str(data / "ratings.csv"),
            "--max-steps",
            str(args.max_steps),
        ]
        stdout, wall, rss = timed(child, env={"OMP_NUM_THREADS": str(args.threads)})
        _append(
            {
                "phase": "curve",
                "shape": args.shape,
                "ratings": n,
                **_last_json(stdout),
                "peak_rss_mb": round(rss, 1),
                "wall_seconds": round(wall, 1),
            }
        )
        for f in data.iterdir():
            f.unlink()
        data.rmdir()


NOTES = """\
- ml-10m-synth-1epoch-ml10m-art and ml-10m-synth-1epoch-ml10m-art2 (Serving artifacts trained elsewhere):
  two artifacts of the synthetic ml-10m matrix, each `dcmc data synth --shape ml-10m` then `dcmc train
  --dataset csv --data-dir .../ratings.csv --split random --epochs 1 --no-tune` (start-up does not depend
  on the network's quality; no test split scored), the first written before `abfa816` (no `baseline.npz`:
  each worker fits the bias baseline at start-up), the second after it; both served at `88a3cc5`, one after
  the other, nothing else running: start-up with 2 workers 50.7 s and 5.0 s. In process (one worker, one
  BLAS thread) the fit was 37.1 of the first one's 40.2 s.
- "+ uncommitted changes" on the records of `3112ff7`: the checkout that ran them was clean at that commit
  but for this results file, which the label then counted (it now looks at the code paths only).
  `d52dee0 + uncommitted changes` (the ml-10m epoch): the uncommitted code was the exact inference's, which
  the training loop does not run.
- epinions-synth's training records: `4dae836`, a data-generation job ran beside its first two epochs
  (336 and 267 s), the other eight ran alone (121-131 s); `2e73e84`, development work (profiling, tests)
  ran beside epochs 1-5 and parts of 6-10, so its times are an upper bound; `0db87c5` ran alone (its
  "+ uncommitted changes": this notes text in scale.py, edited after the run had started). Each scored
  the test split once, after its search (0.6971 each time).
- epinions-synth's serve records of the artifact trained at `0db87c5`: at `0db87c5` twice, /predict 100 p50
  5.03 and 4.15 ms, /recommend p50 129 and 118 ms; at `1acb82e` (a refactor of the column pass's
  matrices) 3.62 and 120 ms; at `2c84261` (the converted artifact below) 3.70 and 113 ms. The table shows
  the latest.
- epinions-synth's serve record of `2c84261` served the `2e73e84` artifact after its known field was
  rewritten by the code of `2c84261` with its own chosen settings (`training.tune.write_tuning`: the
  co-rating tables as float32 .npy files, memory-mapped).
- ml-100k before the sparse input layer (`70e5b2a`, the same command with `--no-tune`): validation RMSE
  0.8822, epochs of 1.19-1.59 s (median 1.24 s over 10); at `3112ff7` 0.8839, at `2c84261` 0.8828 (test
  0.8892). Epoch time, `3112ff7` against `2c84261`, alternating, 12 epochs each without the search (the
  first two dropped): medians 1.64 and 1.41 s before, 1.54 and 1.56 s after: the same within the noise.
- Cost curve: rows marked extrapolated timed the epoch's first 300 (before `2c84261`) or 200 steps. Peak
  RSS is the training loop's process (no validation, export or search). The epinions shape's rows are
  from before the 24 x 24 block cap and the generator's speed-up (the generator then needed 54 s for 1 M
  ratings and 23 minutes for ml-10m's 10 M; now 2 and 48 s); the ml-10m shape's rows at `2c84261` are
  the curve of 100 k, 300 k, 1 M, 3 M ratings (75% trained on), with its 10 M point timed whole at
  `d52dee0`. The ml-10m 7,500,040 row of `3112ff7` is the density-sized blocks' 7,440 steps.
- The epinions 498,618 row of `141637b` (0.301 s per step) follows a refactor of the training hot path
  (float32 values converted once, the transpose built in backward only). Timed against `f3dfcdb` right
  after, alternating, 200 steps each (`scale.py _steps`): 0.2713, 0.2708 s per step before, 0.2657,
  0.2629 after; the machine ran slower than at `3112ff7` (0.240) throughout. `a1f3578` against `d52dee0`
  (the sparse product reading the weight in place, LineAdam without the coalescing copy), 120 steps
  each: 0.261 and 0.245 s per step before, 0.226 and 0.219 after.
- The machine of the records from `e6e7396` on (2026-11-27, evening) is faster than that of the earlier
  ones: `e6e7396` (the serving code of `1acb82e`) answered /recommend at p50 66 ms here, `1acb82e` 120 ms
  there, and ML-100K's epochs took 0.9 s against 1.4-1.6 s. Compare times only within one machine.
- epinions-synth's serve records from `e6e7396` on served an artifact retrained here at `e6e7396` with the
  training record's command (run as `dcmc train` directly, so no train record and no look at the test
  split): 10 epochs in 867 s (76-122 s each; tests and profiling ran beside some of them), validation
  RMSE 0.8150, search 472 s (100 trials, best 0.6975). At `e6e7396` /recommend p50 66 ms, at `44ca058`
  (catalogue read in float32, embeddings kept as the artifact's maps, 64 MiB glibc trim threshold) 41 ms,
  at `5e87e2c` 37 ms, at `452eeeb` (start-up's bias fit shared; request code unchanged) 38.7 ms, at
  `cc049fb` (after review: the catalogue's per-item scale computed once) 36.2 ms.
- ml-10m-synth: the schedule (4 epochs, learning rate halved every 2, search cut at 900 s) was chosen for
  this session's time, not on validation; the network's validation RMSE was still falling (1.022, 0.875,
  0.837, 0.827 after epochs 1-4), so the network is under-trained. Its co-rating terms were left out of
  the search (the training split's tables cost 4.3 G and 68 G co-rated pairs, over the 2 G budget). Peak
  RSS is the whole `dcmc train` (training, export, search). Unit tests and a short in-process profile
  (about two minutes in all) ran beside its first epoch (343 s, against 305-318 s for the other three).
  The test split was scored once. Served at
  `b31ff83` (/predict 100 p50 39 ms: the same-item term gathered each column's members' embeddings), at
  `5e87e2c` (9.0 ms; start-up 88 s), at `452eeeb` (9.2 ms; start-up 48 s: the bias baseline fitted
  once per worker instead of twice) and at `cc049fb` (9.4 ms, 47 s).
- ml-10m-synth at `b041842` (14 epochs, learning rate halved every 5, search cut at 900 s; the schedule
  chosen for this session's time, not on validation): validation RMSE after each epoch 1.023, 0.876,
  0.841, 0.818, 0.798, 0.779, 0.770, 0.761, 0.752, 0.743, 0.727, 0.716, 0.718, 0.713, still falling.
  Epochs of 408-477 s (the first, 622 s, ran beside two runs of the unit tests); the same code took
  305-343 s an epoch at `b31ff83` earlier this evening, so the machine ran slower during this run. The
  item co-rating table was built from dense products (`CoRatingGram._products`, new at `b041842`) and
  offered to the search; the user table was left off (68 G pairs). 15 trials in the 900 s (each reads
  the item term over 500 k validation queries; the first built the table); best validation RMSE 0.6656
  (the network alone 0.7132), the chosen output mixes 0.90 of the bias baseline in. The test split was
  scored once.
- Larger blocks on ml-10m, tried on validation only (`dcmc train --dataset csv --data-dir ... --split random
  --epochs 4 --set lr_halve_every=5 --set block_rows=5824 --set block_cols=890 --no-tune`, at `779a864`):
  12 x 12 chunks, 144 steps an epoch of 197-227 s (development work beside it, so upper bounds), validation
  RMSE 1.052, 1.017, 1.020, 1.006 after epochs 1-4, against 1.023, 0.876, 0.841, 0.818 with the 24 x 24
  chunks at `b041842` (epochs of 408-477 s). Per second of training the larger, fewer steps lose:
  `BLOCK_CHUNKS` stays 24.
- `2ed575b` computes a dense block's decoder through its smaller side (`DCMC.block_scores`: B^u v_j once
  per column, then one (p, d) x d product per entry, instead of p d^2 per entry). Against `779a864`,
  alternating, nothing else running: ml-10m's first 60 steps (`scale.py _steps --max-steps 60`) 0.692 and
  0.668 s per step before, 0.644 and 0.601 after; ML-100K u1 (`dcmc train --dataset ml-100k --split u1
  --no-tune`, 100 epochs) validation RMSE 0.8825 and 0.8824 before, 0.8810 and 0.8826 after (the same
  code differs by that much from run to run: its thread pools do not sum in a fixed order), median epoch
  1.33 and 1.33 s before, 1.03 and 1.16 s after.
- epinions-synth retrained and served at `9219339` (2026-11-28's machine, slower than the previous day's:
  ML-100K's epochs with the same training code took 1.33 s there against 0.9 s). Epochs 1-2 (158 and
  153 s) ran beside a one-thread probe (`refine_probe.md`, on ML-100K, about three minutes),
  epochs 3-10 alone (102-108 s). The test split was scored once (0.6971, as at `0db87c5`). After the serve
  record the same artifact was served four more times, alternating the code before that day's serving
  change (`779a864`, the unit rows held beside the lifted ones) with `9219339`; those four records were
  lost from this file (a checkout of the file while uncommitted), their figures: `779a864` 1,034 / 1,291
  MB RSS at rest / after, /predict 100 p50 2.65 ms, /recommend p50 56.9 ms, then 989-1,034 / 1,289 MB,
  1.72 ms, 52.8 ms; `9219339` 856-858 / 1,115 MB, 1.81 ms, 53.9 ms, then 858-1,027 / 1,113 MB, 1.75 ms,
  53.0 ms. /recommend misses its 50 ms target on this machine with either code; the previous artifact
  (settings not kept) answered in 36 ms on the previous day's machine.
- epinions-synth's serve records from `485e11e` on (2026-11-28, the next session's machine) served an
  artifact retrained with the train record's command by `dcmc train` at `7739215` (training code as at
  `9219339`), without a train record of its own and without a look at the test split: 10 epochs in
  1,171 s (102-148 s each, alone), search 784 s over 100 trials, validation RMSE 0.6975 (network
  0.8197). The table's train columns are still `9219339`'s. Serve records: `485e11e` /recommend p50
  58.1 ms; `9d911d8` 64.5, then 55.1 and 57.9 alternating with the code before the day's catalogue
  changes (`782b7df`: 73.1, 64.0); `abfcd6f` 52.4, 51.1 (`782b7df` alternating: 56.8, 57.3); `3b8f17e`
  44.6, 44.5 (`782b7df` alternating: 57.9, 58.7); `e154672` (the same code) 57.5 and 57.9 in a slow
  spell (/predict p50 5.1 and 3.9 ms, twice its usual), then 48.0 and 47.6 (`782b7df` alternating: 58.2,
  63.4); `458ebd7` (the co-rating term's bincount) 58.9, 55.3, 55.7, 57.3, alternating with `782b7df`
  65.5, 63.9, 76.4, 74.9, in a slow spell (/predict p50 3.0-3.8 ms); `474e7df` (the co-rating terms'
  catalogue path moved into `affinity_messages`, the same operations) 45.3 and 46.4 (/predict 2.2-2.6
  ms), not alternated. The `782b7df` runs ran from a second
  checkout, whose
  records were not kept: their figures are these. The machine's speed drifted within the hour (the
  same `782b7df` code 57-73 ms), hence the alternation.
- ml-10m with less dropout, validation only (`dcmc train --dataset csv --data-dir .../ml-10m/ratings.csv
  --split random --epochs 2 --set lr_halve_every=5 --set dropout=0.25 --no-tune`, at `3b8f17e`, alone):
  validation RMSE 1.036 and 0.865 after epochs 1 and 2 (460 and 415 s), against 1.023 and 0.876
  with the paper's 0.75 at `b041842`: no step towards `SVD`'s 0.62 that would change what the search finds
  (the 4- and 14-epoch networks, 0.827 and 0.713, both ended at 0.664 after inference). Not adopted.
- ml-10m-synth at `d833823`: the csv preset's one-layer network for large matrices (64 units, centred,
  sqrt-normalised input, no similarity loss; `benchmarks/results/network_probe.md`), 8 epochs with the
  learning rate halved every 3 (chosen for this session's time). Validation RMSE 0.6708, 0.6539, 0.6342,
  0.6252, 0.6215, 0.6206, 0.6240, 0.6259 after epochs 1-8, 93-107 s each (against 408-477 s for the paper's
  network); its search found nothing better than the network alone (16 trials), so the artifact serves the
  network; a one-thread Epinions probe ran beside the search, and the record, written after later commits,
  was stamped with the commit at its end (`8ed8770`) and corrected by hand to `d833823`, the code it ran
  (`scale.py` now stamps the code a run started on). The default from `8ed8770` on also publishes the best
  epoch (`keep_best`): that would have been epoch 6 (validation 0.6206 against the last epoch's 0.6259). A
  rerun at `0d15c93` was stopped in its second epoch (it ran beside the Epinions run at half speed and
  would not have ended in the session): no record, no test look. The test split was scored once.
  Served at `55684c6` (the artifact serves the network alone: /predict 100 p50 1.05 ms, /recommend 5.35 ms;
  start-up 78 s).
- ml-10m-synth at `0bdc295`: the same command with `keep_best` (the default from `8ed8770` on) and the search
  cut at 300 s (it had found nothing in 900 s before; here 3 trials, none better than the network), alone on
  the machine. Epochs of 92-104 s; the validation curve the same as at `d833823` to 4 digits; epoch 6
  published (0.6207). Test RMSE 0.6205 against `SVD`'s 0.6168, the test split scored once for this
  configuration (the second look at ml-10m this session, after `d833823`'s 0.6256). Served at `0bdc295`.
- epinions-synth at `0d15c93`: from this commit on the csv preset trains the one-layer network from 400,000
  training ratings on, Epinions' 498,618 included (same command as before). It ran beside the stopped
  ml-10m rerun (epochs 2-5) and the unit tests (epochs 5-8), so its epoch times (89-285 s) are upper bounds:
  epochs 9 and 10 ran alone in 17 and 18 s. Validation RMSE 0.7695, 0.7646, then rising to 0.8413 at epoch
  10: `keep_best` published epoch 2. Search 784 s (100 trials; it chose the same-item term, tau 6.9, 0.90 of
  the bias baseline), validation 0.6975; test RMSE 0.6971 (network alone 0.7640), as the paper's network's
  0.6971 (network 0.8148) at `9219339`, with a 148 MB artifact instead of 955 MB. Served at `c4c9871` (its
  uncommitted change: this notes text) and twice at `55684c6`, one after the other: /recommend p50 54.1,
  54.5 and 44.0 ms, /predict 100 p50 2.3, 2.6, 1.9 ms, RSS per worker 416-522 MB (the paper's network's
  artifact: 859-1,111 MB). No artifact of the paper's network was left to alternate with, so whether the
  64-unit embedding changed /recommend's time is not measured here; the three runs spread by the machine's
  drift.
- ml-10m-synth at `7692386`: the large-matrix network now 32 units, Adam at 0.005, `input_dropout` 0.2
  (chosen on validation ratings: `network_probe.md`), `--epochs 10 --halve-every 3 --tune-timeout 300`, alone
  on the machine. Epochs of 69-91 s; validation RMSE 0.6661 after epoch 1, 0.6141 at epoch 9 (published),
  0.6156 at 10; the search (2 trials in 300 s) found nothing better than the network. Test RMSE 0.6142
  against `SVD`'s 0.6168: the third look at ml-10m's test split in two sessions, once per configuration
  (`d833823` 0.6256, `0bdc295` 0.6205, `7692386` 0.6142). Served at `3b7c3ad` twice (/predict 100 p50 1.78,
  1.62 ms; /recommend 6.94, 8.04 ms) and at `13bb435` (2.57, 8.77 ms): slower than the 64-unit artifact's
  1.04 and 4.45 ms at `0bdc295` the day before, with half the embedding. The code of then (`fc91b4e`)
  serving this artifact on this day: 2.03 and 6.34 ms, so the machine's day, not the code, moved them (the
  network alone answers ml-10m: nothing of the exact inference's runs).
- epinions-synth at `7692386`: the same network and training settings, the same command as at `0d15c93`.
  Epochs of 16-19 s alone; validation RMSE 0.7448 after epoch 1 (published; 0.7646 with the 64-unit network),
  then rising to 0.8328 at epoch 10. The search (100 trials, 994 s) chose the same-item term with the item
  co-rating term (gamma 3.5, tau 5.2, 0.90 of the bias baseline): validation 0.69735. Test RMSE 0.6971
  (network alone 0.7459) against `SVD`'s 0.7115; 2.4 GB peak, a 180 MB artifact. Served at `3b7c3ad`:
  /recommend p50 48.3 and 45.5 ms, /predict 100 4.2 and 2.9 ms (the co-rating term, not chosen before, costs
  /predict a table lookup).
- From `2c20e30` one user's whole catalogue is computed level-major (the catalogue products and the column
  pass in Fortran order, the posterior level by level with float32 exponentials: `catalogue_posterior`), and
  from `c1dae23` a request's co-rating block is read from the stored neighbours of the side that holds fewer
  (`SparseAffinity.block`). In-process, one thread, 80 random users' whole rows of this artifact, alternating
  three times: 42.7-47.2 ms p50 at `3b7c3ad` against 24.0-26.1 ms at `9779ffd`. Served, alternating:
  `3b7c3ad` /recommend p50 55.3 ms (/predict 6.2), `9779ffd` 29.1 ms (4.6); then `9779ffd` 30.0 and 29.2 ms
  (/predict 5.6, 4.8), and at `13bb435` 28.0 and 29.5 ms (/predict 3.1, 3.9). RSS per worker 306-542 MB.
  Then `ad9daca` 24.2 ms (/predict 2.5) and `41ac054` 28.4 ms (3.9; the posterior's floored rows moved into
  helpers, the same operations): the table's serve columns.
- The ml-10m curve again at `ad9daca` (`scale.py curve --shape ml-10m --ratings 100000 300000 1000000 3000000
  --max-steps 200`, then `--csv` of the full 10 M), alone: the `csv` preset's own choice of network at each
  size, so the paper's network up to 225,000 training ratings and the 32-unit layer from 750,000 on
  (`LARGE_RATINGS` = 400,000; the plot marks it). Epochs of 27 and 98 s below it, then 18, 35 and 97 s (peak
  RSS 1.36, 1.43, then 0.57, 1.18, 3.40 GB): from 750,000 to 7.5 M ratings, ten times the ratings cost 5.4
  times the epoch. The 100,000-rating row stamped `dbccab9 + uncommitted changes` ran while this notes
  text was being edited (no code changed); the `ad9daca` row of the same size, run after, is the plotted
  one. The plot shows the ml-10m shape alone (the epinions rows are older code's)."""


def _records() -> list[dict[str, Any]]:
    if not RECORDS.is_file():
        return []
    return [json.loads(line) for line in RECORDS.read_text().splitlines() if line.strip()]


def cmd_report(args: argparse.Namespace) -> None:
    records = _records()
    lines = [
        "# Scale",
        "",
        "Written by `python benchmarks/scale.py report` from `scale.jsonl` "
        "(every record, each with its commit). Machine: 2-core x86, no GPU.",
        "",
    ]
    trains = {r["name"]: r for r in records if r["phase"] == "train"}  # the latest of each name
    serves = {r["name"]: r for r in records if r["phase"] == "serve"}
    if trains:
        lines += [
            "## Datasets",
            "",
            "| | ratings (train / val) | users x items | blocks | s / epoch (median) | train s (epochs) "
            "| peak RSS train | artifact | start-up | RSS / PSS, largest worker | /predict 100 p50 / p99 "
            "| /recommend p50 / p99 | test RMSE (network) | Surprise SVD | commit (train, serve) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, t in trains.items():
            s = serves.get(name)
            serve = ["-"] * 4
            if s:
                # the workers: the supervisor's children that hold a model (not its small helper process)
                rest = max((w for w in s["workers_at_rest"]), key=lambda w: w["rss_mb"])
                after = max((w for w in s["workers_after"]), key=lambda w: w["rss_mb"])
                serve = [
                    f"{s['startup_seconds']} s",
                    f"{rest['rss_mb']:.0f} / {rest['pss_mb']:.0f} MB at rest, "
                    f"{after['rss_mb']:.0f} / {after['pss_mb']:.0f} MB after the requests",
                    f"{s['predict100']['p50_ms']} / {s['predict100']['p99_ms']} ms",
                    f"{s['recommend']['p50_ms']} / {s['recommend']['p99_ms']} ms",
                ]
            lines.append(
                f"| {name} | {t['ratings_train']:,} / {t['ratings_val']:,} | {t['users']:,} x {t['items']:,} "
                f"| {t['blocks'][0]} x {t['blocks'][1]} | {np.median(t['epoch_seconds']):.1f} "
                f"| {t['train_seconds']:.0f} ({t['epochs']}) | {t['peak_rss_mb'] / 1024:.2f} GB "
                f"| {t['artifact_mb']:.0f} MB | "
                + " | ".join(serve)
                + f" | {t['test_rmse']:.4f} ({t['test_rmse_network']:.4f}) | {t['svd_rmse']:.4f} "
                f"| `{t['commit']}`, `{s['commit'] if s else '-'}` |"
            )
        lines += ["", "Commands:", ""] + [f"- {n}: `{t['command']}`" for n, t in trains.items()]
        lines += [""] + [f"- {n}: search {t.get('tuning')}" for n, t in trains.items()]
    alone = [r for r in records if r["phase"] == "serve" and r["name"] not in trains]
    if alone:
        lines += [
            "",
            "## Serving artifacts trained elsewhere",
            "",
            "`scale.py serve` of artifacts without a `train` record here (the notes say how each was made).",
            "",
            "| name | workers | start-up | RSS / PSS, largest worker | /predict 100 p50 / p99 "
            "| /recommend p50 / p99 | commit |",
            "|---|---|---|---|---|---|---|",
        ]
        for s in alone:
            rest = max((w for w in s["workers_at_rest"]), key=lambda w: w["rss_mb"])
            lines.append(
                f"| {s['name']} | {s['workers']} | {s['startup_seconds']} s "
                f"| {rest['rss_mb']:.0f} / {rest['pss_mb']:.0f} MB at rest "
                f"| {s['predict100']['p50_ms']} / {s['predict100']['p99_ms']} ms "
                f"| {s['recommend']['p50_ms']} / {s['recommend']['p99_ms']} ms | `{s['commit']}` |"
            )
    curve = [r for r in records if r["phase"] == "curve"]
    if curve:
        lines += [
            "",
            "## Cost curve",
            "",
            "| shape | ratings (train) | blocks | steps / epoch | s / step | s / epoch | peak RSS | commit |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in curve:
            note = f" (extrapolated from {r['steps_timed']} steps)" if r["extrapolated"] else ""
            lines.append(
                f"| {r['shape']} | {r['ratings_train']:,} | {r['blocks'][0]} x {r['blocks'][1]} "
                f"| {r['steps_per_epoch']} | {r['seconds_per_step']:.3f} | {r['epoch_seconds']:.0f}{note} "
                f"| {r['peak_rss_mb'] / 1024:.2f} GB | `{r['commit']}` |"
            )
        _plot(curve)
        lines += ["", "![cost curve](scale-curve.png)"]
    lines += ["", "## Notes on these records", "", NOTES]
    (RESULTS / "scale.md").write_text("\n".join(lines) + "\n")
    print((RESULTS / "scale.md").read_text())


def _plot(curve: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from training.config import LARGE_RATINGS

    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax2 = ax.twinx()
    # The ml-10m shape's sizes (100 k to 10 M ratings of one generator), the latest record of each; earlier
    # ones and the epinions shape's (older code's) stay in the table.
    latest = {r["ratings_train"]: r for r in curve if r["shape"] == "ml-10m"}
    points = sorted(latest.values(), key=lambda r: r["ratings_train"])
    x = [r["ratings_train"] for r in points]
    ax.loglog(x, [r["epoch_seconds"] for r in points], "o-", label="seconds per epoch")
    ax2.semilogx(x, [r["peak_rss_mb"] / 1024 for r in points], "s--", color="C1", label="peak RSS (GB)")
    ax.axvline(LARGE_RATINGS, color="grey", linestyle=":")
    ax.annotate(
        "csv preset: one layer of 32\nunits from here (paper's\nnetwork below)",
        (LARGE_RATINGS, 0.97), xycoords=("data", "axes fraction"), fontsize=8, va="top", ha="left",
    )  # fmt: skip
    ax.set_xlabel("training ratings (synthetic ml-10m shape, 75% of each size)")
    ax.set_ylabel("seconds per epoch")
    ax2.set_ylabel("peak RSS (GB)")
    ax.set_title("Training cost against ratings, synthetic data (2 cores)")
    fig.legend(loc="lower right", bbox_to_anchor=(0.85, 0.15))
    fig.tight_layout()
    fig.savefig(RESULTS / "scale-curve.png", dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--name", required=True)
    t.add_argument("--dataset", required=True)
    t.add_argument("--data", required=True)
    t.add_argument("--split", default="random")
    t.add_argument("--epochs", type=int)
    t.add_argument("--halve-every", type=int)
    t.add_argument("--tune-timeout", type=float, help="stop the inference search after this many seconds")
    t.add_argument("--runs", default=str(REPO / "runs" / "scale"))
    s = sub.add_parser("serve")
    s.add_argument("--name", required=True)
    s.add_argument("--artifacts", required=True)
    s.add_argument("--workers", type=int, default=2)
    s.add_argument("--requests", type=int, default=300)
    c = sub.add_parser("curve")
    c.add_argument("--ratings", type=int, nargs="+", default=[])
    c.add_argument("--csv", help="time this synthetic CSV (of --shape) instead of generating sizes")
    c.add_argument("--shape", default="epinions")
    c.add_argument("--max-steps", type=int, default=300)
    c.add_argument("--threads", type=int, default=2)
    st = sub.add_parser("_steps")
    st.add_argument("--data", required=True)
    st.add_argument("--max-steps", type=int, default=300)
    sub.add_parser("report")
    args = p.parse_args(argv)
    {"train": cmd_train, "serve": cmd_serve, "curve": cmd_curve, "_steps": cmd_steps, "report": cmd_report}[
        args.cmd
    ](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
