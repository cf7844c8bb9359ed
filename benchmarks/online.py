"""Online ratings (POST /ratings) measured end to end: fold-in accuracy and cold start, freshness across
replicas, and the speed of writes next to reads.

    python benchmarks/online.py --accuracy --freshness --speed [--work /tmp/dcmc-online] [--duration 10]

Every part starts its own redis-server (a free port, a temporary directory, `--appendonly yes
--appendfsync always`, stopped by its pid) and real `dcmc serve` processes; the shared Redis is not used.

1. --accuracy (ML-100K u1). A seeded 10% of the users with training ratings (seed 0) are held out: a csv
   dataset whose train.csv lacks every u1 training rating of theirs (test.csv = u1's test) is trained with
   `dcmc train --dataset csv` and the `--set` overrides that reproduce the ml-100k `default` preset's
   training and inference. `dcmc serve` on it takes the held-out users' training ratings through
   POST /ratings, in u.data's timestamp order, in steps (their first 1, 2, 5, 10, 20, 50, then all), and
   their u1 test ratings are scored through POST /predict after each step. Compared on the same test
   entries with the model trained on everything (`--base`, scored with the Python API) and with a
   bias-only fold-in mu + b_i + c_j. The test split only reports this comparison; nothing is tuned on it.
2. --freshness: two `dcmc serve` (1 worker each) on one Redis; a rating POSTed to A, B's /predict polled
   until its answer changes; the time from A's 200 to B's changed answer.
3. --speed: wrk against `dcmc serve --workers 2` on `--base`: /health (the floor), /predict with 100 items,
   GET /recommend/{user}?k=10 (when the route exists), POST /ratings with one random rating (conc. 1, 32).

Each part appends one JSON record to benchmarks/results/online.jsonl (and prints JSON lines); the report
benchmarks/results/online.md (and online-cold-start.png) is rebuilt from the latest record of each part.
Needs `wrk`, `redis-server` and matplotlib (the `experiments` extra).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import free_port, parse_wrk, run_wrk  # noqa: F401  (parse_wrk: tested through here)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
DCMC = str(Path(sys.executable).with_name("dcmc"))
DATA_DIR = REPO.parent / "shared" / "datasets"
BASE = REPO.parent / "runs" / "base" / "ml-100k"
TOKEN = "online-bench-token"
COLD_START = (0, 1, 2, 5, 10, 20, 50)
"""Ratings posted per held-out user at each point of the cold-start curve (then all of them)."""
HELD_FRACTION = 0.10
HELD_SEED = 0
TARGET_GAP = 0.01
"""The target: fold-in RMSE within this much of the trained-in model's on the same entries."""
PARTS = ("accuracy", "freshness", "speed")
NOTES_MARK = "<!-- notes: the text below this line is kept when the report is rebuilt -->"


# -- pure helpers (tests/test_online_bench.py) --------------------------------------------------------------


def select_users(users: np.ndarray, fraction: float = HELD_FRACTION, seed: int = HELD_SEED) -> np.ndarray:
    """A seeded `fraction` of the distinct `users` (round(fraction * n) of them), sorted."""
    pool = np.unique(np.asarray(users, dtype=np.int64))
    n = round(fraction * len(pool))
    chosen = np.random.default_rng(seed).choice(pool, size=n, replace=False)
    return np.sort(chosen)


def write_csv(
    path: Path,
    user_ids: Sequence[str],
    item_ids: Sequence[str],
    rows: np.ndarray,
    cols: np.ndarray,
    values: np.ndarray,
) -> None:
    """A `user,item,rating` file (header line, external ids) of the entries, in order."""
    with path.open("w") as fh:
        fh.write("user,item,rating\n")
        for i, j, v in zip(rows.tolist(), cols.tolist(), values.tolist(), strict=True):
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


def rmse(pred: np.ndarray, truth: np.ndarray) -> float:
    """Root mean squared error."""
    err = np.asarray(pred, dtype=np.float64) - np.asarray(truth, dtype=np.float64)
    return float(np.sqrt(np.mean(err**2)))


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
    out: dict[int, np.ndarray] = {}
    sorted_users = users[order]
    bounds = np.flatnonzero(np.diff(sorted_users)) + 1
    for chunk in np.split(order, bounds):
        if len(chunk):
            out[int(users[chunk[0]])] = chunk
    return out


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


def summarize(samples_ms: Iterable[float]) -> dict[str, float]:
    """n, p50, p99, max and mean of latencies in ms (linear-interpolated percentiles)."""
    x = np.asarray(list(samples_ms), dtype=np.float64)
    if len(x) == 0:
        return {"n": 0}
    return {
        "n": len(x),
        "p50_ms": float(np.percentile(x, 50)),
        "p99_ms": float(np.percentile(x, 99)),
        "max_ms": float(x.max()),
        "mean_ms": float(x.mean()),
    }


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
    from dataclasses import MISSING

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


# -- environment: machine, commit, processes -----------------------------------------------------------------


def machine() -> dict[str, Any]:
    """nproc and the CPU model."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    # `nproc --all`: plain nproc follows OMP_NUM_THREADS, which the benchmark's commands often set to 1
    nproc = subprocess.run(["nproc", "--all"], capture_output=True, text=True).stdout.strip()
    return {"nproc": int(nproc) if nproc.isdigit() else os.cpu_count(), "cpu": cpu}


def commit() -> dict[str, Any]:
    """The short HEAD commit and whether the working tree has uncommitted changes (files listed)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    status = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True)
    changed = [line for line in status.stdout.splitlines() if line.strip()]
    return {"commit": head.stdout.strip() or "unknown", "dirty": bool(changed), "changes": changed}


def describe_commit(c: dict[str, Any]) -> str:
    return f"`{c['commit']}`" + (" with uncommitted changes" if c["dirty"] else "")


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


