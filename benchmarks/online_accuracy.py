"""Part 1 of benchmarks/online.py: fold-in accuracy and the cold-start curve on ML-100K u1 (a seeded 10% of
the users left out of training, their ratings posted through POST /ratings, their u1 test ratings scored
against the model trained with them), and its section of online.md."""

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import harness as h
import numpy as np
from harness import Redis, Service, rmse

COLD_START = (0, 1, 2, 5, 10, 20, 50)
"""Ratings posted per held-out user at each point of the cold-start curve (then all of them)."""
HELD_FRACTION = 0.10
HELD_SEED = 0
TARGET_GAP = 0.01
"""The target: fold-in RMSE within this much of the trained-in model's on the same entries."""


def select_users(users: np.ndarray, fraction: float = HELD_FRACTION, seed: int = HELD_SEED) -> np.ndarray:
    """A seeded `fraction` of the distinct `users` (round(fraction * n) of them), sorted."""
    pool = np.unique(np.asarray(users, dtype=np.int64))
    n = round(fraction * len(pool))
    chosen = np.random.default_rng(seed).choice(pool, size=n, replace=False)
    return np.sort(chosen)


def write_csv(path: Path, user_ids: Sequence[str], item_ids: Sequence[str], *entries: np.ndarray) -> None:
    """A `user,item,rating` file (header line, external ids) of the entries (rows, cols, values), in order."""
    with path.open("w") as fh:
        fh.write("user,item,rating\n")
        for i, j, v in zip(*(e.tolist() for e in entries), strict=True):
            fh.write(f"{user_ids[i]},{item_ids[j]},{v:g}\n")


def write_dataset(directory: Path, split: Any, held: np.ndarray) -> np.ndarray:
    """A csv dataset directory: train.csv = the split's training entries less every one of the `held`
    users, test.csv = the split's test entries. Returns the mask of the training entries kept."""
    directory.mkdir(parents=True, exist_ok=True)
    keep = ~np.isin(split.train.rows, held)
    tr, te = split.train, split.test
    write_csv(
        directory / "train.csv", split.user_ids, split.item_ids, tr.rows[keep], tr.cols[keep], tr.values[keep]
    )
    write_csv(directory / "test.csv", split.user_ids, split.item_ids, te.rows, te.cols, te.values)
    return keep


def bootstrap_gap(
    groups: np.ndarray, a: np.ndarray, b: np.ndarray, truth: np.ndarray, n: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """95% interval of rmse(a) - rmse(b) over the same entries, resampling the groups (users) with
    replacement (paired: both predictions of an entry stay together)."""
    uniq, inverse = np.unique(groups, return_inverse=True)
    sa = np.bincount(inverse, (a - truth) ** 2, len(uniq))
    sb = np.bincount(inverse, (b - truth) ** 2, len(uniq))
    cnt = np.bincount(inverse, minlength=len(uniq)).astype(np.float64)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(uniq), size=(n, len(uniq)))
    w = np.stack([np.bincount(d, minlength=len(uniq)) for d in draws]).astype(np.float64)
    gaps = np.sqrt(w @ sa / (w @ cnt)) - np.sqrt(w @ sb / (w @ cnt))
    lo, hi = np.percentile(gaps, [2.5, 97.5])
    return float(lo), float(hi)


def time_order(users: np.ndarray, timestamps: np.ndarray) -> dict[int, np.ndarray]:
    """Per user, the positions of their entries by timestamp (ties by position)."""
    order = np.lexsort((np.arange(len(users)), timestamps, users))
    bounds = np.flatnonzero(np.diff(users[order])) + 1
    return {int(users[chunk[0]]): chunk for chunk in np.split(order, bounds) if len(chunk)}


