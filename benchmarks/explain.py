"""Explanations (model/exact/explain.py): what they cost a request, and whether they are faithful.

    python benchmarks/explain.py --artifacts DIR [--data-dir ../shared/datasets] [--entries 500]

1. cost: in process, one BLAS thread, `service.routes.predict.answer` (what POST /predict runs) for a
   random known user and 10 random items, without and with `explain` (DCMC_EXPLAIN_K 5), alternating in
   rounds; p50 and p99 of each and the p50 difference.
2. faithfulness, on `--entries` random entries of ML-100K u1's test split (reporting only; the artifact
   trained on u1's training ratings): for m = 1, 3, 5, how far the prediction moves when the m
   top-explained known ratings are taken out together, against m random ones of the user's and item's
   ratings and m random ones of all, read as direct sums over every known rating (not the field's summary
   G); then, on `--check` entries, each top single effect against a field rebuilt without that rating.

Writes benchmarks/results/explain.md (and explain-deletion.png) and appends to explain.jsonl.
"""

import copy
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as a service worker runs

import harness as h
import numpy as np

SIZES = (1, 3, 5)


def cost(artifacts: Path, rounds: int, per_round: int, seed: int) -> dict[str, Any]:
    from model.artifact import load_artifact
    from service.metrics import Metrics
    from service.routes.predict import answer
    from service.scoring import ServedModel
    from service.settings import Settings

    settings = Settings(artifacts=artifacts)
    served = ServedModel(load_artifact(artifacts), settings, Metrics())
    art = served.artifact
    rng = np.random.default_rng(seed)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        n, m = len(art.users.ids), len(art.items.ids)
        bodies = [
            (art.users.ids[rng.integers(n)], [art.items.ids[j] for j in rng.choice(m, 10, replace=False)])
            for _ in range(per_round)
        ]
        for explain in (False, True):
            for user, items in bodies:
                t0 = time.perf_counter()
                answer(served, settings, user, items, False, explain)
                times[explain].append((time.perf_counter() - t0) * 1e3)
    out: dict[str, Any] = {}
    for name, flag in (("plain", False), ("explain", True)):
        s = h.summarize(times[flag])
        out[name] = {"p50_ms": s["p50_ms"], "p99_ms": s["p99_ms"]}
    out["added_p50_ms"] = out["explain"]["p50_ms"] - out["plain"]["p50_ms"]
    out["requests_each"] = len(times[False])
    return out


def faithfulness(artifacts: Path, data_dir: Path, entries: int, check: int, seed: int) -> dict[str, Any]:
    from model.artifact import load_artifact
    from model.engine import expected_rating
    from model.exact import known_field
    from model.exact.explain import Queries
    from model.ratings import Ratings
    from model.scorers import artifact_scorer
    from training.data import load_dataset

    art = load_artifact(artifacts)
    _, scorer = artifact_scorer(art, art.inference)
    split = load_dataset("ml-100k", data_dir, split="u1")
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(split.test), entries, replace=False)
    users = art.users.indices([split.user_ids[u] for u in split.test.rows[pick]])
    items = art.items.indices([split.item_ids[j] for j in split.test.cols[pick]])
    known = scorer.known
    everyone = np.arange(len(known))
    moved = {w: {m: [] for m in SIZES} for w in ("explained", "line", "any")}
    checks: list[float] = []
    levels = scorer.network.levels

    def direct(query: Any, gone: np.ndarray) -> float:
        """The prediction with `gone` taken out, from the direct sum over every other known rating."""
        kept = np.setdiff1d(everyone, gone)
        k = query.weights(np.zeros(len(kept), dtype=np.int64), kept)
        num = (k[:, None] * query.compat[query.labels[kept]]).sum(axis=0)
        lines = scorer.lines
        den = k.sum() + (lines.prior_weight if lines is not None else 0.0)
        return float(query.read(np.zeros(1, dtype=np.int64), num[None], np.array([den]))[0])

    for n, (user, item) in enumerate(zip(users.tolist(), items.tolist(), strict=True)):
        query = Queries(scorer, user, np.array([item]))
        (e,) = query.explain(max(SIZES))
        full = direct(query, np.empty(0, dtype=np.int64))
        assert abs(full - e.rating) < 1e-9, (full, e.rating)  # the direct sum is the prediction
        own = np.setdiff1d(np.union1d(query.row, query.column(0)), e.known)
        for m in SIZES:
            moved["explained"][m].append(abs(full - direct(query, e.known[:m])))
            moved["line"][m].append(
                abs(full - direct(query, rng.choice(own, min(m, len(own)), replace=False)))
            )
            moved["any"][m].append(abs(full - direct(query, rng.choice(everyone, m, replace=False))))
        if n < check:  # the top effect against a field rebuilt from scratch without that rating
            position = int(e.known[0])
            keep = everyone != position
            fewer = Ratings(
                known.rows[keep], known.cols[keep], known.values[keep], known.n_users, known.n_items
            )
            lines = None if scorer.lines is None else dataclasses.replace(scorer.lines, known=fewer)
            field = known_field(
                scorer.user_lifted, scorer.item_lifted, fewer.rows, fewer.cols, None, fewer.labels(levels),
                scorer.compat, scorer.crf.gamma, scorer.crf.layers, scorer.kernel.scaling, scorer.field.scale,
                "clamped", lines,
            )  # fmt: skip
            rebuilt = copy.copy(scorer)
            rebuilt.known, rebuilt.lines, rebuilt.field = fewer, lines, field
            dist = rebuilt.predict(np.array([user]), np.array([item]))
            again = float(np.clip(expected_rating(dist, levels), levels[0], levels[-1])[0])
            checks.append(abs(float(e.effects[0]) - (e.rating - again)))
    curve = {w: {str(m): float(np.mean(v)) for m, v in by.items()} for w, by in moved.items()}
    wins = {
        str(m): float(np.mean(np.array(moved["explained"][m]) > np.array(moved["line"][m]))) for m in SIZES
    }
    return {"entries": entries, "mean_abs_change": curve, "explained_beats_line_share": wins,
            "checked": len(checks), "max_abs_effect_error": float(max(checks, default=0.0))}  # fmt: skip