class Redis:
    """A private redis-server: free port, temporary directory, append-only file fsynced on every write."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = Path(tempfile.mkdtemp(prefix="dcmc-online-redis-"))
        self.argv = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--dir",
            str(self.dir),
            "--daemonize",
            "no",
        ]

    def __enter__(self) -> Redis:
        import redis

        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = redis.Redis.from_url(self.url)
        for _ in range(200):
            try:
                self.client.ping()
                return self
            except redis.ConnectionError:
                time.sleep(0.05)
        self.__exit__()
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def config(self) -> dict[str, str]:
        got: Any = self.client.config_get("append*")
        return {k: str(got.get(k)) for k in ("appendonly", "appendfsync")}


class Service:
    """`dcmc serve` as a child process with a private environment (Redis, prefix, write token)."""

    def __init__(
        self,
        artifacts: Path,
        redis_url: str,
        prefix: str,
        workers: int,
        log: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [
            DCMC,
            "serve",
            "--artifacts",
            str(artifacts),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            str(workers),
        ]
        clean = {k: v for k, v in os.environ.items() if not k.startswith("DCMC_") and k != "REDIS_URL"}
        self.env = {
            **clean,
            "REDIS_URL": redis_url,
            "DCMC_REDIS_KEY_PREFIX": prefix,
            "DCMC_WRITE_TOKEN": TOKEN,
            "DCMC_LOG_LEVEL": "warning",
            **(env or {}),
        }
        self.log = log.open("a")
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        self.client = httpx.Client(base_url=self.url, timeout=60)
        self.last_id: str | None = None  # the stream id of the last batch written through this helper

    def wait_ready(self, timeout: float = 180) -> Service:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dcmc serve exited with {self.proc.returncode} (log: {self.log.name})")
            try:
                if self.client.get("/ready").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.url} not ready after {timeout}s")

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()

    def post_ratings(self, batch: Sequence[tuple[str, str, float]]) -> dict[str, Any]:
        body = {"ratings": [{"user": u, "item": i, "rating": r} for u, i, r in batch]}
        r = self.client.post("/ratings", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
        if r.status_code != 200:
            raise RuntimeError(f"POST /ratings answered {r.status_code}: {r.text[:500]}")
        self.last_id = str(r.json()["last_id"])
        return dict(r.json())

    def predict(self, user: str, items: Sequence[str]) -> np.ndarray:
        """Predictions that include every rating this helper wrote (`after`: read-your-writes)."""
        params = {"after": self.last_id} if self.last_id else None
        r = self.client.post("/predict", json={"user": user, "items": list(items)}, params=params)
        if r.status_code != 200:
            raise RuntimeError(f"POST /predict answered {r.status_code}: {r.text[:500]}")
        return np.array([p["rating"] for p in r.json()["predictions"]], dtype=np.float64)

    def metric(self, name: str) -> float:
        for line in self.client.get("/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rpartition(" ")[2])
        return 0.0

    def metrics_by(self, name: str, label: str) -> dict[str, float]:
        """A labelled counter's values by that label (summed over the workers)."""
        out: dict[str, float] = {}
        pattern = re.compile(rf'^{re.escape(name)}{{.*{re.escape(label)}="([^"]*)".*}} (\S+)$')
        for line in self.client.get("/metrics").text.splitlines():
            match = pattern.match(line)
            if match:
                out[match.group(1)] = out.get(match.group(1), 0.0) + float(match.group(2))
        return out


# -- part 1: fold-in accuracy and the cold-start curve ------------------------------------------------------


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def train_reduced(data: Path, out: Path, overrides: list[str], retrain: bool) -> dict[str, Any]:
    """`dcmc train` on the reduced csv dataset; reuses an artifact this script trained on the same data
    with the same command (stamp file beside it) unless `retrain`."""
    argv = [
        DCMC,
        "train",
        "--dataset",
        "csv",
        "--data-dir",
        str(data),
        "--split",
        "u1",
        "--seed",
        "0",
        "--threads",
        "1",
        "--no-progress",
        "--out",
        str(out),
    ]
    for pair in overrides:
        argv += ["--set", pair]
    stamp_path = out.parent / f"{out.name}.stamp.json"
    stamp: dict[str, Any] = {
        "argv": argv[1:],
        "train_csv": _sha256(data / "train.csv"),
        "test_csv": _sha256(data / "test.csv"),
    }
    command = " ".join(["dcmc", *argv[1:]])
    if not retrain and (out / "manifest.json").is_file() and stamp_path.is_file():
        old = json.loads(stamp_path.read_text())
        if {k: old.get(k) for k in stamp} == stamp:
            metrics = json.loads((out / "metrics.json").read_text())
            return {
                "command": command,
                "reused": True,
                "trained_at": old.get("trained_at"),
                "trained_commit": old.get("commit"),
                **_train_summary(metrics),
            }
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(out.parent / f"{out.name}.ckpt", ignore_errors=True)
    print("$", command, flush=True)
    log = out.parent / f"{out.name}.train.log"
    t0 = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"dcmc train failed ({proc.returncode}); see {log}")
    wall = time.perf_counter() - t0
    c = commit()
    stamp.update(trained_at=time.strftime("%Y-%m-%d %H:%M:%S"), commit=describe_commit(c), wall_s=wall)
    stamp_path.write_text(json.dumps(stamp, indent=2) + "\n")
    metrics = json.loads((out / "metrics.json").read_text())
    return {
        "command": command,
        "reused": False,
        "trained_at": stamp["trained_at"],
        "trained_commit": stamp["commit"],
        "wall_s": round(wall, 1),
        **_train_summary(metrics),
    }


def _train_summary(metrics: dict[str, Any]) -> dict[str, Any]:
    keys = ("train_seconds", "epochs", "val_rmse", "n_train", "n_val")
    return {k: metrics.get(k) for k in keys}


def same_settings(reduced: Path, base: Path) -> dict[str, Any]:
    """Whether the reduced artifact's training, model and inference settings equal the base artifact's
    (data-given fields aside); the differences otherwise."""
    from model.config import InferenceConfig

    a, b = (json.loads((p / "config.json").read_text()) for p in (reduced, base))
    diff: dict[str, Any] = {}
    for key in sorted(set(a["train"]) | set(b["train"])):
        if a["train"].get(key) != b["train"].get(key):
            diff[f"train.{key}"] = [a["train"].get(key), b["train"].get(key)]
    for key in sorted(set(a["model"]) | set(b["model"])):
        if key not in ("n_users", "n_items") and a["model"].get(key) != b["model"].get(key):
            diff[f"model.{key}"] = [a["model"].get(key), b["model"].get(key)]
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