def steps(counts: Sequence[int], sizes: dict[int, int]) -> list[tuple[int, dict[int, tuple[int, int]]]]:
    """The posting plan of the cold-start curve: for each count n (then None = all), the slice
    [start, stop) of each user's ordered ratings to post so that the first min(n, n_i) are posted."""
    plan: list[tuple[int, dict[int, tuple[int, int]]]] = []
    done = dict.fromkeys(sizes, 0)
    for n in [*counts, -1]:
        todo = {}
        for user, size in sizes.items():
            stop = size if n < 0 else min(n, size)
            if stop > done[user]:
                todo[user] = (done[user], stop)
                done[user] = stop
        plan.append((n, todo))
    return plan


def chunks(seq: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    """Consecutive slices of at most `size`."""
    for start in range(0, len(seq), size):
        yield seq[start : start + size]


def flat_inference(d: dict[str, Any]) -> dict[str, Any]:
    """An inference dict's settings by dotted name (`mode`, `crf.gamma`, ...)."""
    out: dict[str, Any] = {}
    for group, values in d.items():
        if isinstance(values, dict):
            out.update({f"{group}.{k}": v for k, v in values.items()})
        else:
            out[group] = values
    return out


def _value(v: Any) -> str:
    return "none" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def artifact_overrides(artifact: Path, base: Any, train_cls: Any) -> list[str]:
    """`--set` pairs that turn preset `base` (what `dcmc train` starts from) into the training, model and
    inference settings an artifact was trained with (read from its config.json): the reduced model is
    trained as the base artifact was, whatever the presets say today."""
    config = json.loads((artifact / "config.json").read_text())
    train = {k: v for k, v in config["train"].items() if k not in ("seed", "preset")}
    out = []
    for f in fields(train_cls):
        if f.name in train and train[f.name] != getattr(base.train, f.name):
            out.append(f"{f.name}={_value(train[f.name])}")
    from model.config import InferenceConfig, ModelConfig

    defaults = {f.name: f.default for f in fields(ModelConfig) if f.default is not MISSING}
    model = {k: v for k, v in config["model"].items() if k not in ("n_users", "n_items", "levels")}
    for key, v in sorted(model.items()):
        if (tuple(v) if isinstance(v, list) else v) != base.model.get(key, defaults.get(key)):
            out.append(f"{key}={','.join(map(str, v)) if isinstance(v, tuple | list) else _value(v)}")
    inference = InferenceConfig.from_dict(config["inference"])
    for key, v in flat_inference(inference.to_dict()).items():
        if inference.reads(key):
            out.append(f"inference.{key}={_value(v)}")
    return out


# -- part 1: fold-in accuracy and the cold-start curve ------------------------------------------------------


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def train_reduced(data: Path, out: Path, overrides: list[str], retrain: bool) -> dict[str, Any]:
    """`dcmc train` on the reduced csv dataset; reuses an artifact this script trained on the same data
    with the same command (stamp file beside it) unless `retrain`."""
    argv = [h.DCMC, "train", "--dataset", "csv", "--data-dir", str(data), "--split", "u1", "--seed", "0"]
    argv += ["--threads", "1", "--no-progress", "--out", str(out)]
    for pair in overrides:
        argv += ["--set", pair]
    stamp_path = out.parent / f"{out.name}.stamp.json"
    stamp: dict[str, Any] = {"argv": argv[1:], "train_csv": _sha256(data / "train.csv")}
    stamp["test_csv"] = _sha256(data / "test.csv")
    command = " ".join(["dcmc", *argv[1:]])
    old = json.loads(stamp_path.read_text()) if stamp_path.is_file() else {}
    if not retrain and (out / "manifest.json").is_file() and {k: old.get(k) for k in stamp} == stamp:
        done = {"reused": True, "trained_at": old.get("trained_at"), "trained_commit": old.get("commit")}
    else:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(out.parent / f"{out.name}.ckpt", ignore_errors=True)
        print("$", command, flush=True)
        log = out.parent / f"{out.name}.train.log"
        t0 = time.perf_counter()
        with log.open("w") as fh:
            proc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, cwd=h.REPO)
        if proc.returncode != 0:
            raise RuntimeError(f"dcmc train failed ({proc.returncode}); see {log}")
        wall = time.perf_counter() - t0
        stamp.update(
            trained_at=time.strftime("%Y-%m-%d %H:%M:%S"), commit=h.describe_commit(h.commit()), wall_s=wall
        )
        stamp_path.write_text(json.dumps(stamp, indent=2) + "\n")
        done = {"reused": False, "trained_at": stamp["trained_at"], "trained_commit": stamp["commit"]}
        done["wall_s"] = round(wall, 1)
    metrics = json.loads((out / "metrics.json").read_text())
    keys = ("train_seconds", "epochs", "val_rmse", "n_train", "n_val")
    return {"command": command, **done, **{k: metrics.get(k) for k in keys}}


