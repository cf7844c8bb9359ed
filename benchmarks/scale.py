"""How DCMC's cost grows with the data, on this machine: training, the artifact, serving, accuracy. Each
phase appends its records to benchmarks/results/scale.jsonl (stamped with the commit); `report` writes
scale.md and scale-curve.png from every record.

    python benchmarks/scale.py train --name epinions-synth --dataset csv --data DIR/ratings.csv \
        --split random [--epochs 10 --halve-every 4] [--runs runs/scale]
        `dcmc train` under /usr/bin/time (peak RSS, wall), its per-epoch seconds and the search's, the
        artifact's size; then the test split scored ONCE (every look at a test split is this record):
        `dcmc evaluate` (tuned inference, network alone) beside Surprise `SVD` (defaults, same ratings).
    python benchmarks/scale.py serve --name epinions-synth --artifacts runs/scale/epinions-synth
        `dcmc serve` (2 workers, private redis-server): seconds to /ready, RSS and PSS per worker at rest,
        `/predict` (100 random items, a random user each time) and `/recommend?k=10` p50/p99, sequential.
    python benchmarks/scale.py curve --ratings 100000 300000 1000000 [--shape epinions] [--max-steps 300]
    python benchmarks/scale.py curve --shape ml-10m --csv DIR/ratings.csv   (a CSV already generated)
        For each size, `dcmc data synth --shape SHAPE --ratings N`, then the csv preset's training loop
        (blocks sized to the density) in a child process under /usr/bin/time: an epoch's steps, seconds per
        step, peak RSS; an epoch of more than --max-steps steps is timed over its first --max-steps and
        extrapolated (said so in the record and the table).
    python benchmarks/scale.py report
"""

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

import harness as h
import numpy as np
from harness import REPO, RESULTS

RECORDS = RESULTS / "scale.jsonl"
DCMC = [sys.executable, "-m", "training.cli"]


def _code() -> str:
    """The commit of the code measured (this file's own results, written as it runs, do not count)."""
    return h.commit_label("model", "service", "training", "benchmarks/scale.py", "benchmarks/harness.py")


def _append(record: dict[str, Any], code: str | None = None) -> None:
    """Append a record; `code`: the commit read when the measurement started (a long run outlasts commits)."""
    when = datetime.now(timezone.utc).isoformat(timespec="seconds")
    record = {"when": when, "commit": code or _code(), **record}
    h.append_jsonl(RECORDS, record)
    h.emit(record)


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[str, float, float]:
    """Run `cmd` under /usr/bin/time -v: (stdout, wall seconds, peak RSS in MB)."""
    env = {**os.environ, **(env or {})}
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], cwd=REPO, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rss = float(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1)) / 1024  # type: ignore[union-attr]
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", proc.stderr).group(1)  # type: ignore[union-attr]
    seconds = sum(float(x) * 60**i for i, x in enumerate(reversed(wall.split(":"))))
    return proc.stdout, seconds, rss


def surprise_svd(dataset: str, data: str, split: str) -> dict[str, Any]:
    """Surprise SVD (defaults, seeded) fitted on the training and validation ratings, RMSE on the test."""
    from surprise import SVD

    from training.data import Entries, load_dataset

    s = load_dataset(dataset, data, split=split, seed=0)
    known = s.train if s.val is None else Entries.concat([s.train, s.val])
    trainset, testset = h.surprise_data(known, s.test, s.user_ids, s.item_ids, (s.levels[0], s.levels[-1]))
    t0 = time.perf_counter()
    algo = SVD(random_state=0)
    algo.fit(trainset)
    fit = time.perf_counter() - t0
    est = np.array([p.est for p in algo.test(testset)])
    return {"svd_rmse": h.rmse(est, s.test.values), "svd_fit_seconds": round(fit, 1)}