def diagnose(
    reduced: Path,
    base: Path,
    posted: list[tuple[str, str, float]],
    test_users: list[str],
    test_items: list[str],
    truth: np.ndarray,
    served: np.ndarray,
) -> dict[str, Any]:
    """Where the fold-in's gap comes from, in this process (Python API, not the service): RMSE of the
    test entries (external ids) under variants of the fold-in model and of the trained-in model.

    `library`: model/online.py's FoldIn on the reduced artifact, every posted rating applied in one batch
    (what the service does, there once per applied batch; compared with the service's answers).
    `row branch only`: the posted users' embeddings recomputed by the row branch (ONNX) from their rating
    rows and nothing else, the scorer updated by ExactScorer.updated. For each: `network only` (the base
    network's expectation, inference mode none), `default` (the artifact's inference) and `tables rebuilt`
    (the scorer built anew over the same known ratings, every co-rating table recomputed)."""
    from model.artifact import load_artifact
    from model.engine import Network, OnnxNetwork, expected_rating
    from model.online import FoldIn
    from model.ratings import Ratings
    from model.scorers import artifact_scorer, build_scorer, predict_distributions

    def expected(network: Any, scorer: Any, rows: np.ndarray, cols: np.ndarray, levels: np.ndarray) -> Any:
        pred = expected_rating(predict_distributions(network, scorer, rows, cols), levels)
        return np.clip(pred, levels[0], levels[-1])

    art = load_artifact(reduced)
    levels = art.levels
    onnx = OnnxNetwork(reduced, threads=1)
    none = art.inference.with_overrides({"mode": "none"})
    out: dict[str, Any] = {}

    def variants(name: str, network: Any, known: Any, scorer: Any, rows: np.ndarray, cols: np.ndarray) -> Any:
        served_here = expected(network, scorer, rows, cols, levels)
        out[f"{name}_network_only"] = rmse(
            expected(network, build_scorer(network, known, none), rows, cols, levels), truth
        )
        out[f"{name}_default"] = rmse(served_here, truth)
        rebuilt = build_scorer(network, known, art.inference)
        out[f"{name}_tables_rebuilt"] = rmse(expected(network, rebuilt, rows, cols, levels), truth)
        return served_here

    # the library's fold-in, one batch
    fold = FoldIn(art, art.inference, onnx.embed_users, onnx.embed_items)
    fold.apply(posted)
    state = fold.state
    rows = np.array([fold.user_index(u) for u in test_users], dtype=np.int64)
    cols = np.array([fold.item_index(i) for i in test_items], dtype=np.int64)
    library = variants("library", state.network, state.known, state.scorer, rows, cols)
    out["library_max_abs_diff_to_service"] = float(np.max(np.abs(library - served)))

    # the row branch alone
    users = list(art.users.ids)
    index = {u: i for i, u in enumerate(users)}
    for u, _, _ in posted:
        if u not in index:
            index[u] = len(users)
            users.append(u)
    pr = np.array([index[u] for u, _, _ in posted], dtype=np.int64)
    pc = art.items.indices([i for _, i, _ in posted])
    pv = np.array([r for _, _, r in posted], dtype=np.float64)
    base_known = art.known()
    known = Ratings(
        np.concatenate([base_known.rows, pr]),
        np.concatenate([base_known.cols, pc]),
        np.concatenate([base_known.values, pv]),
        len(users),
        len(art.items),
    )
    changed = np.unique(pr)
    dense = np.zeros((len(changed), len(art.items)), dtype=np.float32)
    existing = changed < art.train.n_users
    if existing.any():
        dense[existing] = art.train.dense_rows(changed[existing])
    dense[np.searchsorted(changed, pr), pc] = pv
    user_emb = np.zeros((len(users), art.config.embedding_dim))
    user_emb[: len(art.users)] = art.user_embeddings
    user_emb[changed] = onnx.embed_users(dense).astype(np.float64)
    network, scorer = artifact_scorer(art)
    folded = Network(network.config, user_emb, network.item_emb, network.bilinear)
    rows = np.array([index[u] for u in test_users], dtype=np.int64)
    cols = art.items.indices(test_items)
    variants("row_branch", folded, known, scorer.updated(folded, known, changed), rows, cols)

    # the model trained on everything
    full = load_artifact(base)
    brows, bcols = full.users.indices(test_users), full.items.indices(test_items)
    bnet, bscorer = artifact_scorer(full)
    out["trained_in_default"] = rmse(expected(bnet, bscorer, brows, bcols, full.levels), truth)
    _, bnone = artifact_scorer(full, full.inference.with_overrides({"mode": "none"}))
    out["trained_in_network_only"] = rmse(expected(bnet, bnone, brows, bcols, full.levels), truth)
    return out


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