def same_settings(reduced: Path, base: Path) -> dict[str, Any]:
    """Whether the reduced artifact's training, model and inference settings equal the base artifact's
    (data-given fields aside); the differences otherwise."""
    from model.config import InferenceConfig

    a, b = (json.loads((p / "config.json").read_text()) for p in (reduced, base))
    diff: dict[str, Any] = {}
    for group in ("train", "model"):
        for key in sorted(set(a[group]) | set(b[group])):
            if key not in ("n_users", "n_items") and a[group].get(key) != b[group].get(key):
                diff[f"{group}.{key}"] = [a[group].get(key), b[group].get(key)]
    ia, ib = (flat_inference(InferenceConfig.from_dict(x["inference"]).to_dict()) for x in (a, b))
    for key in ia:
        if ia[key] != ib[key]:
            diff[f"inference.{key}"] = [ia[key], ib[key]]
    return {"equal": not diff, "differences": diff}


def trained_in(
    base: Path, user_ids: list[str], item_ids: list[str], rows: np.ndarray, cols: np.ndarray
) -> np.ndarray:
    """Expected ratings of entries (dataset ids) by the model trained on everything, its own inference,
    clipped to the levels as the service does (Python API)."""
    from model.artifact import load_artifact
    from model.engine import expected_rating
    from model.scorers import artifact_scorer, predict_distributions

    artifact = load_artifact(base)
    u = artifact.users.indices([user_ids[i] for i in rows])
    j = artifact.items.indices([item_ids[k] for k in cols])
    network, scorer = artifact_scorer(artifact)
    pred = expected_rating(predict_distributions(network, scorer, u, j), artifact.levels)
    return np.clip(pred, artifact.levels[0], artifact.levels[-1])


def score_service(
    svc: Service, user_ids: list[str], item_ids: list[str], test: Any, users: np.ndarray
) -> np.ndarray:
    """The service's predictions of the test entries of `users`, one /predict per user; NaN elsewhere."""
    pred = np.full(len(test), np.nan)
    for user in users.tolist():
        pos = np.flatnonzero(test.rows == user)
        if len(pos):
            pred[pos] = svc.predict(user_ids[user], [item_ids[j] for j in test.cols[pos]])
    return pred


def prepare(args: argparse.Namespace) -> tuple[Any, np.ndarray, np.ndarray, list[str], dict[str, Any]]:
    """The reduced model: ML-100K u1 less the held-out users' training ratings (<work>/data), trained as the
    base artifact was (<work>/reduced). The split, the held-out users, the mask of the training ratings
    kept, the `--set` overrides and the training's summary."""
    from training.config import TrainConfig, preset
    from training.data import load_dataset

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    split = load_dataset("ml-100k", args.data_dir, split="u1")
    held = select_users(split.train.rows, HELD_FRACTION, HELD_SEED)
    keep = write_dataset(work / "data", split, held)
    overrides = artifact_overrides(Path(args.base), preset("csv"), TrainConfig)
    training = train_reduced(work / "data", work / "reduced", overrides, args.retrain)
    return split, held, keep, overrides, training


