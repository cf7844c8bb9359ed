"""Experiments and feedback over HTTP (service/experiments.py, service/routes/events.py): who gets which
variant (the same in two workers and after a restart), what the variants answer, events and dismissals
stored through the rating stream, interleaved lists, and results that equal `dcmc experiment report`."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from model.experiments import read_experiments
from tests.service.conftest import DCMC, REDIS_URL, App, Service

TOKEN = "w-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}

AB = """
[[experiment]]
id = "ab"
salt = "s1"
hit_rating = 4.0

[[experiment.variant]]
name = "exact"

[[experiment.variant]]
name = "base"
inference = { "mode" = "none" }
"""

INTERLEAVE = """
[[experiment]]
id = "mix"
salt = "s2"
method = "interleave"

[[experiment.variant]]
name = "model"

[[experiment.variant]]
name = "popular"
ranking = { popular = true }
"""


@pytest.fixture()
def prefix(redis_client: redis.Redis) -> Iterator[str]:
    """A key prefix of this test; its keys are deleted after it."""
    name = f"dcmc-exp-{uuid.uuid4().hex[:8]}"
    yield name
    keys = list(redis_client.scan_iter(f"{name}:*", count=1000))
    if keys:
        redis_client.delete(*keys)


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "experiments.toml"
    path.write_text(text)
    return path


USERS = [f"u{n}" for n in range(1, 25)]  # users of the tiny artifact (tests/conftest.py)


def _impressions(client: redis.Redis, prefix: str, want: int, timeout: float = 10.0) -> list[dict[str, str]]:
    deadline = time.monotonic() + timeout
    while True:
        raw: Any = client.xrange(f"{prefix}:impressions")
        if len(raw) >= want or time.monotonic() > deadline:
            return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in raw]
        time.sleep(0.05)


def test_assignment_is_the_same_in_two_workers_and_after_a_restart(
    tiny_artifact: Path, tmp_path: Path, prefix: str
) -> None:
    path = _file(tmp_path, AB)
    spec = read_experiments(path)[0]
    users = [f"user-{n}" for n in range(40)]
    env = {"REDIS_URL": REDIS_URL, "DCMC_REDIS_KEY_PREFIX": prefix, "DCMC_EXPERIMENTS": str(path)}
    seen: list[dict[str, str | None]] = []
    for _ in range(2):  # a restart: a new process of two workers
        svc = Service(tiny_artifact, env, workers=2).wait_ready()
        try:
            got: dict[str, str | None] = {}
            for user in users:
                for _ in range(3):  # a new connection each: both workers answer
                    with httpx.Client(base_url=svc.url, timeout=30) as one:
                        answer = one.get(f"/experiments/ab/assignment/{user}").json()
                    assert got.setdefault(user, answer["variant"]) == answer["variant"]
                    assert answer["answering"] and answer["active"]
            seen.append(got)
        finally:
            svc.stop()
    assert seen[0] == seen[1] == {u: spec.assign(u) for u in users}
    assert set(seen[0].values()) == {"exact", "base"}


def test_variants_answer_as_declared_and_their_impressions_say_so(
    tiny_artifact: Path, tmp_path: Path, prefix: str, redis_client: redis.Redis
) -> None:
    path = _file(tmp_path, AB)
    spec = read_experiments(path)[0]
    with App(
        tiny_artifact, redis_url=REDIS_URL, redis_key_prefix=prefix, experiments=path, write_token=TOKEN
    ) as api:
        control_mode = api.client.app.state.scorer.inference.mode  # type: ignore[attr-defined]
        listed = api.client.get("/experiments").json()["experiments"]
        assert [e["id"] for e in listed] == ["ab"] and listed[0]["control"] == "exact"
        answers = {u: api.client.get(f"/recommend/{u}", params={"k": 4}).json() for u in USERS}
        assert {a["variant"] for a in answers.values()} == {"exact", "base"}
        for user, answer in answers.items():
            assert (answer["experiment"], answer["variant"]) == ("ab", spec.assign(user))
            assert answer["inference"] == ("none" if answer["variant"] == "base" else control_mode)
        shown = {s["id"]: s for s in _impressions(redis_client, prefix, len(answers))}
        for user, answer in answers.items():
            s = shown[answer["recommendation_id"]]
            assert (s["user"], s["experiment"], s["variant"]) == (user, "ab", answer["variant"])
            assert json.loads(s["items"]) == [r["item"] for r in answer["recommendations"]]
            dists = json.loads(s["dists"])
            assert len(dists) == len(answer["recommendations"])
            assert all(abs(sum(d) - 1) < 1e-4 for d in dists)
        user = USERS[0]
        item = answers[user]["recommendations"][0]["item"]
        tracked = api.client.post("/predict", json={"user": user, "items": [item], "track": True}).json()
        assert (tracked["experiment"], tracked["variant"]) == ("ab", spec.assign(user))
        plain = api.client.post("/predict", json={"user": user, "items": [item]}).json()
        assert "recommendation_id" not in plain and "experiment" not in plain
        s = {s["id"]: s for s in _impressions(redis_client, prefix, len(answers) + 1)}[
            tracked["recommendation_id"]
        ]
        assert s["route"] == "/predict" and json.loads(s["scores"]) == [tracked["predictions"][0]["rating"]]
        assert api.client.get("/experiments/nope/results").status_code == 404
        assert api.client.get("/experiments/nope/assignment/u1").status_code == 404


def test_an_interleaved_list_merges_both_variants_and_credits_each_item(
    tiny_artifact: Path, tmp_path: Path, prefix: str, redis_client: redis.Redis
) -> None:
    path = _file(tmp_path, INTERLEAVE)
    with App(tiny_artifact, redis_url=REDIS_URL, redis_key_prefix=prefix, experiments=path) as api:
        answers = [api.client.get(f"/recommend/{u}", params={"k": 6}).json() for u in USERS[:8]]
        shown = {s["id"]: s for s in _impressions(redis_client, prefix, len(answers))}
        teams_seen: set[str] = set()
        for answer in answers:
            assert (answer["experiment"], answer["variant"]) == ("mix", "interleaved")
            items = [r["item"] for r in answer["recommendations"]]
            assert len(items) == len(set(items)) == 6
            s = shown[answer["recommendation_id"]]
            teams = json.loads(s["teams"])
            assert len(teams) == 6 and abs(teams.count("model") - teams.count("popular")) <= 1
            teams_seen |= set(teams)
        assert teams_seen == {"model", "popular"}


def test_events_are_stored_and_a_dismissed_item_is_never_recommended_again(
    tiny_artifact: Path, prefix: str, redis_client: redis.Redis
) -> None:
    with App(tiny_artifact, redis_url=REDIS_URL, redis_key_prefix=prefix, write_token=TOKEN) as api:
        c = api.client
        first = c.get("/recommend/u3", params={"k": 5}).json()
        rec, top = first["recommendation_id"], first["recommendations"][0]["item"]
        events = [
            {"user": "u3", "item": top, "type": "click", "recommendation_id": rec},
            {"user": "u3", "item": top, "type": "dismiss"},
        ]
        assert c.post("/events", json={"events": events}).status_code == 401
        stored = c.post("/events", json={"events": events}, headers=AUTH)
        assert stored.status_code == 200 and stored.json()["accepted"] == 2
        after = stored.json()["last_id"]
        for _ in range(3):
            again = c.get("/recommend/u3", params={"k": 5, "after": after}).json()
            assert top not in [r["item"] for r in again["recommendations"]]
        post = c.post("/recommend", json={"user": "u3", "k": 20}, params={"after": after}).json()
        assert top not in [r["item"] for r in post["recommendations"]]
        other = c.get("/recommend/u4", params={"k": 30}).json()  # another user's lists are not touched
        assert len(other["recommendations"]) > 0
        rated = c.post(
            "/ratings",
            json={"ratings": [{"user": "u3", "item": top, "rating": 5, "recommendation_id": rec}]},
            headers=AUTH,
        )
        assert rated.status_code == 200
        raw: Any = redis_client.xrange(f"{prefix}:ratings")
        fields = [{k.decode(): v.decode() for k, v in f.items()} for _, f in raw]
        assert fields[-3:] == [
            {"user": "u3", "item": top, "event": "click", "rec": rec},
            {"user": "u3", "item": top, "event": "dismiss"},
            {"user": "u3", "item": top, "rating": "5.0", "rec": rec},
        ]
        for bad in (
            {"user": "u3", "item": top, "type": "Click"},
            {"user": "u3", "item": top, "type": "click", "recommendation_id": "xyz"},
            {"user": "u3", "item": top},
            {"user": "u3", "item": top, "type": "click", "extra": 1},
        ):
            answer = c.post("/events", json={"events": [bad]}, headers=AUTH)
            assert answer.status_code == 422, bad
        assert c.post("/events", json={"events": []}, headers=AUTH).status_code == 422
        bad_rec = {"ratings": [{"user": "u3", "item": top, "rating": 5, "recommendation_id": "g" * 32}]}
        assert c.post("/ratings", json=bad_rec, headers=AUTH).status_code == 422
        # Forgetting the user drops the dismissal with everything else, and the impressions of their lists.
        forgot = c.delete("/users/u3", headers=AUTH)
        assert forgot.status_code == 200
        assert not [s for s in _impressions(redis_client, prefix, 0) if s.get("user") == "u3"]
        assert not _wait_forgotten(api, "u3")
        assert top in [r["item"] for r in c.get("/recommend/u3", params={"k": 50}).json()["recommendations"]]


def _wait_forgotten(api: App, user: str, timeout: float = 5.0) -> bool:
    """Whether `user` still has dismissals after `timeout` (False once the forget is folded in)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if user not in api.client.app.state.scorer.state.dismissed:  # type: ignore[attr-defined]
            return False
        time.sleep(0.05)
    return True