def part_accuracy(args: argparse.Namespace) -> dict[str, Any]:
    from model.exact import BiasModel
    from model.online import ITEM_SHRINK, USER_SHRINK
    from training.config import TrainConfig, preset
    from training.data import load_dataset

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    split = load_dataset("ml-100k", args.data_dir, split="u1")
    # u1's training entries are u.data's lines 20001..100000 in file order: their timestamps.
    raw = np.loadtxt(Path(args.data_dir) / "ml-100k" / "u.data", dtype=np.int64)
    train_raw = raw[20_000:]
    uid = np.asarray(split.user_ids)[split.train.rows].astype(np.int64)
    iid = np.asarray(split.item_ids)[split.train.cols].astype(np.int64)
    if not (np.array_equal(uid, train_raw[:, 0]) and np.array_equal(iid, train_raw[:, 1])):
        raise RuntimeError("u1's training entries are not u.data's lines 20001.. in order")
    stamps = train_raw[:, 3]
    held = select_users(split.train.rows, HELD_FRACTION, HELD_SEED)
    data_dir = work / "data"
    keep = write_dataset(data_dir, split, held)
    n_users_with_train = len(np.unique(split.train.rows))
    overrides = artifact_overrides(Path(args.base), preset("csv"), TrainConfig)
    training = train_reduced(data_dir, work / "reduced", overrides, args.retrain)
    emit({"part": "accuracy", "step": "trained", **training})
    reduced = work / "reduced"
    settings_check = same_settings(reduced, Path(args.base))
    if not settings_check["equal"]:
        print(
            "warning: the reduced model's settings differ from the base artifact's:",
            settings_check["differences"],
            file=sys.stderr,
        )

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
    restart: dict[str, Any] = {}
    others: dict[str, Any] = {}
    with Redis() as redis_server:
        prefix = "online-accuracy"
        log = work / "serve-accuracy.log"
        svc = Service(reduced, redis_server.url, prefix, 1, log).wait_ready()
        try:
            posted = 0
            stream: list[tuple[str, str, float]] = []
            for n, todo in steps(COLD_START, sizes):
                batch = []
                for user, (start, stop) in todo.items():
                    for k in per_user[user][start:stop].tolist():
                        batch.append(
                            (split.user_ids[tr.rows[k]], split.item_ids[tr.cols[k]], float(tr.values[k]))
                        )
                t0 = time.perf_counter()
                for part in chunks(batch, 1000):
                    svc.post_ratings(part)
                post_s = time.perf_counter() - t0
                posted += len(batch)
                stream += batch
                scored = (
                    users_with_test
                    if n != 0
                    else np.array(
                        [u for u in users_with_test.tolist() if split.user_ids[u] in red_users],
                        dtype=np.int64,
                    )
                )
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
                    posted = (tr.cols[entries[:stop]], tr.values[entries[:stop]])
                    refit = biases.with_users([user], lambda _, posted=posted: posted)
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
                emit({"part": "accuracy", "step": "point", **point})
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
    diagnostics = diagnose(
        reduced,
        Path(args.base),
        stream,
        [split.user_ids[u] for u in te.rows[test_held]],
        [split.item_ids[j] for j in te.cols[test_held]],
        te.values[test_held],
        final[test_held],
    )
    emit({"part": "accuracy", "step": "diagnostics", **diagnostics})
    full = curve[-1]
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
        "gap_ci95_users": bootstrap_gap(
            te.rows[test_held], final[test_held], base_pred[test_held], te.values[test_held]
        ),
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
        "diagnostics": diagnostics,
        "ratings_applied_metric": applied,
        "redis": durability,
        "workers": 1,
    }
    return record


def _base_meta(base: Path) -> dict[str, Any]:
    cfg = json.loads((base / "config.json").read_text())
    man = json.loads((base / "manifest.json").read_text())
    met = json.loads((base / "metrics.json").read_text())
    return {
        "model_version": man.get("model_version"),
        "dataset": cfg.get("dataset"),
        "preset": cfg.get("train", {}).get("preset"),
        "train_seconds": met.get("train_seconds"),
    }


# -- part 2: freshness across replicas -----------------------------------------------------------------------


def _probe(base: Path, n_query: int = 20) -> tuple[str, str, list[str]]:
    """A known user, an item it has not rated (the one posted) and n_query other unrated items (queried)."""
    from model.artifact import load_artifact

    art = load_artifact(base)
    known = art.known()
    rated = set(known.cols[known.rows == 0].tolist())
    unrated = [j for j in range(len(art.items)) if j not in rated]
    return art.users.ids[0], art.items.ids[unrated[0]], [art.items.ids[j] for j in unrated[1 : 1 + n_query]]


def part_freshness(args: argparse.Namespace) -> dict[str, Any]:
    base = Path(args.base)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    user, item, query = _probe(base)
    latencies, polls, post_ms, poll_ms = [], [], [], []
    mismatches = timeouts = 0
    with Redis() as redis_server:
        prefix = "online-freshness"
        log = work / "serve-freshness.log"
        a = Service(base, redis_server.url, prefix, 1, log)
        b = Service(base, redis_server.url, prefix, 1, log)
        try:
            a.wait_ready()
            b.wait_ready()
            for _ in range(20):  # warm both
                a.predict(user, query)
                b.predict(user, query)
            prev = b.predict(user, query)
            deadline = time.monotonic() + args.freshness_seconds
            for k in range(args.freshness_n):
                if time.monotonic() > deadline:
                    break
                rating = 1.0 if k % 2 == 0 else 5.0  # flips, so every post changes the answer
                t0 = time.perf_counter()
                a.post_ratings([(user, item, rating)])
                t1 = time.perf_counter()
                post_ms.append((t1 - t0) * 1e3)
                n = 0
                while True:
                    s = time.perf_counter()
                    cur = b.predict(user, query)
                    now = time.perf_counter()
                    poll_ms.append((now - s) * 1e3)
                    n += 1
                    if not np.array_equal(cur, prev):
                        latencies.append((now - t1) * 1e3)
                        polls.append(n)
                        break
                    if now - t1 > 10:
                        timeouts += 1
                        break
                if not np.array_equal(a.predict(user, query), cur):
                    mismatches += 1  # A and B must answer alike once B has the rating
                prev = cur
            stream = int(redis_server.client.xlen(f"{prefix}:ratings"))
            durability = redis_server.config()
        finally:
            a.stop()
            b.stop()
    return {
        "part": "freshness",
        "base": str(base),
        "servers": "2 x `dcmc serve --workers 1`, one Redis",
        "probe": {"user": user, "item": item, "query_items": len(query), "ratings": "1 and 5, alternating"},
        "posts": len(latencies) + timeouts,
        "timeouts_10s": timeouts,
        "a_b_mismatches": mismatches,
        "stream_length": stream,
        "latency": summarize(latencies),
        "polls_per_change": {
            "p50": float(np.median(polls)) if polls else None,
            "max": int(max(polls)) if polls else None,
        },
        "poll_latency": summarize(poll_ms),
        "post_latency": summarize(post_ms),
        "redis": durability,
        "bounds": {"n": args.freshness_n, "seconds": args.freshness_seconds},
    }


# -- part 3: speed with wrk ----------------------------------------------------------------------------------

PREDICT_LUA = """
local bodies = {%s}
local n = 0
request = function()
  n = n + 1
  return wrk.format("POST", "/predict", {["Content-Type"] = "application/json"}, bodies[(n %% #bodies) + 1])
end
"""

RATINGS_LUA = """
local users = {%s}
local items = {%s}
local levels = {%s}
local counter = 0
setup = function(thread)
  counter = counter + 1
  thread:set("id", counter)
end
init = function(args)
  math.randomseed(1000 + (id or 0))
end
request = function()
  local body = '{"ratings":[{"user":"' .. users[math.random(#users)] .. '","item":"'
    .. items[math.random(#items)] .. '","rating":' .. levels[math.random(#levels)] .. '}]}'
  return wrk.format("POST", "/ratings",
    {["Content-Type"] = "application/json", ["Authorization"] = "Bearer %s"}, body)
end
"""

