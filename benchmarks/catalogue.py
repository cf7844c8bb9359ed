"""What filters cost /recommend (service/catalogue.py).

    python benchmarks/catalogue.py --artifacts DIR [--items 140000] [--duration 8] [--rounds 20]
                                   [--epinions DIR] [--requests 300]

1. In process, a synthetic catalogue of `--items` records (the Epinions shape's 139,738 items rounded up:
   20 categories, a year, a language, tags): building the index, and one three-clause filter (category any
   of two, a year range, not one language): its first evaluation, then repeated (kept per catalogue), with
   the masking a /recommend adds around it; p50 of 200 each.
   With `--epinions DIR` (an artifact of the Epinions shape, 139,738 items), the whole in-process
   /recommend (FastAPI's TestClient over `create_app`, no Redis): that artifact with the same synthetic
   catalogue, `--requests` uniformly random users, POST /recommend {user, k: 10} without and with the
   three-clause filter, alternating: p50 of each and their difference.
2. Over HTTP: `dcmc serve --workers 2` on DIR (an ML-100K artifact with its u.item catalogue) and a
   private Redis; wrk at concurrency 32 on GET /recommend/{uniformly random user}?k=10, without and with
   `category=Comedy,Drama&exclude_category=Horror` (three clauses), alternating, twice each; requests per
   second, the filtered as a share of the unfiltered.
3. Catalogue writes over HTTP: two replicas (`dcmc serve --workers 1` each, the same private Redis with
   appendfsync always). POST /items of 1,000 whole records through replica A, `--rounds` times: seconds
   until the answer (stored), and until replica B has applied the batch (GET /items/{id}?after=). Then
   `--rounds` times: PATCH {"hidden": true} of a uniformly random user's current top item through A, and
   the seconds until GET /recommend/{user} (no `after`: what a client sees) leaves it out on A and on B,
   each polled every 10 ms (then shown again).

Writes benchmarks/results/catalogue.md and appends to catalogue.jsonl.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import harness as h
import numpy as np

FILTER = {
    "op": "all",
    "of": [
        {"op": "category", "any_of": ["c3", "c7"]},
        {"op": "range", "attribute": "year", "gte": 1990, "lt": 2000},
        {"op": "not", "filter": {"op": "eq", "attribute": "lang", "value": "de"}},
    ],
}
QUERY = "&category=Comedy,Drama&exclude_category=Horror"


def in_process(n_items: int, seed: int = 0) -> dict[str, Any]:
    from pydantic import TypeAdapter

    from service.catalogue import CatalogueIndex, Filter

    records = synthetic_catalogue([str(j) for j in range(n_items)], seed)
    t0 = time.perf_counter()
    index = CatalogueIndex(records, n_items, str)
    build_s = time.perf_counter() - t0
    chosen = TypeAdapter(Filter).validate_python(FILTER)
    visible = index.visible
    first, again = [], []
    for _ in range(200):
        index._selected.clear()  # the first evaluation of a filter
        t0 = time.perf_counter()
        mask, _ = index.select(chosen, ["filter"])
        candidates = np.ones(n_items, dtype=bool) & visible & mask
        first.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        mask, _ = index.select(chosen, ["filter"])  # kept: the same filter again
        candidates = np.ones(n_items, dtype=bool) & visible & mask
        again.append((time.perf_counter() - t0) * 1e3)
    return {
        "items": n_items,
        "index_build_s": round(build_s, 2),
        "first_p50_ms": round(float(np.median(first)), 3),
        "repeated_p50_ms": round(float(np.median(again)), 3),
        "passing": int(candidates.sum()),
    }


def synthetic_catalogue(ids: list[str], seed: int = 0) -> dict[str, Any]:
    from model.catalogue import ItemRecord

    rng = np.random.default_rng(seed)
    langs = ["en", "fr", "de", "es"]
    return {
        x: ItemRecord(
            categories=[f"c{c}" for c in rng.choice(20, size=int(rng.integers(1, 4)), replace=False)],
            attributes={"year": int(rng.integers(1950, 2025)), "lang": langs[j % 4], "tags": [f"t{j % 50}"]},
            hidden=bool(rng.random() < 0.01),
        )
        for j, x in enumerate(ids)
    }


def whole_recommend(artifacts: Path, requests: int, seed: int = 0) -> dict[str, Any]:
    import shutil

    from fastapi.testclient import TestClient

    from model.artifact import load_artifact, rewritten
    from model.catalogue import write_catalogue
    from service.main import create_app
    from service.settings import Settings

    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(shutil.copytree(artifacts, Path(tmp) / "artifact"))
        art = load_artifact(copy)
        users, ids = list(art.users.ids), list(art.items.ids)
        with rewritten(copy) as (directory, _):
            write_catalogue(directory, synthetic_catalogue(ids))
        rng = np.random.default_rng(seed)
        plain, filtered = [], []
        with TestClient(create_app(Settings(artifacts=copy, log_level="warning"))) as client:
            for k in range(requests + 20):
                user = users[int(rng.integers(len(users)))]
                times = []
                for body in ({"user": user, "k": 10}, {"user": user, "k": 10, "filter": FILTER}):
                    t0 = time.perf_counter()
                    r = client.post("/recommend", json=body)
                    times.append((time.perf_counter() - t0) * 1e3)
                    assert r.status_code == 200, r.text
                if k >= 20:  # past the first requests (the filter's first evaluation among them)
                    plain.append(times[0])
                    filtered.append(times[1])
    p50, f50 = float(np.median(plain)), float(np.median(filtered))
    return {
        "items": len(ids),
        "requests": requests,
        "plain_p50_ms": round(p50, 2),
        "filtered_p50_ms": round(f50, 2),
        "added_p50_ms": round(f50 - p50, 2),
    }


def over_http(artifacts: Path, duration: int) -> dict[str, Any]:
    out: dict[str, list[float]] = {"plain": [], "filtered": []}
    with tempfile.TemporaryDirectory() as tmp, h.Redis() as redis:
        scripts = h.lua_scripts(Path(tmp), artifacts, [])
        plain = scripts["recommend"]
        filtered = Path(tmp) / "filtered.lua"
        filtered.write_text(plain.read_text().replace('"?k=10"', f'"?k=10{QUERY}"'))
        svc = h.Service(artifacts, redis.url, "bench-catalogue", 2, Path(tmp) / "serve.log").wait_ready()
        try:
            for script in (plain, filtered):  # warm every user's row once
                h.wrk(svc.url, "/", 32, 3, script, strict=True)
            for _ in range(2):
                for name, script in (("plain", plain), ("filtered", filtered)):
                    out[name].append(h.wrk(svc.url, "/", 32, duration, script, strict=True)["rps"])
        finally:
            svc.stop()
    plain_rps, filtered_rps = float(np.mean(out["plain"])), float(np.mean(out["filtered"]))
    return {
        "plain_rps": [round(x) for x in out["plain"]],
        "filtered_rps": [round(x) for x in out["filtered"]],
        "share": round(filtered_rps / plain_rps, 3),
    }


def writes(artifacts: Path, rounds: int, seed: int = 0) -> dict[str, Any]:
    from service.settings import Settings

    users, _, _ = h.artifact_ids(artifacts)
    rng = np.random.default_rng(seed)
    auth = {"Authorization": f"Bearer {h.TOKEN}"}
    stored, applied, hidden_a, hidden_b = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp, h.Redis() as redis:
        a = h.Service(artifacts, redis.url, "bench-items", 1, Path(tmp) / "a.log").wait_ready()
        b = h.Service(artifacts, redis.url, "bench-items", 1, Path(tmp) / "b.log").wait_ready()
        try:
            for r in range(rounds):
                batch = [
                    {
                        "item": f"batch-{r}-{k}",
                        "record": {
                            "title": f"item {k}",
                            "categories": [f"c{k % 20}", f"c{(k * 7) % 20}"],
                            "attributes": {"year": 1950 + k % 70, "lang": "en", "tags": [f"t{k % 50}"]},
                        },
                    }
                    for k in range(1000)
                ]
                t0 = time.perf_counter()
                got = a.client.post("/items", json={"items": batch}, headers=auth)
                stored.append(time.perf_counter() - t0)
                assert got.status_code == 200, got.text
                last = got.json()["last_id"]
                seen = b.client.get(f"/items/batch-{r}-999", params={"after": last})
                applied.append(time.perf_counter() - t0)
                assert seen.status_code == 200 and seen.json()["in_catalogue"], seen.text
            for _ in range(rounds):
                user = users[int(rng.integers(len(users)))]
                top = a.client.get(f"/recommend/{user}", params={"k": 1}).json()["recommendations"][0]["item"]
                t0 = time.perf_counter()
                got = a.client.patch(f"/items/{top}", json={"hidden": True}, headers=auth)
                assert got.status_code == 200, got.text
                for svc, out in ((a, hidden_a), (b, hidden_b)):
                    while True:
                        listed = svc.client.get(f"/recommend/{user}", params={"k": 10}).json()
                        if top not in [x["item"] for x in listed["recommendations"]]:
                            out.append(time.perf_counter() - t0)
                            break
                        assert time.perf_counter() - t0 < 30, "a hidden item still recommended after 30 s"
                        time.sleep(0.01)
                a.client.patch(f"/items/{top}", json={"hidden": False}, headers=auth)
        finally:
            a.stop()
            b.stop()

    def stats(values: list[float]) -> dict[str, float]:
        return {"p50": round(float(np.median(values)), 3), "max": round(max(values), 3)}

    return {
        "rounds": rounds,
        "batch_stored_s": stats(stored),
        "batch_applied_elsewhere_s": stats(applied),
        "hidden_gone_here_s": stats(hidden_a),
        "hidden_gone_elsewhere_s": stats(hidden_b),
        "fold_in_interval_s": Settings.model_fields["fold_in_interval_s"].default,
    }


def report(records: list[dict[str, Any]]) -> str:
    lines = ["# Filters on /recommend: what they cost", "", "Generated by `benchmarks/catalogue.py`.", ""]
    for r in records:
        p, w = r["in_process"], r["http"]
        lines += [
            f"## {r['stamp']}, {h.describe_commit(r['commit'])}",
            "",
            f"`{r['command']}`; {r['machine']}.",
            "",
            f"- In process, {p['items']:,} items: index built in {p['index_build_s']} s; the three-clause "
            f"filter {p['first_p50_ms']} ms at p50 the first time, {p['repeated_p50_ms']} ms repeated "
            f"(with the masking; {p['passing']:,} items pass).",
            *(
                [
                    f"- In process, the whole POST /recommend on an Epinions-shaped artifact "
                    f"({e['items']:,} items, the same catalogue), {e['requests']} random users: p50 "
                    f"{e['plain_p50_ms']} ms unfiltered, {e['filtered_p50_ms']} ms with the filter: "
                    f"{e['added_p50_ms']} ms added."
                ]
                if (e := r.get("whole"))
                else []
            ),
            f"- HTTP, ML-100K, 2 workers, concurrency 32, uniformly random users: unfiltered "
            f"{w['plain_rps']} requests/s, filtered (`{QUERY[1:]}`) {w['filtered_rps']}: "
            f"{w['share']:.0%} of the unfiltered rate.",
        ]
        if "writes" in r:
            wr = r["writes"]
            lines += [
                f"- Catalogue writes, two replicas, {wr['rounds']} rounds: a batch of 1,000 records stored "
                f"in {wr['batch_stored_s']['p50']} s at p50 (max {wr['batch_stored_s']['max']}), applied by "
                f"the other replica {wr['batch_applied_elsewhere_s']['p50']} s after it was sent (max "
                f"{wr['batch_applied_elsewhere_s']['max']}); a hidden item gone from /recommend on the "
                f"replica written to after {wr['hidden_gone_here_s']['p50']} s (max "
                f"{wr['hidden_gone_here_s']['max']}), on the other after "
                f"{wr['hidden_gone_elsewhere_s']['p50']} s (max {wr['hidden_gone_elsewhere_s']['max']}).",
            ]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = h.parser(__doc__)
    p.add_argument("--artifacts", type=Path, required=True)
    p.add_argument("--items", type=int, default=140_000)
    p.add_argument("--duration", type=int, default=8)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--epinions", type=Path, help="an artifact of the Epinions shape (whole /recommend)")
    p.add_argument("--requests", type=int, default=300)
    args = p.parse_args(argv)
    record = {
        "stamp": h.stamp(),
        "commit": h.commit(),
        "machine": h.machine_line(),
        "command": h.command("catalogue.py", argv),
        "in_process": in_process(args.items),
        **({"whole": whole_recommend(args.epinions, args.requests)} if args.epinions else {}),
        "http": over_http(args.artifacts, args.duration),
        "writes": writes(args.artifacts, args.rounds),
    }
    h.emit(record)
    path = h.RESULTS / "catalogue.jsonl"
    h.append_jsonl(path, record)
    (h.RESULTS / "catalogue.md").write_text(report(h.read_jsonl(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