def test_results_equal_the_report_computed_from_the_streams(
    tiny_artifact: Path, tmp_path: Path, prefix: str, redis_client: redis.Redis
) -> None:
    path = _file(tmp_path, AB)
    with App(
        tiny_artifact, redis_url=REDIS_URL, redis_key_prefix=prefix, experiments=path, write_token=TOKEN
    ) as api:
        c = api.client
        ratings, events = [], []
        for n, user in enumerate(USERS):
            answer = c.get(f"/recommend/{user}", params={"k": 5}).json()
            rec = answer["recommendation_id"]
            items = [r["item"] for r in answer["recommendations"]]
            if n % 2 == 0:
                events.append({"user": user, "item": items[0], "type": "click", "recommendation_id": rec})
            if n % 3 == 0:
                ratings.append({"user": user, "item": items[1], "rating": 5, "recommendation_id": rec})
            if n % 4 == 1:
                ratings.append({"user": user, "item": items[2], "rating": 2})  # unnamed: by the window
        assert c.post("/events", json={"events": events}, headers=AUTH).status_code == 200
        assert c.post("/ratings", json={"ratings": ratings}, headers=AUTH).status_code == 200
        _impressions(redis_client, prefix, len(USERS))
        time.sleep(2.5)  # past the results' cache
        served = c.get("/experiments/ab/results").json()
        report = _report("ab", path, tiny_artifact, prefix, "--json")
        assert report.returncode == 0, report.stderr
        assert json.loads(report.stdout) == served
        variants = served["variants"]
        assert sum(v["impressions"] for v in variants.values()) == len(USERS)
        assert sum(
            v["click_through"]["value"] * v["impressions"] for v in variants.values()
        ) == pytest.approx(len(events))
        assert sum(v["rmse"]["n"] for v in variants.values()) == len(ratings)
        assert set(served["differences"]) == {"base"}
        assert (
            api.metric(
                "dcmc_experiment_figure", experiment="ab", variant="exact", figure="impressions", part="value"
            )
            == variants["exact"]["impressions"]
        )
        table = _report("ab", path, tiny_artifact, prefix)
        assert table.returncode == 0, table.stderr
        assert "exact" in table.stdout and "base - exact" in table.stdout
        missing = _report("nope", path, tiny_artifact, prefix)
        assert missing.returncode == 2 and "no experiment 'nope'" in missing.stderr
        assert "Traceback" not in missing.stderr


def _report(
    experiment: str, path: Path, artifact: Path, prefix: str, *more: str
) -> subprocess.CompletedProcess[str]:
    """`dcmc experiment report` of the experiment over the shared Redis under `prefix`."""
    argv = [
        DCMC,
        "experiment",
        "report",
        experiment,
        "--experiments",
        str(path),
        "--artifacts",
        str(artifact),
    ]
    argv += ["--redis", REDIS_URL, "--prefix", prefix, *more]
    return subprocess.run(argv, capture_output=True, text=True)


def test_a_bad_experiments_file_stops_start_up_with_one_line(tiny_artifact: Path, tmp_path: Path) -> None:
    for text, says in (
        ("[[experiment]]\nid = 'x'\n", "salt"),
        ("not toml [", "not TOML"),
        (AB.replace('"mode" = "none"', '"mode" = "nonsense"'), "variant 'base'"),
    ):
        path = _file(tmp_path, text)
        run = subprocess.run(
            [DCMC, "serve", "--artifacts", str(tiny_artifact), "--port", "1"],
            env={"PATH": "/usr/bin:/bin", "DCMC_EXPERIMENTS": str(path)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 2, run.stderr
        assert says in run.stderr and "Traceback" not in run.stderr
