"""Faults with real processes: Redis killed (-9) right after acknowledged ratings and catalogue changes and
restarted from its append-only file, and a replica killed under load and restarted: nothing acknowledged
is lost, and every replica ends up answering the same. (The longer versions: benchmarks/reliability.py.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from tests.service.conftest import RedisServer, Service

TOKEN = "fault-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ITEMS = [f"i{j}" for j in range(0, 40, 4)]
ENV = {"DCMC_WRITE_TOKEN": TOKEN, "DCMC_INFERENCE__MODE": "exact", "DCMC_REDIS_RETRY_S": "0.2"}


@pytest.fixture()
def durable(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(directory=tmp_path).start()
    yield server
    server.kill()


def _answers(svc: Service, users: list[str]) -> np.ndarray:
    out = []
    for user in users:
        r = svc.client.post("/predict", json={"user": user, "items": ITEMS})
        assert r.status_code == 200, r.text
        out.append([p["rating"] for p in r.json()["predictions"]])
    return np.array(out)


def _applied(svc: Service) -> int:
    return int(svc.client.get("/health").json()["online_ratings"])


def _writes(svc: Service) -> int:
    health = svc.client.get("/health").json()
    return int(health["online_ratings"]) + int(health["catalogue_changes"])


def _wait(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_redis_killed_after_acknowledged_ratings_loses_none(
    tiny_artifact: Path, durable: RedisServer
) -> None:
    env = {**ENV, "REDIS_URL": durable.url}
    a, b = Service(tiny_artifact, env), Service(tiny_artifact, env)
    try:
        a.wait_ready()
        b.wait_ready()
        acknowledged, records = 0, {}
        for n in range(20):  # ratings and catalogue changes, through either worker, in one stream
            body = {"ratings": [{"user": f"k{n % 4}", "item": f"i{n}", "rating": 1 + n % 5}]}
            assert a.client.post("/ratings", json=body, headers=AUTH).status_code == 200
            item, change = f"i{n % 7}", {"categories": [f"c{n}"], "hidden": n % 2 == 0}
            assert b.client.put(f"/items/{item}", json=change, headers=AUTH).status_code == 200
            acknowledged, records[item] = acknowledged + 2, change
        durable.kill()  # kill -9 right after the 40th acknowledgement
        durable.start()  # same port and directory: from its append-only file
        assert redis.Redis.from_url(durable.url).xlen("dcmc:ratings") == acknowledged
        _wait(lambda: _writes(a) == acknowledged and _writes(b) == acknowledged)
        users = [f"k{n}" for n in range(4)]
        np.testing.assert_allclose(_answers(a, users), _answers(b, users), rtol=0, atol=1e-12)
        for svc in (a, b):  # every acknowledged catalogue change is there, on both
            for item, change in records.items():
                got = svc.client.get(f"/items/{item}").json()
                assert (got["categories"], got["hidden"]) == (change["categories"], change["hidden"])
    finally:
        a.stop()
        b.stop()


def test_a_replica_killed_under_load_replays_and_answers_as_its_peer(
    tiny_artifact: Path, durable: RedisServer
) -> None:
    env = {**ENV, "REDIS_URL": durable.url}
    a, b = Service(tiny_artifact, env), Service(tiny_artifact, env)
    acknowledged: list[int] = []
    stop = threading.Event()

    def write() -> None:  # a steady stream of ratings through `a` while `b` dies and comes back
        n = 0
        while not stop.is_set():
            body = {"ratings": [{"user": f"w{n % 5}", "item": f"i{n % 50}", "rating": 1 + n % 5}]}
            if a.client.post("/ratings", json=body, headers=AUTH).status_code == 200:
                acknowledged.append(n)
            n += 1

    try:
        a.wait_ready()
        b.wait_ready()
        writer = threading.Thread(target=write)
        writer.start()
        time.sleep(0.5)
        b.proc.kill()  # kill -9 of the replica
        b.proc.wait()
        time.sleep(0.5)
        b = Service(tiny_artifact, env).wait_ready()  # a new process: replays the stream, then follows it
        time.sleep(0.5)
        stop.set()
        writer.join()
        total = len(acknowledged)
        assert total > 10
        assert redis.Redis.from_url(durable.url).xlen("dcmc:ratings") == total
        _wait(lambda: _applied(a) == total and _applied(b) == total)
        users = [f"w{n}" for n in range(5)]
        np.testing.assert_allclose(_answers(a, users), _answers(b, users), rtol=0, atol=1e-12)
    finally:
        stop.set()
        a.stop()
        b.stop()
