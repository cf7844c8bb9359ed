"""Recommendation ids and impressions (service/impressions.py): every /recommend and /similar-items answer
carries an id, and what it showed reaches the bounded impressions stream off the answer's path; with Redis
stalled (SIGSTOP) the answers go on and the impressions are dropped and counted."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.service.conftest import App, RedisServer


@pytest.fixture()
def redis_server() -> Iterator[RedisServer]:
    """A private redis-server (the stall test stops it)."""
    server = RedisServer().start()
    yield server
    server.kill()


def _entries(client: redis.Redis, want: int, timeout: float = 10.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        raw: Any = client.xrange("dcmc:impressions")
        if len(raw) >= want or time.monotonic() > deadline:
            return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in raw]
        time.sleep(0.05)


def test_every_list_carries_an_id_and_its_impression_reaches_the_stream(
    tiny_artifact: Path, redis_server: RedisServer
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    with App(tiny_artifact, redis_url=redis_server.url) as api:
        answers = [
            api.client.get("/recommend/u1", params={"k": 5}).json(),  # the fast path
            api.client.post("/recommend", json={"user": "u2", "k": 3}).json(),  # the route
            api.client.get("/similar-items/i3", params={"k": 4}).json(),
        ]
        ids = [a["recommendation_id"] for a in answers]
        assert len(set(ids)) == 3 and all(len(i) == 32 for i in ids)
        got = {e["id"]: e for e in _entries(client, 3)}
        assert set(got) == set(ids)
        for answer, route, subject, key, score in (
            (answers[0], "/recommend", ("user", "u1"), "recommendations", "rating"),
            (answers[1], "/recommend", ("user", "u2"), "recommendations", "rating"),
            (answers[2], "/similar-items", ("item", "i3"), "similar", "score"),
        ):
            shown = got[answer["recommendation_id"]]
            assert (shown["route"], shown[subject[0]]) == (route, subject[1])
            assert json.loads(shown["items"]) == [r["item"] for r in answer[key]]
            assert json.loads(shown["scores"]) == [r[score] for r in answer[key]]
            assert shown["model_version"] == answer["model_version"]
        assert api.metric("dcmc_impressions_total", outcome="written") == 3
    client.close()


AB = """
[[experiment]]
id = "ab"
salt = "s"
[[experiment.variant]]
name = "exact"
[[experiment.variant]]
name = "base"
inference = { "mode" = "none" }
"""


@pytest.mark.parametrize("experiment", [False, True], ids=["plain", "in-an-experiment"])
def test_with_redis_stalled_the_answers_go_on_and_impressions_are_dropped_and_counted(
    tiny_artifact: Path, redis_server: RedisServer, tmp_path: Path, experiment: bool
) -> None:
    assert redis_server.proc is not None
    more: dict[str, Any] = {}
    if experiment:  # two models following the stalled Redis, impressions with distributions
        (tmp_path / "experiments.toml").write_text(AB)
        more["experiments"] = tmp_path / "experiments.toml"
    with App(tiny_artifact, redis_url=redis_server.url, redis_timeout_s=1.0, **more) as api:
        assert api.client.get("/recommend/u1").status_code == 200
        os.kill(redis_server.proc.pid, signal.SIGSTOP)  # Redis stalls: it takes connections, answers nothing
        try:
            for n in range(20):
                began = time.monotonic()
                r = api.client.get(f"/recommend/u{n}", params={"k": 5})
                assert r.status_code == 200 and len(r.json()["recommendation_id"]) == 32
                assert time.monotonic() - began < 0.5  # never waits for Redis (its timeout is 1 s)
                assert ("experiment" in r.json()) == experiment
            deadline = time.monotonic() + 10
            while api.metric("dcmc_impressions_total", outcome="dropped") < 1:
                assert time.monotonic() < deadline, "no impression counted as dropped"
                time.sleep(0.05)
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        r = api.client.get("/recommend/u3")
        assert r.status_code == 200
        wanted = r.json()["recommendation_id"]
        client = redis.Redis.from_url(redis_server.url)
        deadline = time.monotonic() + 10
        while wanted not in {e["id"] for e in _entries(client, 0, 0)}:  # written again once it is back
            assert time.monotonic() < deadline, "impressions not written after Redis came back"
            time.sleep(0.1)
        client.close()