def cmd_train(args: argparse.Namespace) -> None:
    code = _code()
    out = Path(args.runs) / args.name
    argv = [*DCMC, "train", "--dataset", args.dataset, "--data-dir", args.data, "--split", args.split]
    argv += ["--out", str(out), "--no-progress"]
    if args.epochs:
        argv += ["--epochs", str(args.epochs)]
    if args.halve_every:
        argv += ["--set", f"lr_halve_every={args.halve_every}"]
    if args.tune_timeout:
        argv += ["--tune-timeout", str(args.tune_timeout)]
    stdout, wall, rss = timed(argv)
    metrics = h.last_json(stdout)
    history = metrics.get("history") or json.loads((out / "metrics.json").read_text()).get("history", [])
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
        "epoch_seconds": [round(float(e["seconds"]), 1) for e in history],
        "train_seconds": metrics["train_seconds"],
        "val_rmse": metrics["val_rmse"],
        "tuning": metrics.get("tuning"),
        "wall_seconds": round(wall, 1),
        "peak_rss_mb": round(rss, 1),
        "artifact_mb": round(sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2**20, 1),
    }
    evaluate = [*DCMC, "evaluate", "--artifacts", str(out), "--data-dir", args.data]
    tuned, network = h.run_json(evaluate), h.run_json([*evaluate, "--set", "inference.mode=none"])
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
    s = h.summarize(np.array(seconds) * 1000)
    return {"p50_ms": round(s["p50_ms"], 2), "p99_ms": round(s["p99_ms"], 2), "n": s["n"]}


