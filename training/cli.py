"""The `dcmc` command: train, evaluate, data download, serve.

Heavy imports (torch, the service, even numpy) happen inside the subcommands, so `dcmc serve` works in
the slim serving image that has no torch, and hands over to the service without importing anything twice.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

DATASET_CHOICES = ("ml-100k", "douban", "flixster", "yahoo_music", "epinions", "csv")
DEFAULT_TRIALS = 100  # training.tune.DEFAULT_TRIALS (not imported here: it needs optuna)


def _settings(pairs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            from model.config import ConfigError

            raise ConfigError(f"--set expects KEY=VALUE, got {pair!r}")
        out[key.strip()] = value.strip()
    return out


FROM_ENV = "$REDIS_URL"
"""`--online-ratings` given without a URL: read it from the environment variable REDIS_URL."""


def _online_url(value: str | None) -> str | None:
    """The Redis URL of `--online-ratings` (DataError when it names REDIS_URL and that is unset)."""
    if value != FROM_ENV:
        return value
    url = os.environ.get("REDIS_URL")
    if not url:
        from training.data import DataError

        raise DataError(
            "--online-ratings without a URL reads the environment variable REDIS_URL, which is unset"
        )
    return url


def _cmd_train(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from training.pipeline import run_training

    online_ratings = _online_url(args.online_ratings)

    if args.threads:
        torch.set_num_threads(args.threads)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1  # set by torchrun
    if distributed:
        dist.init_process_group("gloo")
        torch.set_num_threads(args.threads or 1)
    try:
        metrics = run_training(
            args.dataset,
            args.data_dir,
            args.out,
            split=args.split,
            split_seed=args.split_seed,
            preset_name=args.preset,
            epochs=args.epochs,
            seed=args.seed,
            settings=_settings(args.set),
            checkpoint_dir=args.checkpoint_dir,
            resume=args.resume,
            progress=not args.no_progress,
            tune=not args.no_tune,
            tune_trials=args.tune_trials,
            tune_timeout=args.tune_timeout,
            online_ratings=online_ratings,
            online_prefix=args.online_prefix,
            items=args.items,
        )
        if distributed:  # tear gloo down together: a rank that left while rank 0 still exported aborted
            dist.barrier()  # at exit now and then ("terminate called without an active exception", SIGABRT)
    finally:
        if distributed:
            dist.destroy_process_group()
    if not distributed or int(os.environ.get("RANK", "0")) == 0:
        summary = {k: v for k, v in metrics.items() if k != "history"}
        if args.publish:
            from model.artifact import publish

            summary["published"] = {"link": args.publish, "model_version": publish(args.out, args.publish)}
        print(json.dumps({"artifacts": str(args.out), **summary}))
    return 0


def _inference_overrides(pairs: list[str], command: str) -> dict[str, str]:
    """`--set inference.<group>.<name>=VALUE` pairs as inference overrides (ConfigError otherwise)."""
    from model.config import ConfigError, setting_names

    overrides = {}
    for key, value in _settings(pairs).items():
        group, dot, name = key.partition(".")
        if group != "inference" or not dot:
            raise ConfigError(
                f"dcmc {command} --set takes inference settings (inference.<group>.<name>), got {key!r}"
            )
        if name not in setting_names():
            raise ConfigError(f"unknown inference setting {name!r}; valid: {', '.join(setting_names())}")
        overrides[name] = value
    return overrides


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from training.evaluate import evaluate

    overrides = _inference_overrides(args.set, "evaluate")
    result = evaluate(args.artifacts, args.data_dir, overrides=overrides, part=args.on)
    print(json.dumps(result))
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    from model.artifact import load_artifact
    from model.scorers import artifact_scorer

    artifact = load_artifact(args.artifacts)
    _, scorer = artifact_scorer(artifact, artifact.settings(_inference_overrides(args.set, "explain")))
    user = artifact.users.indices([args.user])[0]
    items = artifact.items.indices(args.item)
    if args.k < 1:
        from model.config import ConfigError

        raise ConfigError(f"-k must be at least 1, got {args.k}")
    known = artifact.known()  # the scorer's known ratings, in the same order
    for item, e in zip(args.item, scorer.explain(int(user), items, args.k), strict=True):
        because = [
            {
                "user": artifact.users.ids[int(known.rows[pos])],
                "item": artifact.items.ids[int(known.cols[pos])],
                "rating": float(known.values[pos]),
                "effect": effect,
            }
            for pos, effect in zip(e.known.tolist(), e.effects.tolist(), strict=True)
        ]
        why = {"network": e.network, "because": because}
        print(json.dumps({"user": args.user, "item": item, "rating": e.rating, "explanation": why}))
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    from training.fold_in import choose_and_write
    from training.tune import tune_artifact

    result = tune_artifact(
        args.artifacts,
        trials=args.trials,
        timeout=args.timeout,
        seed=args.seed,
        progress=not args.no_progress,
    )
    fold_in = choose_and_write(args.artifacts, args.seed)  # it depends on the inference just chosen
    r = result.record
    summary = {k: r[k] for k in ("trials_run", "seconds", "best_val_rmse", "base_network_val_rmse", "why")}
    chosen = result.chosen.to_dict()
    refine = fold_in.get("refine", "all")
    print(
        json.dumps({"artifacts": str(args.artifacts), "chosen": chosen, **summary, "fold_in_refine": refine})
    )
    return 0


def _cmd_publish(args: argparse.Namespace) -> int:
    from model.artifact import publish

    version = publish(args.artifacts, args.link)
    print(json.dumps({"published": str(args.artifacts), "link": str(args.link), "model_version": version}))
    return 0


def _cmd_compact(args: argparse.Namespace) -> int:
    from training.compact import compact_for_artifact

    url = _online_url(args.online_ratings)
    assert url is not None
    print(json.dumps(compact_for_artifact(url, args.online_prefix, args.artifacts)))
    return 0


def _cmd_experiment_report(args: argparse.Namespace) -> int:
    import redis

    from model.artifact import read_config
    from model.experiments import read_experiments, read_streams, report_table, results
    from model.stream import connect, redact_url
    from training.data import DataError

    if not args.experiments:
        raise DataError("give the experiments file (--experiments, or DCMC_EXPERIMENTS)")
    specs = {e.id: e for e in read_experiments(args.experiments)}
    if args.id not in specs:
        raise DataError(
            f"no experiment {args.id!r} in {args.experiments} (it has: {', '.join(specs) or 'none'})"
        )
    if not args.artifacts:
        raise DataError("give the served artifact (--artifacts, or DCMC_ARTIFACTS): its levels and items")
    model_config, _ = read_config(args.artifacts)
    url = args.redis or os.environ.get("REDIS_URL")
    if not url:
        raise DataError("give the Redis URL (--redis URL, or REDIS_URL)")
    client = connect(url, socket_timeout=30, socket_connect_timeout=10)
    try:
        impressions, feedback = read_streams(client, args.prefix)
    except redis.RedisError as exc:
        raise DataError(f"cannot read the streams from {redact_url(url)}: {exc}") from None
    finally:
        client.close()
    figures = results(specs[args.id], impressions, feedback, list(model_config.levels), model_config.n_items)
    print(json.dumps(figures, indent=2) if args.json else report_table(figures))
    return 0


def _cmd_synth(args: argparse.Namespace) -> int:
    import time

    from training.synthetic import SHAPES, planted_ratings, write_ratings_csv

    shape = SHAPES[args.shape]
    t0 = time.perf_counter()
    try:
        rows, cols, values = planted_ratings(
            shape.n_users, shape.n_items, args.ratings or shape.n_ratings, shape.levels, seed=args.seed
        )
    except ValueError as exc:
        from training.data import DataError

        raise DataError(str(exc)) from None
    path = write_ratings_csv(Path(args.out) / "ratings.csv", rows, cols, values)
    summary = {
        "csv": str(path),
        "shape": args.shape,
        "users": shape.n_users,
        "items": shape.n_items,
        "ratings": len(values),
        "seed": args.seed,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(summary))
    return 0


def _cmd_download(args: argparse.Namespace) -> int:
    from training.download import download

    path = download(args.name, Path(args.to))
    print(f"{args.name}: ready in {path}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from training.pipeline import run_training
    from training.synthetic import low_rank_ratings, write_csv

    out = Path(args.out)
    if args.data_dir:
        print(f"training on MovieLens-100K from {args.data_dir} (a few minutes)...", file=sys.stderr)
        run_training("ml-100k", args.data_dir, out, progress=True)
        user, items = "196", ["242", "302", "377"]
    else:
        data = write_csv(out.parent / f"{out.name}-data" / "ratings.csv", low_rank_ratings(300, 200, 4, 0.2))
        print(f"training on a generated 300 x 200 rating matrix ({data})...", file=sys.stderr)
        run_training(
            "csv",
            data,
            out,
            split="random",
            epochs=40,
            settings={"block_rows": "100", "block_cols": "100", "lr_halve_every": "15"},
        )
        user, items = "u0", ["i1", "i2", "i3"]
    token = os.environ.setdefault("DCMC_WRITE_TOKEN", "demo-token")
    redis_url = os.environ.get("REDIS_URL") or _local_redis()
    if redis_url:
        os.environ["REDIS_URL"] = redis_url
        os.environ.setdefault("DCMC_REDIS_KEY_PREFIX", f"dcmc-demo-{out.name}")
    else:
        print("no Redis at 127.0.0.1:6379: serving without online ratings (see the README)", file=sys.stderr)
    print(f"\nartifact: {out}", flush=True)
    from model.artifact import load_artifact
    from model.catalogue import CATALOGUE

    category = None
    if (out / CATALOGUE).is_file():  # MovieLens-100K's u.item: titles, genres
        category = "Comedy" if args.data_dir else None
        print(demo_showcase(load_artifact(out), user, category), flush=True)
    print(
        demo_commands(f"http://{args.host}:{args.port}", user, items, token if redis_url else None, category),
        flush=True,
    )
    if args.no_serve:
        return 0
    args.artifacts, args.workers = out, 1
    return _cmd_serve(args)


def _local_redis() -> str | None:
    """redis://127.0.0.1:6379/0 when a server answers there."""
    import socket

    try:
        with socket.create_connection(("127.0.0.1", 6379), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            if s.recv(16).startswith(b"+PONG"):
                return "redis://127.0.0.1:6379/0"
    except OSError:
        pass
    return None


def demo_showcase(artifact: Any, user: str, category: str | None, k: int = 5) -> str:
    """What `dcmc demo` shows of an artifact with a catalogue: the user's best-rated items and top k by
    predicted rating, with titles (of `category` only, when given), as GET /recommend ranks them
    (hidden items left out; no diversity)."""
    import numpy as np

    from training.evaluate import predict_ratings

    records = artifact.catalogue
    u, n = artifact.users.index(user), len(artifact.items)
    ratings = predict_ratings(artifact, np.full(n, u), np.arange(n), artifact.settings())
    known = artifact.known()
    mine = known.by_row.of(u)
    rated = set(known.cols[mine].tolist())

    def title(j: int) -> str:
        record = records.get(artifact.items.ids[j])
        return record.title if record is not None and record.title else artifact.items.ids[j]

    def allowed(j: int, only: str | None) -> bool:
        record = records.get(artifact.items.ids[j])
        hidden = record is not None and record.hidden
        return (
            j not in rated
            and not hidden
            and (only is None or (record is not None and only in record.categories))
        )

    best = sorted(mine.tolist(), key=lambda p: -known.values[p])[:k]
    lines = [f"user {user} rated {len(mine)} items, among them:"]
    lines += [f"  {known.values[p]:.0f}  {title(int(known.cols[p]))}" for p in best]
    for only in (None, category) if category else (None,):
        order = sorted((j for j in range(n) if allowed(j, only)), key=lambda j: (-ratings[j], j))[:k]
        among = f" among {only}" if only else ""
        lines.append(f"top {k} by predicted rating{among} (GET /recommend with diversity=0):")
        lines += [f"  {ratings[j]:.2f}  {title(j)}" for j in order]
    return "\n".join(lines)


def demo_commands(
    url: str, user: str, items: list[str], token: str | None, category: str | None = None
) -> str:
    """The curl commands `dcmc demo` prints: predictions, a filtered list where the artifact has a
    catalogue (`category`), then (with Redis) the online loop: a new user's recommendations before and
    after its first ratings."""
    predict = json.dumps({"user": user, "items": items})
    lines = [
        f"serving on {url} (Ctrl-C stops). Try:",
        f"  curl -s -X POST {url}/predict -H 'content-type: application/json' -d '{predict}'",
        f"  curl -s '{url}/similar-users/{user}?k=5'",
        f"  curl -s '{url}/recommend/{user}?k=5'",
    ]
    if category is not None:
        lines += [
            f"  curl -s '{url}/recommend/{user}?k=5&category={category}'",
            f"  curl -s '{url}/items/{items[0]}'",
        ]
    if token is not None:
        ratings = json.dumps({"ratings": [{"user": "newcomer", "item": i, "rating": 5} for i in items]})
        lines += [
            "A user the model never saw: popular items first, then its own recommendations once it rates:",
            f"  curl -s '{url}/recommend/newcomer?k=5'",
            f"  curl -s -X POST {url}/ratings -H 'authorization: Bearer {token}' "
            f"-H 'content-type: application/json' -d '{ratings}'",
            f"  curl -s '{url}/recommend/newcomer?k=5'",
        ]
    return "\n".join(lines) + "\n"


def _cmd_serve(args: argparse.Namespace) -> int:
    # The service is a separate program (it shares only the artifact with training): hand over to it.
    argv = [
        sys.executable,
        "-m",
        "service",
        "--artifacts",
        str(args.artifacts),
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--workers",
        str(args.workers),
    ]
    os.execv(sys.executable, argv)
    return 0  # pragma: no cover


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `dcmc`."""
    parser = argparse.ArgumentParser(
        prog="dcmc", description="Deep CRF matrix completion: train, evaluate, serve."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model and write an artifact directory")
    t.add_argument("--dataset", required=True, choices=DATASET_CHOICES)
    t.add_argument("--data-dir", required=True, help="directory (or CSV file) holding the data")
    t.add_argument("--out", required=True, help="artifact directory to write")
    t.add_argument(
        "--split",
        default="u1",
        help="u1 (the standard split; ml-100k also u2..u5), random (75/5/20), or resample (ml-100k and the "
        "Monti datasets: the pooled ratings re-split with the standard test size; --split-seed) (default u1)",
    )
    t.add_argument(
        "--items",
        help="item catalogue to keep in the artifact: CSV (item, title, categories as a|b, hidden, other "
        "columns as attributes) or JSON lines; MovieLens-100K reads its own u.item without it",
    )
    t.add_argument("--split-seed", type=int, default=0, help="seed of random train/val/test splits")
    t.add_argument("--preset", default="default", choices=("default", "paper", "tiny"))
    t.add_argument("--epochs", type=int, help="override the preset's number of epochs")
    t.add_argument("--seed", type=int, help="seed of initialisation, data order and dropout (default 0)")
    t.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a ModelConfig/TrainConfig field, e.g. --set gamma=0.01, or the artifact's inference "
        "setting, e.g. --set inference.crf.gamma=2 (repeatable)",
    )
    t.add_argument("--checkpoint-dir", help="where checkpoints go (default: OUT.ckpt beside OUT)")
    t.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    t.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument(
        "--no-tune",
        action="store_true",
        help="do not search the inference settings nor choose the fold-in policy on validation after "
        "training (the artifact serves the generic start and refines every rating user at fold-in)",
    )
    t.add_argument("--tune-trials", type=int, help=f"trials of the search (default {DEFAULT_TRIALS})")
    t.add_argument("--tune-timeout", type=float, help="stop the search after this many seconds")
    t.add_argument(
        "--online-ratings",
        metavar="REDIS_URL",
        nargs="?",
        const=FROM_ENV,
        help="also train on the ratings the service took online (the Redis stream PREFIX:ratings at this "
        "URL, e.g. redis://127.0.0.1:6379/0; without a URL, the one in the environment variable REDIS_URL, "
        "which keeps a password off the command line); the artifact records how far it read, and a "
        "service loading it replays only the later ones",
    )
    t.add_argument(
        "--online-prefix", default="dcmc", help="the service's DCMC_REDIS_KEY_PREFIX (default dcmc)"
    )
    t.add_argument(
        "--publish",
        metavar="LINK",
        help="then point the symlink LINK (what `dcmc serve` serves, e.g. artifacts/current) at OUT, "
        "atomically: running services swap the new model in (`dcmc publish`)",
    )
    t.set_defaults(func=_cmd_train)

    tu = sub.add_parser(
        "tune",
        help="choose an artifact's inference settings on its validation ratings and write them into it",
    )
    tu.add_argument("--artifacts", required=True)
    tu.add_argument("--trials", type=int, default=DEFAULT_TRIALS, help=f"default {DEFAULT_TRIALS}")
    tu.add_argument("--timeout", type=float, help="stop after this many seconds (then the trials run vary)")
    tu.add_argument("--seed", type=int, default=0, help="seed of the TPE sampler (default 0)")
    tu.add_argument("--no-progress", action="store_true", help="no progress bar")
    tu.set_defaults(func=_cmd_tune)

    p = sub.add_parser(
        "publish",
        help="verify an artifact and point a symlink (what `dcmc serve` serves) at it atomically; "
        "running services swap it in (hot reload)",
    )
    p.add_argument("--artifacts", required=True, help="the artifact to publish")
    p.add_argument("--link", required=True, help="the symlink to repoint, e.g. artifacts/current")
    p.set_defaults(func=_cmd_publish)

    c = sub.add_parser(
        "compact",
        help="trim the rating stream up to what the published artifact read, keeping it consolidated in "
        "Redis (a retrain and an older model's service read it from there)",
    )
    c.add_argument("--artifacts", required=True, help="the published artifact, e.g. artifacts/current")
    c.add_argument(
        "--online-ratings",
        nargs="?",
        const=FROM_ENV,
        default=FROM_ENV,
        metavar="REDIS_URL",
        help="the Redis of the stream (default: the environment variable REDIS_URL)",
    )
    c.add_argument(
        "--online-prefix", default="dcmc", help="the service's DCMC_REDIS_KEY_PREFIX (default dcmc)"
    )
    c.set_defaults(func=_cmd_compact)

    e = sub.add_parser(
        "evaluate", help="RMSE/MAE of an artifact on its test (or validation) split (one JSON line)"
    )
    e.add_argument(
        "--artifacts",
        required=True,
        nargs="+",
        help="an artifact, or several of one dataset and split: an ensemble (expected ratings averaged)",
    )
    e.add_argument("--data-dir", required=True)
    e.add_argument(
        "--on",
        choices=("test", "val"),
        default="test",
        help="held-out entries to score: the test split (default) or the validation entries",
    )
    e.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="inference.GROUP.NAME=VALUE",
        help="override an inference setting of the artifact, e.g. --set inference.mode=exact "
        "--set inference.crf.gamma=2 (repeatable; docs/inference.md lists them)",
    )
    e.set_defaults(func=_cmd_evaluate)

    x = sub.add_parser(
        "explain",
        help="which known ratings moved a prediction of an artifact, by how much (one JSON line per item, "
        "as POST /predict with explain answers; exact inference only)",
    )
    x.add_argument("--artifacts", required=True)
    x.add_argument("--user", required=True, help="external user id")
    x.add_argument("--item", required=True, action="append", help="external item id (repeatable)")
    x.add_argument("-k", type=int, default=5, help="known ratings to list per prediction (default 5)")
    x.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="inference.GROUP.NAME=VALUE",
        help="override an inference setting of the artifact, as `dcmc evaluate --set` (repeatable)",
    )
    x.set_defaults(func=_cmd_explain)

    ex = sub.add_parser("experiment", help="experiments on live traffic (DCMC_EXPERIMENTS)")
    exsub = ex.add_subparsers(dest="experiment_command", required=True)
    rep = exsub.add_parser(
        "report",
        help="an experiment's results computed from the service's Redis streams: the figures GET "
        "/experiments/{id}/results shows",
    )
    rep.add_argument("id", help="the experiment's id")
    rep.add_argument(
        "--experiments",
        default=os.environ.get("DCMC_EXPERIMENTS"),
        help="the experiments file (default: DCMC_EXPERIMENTS)",
    )
    rep.add_argument(
        "--artifacts",
        default=os.environ.get("DCMC_ARTIFACTS"),
        help="the served artifact (its rating levels and item count; default: DCMC_ARTIFACTS)",
    )
    rep.add_argument(
        "--redis",
        default=None,
        metavar="REDIS_URL",
        help="the service's Redis (default: the environment variable REDIS_URL)",
    )
    rep.add_argument(
        "--prefix",
        default=os.environ.get("DCMC_REDIS_KEY_PREFIX", "dcmc"),
        help="the service's DCMC_REDIS_KEY_PREFIX (default dcmc)",
    )
    rep.add_argument("--json", action="store_true", help="the JSON GET /experiments/{id}/results answers")
    rep.set_defaults(func=_cmd_experiment_report)

    d = sub.add_parser("data", help="dataset utilities")
    dsub = d.add_subparsers(dest="data_command", required=True)
    dl = dsub.add_parser("download", help="download a public dataset and verify its sha256")
    dl.add_argument("name", choices=("ml-100k", "douban", "flixster", "yahoo_music", "epinions"))
    dl.add_argument("--to", required=True, help="target directory")
    dl.set_defaults(func=_cmd_download)
    sy = dsub.add_parser(
        "synth",
        help="write a seeded synthetic rating CSV of a large dataset's shape (power-law degrees, planted "
        "biases, low-rank preferences, neighbourhoods and noise): train it with --dataset csv --split random",
    )
    sy.add_argument("--shape", required=True, choices=("epinions", "ml-10m"))
    sy.add_argument("--out", required=True, help="directory; the CSV is OUT/ratings.csv")
    sy.add_argument("--ratings", type=int, help="how many ratings (default the dataset's own count)")
    sy.add_argument("--seed", type=int, default=0)
    sy.set_defaults(func=_cmd_synth)

    demo = sub.add_parser("demo", help="train on built-in data (or a local ML-100K copy), then serve it")
    demo.add_argument("--data-dir", help="train on MovieLens-100K from here instead of generated data")
    demo.add_argument("--out", default="artifacts/demo", help="artifact directory (default artifacts/demo)")
    demo.add_argument("--host", default="127.0.0.1")
    demo.add_argument("--port", type=int, default=8000)
    demo.add_argument("--no-serve", action="store_true", help="train and stop")
    demo.set_defaults(func=_cmd_demo)

    s = sub.add_parser("serve", help="serve an artifact over HTTP")
    s.add_argument("--artifacts", required=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--workers", type=int, default=1)
    s.set_defaults(func=_cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `dcmc`; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    if args.command == "serve":
        return _cmd_serve(args)
    from model.artifact import ArtifactError
    from model.catalogue import CatalogueError
    from model.config import ConfigError
    from model.exact.explain import CannotExplain
    from model.experiments import ExperimentError
    from model.ids import UnknownIdError
    from training.data import DataError
    from training.errors import ExportError, TrainingError

    try:
        return int(args.func(args))
    except (
        DataError,
        ConfigError,
        ArtifactError,
        UnknownIdError,
        TrainingError,
        ExportError,
        CannotExplain,
        CatalogueError,
        ExperimentError,
    ) as exc:
        print(f"dcmc {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