RECOMMEND_LUA = """
local users = {%s}
local counter = 0
setup = function(thread)
  counter = counter + 1
  thread:set("id", counter)
end
init = function(args)
  math.randomseed(2000 + (id or 0))
end
request = function()
  return wrk.format("GET", "/recommend/" .. users[math.random(#users)] .. "?k=10")
end
"""


def _lua_list(values: Iterable[Any]) -> str:
    return ",".join(json.dumps(v) for v in values)


def _wrk(url: str, path: str, connections: int, duration: int, script: Path | None) -> dict[str, Any]:
    result, out = run_wrk(url, path, connections, duration, script)
    if result["non_2xx"] or result["socket_errors"]:
        print(out, file=sys.stderr)
    return result


class Writer:
    """Threads that POST one random known rating each, `per_s` in all, until `stop()`: several senders
    (`senders`), each paced at per_s / senders, so that a write waiting behind the readers does not hold
    the rate back (one sender got 26-69 of 100/s acknowledged while 32 connections read)."""

    def __init__(
        self,
        svc: Service,
        users: list[str],
        items: list[str],
        levels: list[Any],
        per_s: float,
        senders: int = 8,
    ) -> None:
        import threading

        self.svc, self.users, self.items, self.levels, self.per_s = svc, users, items, levels, per_s
        self.done = threading.Event()
        self.written = [0] * senders
        self.threads = [
            threading.Thread(target=self._run, args=(k, per_s / senders), daemon=True) for k in range(senders)
        ]
        for thread in self.threads:
            thread.start()

    def _run(self, k: int, per_s: float) -> None:
        import httpx

        rng = np.random.default_rng(3 + k)
        started, sent = time.monotonic(), 0
        with httpx.Client(base_url=self.svc.url, timeout=30) as client:
            while not self.done.is_set():
                rating = {
                    "user": self.users[rng.integers(len(self.users))],
                    "item": self.items[rng.integers(len(self.items))],
                    "rating": self.levels[rng.integers(len(self.levels))],
                }
                r = client.post(
                    "/ratings", json={"ratings": [rating]}, headers={"Authorization": f"Bearer {TOKEN}"}
                )
                sent += 1
                self.written[k] += r.status_code == 200
                pause = started + sent / per_s - time.monotonic()
                if pause > 0:
                    self.done.wait(pause)

    def stop(self) -> int:
        """Stop; returns the ratings acknowledged."""
        self.done.set()
        for thread in self.threads:
            thread.join()
        return sum(self.written)