def part_accuracy(args: argparse.Namespace) -> dict[str, Any]:
    from model.exact import BiasModel
    from model.online import ITEM_SHRINK, USER_SHRINK

    work = Path(args.work)
    split, held, keep, overrides, training = prepare(args)
    # u1's training entries are u.data's lines 20001..100000 in file order: their timestamps.
    train_raw = np.loadtxt(Path(args.data_dir) / "ml-100k" / "u.data", dtype=np.int64)[20_000:]
    uid = np.asarray(split.user_ids)[split.train.rows].astype(np.int64)
    iid = np.asarray(split.item_ids)[split.train.cols].astype(np.int64)
    if not (np.array_equal(uid, train_raw[:, 0]) and np.array_equal(iid, train_raw[:, 1])):
        raise RuntimeError("u1's training entries are not u.data's lines 20001.. in order")
    stamps = train_raw[:, 3]
    n_users_with_train = len(np.unique(split.train.rows))
    h.emit({"part": "accuracy", "step": "trained", **training})
    reduced = work / "reduced"
    settings_check = same_settings(reduced, Path(args.base))
    if not settings_check["equal"]:
        warning = "warning: the reduced model's settings differ from the base artifact's:"
        print(warning, settings_check["differences"], file=sys.stderr)

    red_items = set(json.loads((reduced / "item_ids.json").read_text()))
    red_users = set(json.loads((reduced / "user_ids.json").read_text()))
    tr, te = split.train, split.test
    lo, hi = float(split.levels[0]), float(split.levels[-1])
    # The held-out users' training ratings in time order; items the reduced model lacks (rated only by
    # held-out users in training and absent from the test split) cannot be posted and are left out of both
    # fold-ins.
    order = time_order(tr.rows[~keep], stamps[~keep])
    idx_held = np.flatnonzero(~keep)
    per_user: dict[int, np.ndarray] = {}
    dropped = 0
    for user, pos in order.items():
        entries = idx_held[pos]
        ok = np.array([split.item_ids[j] in red_items for j in tr.cols[entries]], dtype=bool)
        dropped += int((~ok).sum())
        per_user[user] = entries[ok]
    in_test = np.isin(te.rows, held)
    test_held = np.flatnonzero(in_test)
    users_with_test = np.unique(te.rows[in_test])
    # Bias-only fold-in: mu and item biases c fitted on the reduced training set.
    biases = BiasModel.fit(
        tr.rows[keep], tr.cols[keep], tr.values[keep], split.n_users, split.n_items, USER_SHRINK, ITEM_SHRINK
    )
    # The model trained on everything, on every test entry (the held-out users' and the others').
    base_pred = trained_in(Path(args.base), split.user_ids, split.item_ids, te.rows, te.cols)
    base_held = rmse(base_pred[in_test], te.values[in_test])

    sizes = {u: len(p) for u, p in per_user.items()}
    curve: list[dict[str, Any]] = []
    others: dict[str, Any] = {}
    with Redis() as redis_server:
        prefix = "online-accuracy"
        log = work / "serve-accuracy.log"
        svc = Service(reduced, redis_server.url, prefix, 1, log).wait_ready()
        try:
            posted = 0
            for n, todo in steps(COLD_START, sizes):
                batch = [
                    (split.user_ids[tr.rows[k]], split.item_ids[tr.cols[k]], float(tr.values[k]))
                    for user, (start, stop) in todo.items()
                    for k in per_user[user][start:stop].tolist()
                ]
                t0 = time.perf_counter()
                for part in chunks(batch, 1000):
                    svc.post_ratings(part)
                post_s = time.perf_counter() - t0
                posted += len(batch)
                scored = users_with_test
                if n == 0:
                    known = [u for u in users_with_test.tolist() if split.user_ids[u] in red_users]
                    scored = np.array(known, dtype=np.int64)
                everyone = n in (0, -1)  # before and after: the other users too
                t0 = time.perf_counter()
                pred = score_service(
                    svc, split.user_ids, split.item_ids, te, np.unique(te.rows) if everyone else scored
                )
                score_s = time.perf_counter() - t0
                # bias-only fold-in from the same posted ratings
                bias = np.full(len(te), np.nan)
                for user in users_with_test.tolist():
                    entries = per_user.get(user, np.empty(0, np.int64))
                    stop = len(entries) if n < 0 else min(n, len(entries))
                    rated = (tr.cols[entries[:stop]], tr.values[entries[:stop]])
                    refit = biases.with_users([user], lambda _, rated=rated: rated)
                    pos = np.flatnonzero(te.rows == user)
                    bias[pos] = np.clip(refit.predict(user, te.cols[pos]), lo, hi)
                sel = test_held[~np.isnan(pred[test_held])]
                capped = sum(1 for u in users_with_test.tolist() if n > 0 and sizes.get(u, 0) < n)
                point: dict[str, Any] = {
                    "n": "all" if n < 0 else n,
                    "ratings_posted_total": posted,
                    "users_scored": len(np.unique(te.rows[sel])),
                    "test_entries": len(sel),
                    "users_with_fewer": capped,
                    "rmse_foldin": rmse(pred[sel], te.values[sel]),
                    "rmse_bias": rmse(bias[sel], te.values[sel]),
                    "rmse_trained_in": rmse(base_pred[sel], te.values[sel]),
                    "post_s": round(post_s, 2),
                    "score_s": round(score_s, 2),
                }
                curve.append(point)
                h.emit({"part": "accuracy", "step": "point", **point})
                if everyone:
                    rest = np.flatnonzero(~in_test)
                    others["before" if n == 0 else "after"] = rmse(pred[rest], te.values[rest])
                if n < 0:
                    final = pred.copy()
            applied = svc.metric("dcmc_ratings_applied_total")
            svc.stop()
            # A fresh process replays the stream at start-up: it must answer alike.
            t0 = time.perf_counter()
            svc = Service(reduced, redis_server.url, prefix, 1, log).wait_ready()
            replay_s = time.perf_counter() - t0
            again = score_service(svc, split.user_ids, split.item_ids, te, users_with_test)
            restart = {
                "max_abs_diff": float(np.nanmax(np.abs(again[test_held] - final[test_held]))),
                "ready_s": round(replay_s, 1),
                "stream_length": int(redis_server.client.xlen(f"{prefix}:ratings")),
            }
            durability = redis_server.config()
        finally:
            svc.stop()
    full = curve[-1]
    gap_ci = bootstrap_gap(te.rows[test_held], final[test_held], base_pred[test_held], te.values[test_held])
    record = {
        "part": "accuracy",
        "dataset": "ml-100k u1",
        "held_out": {
            "users": len(held),
            "of_users_with_training_ratings": n_users_with_train,
            "fraction": HELD_FRACTION,
            "seed": HELD_SEED,
            "users_with_test_entries": len(users_with_test),
            "training_ratings_removed": int((~keep).sum()),
            "training_ratings_posted": int(sum(sizes.values())),
            "ratings_not_postable_item_unknown": dropped,
            "test_entries": int(in_test.sum()),
            "users_in_reduced_vocabulary": sum(1 for u in held.tolist() if split.user_ids[u] in red_users),
        },
        "order": "u.data timestamp order per user (ties by file line)",
        "reduced_train_rows": int(keep.sum()),
        "training": training,
        "overrides": overrides,
        "settings_match_base": settings_check,
        "base": str(args.base),
        "base_meta": _base_meta(Path(args.base)),
        "bias": {"mu": biases.mu, "user_shrink": biases.user_shrink, "item_shrink": biases.item_shrink},
        "curve": curve,
        "rmse_foldin": full["rmse_foldin"],
        "rmse_trained_in": full["rmse_trained_in"],
        "rmse_bias": full["rmse_bias"],
        "gap": full["rmse_foldin"] - full["rmse_trained_in"],
        "gap_ci95_users": gap_ci,
        "target_gap": TARGET_GAP,
        "met": full["rmse_foldin"] - full["rmse_trained_in"] <= TARGET_GAP,
        "trained_in_all_test": rmse(base_pred, te.values),
        "trained_in_held_all_entries": base_held,
        "other_users": {
            "test_entries": int((~in_test).sum()),
            "rmse_reduced_before_posting": others.get("before"),
            "rmse_reduced_after_posting": others.get("after"),
            "rmse_trained_in": rmse(base_pred[~in_test], te.values[~in_test]),
        },
        "replay_restart": restart,
        "ratings_applied_metric": applied,
        "redis": durability,
        "workers": 1,
    }
    return record


