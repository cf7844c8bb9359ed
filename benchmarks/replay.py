"""Does the evaluation loop find what it should? A replay of MovieLens-100K in timestamp order through the
HTTP service, with experiments running (model/experiments.py, service/experiments.py).

    python benchmarks/replay.py prepare --out DIR     # the time split, then the `dcmc train` it prints
    python benchmarks/replay.py run --split DIR --artifacts ARTIFACT [--power-draws 40] [--aa-salts 200]

`prepare` sorts u.data by timestamp and writes DIR/train.csv (the first 80% of the ratings: what the
artifact is trained on, `dcmc train --dataset csv --data-dir DIR`, which carves its validation ratings
from them) and DIR/test.csv (the last 20%: the replay). `run` replays DIR/test.csv. Each user's ratings are
grouped into visits (a UTC day with a rating); at the start of each visit the user asks
GET /recommend/{user}?k=10, and then

- for every shown item the user rates at any later point of the replay (what they "really rated later")
  a `click` event naming the answer's recommendation_id is posted, and
- the visit's own ratings are posted (POST /ratings, the shown ones naming the answer);

so a shown item counts as a hit when the user rated it later, and online accuracy scores the predictions
and distributions served for shown items against the ratings those users then gave them. Every run starts
from a fresh private Redis and the artifact as trained: the ratings of the replay fold in as it goes.

Experiments (each a run of its own, the whole replay):

1. `popular`: A/B, the artifact's default exact CRF against the popular list (`ranking.popular`);
2. `base`: A/B, exact against the base network alone (`inference.mode = none`);
3. `popular-interleaved`, `base-interleaved`: the same pairs interleaved (team draft);
4. `aa`: A/A, two variants that change nothing.

For each: GET /experiments/{id}/results at the end, checked equal to `dcmc experiment report --json`
computed from the streams. Users needed: for n users drawn from the replay's (`--power-draws` draws per
n, seeded), the share of draws in which the hit-rate difference (A/B) or the preference (interleaved)
is significant; the smallest n where that reaches 80%. A/A: the same analysis over `--aa-salts` salts (the
impressions re-assigned by each salt's keyed hash, which is what the service would have done since both
variants answer alike): the share of salts whose hit-rate difference is called significant, which should
be about 5%.

Writes benchmarks/results/replay.md and appends to replay.jsonl.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import harness as h
import numpy as np

from model.experiments import (
    METRICS,
    ExperimentSpec,
    Impression,
    difference,
    read_experiments,
    read_streams,
    results,
)

SHARE = 0.8
K = 10
DAY = 86400
SIZES = (25, 50, 100, 150, 200, 300)

PAIRS = {
    "popular": "ranking = { popular = true }",
    "base": 'inference = { "mode" = "none" }',
}


def experiment_file(name: str) -> str:
    """The experiments file of one run: `truth-X` (everyone gets X: its weight 1 against 1e-9), `X` (A/B,
    exact against X), `X-interleaved` (exact and X interleaved)."""
    if name.startswith("truth-"):
        variant = name.removeprefix("truth-")
        first = f'name = "{variant}"\n' + (PAIRS.get(variant, "") + "\n")
        second, method, weight = 'name = "unused"', "ab", "weight = 1e-9"
    else:
        pair = name.removesuffix("-interleaved")
        first = 'name = "exact"\n'
        second = f'name = "{pair}"\n{PAIRS[pair]}'
        method, weight = ("interleave" if name.endswith("-interleaved") else "ab"), ""
    return (
        f'[[experiment]]\nid = "{name}"\nsalt = "replay"\nmethod = "{method}"\nhit_rating = 4.0\n'
        f"window_s = 864000\n\n[[experiment.variant]]\n{first}\n[[experiment.variant]]\n{second}\n{weight}\n"
    )


def prepare(out: Path) -> None:
    data = np.loadtxt(h.DATA_DIR / "ml-100k" / "u.data", dtype=np.int64)
    data = data[np.argsort(data[:, 3], kind="stable")]
    cut = int(len(data) * SHARE)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", data[:cut]), ("test", data[cut:])):
        with (out / f"{name}.csv").open("w") as f:
            f.write("user,item,rating,timestamp\n")
            f.writelines(f"{u},{i},{r},{t}\n" for u, i, r, t in part.tolist())
    print(f"wrote {out}/train.csv ({cut} ratings) and {out}/test.csv ({len(data) - cut}); now:")
    print(f"  dcmc train --dataset csv --data-dir {out} --out ARTIFACT")


def read_replay(split: Path) -> list[tuple[str, str, float, int]]:
    rows = []
    with (split / "test.csv").open() as f:
        next(f)
        for line in f:
            u, i, r, t = line.strip().split(",")
            rows.append((u, i, float(r), int(t)))
    return rows


def replay(svc: h.Service, rows: list[tuple[str, str, float, int]]) -> dict[str, Any]:
    """The whole replay through the service (module docstring); counts."""
    visits: dict[tuple[str, int], list[tuple[str, float]]] = defaultdict(list)
    order: list[tuple[str, int]] = []
    later: dict[str, list[tuple[int, str]]] = defaultdict(list)  # user -> (time, item) of every rating
    for u, i, r, t in rows:
        key = (u, t // DAY)
        if key not in visits:
            order.append(key)
        visits[key].append((i, r))
        later[u].append((t, i))
    first_day = {}
    for u, entries in later.items():
        first_day[u] = defaultdict(set)
        for t, i in entries:
            first_day[u][t // DAY].add(i)
    lists = clicks = posted = 0
    began = time.perf_counter()
    for user, day in order:
        answer = svc.client.get(f"/recommend/{user}", params={"k": K})
        answer.raise_for_status()
        body = answer.json()
        rec = body["recommendation_id"]
        shown = [r["item"] for r in body["recommendations"]]
        lists += 1
        rated_later = set().union(*(items for d, items in first_day[user].items() if d >= day))
        events = [
            {"user": user, "item": i, "type": "click", "recommendation_id": rec}
            for i in shown
            if i in rated_later
        ]
        if events:
            r = svc.client.post("/events", json={"events": events}, headers=h.AUTH)
            r.raise_for_status()
            clicks += len(events)
        ratings = [
            {"user": user, "item": i, "rating": v, **({"recommendation_id": rec} if i in shown else {})}
            for i, v in visits[(user, day)]
        ]
        for start in range(0, len(ratings), 1000):
            r = svc.client.post("/ratings", json={"ratings": ratings[start : start + 1000]}, headers=h.AUTH)
            r.raise_for_status()
            posted += len(ratings[start : start + 1000])
        svc.last_id = r.json()["last_id"]
    return {
        "lists": lists,
        "clicks": clicks,
        "ratings": posted,
        "replay_s": round(time.perf_counter() - began, 1),
    }


def relabelled(impressions: list[Impression], experiment: str, variant: str) -> list[Impression]:
    """A truth run's impressions as if of `experiment`'s `variant`."""
    return [replace(i, experiment=experiment, variant=variant) for i in impressions if i.user is not None]


def ab_power(
    spec: ExperimentSpec,
    truth: dict[str, tuple[list[Impression], list[Any]]],
    known: dict[str, Any],
    levels: list[float],
    n_items: int,
    draws: int,
) -> dict[str, Any]:
    """A/B with n users: n users drawn (seeded), each assigned by the keyed hash of a salt of the draw,
    each user's lists and feedback those of the truth run of their variant; the share of draws whose
    hit-rate difference (and the coverage difference) is significant with the sign of the known one."""
    control, other = spec.variants[0].name, spec.variants[1].name
    users = sorted({i.user for i in truth[control][0] if i.user is not None})
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"hit_rate": {}, "coverage": {}}
    for n in [s for s in SIZES if s < len(users)] + [len(users)]:
        called = dict.fromkeys(out, 0)
        for d in range(draws):
            chosen = set(rng.choice(users, n, replace=False).tolist())
            draw = spec.model_copy(update={"salt": f"draw-{n}-{d}"})
            arm = {u: draw.assign(u) for u in chosen}
            impressions = [
                i
                for name in (control, other)
                for i in relabelled(truth[name][0], spec.id, name)
                if i.user in chosen and arm[i.user] == name
            ]
            feedback = [
                f
                for name in (control, other)
                for f in truth[name][1]
                if f.user in chosen and arm[f.user] == name
            ]
            got = results(draw, impressions, feedback, levels, n_items)["differences"][other]
            for m in out:
                sign = np.sign(known[m]["value"] or 0.0)
                called[m] += bool(got[m]["significant"] and np.sign(got[m]["value"] or 0.0) == sign)
        for m in out:
            out[m][str(n)] = round(called[m] / draws, 3)
    return out


def interleaved_power(
    spec: ExperimentSpec,
    impressions: list[Impression],
    feedback: list[Any],
    levels: list[float],
    n_items: int,
    draws: int,
) -> dict[str, Any]:
    """Interleaving with n users drawn from the interleaved run (seeded): the share of draws whose
    preference is significant, and of those with each sign."""
    users = sorted({i.user for i in impressions if i.user is not None})
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {}
    for n in [s for s in SIZES if s < len(users)] + [len(users)]:
        called = 0
        for _ in range(draws if n < len(users) else 1):
            chosen = set(rng.choice(users, n, replace=False).tolist())
            got = results(
                spec,
                [i for i in impressions if i.user in chosen],
                [f for f in feedback if f.user in chosen],
                levels,
                n_items,
            )["interleaving"]["preference"]
            called += bool(got["significant"])
        out[str(n)] = round(called / (draws if n < len(users) else 1), 3)
    return out


def aa_rate(
    truth: tuple[list[Impression], list[Any]], levels: list[float], n_items: int, salts: int
) -> dict[str, Any]:
    """The truth run of the control, its users split by the keyed hash of each of `salts` salts into two
    variants that answer alike: the share of salts whose difference is called significant, per figure."""
    calls = {m: 0 for m in ("hit_rate", "click_through", "mean_later_rating", "rmse", "log_loss", "coverage")}
    base = ExperimentSpec.model_validate(
        {
            "id": "aa",
            "salt": "-",
            "hit_rating": 4.0,
            "window_s": 864000,
            "variant": [{"name": "a"}, {"name": "b"}],
        }
    )
    for s in range(salts):
        spec = base.model_copy(update={"salt": f"aa-{s}"})
        moved = [replace(i, experiment="aa", variant=spec.assign(i.user or "")) for i in truth[0] if i.user]
        got = results(spec, moved, truth[1], levels, n_items)["differences"]["b"]
        for m in calls:
            calls[m] += got[m]["significant"]
    return {m: round(c / salts, 3) for m, c in calls.items()}


def extrapolated(figure: dict[str, Any], users: int) -> int | None:
    """Users for 80% power at 95% two-sided, from a difference measured with `users` users and its
    standard error (se scales as 1/sqrt(n)): users * (2.80 se / |d|)^2; None without one."""
    d, se = figure.get("value"), figure.get("se")
    if se is None:
        low, high = figure.get("low"), figure.get("high")
        se = None if low is None or high is None else (high - low) / (2 * 1.959964)
    if not d or se is None:
        return None
    return int(np.ceil(users * (2.8016 * se / abs(d)) ** 2))


def one_run(
    name: str, artifacts: Path, rows: list[tuple[str, str, float, int]], work: Path
) -> tuple[ExperimentSpec, dict[str, Any], list[Impression], list[Any]]:
    """One replay with the experiment `name` running: its counts, results and whether `dcmc experiment
    report` agrees, and the streams it left."""
    path = work / f"{name}.toml"
    path.write_text(experiment_file(name))
    spec = read_experiments(path)[0]
    with h.Redis() as redis_server:
        svc = h.Service(
            artifacts, redis_server.url, "dcmc", 1, work / f"{name}.log", {"DCMC_EXPERIMENTS": str(path)}
        ).wait_ready()
        try:
            counts = replay(svc, rows)
            time.sleep(3.2)  # the last impressions written (every 0.2 s), and past the results' cache (2 s)
            served = svc.client.get(f"/experiments/{name}/results").json()
            report = subprocess.run(
                [
                    h.DCMC,
                    "experiment",
                    "report",
                    name,
                    "--experiments",
                    str(path),
                    "--artifacts",
                    str(artifacts),
                    "--redis",
                    redis_server.url,
                    "--json",
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            impressions, feedback = read_streams(redis_server.client, "dcmc")
        finally:
            svc.stop()
    agree = json.loads(report.stdout) == served
    print(json.dumps({"run": name, **counts, "report_agrees": agree}), flush=True)
    return spec, {**counts, "results": served, "report_agrees": agree}, impressions, feedback


def run(split: Path, artifacts: Path, draws: int, salts: int) -> dict[str, Any]:
    began = time.perf_counter()
    rows = read_replay(split)
    config = json.loads((artifacts / "config.json").read_text())
    levels = [float(x) for x in config["model"]["levels"]]
    n_items = int(config["model"]["n_items"])
    record: dict[str, Any] = {"started": h.stamp(), "machine": h.machine(), "git": h.commit()}
    record.update({"replay_ratings": len(rows), "users": len({u for u, *_ in rows}), "runs": {}})
    work = Path(tempfile.mkdtemp(prefix="dcmc-replay-"))
    truth: dict[str, tuple[list[Impression], list[Any]]] = {}
    for variant in ("exact", *PAIRS):
        _, entry, impressions, feedback = one_run(f"truth-{variant}", artifacts, rows, work)
        truth[variant] = ([i for i in impressions if i.variant == variant], feedback)
        record["runs"][f"truth-{variant}"] = entry
    for pair in PAIRS:
        spec, entry, _, _ = one_run(pair, artifacts, rows, work)  # the A/B as the service runs it
        # Every user seen under each variant (the two truth runs as two groups): the known difference.
        a = record["runs"]["truth-exact"]["results"]["variants"]["exact"]
        b = record["runs"][f"truth-{pair}"]["results"]["variants"][pair]
        entry["known"] = {m: difference(a[m], b[m]) for m in METRICS}
        powers = ab_power(spec, truth, entry["known"], levels, n_items, draws)
        entry["power"] = powers["hit_rate"]
        entry["extrapolated"] = extrapolated(entry["known"]["hit_rate"], 2 * record["users"])
        record["runs"][f"{pair}-coverage"] = {
            "power": powers["coverage"],
            "extrapolated": extrapolated(entry["known"]["coverage"], 2 * record["users"]),
        }
        record["runs"][pair] = entry
        spec, entry, impressions, feedback = one_run(f"{pair}-interleaved", artifacts, rows, work)
        entry["power"] = interleaved_power(spec, impressions, feedback, levels, n_items, draws)
        entry["extrapolated"] = extrapolated(entry["results"]["interleaving"]["preference"], record["users"])
        record["runs"][f"{pair}-interleaved"] = entry
    record["aa"] = {"salts": salts, "significant_share": aa_rate(truth["exact"], levels, n_items, salts)}
    record["wall_s"] = round(time.perf_counter() - began, 1)
    return record


def _fig(f: dict[str, Any], scale: float = 100.0, unit: str = "%") -> str:
    if f.get("value") is None:
        return "-"
    low = "" if f.get("low") is None else f" [{f['low'] * scale:.2f}, {f['high'] * scale:.2f}]"
    return f"{f['value'] * scale:.2f}{unit}{low}" + (" *" if f.get("significant") else "")


FIGURES = (
    ("hit_rate", 100.0, "%"),
    ("mean_later_rating", 1.0, ""),
    ("rmse", 1.0, ""),
    ("log_loss", 1.0, ""),
    ("coverage", 100.0, "%"),
)


def _needed(power: dict[str, Any]) -> str:
    enough = [int(n) for n, share in power.items() if share >= 0.8]
    return str(min(enough)) if enough else f"more than {max(int(n) for n in power)}"


def report(record: dict[str, Any], command: str) -> list[str]:
    runs = record["runs"]
    lines = [
        "# Replay: the evaluation loop on ML-100K in timestamp order",
        "",
        f"- command: `{command}` (started {record['started']}, {record['wall_s']:.0f} s)",
        f"- machine: {record['machine']['nproc']} cores, {record['machine']['cpu']}",
        f"- commit: {h.describe_commit(record['git'])}",
        f"- replay: the last 20% of ML-100K by timestamp ({record['replay_ratings']} ratings, "
        f"{record['users']} users, a list of 10 at each of a user's visits), through `dcmc serve` with a "
        "private Redis, once per run; the artifact was trained on the first 80% (its validation ratings "
        "carved from them). The replay is the test part: each run looks at it once; nothing was chosen "
        "on it.",
        "- a hit: a shown item the user rated at any later point of the replay (the simulated user clicks "
        "it); "
        "online RMSE and log loss: the predictions and (calibrated) distributions served for shown items "
        "against the ratings the users then gave them. `*`: the 95% interval excludes 0.",
        "",
        "## The known differences",
        "",
        "Each variant served to every user (a `truth-` run each), the variants' figures over all users:",
        "",
        "| variant | lists | " + " | ".join(m for m, _, _ in FIGURES) + " |",
        "|---|---|" + "---|" * len(FIGURES),
    ]
    for name in ("exact", *PAIRS):
        r = runs[f"truth-{name}"]
        v = r["results"]["variants"][name]
        cells = " | ".join(_fig(v[m], sc, u) for m, sc, u in FIGURES)
        lines.append(f"| {name} | {r['lists']} | {cells} |")
    lines += ["", "Differences from `exact` (the variant minus exact, independent groups):", ""]
    lines += ["| variant | " + " | ".join(m for m, _, _ in FIGURES) + " |", "|---|" + "---|" * len(FIGURES)]
    for pair in PAIRS:
        k = runs[pair]["known"]
        lines.append(f"| {pair} | " + " | ".join(_fig(k[m], sc, u) for m, sc, u in FIGURES) + " |")
    lines += [
        "",
        "## What the experiments found",
        "",
        "A/B as the service runs it (half the users each, by the keyed hash), and interleaved (every user, "
        "one merged list); `results = report`: GET /experiments/{id}/results equal to `dcmc experiment "
        "report --json`.",
        "",
        "| run | users | hit rate difference | mean later rating difference | RMSE difference | "
        "coverage difference | interleaving preference | results = report |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for pair in PAIRS:
        for name in (pair, f"{pair}-interleaved"):
            r = runs[name]
            res = r["results"]
            users = sum(v["users"] for v in res["variants"].values())
            if "interleaving" in res:
                users = res["interleaving"]["users"]
            d = res["differences"][pair]
            pref = _fig(res["interleaving"]["preference"], 1.0, "") if "interleaving" in res else "-"
            cells = [_fig(d[m], sc, u) for m, sc, u in FIGURES if m != "log_loss"]
            if "interleaving" in res:  # per team: what each variant's items earned (hit rate only)
                cells = [_fig(d["hit_rate"]), "-", "-", "-"]
            agrees = "yes" if r["report_agrees"] else "**no**"
            lines.append(f"| {name} | {users} | {' | '.join(cells)} | {pref} | {agrees} |")
    sizes = sorted({int(n) for r in runs.values() for n in r.get("power", {})})
    lines += [
        "",
        "## Users needed",
        "",
        "The share of draws of n users (seeded, without replacement) in which the comparison is significant "
        "at 95% with the sign of the known difference (A/B: the hit-rate or coverage difference, each drawn "
        "user in the arm a salt of the draw assigns, with that arm's truth-run lists and feedback; "
        "interleaved: the preference, users drawn from the interleaved run), and the smallest n where it "
        "reaches 80%:",
        "",
        "| comparison | " + " | ".join(str(n) for n in sizes) + " | users for 80% | extrapolated |",
        "|---|" + "---|" * (len(sizes) + 2),
    ]
    for name, r in runs.items():
        if "power" in r:
            cells = [str(r["power"].get(str(n), "")) for n in sizes]
            label = f"{name} (A/B, hit rate)" if name in PAIRS else name
            label = (
                f"{name.removesuffix('-coverage')} (A/B, coverage)" if name.endswith("-coverage") else label
            )
            far = r.get("extrapolated")
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {_needed(r['power'])} | {far or '-'} |")
    lines += [
        "",
        "`extrapolated`: users for 80% power from the measured difference and its standard error (which "
        "shrinks as 1/sqrt(n)): A/B from the known hit-rate difference (its error over all users in each "
        "arm, so n = 2 N (2.80 se / |d|)^2 users in all), interleaved from the preference the interleaved "
        "run measured (n = N (2.80 se / |d|)^2). A difference measured as near 0 extrapolates to many users.",
    ]
    aa = record["aa"]
    lines += [
        "",
        "## A/A",
        "",
        f"The `truth-exact` run's users split by each of {aa['salts']} salts into two variants that answer "
        "alike; the share of salts whose difference is called significant (about 5% expected):",
        "",
    ]
    lines += [f"- {m}: {v:.1%}" for m, v in aa["significant_share"].items()]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = h.parser(__doc__)
    sub = p.add_subparsers(dest="step", required=True)
    prep = sub.add_parser("prepare")
    prep.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("run")
    r.add_argument("--split", type=Path, required=True)
    r.add_argument("--artifacts", type=Path, required=True)
    r.add_argument("--power-draws", type=int, default=40)
    r.add_argument("--aa-salts", type=int, default=200)
    r.add_argument(
        "--runs", nargs="+", default=["popular", "base", "popular-interleaved", "base-interleaved", "aa"]
    )
    r.add_argument("--results", type=Path, default=h.RESULTS)
    args = p.parse_args(argv)
    if args.step == "prepare":
        prepare(args.out)
        return 0
    command = h.command("replay.py", argv)
    record = run(args.split, args.artifacts, args.power_draws, args.aa_salts)
    record["command"] = command
    h.append_jsonl(args.results / "replay.jsonl", record)
    h.write_report(args.results / "replay.md", report(record, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