def first_rating_everywhere(svc: Service, item: str, level: Any, runs: int = 20) -> dict[str, Any]:
    """A new user's first rating, then /predict for that user on fresh connections (each may reach either
    worker) until `runs` in a row answer 200: the seconds from the write's 200 to the first of them."""
    import httpx

    user = f"newcomer-{time.time_ns()}"
    r = svc.client.post(
        "/ratings",
        json={"ratings": [{"user": user, "item": item, "rating": level}]},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    acknowledged = time.monotonic()
    streak, streak_start = 0, acknowledged
    with httpx.Client(
        base_url=svc.url, timeout=30, limits=httpx.Limits(max_keepalive_connections=0)
    ) as fresh:
        while streak < runs and time.monotonic() - acknowledged < 120:
            started = time.monotonic()
            ok = fresh.post("/predict", json={"user": user, "items": [item]}).status_code == 200
            if ok and streak == 0:
                streak_start = started
            streak = streak + 1 if ok else 0
    return {
        "write_status": r.status_code,
        "answered_everywhere_s": round(streak_start - acknowledged, 3) if streak >= runs else None,
        "fresh_connections_in_a_row": runs,
    }


def recommend_state(svc: Service, user: str) -> dict[str, Any]:
    """Whether GET /recommend/{user}?k=10 exists: a route 404 says `Not Found`."""
    r = svc.client.get(f"/recommend/{user}", params={"k": 10})
    body: Any = None
    with contextlib.suppress(ValueError):
        body = r.json()
    exists = not (r.status_code == 404 and isinstance(body, dict) and body.get("detail") == "Not Found")
    return {"exists": exists, "status": r.status_code, "ok": r.status_code == 200}


def part_speed(args: argparse.Namespace) -> dict[str, Any]:
    base = Path(args.base)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    users = json.loads((base / "user_ids.json").read_text())
    items = json.loads((base / "item_ids.json").read_text())
    levels = [int(x) if float(x).is_integer() else float(x) for x in np.load(base / "levels.npy")]
    rng = np.random.default_rng(0)
    bodies = [
        json.dumps(
            {
                "user": users[rng.integers(len(users))],
                "items": [items[j] for j in rng.choice(len(items), 100, replace=False)],
            }
        )
        for _ in range(500)
    ]
    results: dict[str, Any] = {}
    with Redis() as redis_server, tempfile.TemporaryDirectory() as tmp:
        prefix = "online-speed"
        service_env = dict(pair.split("=", 1) for pair in args.service_env)
        svc = Service(base, redis_server.url, prefix, 2, work / "serve-speed.log", service_env)
        try:
            svc.wait_ready()
            scripts = {
                "predict": Path(tmp) / "predict.lua",
                "ratings": Path(tmp) / "ratings.lua",
                "recommend": Path(tmp) / "recommend.lua",
            }
            scripts["predict"].write_text(PREDICT_LUA % _lua_list(bodies))
            scripts["ratings"].write_text(
                RATINGS_LUA % (_lua_list(users), _lua_list(items), ",".join(map(str, levels)), TOKEN)
            )
            scripts["recommend"].write_text(RECOMMEND_LUA % _lua_list(users))
            rec = recommend_state(svc, users[0])
            d = args.duration
            _wrk(svc.url, "/predict", 2, 3, scripts["predict"])  # warm both workers
            if rec["exists"]:
                _wrk(svc.url, "/recommend", 2, 3, scripts["recommend"])
            plan: list[tuple[str, str, int, Path | None]] = [
                ("health@1", "/health", 1, None),
                ("predict@1", "/predict", 1, scripts["predict"]),
            ]
            if rec["exists"]:
                plan.append(("recommend@1", "/recommend", 1, scripts["recommend"]))
            plan += [
                ("health@32", "/health", 32, None),
                ("predict@32", "/predict", 32, scripts["predict"]),
                ("predict@32 while 100 ratings/s are written", "/predict", 32, scripts["predict"]),
                ("ratings@1", "/ratings", 1, scripts["ratings"]),
                ("ratings@32", "/ratings", 32, scripts["ratings"]),
                ("predict@1 after writes", "/predict", 1, scripts["predict"]),
            ]
            if rec["exists"]:
                plan.append(("recommend@1 after writes", "/recommend", 1, scripts["recommend"]))
            for name, path, conns, script in plan:
                writer = Writer(svc, users, items, levels, per_s=100) if "while" in name else None
                cache_before = svc.metrics_by("dcmc_user_rows_total", "event")
                results[name] = _wrk(svc.url, path, conns, d, script)
                if writer is not None:
                    results[name]["ratings_written_during"] = writer.stop()
                if path == "/predict":  # how the answers were made: cached rows, row parts, computed
                    cache_after = svc.metrics_by("dcmc_user_rows_total", "event")
                    results[name]["user_rows"] = {
                        k: cache_after[k] - cache_before.get(k, 0.0) for k in sorted(cache_after)
                    }
                if name.startswith("ratings"):
                    results[name]["stream_length_after"] = int(redis_server.client.xlen(f"{prefix}:ratings"))
                emit({"part": "speed", "run": name, **results[name]})
                if name == "ratings@32":  # right after the burst: a new user's first rating, everywhere
                    newcomer = first_rating_everywhere(svc, items[0], levels[-1])
                    emit({"part": "speed", "run": "newcomer after the burst", **newcomer})
            time.sleep(1.0)  # the other worker's tail (200 ms reads) catches up
            stream = int(redis_server.client.xlen(f"{prefix}:ratings"))
            written = svc.metric("dcmc_ratings_written_total")
            applied = svc.metric("dcmc_ratings_applied_total")
            redis_errors = svc.metric("dcmc_redis_errors_total")
            health = svc.client.get("/health").json()
            durability = redis_server.config()
        finally:
            svc.stop()
    return {
        "part": "speed",
        "base": str(base),
        "service_env": service_env,
        "workers": 2,
        "duration_s": args.duration,
        "recommend": rec,
        "results": results,
        "newcomer_after_burst": newcomer,
        "stream_length": stream,
        "ratings_written_metric": written,
        "ratings_applied_metric": applied,
        "redis_errors_metric": redis_errors,
        "health": health,
        "redis": durability,
    }


# -- report --------------------------------------------------------------------------------------------------


def plot_cold_start(record: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = record["curve"]
    labels = [str(p["n"]) for p in curve]
    x = np.arange(len(curve))
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(x, [p["rmse_foldin"] for p in curve], "o-", label="DCMC fold-in (POST /ratings)")
    ax.plot(x, [p["rmse_bias"] for p in curve], "s--", label="bias-only fold-in (mu + b_i + c_j)")
    ax.axhline(
        record["rmse_trained_in"],
        color="k",
        lw=1,
        ls=":",
        label=f"trained on everything ({record['rmse_trained_in']:.4f})",
    )
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


def _header(r: dict[str, Any]) -> list[str]:
    m, g = r["machine"], r["git"]
    return [
        f"- command: `{r['command']}` (started {r['started']}, {r['wall_s']:.0f} s)",
        f"- machine: {m['nproc']} cores (`nproc`), {m['cpu']}",
        f"- commit: {describe_commit(g)}"
        + (
            f" ({len(g['changes'])} paths in `git status --porcelain`: "
            + ", ".join(f"`{c.strip()}`" for c in g["changes"][:12])
            + (", ..." if len(g["changes"]) > 12 else "")
            + ")"
            if g["dirty"]
            else ""
        ),
        *(
            [
                f"- **the code changed during the run**: it started at {describe_commit(r['git_start'])} "
                f"({', '.join(c.strip() for c in r['git_start']['changes']) or 'clean'})"
            ]
            if "git_start" in r
            and (r["git_start"]["commit"], r["git_start"]["changes"])
            != (
                g["commit"],
                g["changes"],
            )
            else []
        ),
        f"- Redis: a private redis-server, appendonly={r['redis']['appendonly']}, "
        f"appendfsync={r['redis']['appendfsync']}",
    ]


def accuracy_section(r: dict[str, Any], figure: Path | None) -> list[str]:
    h, t = r["held_out"], r["training"]
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
        *_header(r),
        f"- held out: {h['users']} of the {h['of_users_with_training_ratings']} users with u1 training "
        "ratings "
        f"(a seeded {h['fraction']:.0%}, numpy default_rng({h['seed']}).choice); their "
        f"{h['training_ratings_removed']} training ratings are left out of the reduced train.csv "
        f"({r['reduced_train_rows']} ratings remain); test.csv is u1's test (20,000 ratings).",
        f"- reduced model: `{t['command']}` — {trained}; {t['epochs']} epochs, {t['n_train']} training + "
        f"{t['n_val']} validation ratings, train_seconds {t['train_seconds']}, validation RMSE "
        f"{t['val_rmse']:.4f}. Its training, model and inference settings equal the base artifact's: "
        f"{match}.",
        f"- trained-in model: `{r['base']}` (model {r['base_meta']['model_version']}, trained before this "
        "run on all of u1's training ratings, seed 0; its config.json holds the settings the reduced model "
        "copies), "
        "reused, scored with the Python API (load_artifact, artifact_scorer, "
        "predict_distributions, expected_rating, clipped to the levels as the service does) with its own "
        f"inference. Its RMSE on all of u1's test: {r['trained_in_all_test']:.4f}.",
        f"- fold-in: `dcmc serve --workers {r['workers']}` on the reduced artifact with a write token; each "
        f"held-out user's training ratings POSTed to /ratings ({h['training_ratings_posted']} ratings, "
        "batches of at most 1000) in u.data timestamp order per user, in steps; after each step the held-out "
        "users' "
        "u1 test ratings are scored through POST /predict (one request per user).",
        f"- bias-only fold-in: mu + b_i + c_j clipped to [1, 5]; mu = {r['bias']['mu']:.4f} and the item "
        f"biases c from model.exact.BiasModel.fit on the reduced training set (user shrink "
        f"{r['bias']['user_shrink']:g}, item shrink {r['bias']['item_shrink']:g}), b_i = sum(r - mu - c_j) / "
        "(n_i + 2) over the same posted ratings.",
        f"- scored: the {h['test_entries']} u1 test ratings of the {h['users_with_test_entries']} held-out "
        f"users that have any (u1's test holds users 1..462 only; the other "
        f"{h['users'] - h['users_with_test_entries']} held-out users are posted too, and join the model as "
        "new users, but have nothing to score). The scored users are in the reduced artifact's vocabulary "
        "(test.csv names them) with an empty training row, so before any post they are predicted from an "
        "all-zero row; "
        "the row branch then embeds the same rating row as it would for a new id.",
        f"- {h['ratings_not_postable_item_unknown']} training ratings of held-out users name items that the "
        "reduced dataset lacks entirely (only held-out users rated them, and not in the test split): the "
        "service refuses unknown items, so they are posted to neither fold-in.",
        "- The test split is used here only to report this comparison; nothing was tuned on it.",
        "",
        f"**Result**: fold-in RMSE {r['rmse_foldin']:.4f} against trained-in {r['rmse_trained_in']:.4f} on "
        f"the same {h['test_entries']} test ratings: gap {r['gap']:+.4f} (95% interval over users, paired "
        f"bootstrap: {lo:+.4f} to {hi:+.4f}); target within {r['target_gap']:g}: {verdict}. Bias-only "
        f"fold-in: {r['rmse_bias']:.4f}.",
        "",
        "| ratings posted per user | users with fewer (all posted) | ratings posted in total "
        "| DCMC fold-in RMSE | bias-only RMSE | trained-in RMSE | test ratings |",
        "|---|---|---|---|---|---|---|",
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
    d = r.get("diagnostics")
    if d:
        lines += [
            "Where the gap comes from (diagnostic, in this process with the Python API, on the same "
            f"{h['test_entries']} test ratings after every rating was posted). `library fold-in`: "
            "model/online.py's FoldIn on the reduced artifact, all posted ratings applied in one batch "
            "(the service applied them in 8 batches; max difference to its answers: "
            f"{d['library_max_abs_diff_to_service']:.1e}). `row branch only`: the posted users re-embedded "
            "by the row branch (ONNX) from their rating rows and nothing else, the scorer updated by "
            "ExactScorer.updated. `network only` is inference mode none; `tables rebuilt` builds the exact "
            "scorer anew over the same known ratings, every co-rating table recomputed.",
            "",
            "| inference | library fold-in | row branch only | trained-in |",
            "|---|---|---|---|",
            f"| network only (mode none) | {d['library_network_only']:.4f} | "
            f"{d['row_branch_network_only']:.4f} | {d['trained_in_network_only']:.4f} |",
            f"| default (the artifact's inference) | {d['library_default']:.4f} | "
            f"{d['row_branch_default']:.4f} | {d['trained_in_default']:.4f} |",
            f"| default, co-rating tables rebuilt | {d['library_tables_rebuilt']:.4f} | "
            f"{d['row_branch_tables_rebuilt']:.4f} | - |",
            "",
        ]
    if figure is not None:
        lines += [f"![cold start]({figure.name})", ""]
    return lines


def freshness_section(r: dict[str, Any]) -> list[str]:
    lat, poll, post = r["latency"], r["poll_latency"], r["post_latency"]
    return [
        "## 2. Freshness across replicas",
        "",
        *_header(r),
        f"- {r['servers']} on `{r['base']}`. {r['posts']} times (bounds: {r['bounds']['n']} posts, "
        f"{r['bounds']['seconds']:g} s): POST one rating of user {r['probe']['user']} for item "
        f"{r['probe']['item']} (unrated in training; {r['probe']['ratings']}) to server A, then poll server "
        f"B's /predict for that user ({r['probe']['query_items']} other unrated items) until the answer "
        "changes. Measured: from A's 200 to B's changed answer (B's answer received), so it includes at "
        f"least one /predict round trip (B's poll: p50 {poll['p50_ms']:.2f} ms).",
        "",
        "| | n | p50 ms | p99 ms | max ms |",
        "|---|---|---|---|---|",
        f"| A's 200 -> B's changed answer | {lat['n']} | {lat['p50_ms']:.2f} | {lat['p99_ms']:.2f} | "
        f"{lat['max_ms']:.2f} |",
        f"| POST /ratings to A (1 rating) | {post['n']} | {post['p50_ms']:.2f} | {post['p99_ms']:.2f} | "
        f"{post['max_ms']:.2f} |",
        f"| one /predict poll of B | {poll['n']} | {poll['p50_ms']:.2f} | {poll['p99_ms']:.2f} | "
        f"{poll['max_ms']:.2f} |",
        "",
        f"Polls of B per change: median {r['polls_per_change']['p50']:g}, max "
        f"{r['polls_per_change']['max']}. "
        f"Timeouts (no change within 10 s): {r['timeouts_10s']}. Times A's answer differed from B's changed "
        f"answer: {r['a_b_mismatches']}. Stream entries at the end: {r['stream_length']}.",
        "",
    ]


def speed_section(r: dict[str, Any]) -> list[str]:
    res = r["results"]
    rec = r["recommend"]
    lines = [
        "## 3. Speed (wrk)",
        "",
        *_header(r),
        f"- `dcmc serve --workers {r['workers']}` on `{r['base']}`, wrk `-d{r['duration_s']}s --latency`, "
        "threads = min(connections, 2), all runs in this order in one run against one service. /predict: 500 "
        "random bodies (user + 100 distinct items, seed 0) cycled; POST /ratings: one rating per request, a "
        "random known user, item and level per request (wrk Lua, bearer token), so every request stores one "
        "rating durably and both workers fold it in.",
        "- GET /recommend/{user}?k=10: "
        + (
            "random known user per request."
            if rec["exists"]
            else f"**skipped**, the route answers {rec['status']} `Not Found` in this service "
            "(not registered)."
        ),
        "",
        "| route | conc. | req/s | p50 ms | p99 ms | requests | non-2xx | ratings in the stream after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, x in res.items():
        route, _, rest = name.partition("@")
        conc, _, note = rest.partition(" ")
        label = {
            "health": "GET /health",
            "predict": "POST /predict (100 items)",
            "recommend": "GET /recommend/{user}?k=10",
            "ratings": "POST /ratings (1 rating)",
        }[route]
        if "ratings_written_during" in x:
            note += f" ({x['ratings_written_during']} acknowledged)"
        lines.append(
            f"| {label}{' ' + note if note else ''} | {conc} | {x['rps']:.0f} | {x['p50_ms']:.2f} | "
            f"{x['p99_ms']:.2f} | {x['requests']} | {x['non_2xx']}"
            f"{' (socket errors: ' + x['socket_errors'] + ')' if x['socket_errors'] else ''} | "
            f"{x.get('stream_length_after', '')} |"
        )
    lines += [
        "",
    ]
    made = [(n, x["user_rows"]) for n, x in res.items() if x.get("user_rows")]
    if made:
        lines += [
            "How the /predict answers were made (dcmc_user_rows_total by event, both workers): `hit` from a "
            "cached row of the state, `fill` a row computed, `parts_hit` from the user's row parts (read "
            "with the state's field and column terms), `parts_fill` parts computed.",
            "",
            "| run | hit | fill | parts_hit | parts_fill |",
            "|---|---|---|---|---|",
            *(
                f"| {n} | {u.get('hit', 0):.0f} | {u.get('fill', 0):.0f} | {u.get('parts_hit', 0):.0f} | "
                f"{u.get('parts_fill', 0):.0f} |"
                for n, u in made
            ),
            "",
        ]
    lines += [
        f"After the runs: {r['stream_length']} ratings in the stream; dcmc_ratings_written_total "
        f"{r['ratings_written_metric']:.0f}, dcmc_ratings_applied_total {r['ratings_applied_metric']:.0f} "
        f"(summed over both workers: each worker applies every rating), dcmc_redis_errors_total "
        f"{r['redis_errors_metric']:.0f}.",
        "",
    ]
    newcomer = r.get("newcomer_after_burst")
    if newcomer:
        took = newcomer["answered_everywhere_s"]
        lines += [
            "Right after the POST /ratings burst at concurrency 32, a new user's first rating: its /predict "
            f"answered 200 on {newcomer['fresh_connections_in_a_row']} fresh connections in a row (either "
            "worker) "
            + (f"from {took:.2f} s after the write's 200." if took is not None else "not within 120 s."),
            "",
        ]
    return lines


def write_report(results: Path, command: str) -> Path:
    """online.md (and the figure) from the latest record of each part in online.jsonl."""
    latest: dict[str, dict[str, Any]] = {}
    path = results / "online.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                latest[rec["part"]] = rec
    lines = [
        "# Online ratings: fold-in accuracy, freshness, speed",
        "",
        "Measured by `benchmarks/online.py` (each section from the latest run of its part, in "
        f"`{path.name}`; report rebuilt by `{command}`). Every part runs its own redis-server with "
        "`--appendonly yes --appendfsync always` and real `dcmc serve` processes.",
        "",
    ]
    if "accuracy" in latest:
        figure = plot_cold_start(latest["accuracy"], results / "online-cold-start.png")
        lines += accuracy_section(latest["accuracy"], figure)
    if "freshness" in latest:
        lines += freshness_section(latest["freshness"])
    if "speed" in latest:
        lines += speed_section(latest["speed"])
    report = results / "online.md"
    notes = ""
    if report.is_file() and NOTES_MARK in report.read_text():
        notes = report.read_text().split(NOTES_MARK, 1)[1].strip("\n")
    lines += [NOTES_MARK, "", notes]
    report.write_text("\n".join(lines).rstrip("\n") + "\n")
    return report


# -- main ----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--accuracy", action="store_true", help="part 1: fold-in accuracy and cold start")
    parser.add_argument("--freshness", action="store_true", help="part 2: replica freshness")
    parser.add_argument("--speed", action="store_true", help="part 3: wrk latencies and throughput")
    parser.add_argument("--report", action="store_true", help="only rebuild online.md from online.jsonl")
    parser.add_argument("--data-dir", default=str(DATA_DIR), help="holds ml-100k/u.data")
    parser.add_argument("--base", default=str(BASE), help="the ML-100K artifact trained on everything")
    parser.add_argument(
        "--work",
        default=str(Path(tempfile.gettempdir()) / "dcmc-online"),
        help="reduced dataset, reduced artifact and logs (outside the repository)",
    )
    parser.add_argument("--retrain", action="store_true", help="train the reduced model even if reusable")
    parser.add_argument("--train-only", action="store_true", help="part 1: prepare and train, then stop")
    parser.add_argument("--freshness-n", type=int, default=200, help="ratings posted (part 2)")
    parser.add_argument("--freshness-seconds", type=float, default=120, help="time bound of part 2")
    parser.add_argument("--duration", type=int, default=10, help="seconds per wrk run (part 3)")
    parser.add_argument(
        "--service-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a service setting for part 3's `dcmc serve` (e.g. DCMC_FOLD_IN_REFINE=new; repeatable)",
    )
    parser.add_argument("--results", default=str(RESULTS))
    args = parser.parse_args(argv)
    command = "python benchmarks/online.py " + " ".join(argv if argv is not None else sys.argv[1:])
    results = Path(args.results)
    chosen = [p for p in PARTS if getattr(args, p)]
    if not chosen and not args.report:
        parser.error("choose at least one of --accuracy, --freshness, --speed (or --report)")
    if args.train_only:
        from training.config import TrainConfig, preset
        from training.data import load_dataset

        split = load_dataset("ml-100k", args.data_dir, split="u1")
        held = select_users(split.train.rows)
        work = Path(args.work)
        write_dataset(work / "data", split, held)
        overrides = artifact_overrides(Path(args.base), preset("csv"), TrainConfig)
        emit({"step": "trained", **train_reduced(work / "data", work / "reduced", overrides, args.retrain)})
        return 0
    functions = {"accuracy": part_accuracy, "freshness": part_freshness, "speed": part_speed}
    for part in chosen:
        t0 = time.time()
        git_start = commit()
        record = functions[part](args)
        record.update(
            command=command,
            machine=machine(),
            git=commit(),
            git_start=git_start,
            started=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t0)),
            wall_s=round(time.time() - t0, 1),
        )
        results.mkdir(parents=True, exist_ok=True)
        with (results / "online.jsonl").open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        emit(record)
    print("report:", write_report(results, command), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