def _base_meta(base: Path) -> dict[str, Any]:
    cfg, man, met = (json.loads((base / f"{n}.json").read_text()) for n in ("config", "manifest", "metrics"))
    return {
        "model_version": man.get("model_version"),
        "dataset": cfg.get("dataset"),
        "preset": cfg.get("train", {}).get("preset"),
        "train_seconds": met.get("train_seconds"),
    }


# -- report --------------------------------------------------------------------------------------------------


def plot_cold_start(record: dict[str, Any], path: Path) -> Path:
    plt = h.pyplot()
    curve = record["curve"]
    labels = [str(p["n"]) for p in curve]
    x = np.arange(len(curve))
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(x, [p["rmse_foldin"] for p in curve], "o-", label="DCMC fold-in (POST /ratings)")
    ax.plot(x, [p["rmse_bias"] for p in curve], "s--", label="bias-only fold-in (mu + b_i + c_j)")
    trained_in = record["rmse_trained_in"]
    ax.axhline(trained_in, color="k", lw=1, ls=":", label=f"trained on everything ({trained_in:.4f})")
    ax.set_xticks(x, labels)
    ax.set_xlabel("training ratings posted per held-out user (first n by timestamp; 'all' = every one)")
    ax.set_ylabel("RMSE on their u1 test ratings")
    held = record["held_out"]
    ax.set_title(
        f"ML-100K u1: cold start of {held['users_with_test_entries']} held-out users "
        f"({held['test_entries']} test ratings)",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def accuracy_section(r: dict[str, Any], figure: Path | None) -> list[str]:
    ho, t = r["held_out"], r["training"]
    lo, hi = r["gap_ci95_users"]
    trained = (
        f"reused the reduced artifact that an earlier run of this script trained at {t['trained_at']} "
        f"({t['trained_commit']}; identical data and command)"
        if t["reused"]
        else f"trained in this run ({t['trained_commit']})"
    )
    verdict = "**met**" if r["met"] else "**not met**"
    check = r["settings_match_base"]
    match = "yes" if check["equal"] else "NO: " + json.dumps(check["differences"])
    lines = [
        "## 1. Fold-in accuracy and cold start (ML-100K u1)",
        "",
        *h.record_header(r),
        f"- held out: {ho['users']} of the {ho['of_users_with_training_ratings']} users with u1 training "
        f"ratings (a seeded {ho['fraction']:.0%}, numpy default_rng({ho['seed']}).choice); their "
        f"{ho['training_ratings_removed']} training ratings are left out of the reduced train.csv "
        f"({r['reduced_train_rows']} ratings remain); test.csv is u1's test (20,000 ratings).",
        f"- reduced model: `{t['command']}` — {trained}; {t['epochs']} epochs, {t['n_train']} training + "
        f"{t['n_val']} validation ratings, train_seconds {t['train_seconds']}, validation RMSE "
        f"{t['val_rmse']:.4f}. Its training, model and inference settings equal the base artifact's: "
        f"{match}.",
        f"- trained-in model: `{r['base']}` (model {r['base_meta']['model_version']}, trained before this "
        "run on all of u1's training ratings, seed 0; its config.json holds the settings the reduced model "
        "copies), reused, scored with the Python API (load_artifact, artifact_scorer, predict_distributions, "
        "expected_rating, clipped to the levels as the service does) with its own inference. Its RMSE on all "
        f"of u1's test: {r['trained_in_all_test']:.4f}.",
        f"- fold-in: `dcmc serve --workers {r['workers']}` on the reduced artifact with a write token; each "
        f"held-out user's training ratings POSTed to /ratings ({ho['training_ratings_posted']} ratings, "
        "batches of at most 1000) in u.data timestamp order per user, in steps; after each step the held-out "
        "users' u1 test ratings are scored through POST /predict (one request per user).",
        f"- bias-only fold-in: mu + b_i + c_j clipped to [1, 5]; mu = {r['bias']['mu']:.4f} and the item "
        f"biases c from model.exact.BiasModel.fit on the reduced training set (user shrink "
        f"{r['bias']['user_shrink']:g}, item shrink {r['bias']['item_shrink']:g}), b_i = sum(r - mu - c_j) / "
        "(n_i + 2) over the same posted ratings.",
        f"- scored: the {ho['test_entries']} u1 test ratings of the {ho['users_with_test_entries']} held-out "
        "users that have any (u1's test holds users 1..462 only; the other "
        f"{ho['users'] - ho['users_with_test_entries']} held-out users are posted too, and join the model as "
        "new users, but have nothing to score). The scored users are in the reduced artifact's vocabulary "
        "(test.csv names them) with an empty training row, so before any post they are predicted from an "
        "all-zero row; the row branch then embeds the same rating row as it would for a new id.",
        f"- {ho['ratings_not_postable_item_unknown']} training ratings of held-out users name items that the "
        "reduced dataset lacks entirely (only held-out users rated them, and not in the test split): the "
        "service refuses unknown items, so they are posted to neither fold-in.",
        "- The test split is used here only to report this comparison; nothing was tuned on it.",
        "",
        f"**Result**: fold-in RMSE {r['rmse_foldin']:.4f} against trained-in {r['rmse_trained_in']:.4f} on "
        f"the same {ho['test_entries']} test ratings: gap {r['gap']:+.4f} (95% interval over users, paired "
        f"bootstrap: {lo:+.4f} to {hi:+.4f}); target within {r['target_gap']:g}: {verdict}. Bias-only "
        f"fold-in: {r['rmse_bias']:.4f}.",
        "",
        *h.table(
            "| ratings posted per user | users with fewer (all posted) | ratings posted in total "
            "| DCMC fold-in RMSE | bias-only RMSE | trained-in RMSE | test ratings |"
        ),
    ]
    for p in r["curve"]:
        lines.append(
            f"| {p['n']} | {'-' if p['n'] == 'all' else p['users_with_fewer']} | "
            f"{p['ratings_posted_total']} | {p['rmse_foldin']:.4f} | "
            f"{p['rmse_bias']:.4f} | {p['rmse_trained_in']:.4f} | {p['test_entries']} |"
        )
    o, rs = r["other_users"], r["replay_restart"]
    lines += [
        "",
        f"Other users (the {o['test_entries']} u1 test ratings of users not held out), same service: "
        f"reduced model {o['rmse_reduced_before_posting']:.4f} before the posts, "
        f"{o['rmse_reduced_after_posting']:.4f} after them; trained-in {o['rmse_trained_in']:.4f}. This is "
        "the retraining difference (another "
        "training set, another run) that the held-out users' gap contains too.",
        "",
        f"Replay: a fresh `dcmc serve` on the same Redis replays the {rs['stream_length']} stream entries at "
        f"start-up (ready in {rs['ready_s']} s); its answers for the held-out users differ from the live "
        f"process's by at most {rs['max_abs_diff']:.2e}.",
        "",
    ]
    if figure is not None:
        lines += [f"![cold start]({figure.name})", ""]
    return lines