def plot(record: dict[str, Any], path: Path) -> None:
    plt = h.pyplot()
    curve = record["faithfulness"]["mean_abs_change"]
    fig, ax = plt.subplots(figsize=(5, 3.4))
    labels = {"explained": "top-explained", "line": "random (user's and item's)", "any": "random (any)"}
    for name, label in labels.items():
        ax.plot(SIZES, [curve[name][str(m)] for m in SIZES], marker="o", label=label)
    ax.set_xlabel("known ratings taken out")
    ax.set_ylabel("mean |change of prediction|")
    ax.set_yscale("log")
    ax.set_xticks(SIZES)
    ax.legend(fontsize=8)
    ax.set_title(f"Deletion curve, {record['faithfulness']['entries']} ML-100K u1 test entries", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(r: dict[str, Any], results: Path) -> None:
    c, f, m = r["cost"], r["faithfulness"], r["machine"]
    plain, explain = c["plain"], c["explain"]
    curve = f["mean_abs_change"]
    lines = [
        "# Explanations: cost and faithfulness",
        "",
        f"- command: `{r['command']}` ({r['started']}, {r['wall_s']:.0f} s)",
        f"- commit: `{r['commit']}`; machine: {m['nproc']} cores, {m['cpu']}",
        f"- artifact: `{r['artifacts']}` (model {r['model_version']}, inference {r['inference']})",
        "",
        "## Cost (in process, one BLAS thread, 10 random items of a random known user per request)",
        "",
        *h.table("| | p50 ms | p99 ms |"),
        f"| POST /predict's answer | {plain['p50_ms']:.3f} | {plain['p99_ms']:.3f} |",
        f"| the same with explain (5 ratings each) | {explain['p50_ms']:.3f} | {explain['p99_ms']:.3f} |",
        "",
        f"Added at p50: {c['added_p50_ms']:.3f} ms over {c['requests_each']} requests each (target 2 ms).",
        "",
        f"## Faithfulness ({f['entries']} random entries of ML-100K u1's test split; reporting only)",
        "",
        "Mean |change of the prediction| when m known ratings are taken out together:",
        "",
        *h.table("| m | top-explained | random of the user's and item's | random of all |"),
        *(
            f"| {m} | {curve['explained'][str(m)]:.5f} | {curve['line'][str(m)]:.5f} | "
            f"{curve['any'][str(m)]:.2e} |"
            for m in SIZES
        ),
        "",
        "Share of entries where taking out the top-explained moved the prediction more than as many random "
        "ratings of the user's and item's: "
        + ", ".join(f"m={m}: {f['explained_beats_line_share'][str(m)]:.1%}" for m in SIZES)
        + ".",
        "",
        f"Single effects against a field rebuilt from scratch without the rating ({f['checked']} entries, "
        f"each top effect): largest difference {f['max_abs_effect_error']:.1e}.",
        "",
        "![deletion curve](explain-deletion.png)",
        "",
    ]
    h.write_report(results / "explain.md", lines)


def main(argv: list[str] | None = None) -> int:
    parser = h.parser(__doc__)
    parser.add_argument("--artifacts", required=True, type=Path)
    parser.add_argument("--data-dir", type=Path, default=h.DATA_DIR)
    parser.add_argument("--entries", type=int, default=500)
    parser.add_argument(
        "--check", type=int, default=20, help="entries whose top effect is rebuilt from scratch"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", type=Path, default=h.RESULTS)
    args = parser.parse_args(argv)
    from model.artifact import load_artifact

    started = time.time()
    art = load_artifact(args.artifacts)
    record: dict[str, Any] = {
        "command": h.command("explain.py", argv),
        "commit": h.commit_label("model", "service", "benchmarks/explain.py"),
        "machine": h.machine(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "artifacts": str(args.artifacts),
        "model_version": art.model_version,
        "inference": art.inference.mode,
        "cost": cost(args.artifacts, args.rounds, args.per_round, args.seed),
    }
    h.emit({"cost": record["cost"]})
    record["faithfulness"] = faithfulness(args.artifacts, args.data_dir, args.entries, args.check, args.seed)
    record["wall_s"] = round(time.time() - started, 1)
    h.emit(record)
    h.append_jsonl(args.results / "explain.jsonl", record)
    plot(record, args.results / "explain-deletion.png")
    report(record, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