def cmd_serve(args: argparse.Namespace) -> None:
    from model.artifact import load_artifact

    art = load_artifact(args.artifacts)
    users, items = art.users.ids, art.items.ids
    rng = np.random.default_rng(0)
    log = Path(tempfile.mkdtemp(prefix="dcmc-scale-")) / "serve.log"
    timings: dict[str, list[float]] = {"predict100": [], "recommend": []}

    def user() -> str:
        return users[rng.integers(len(users))]

    def predict() -> Any:
        body = {"user": user(), "items": [items[j] for j in rng.choice(len(items), 100, replace=False)]}
        return lambda: svc.client.post("/predict", json=body)

    def recommend() -> Any:
        path = f"/recommend/{user()}"
        return lambda: svc.client.get(path, params={"k": 10})

    def time_requests(name: str, route: str, n: int, request: Any) -> None:
        for k in range(n + 20):  # the first 20 of each warm the workers, not counted
            send = request()  # drawn before the clock starts
            t = time.perf_counter()
            r = send()
            if r.status_code != 200:
                raise RuntimeError(f"{route} answered {r.status_code}: {r.text[:300]}")
            if k >= 20:
                timings[name].append(time.perf_counter() - t)

    with h.Redis() as redis:
        t0 = time.perf_counter()
        env = {"OMP_NUM_THREADS": "1"}
        svc = h.Service(Path(args.artifacts), redis.url, "scale", args.workers, log, env=env)
        try:
            svc.wait_ready(timeout=1800)
            startup = time.perf_counter() - t0
            memory = _worker_memory(svc.proc.pid)
            time_requests("predict100", "/predict", args.requests, predict)
            time_requests("recommend", "/recommend", args.requests // 3, recommend)
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
    h.emit(
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


def cmd_curve(args: argparse.Namespace) -> None:
    # --csv: a CSV already written by `dcmc data synth --shape SHAPE` (its full size); else one per size
    for n in [None] if args.csv else args.ratings:
        with tempfile.TemporaryDirectory(prefix="dcmc-curve-") as data:
            if n is not None:
                synth = [*DCMC, "data", "synth", "--shape", args.shape, "--out", data, "--ratings", str(n)]
                subprocess.run(synth, cwd=REPO, check=True, capture_output=True)
            csv = args.csv or str(Path(data) / "ratings.csv")
            child = [sys.executable, __file__, "_steps", "--data", csv, "--max-steps", str(args.max_steps)]
            stdout, wall, rss = timed(child, env={"OMP_NUM_THREADS": str(args.threads)})
        found = h.last_json(stdout)
        size = {"ratings": n} if n is not None else {"ratings": found["ratings_train"], "csv": args.csv}
        record = {"phase": "curve", "shape": args.shape, **size, **found}
        _append({**record, "peak_rss_mb": round(rss, 1), "wall_seconds": round(wall, 1)})


def _serve_cells(s: dict[str, Any]) -> list[str]:
    """start-up, the largest worker's RSS / PSS at rest, /predict and /recommend p50 / p99."""
    # the workers: the supervisor's children that hold a model (not its small helper process)
    rest = max(s["workers_at_rest"], key=lambda w: w["rss_mb"])
    return [
        f"{s['startup_seconds']} s",
        f"{rest['rss_mb']:.0f} / {rest['pss_mb']:.0f} MB at rest",
        *(f"{s[k]['p50_ms']} / {s[k]['p99_ms']} ms" for k in ("predict100", "recommend")),
    ]


def cmd_report(args: argparse.Namespace) -> None:
    records = h.read_jsonl(RECORDS)
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
            *h.table(
                "| | ratings (train / val) | users x items | blocks | s / epoch (median) | train s (epochs) "
                "| peak RSS train | artifact | start-up | RSS / PSS, largest worker | /predict 100 p50 / p99 "
                "| /recommend p50 / p99 | test RMSE (network) | Surprise SVD | commit (train, serve) |"
            ),
        ]
        for name, t in trains.items():
            s = serves.get(name)
            serve = ["-"] * 4
            if s:
                after = max(s["workers_after"], key=lambda w: w["rss_mb"])
                serve = _serve_cells(s)
                serve[1] += f", {after['rss_mb']:.0f} / {after['pss_mb']:.0f} MB after the requests"
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
            *h.table(
                "| name | workers | start-up | RSS / PSS, largest worker | /predict 100 p50 / p99 "
                "| /recommend p50 / p99 | commit |"
            ),
        ]
        for s in alone:
            lines.append(
                f"| {s['name']} | {s['workers']} | " + " | ".join(_serve_cells(s)) + f" | `{s['commit']}` |"
            )
    curve = [r for r in records if r["phase"] == "curve"]
    if curve:
        lines += [
            "",
            "## Cost curve",
            "",
            *h.table(
                "| shape | ratings (train) | blocks | steps / epoch | s / step | s / epoch | peak RSS "
                "| commit |"
            ),
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
    h.write_report(RESULTS / "scale.md", lines)
    print((RESULTS / "scale.md").read_text())


def _plot(curve: list[dict[str, Any]]) -> None:
    from training.config import LARGE_RATINGS

    plt = h.pyplot()
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
    p = h.parser(__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.set_defaults(func=cmd_train)
    for name in ("--name", "--dataset", "--data"):
        t.add_argument(name, required=True)
    t.add_argument("--split", default="random")
    t.add_argument("--epochs", type=int)
    t.add_argument("--halve-every", type=int)
    t.add_argument("--tune-timeout", type=float, help="stop the inference search after this many seconds")
    t.add_argument("--runs", default=str(REPO / "runs" / "scale"))
    s = sub.add_parser("serve")
    s.set_defaults(func=cmd_serve)
    s.add_argument("--name", required=True)
    s.add_argument("--artifacts", required=True)
    s.add_argument("--workers", type=int, default=2)
    s.add_argument("--requests", type=int, default=300)
    c = sub.add_parser("curve")
    c.set_defaults(func=cmd_curve)
    c.add_argument("--ratings", type=int, nargs="+", default=[])
    c.add_argument("--csv", help="time this synthetic CSV (of --shape) instead of generating sizes")
    c.add_argument("--shape", default="epinions")
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--max-steps", type=int, default=300)
    st = sub.add_parser("_steps")
    st.set_defaults(func=cmd_steps)
    st.add_argument("--data", required=True)
    st.add_argument("--max-steps", type=int, default=300)
    sub.add_parser("report").set_defaults(func=cmd_report)
    args = p.parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
