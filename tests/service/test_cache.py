"""The two embedding tiers against real Redis servers, including one that dies mid-run."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from model.artifact import load_artifact
from service.cache import LocalTier
from tests.service.conftest import RedisServer, Service

pytestmark = pytest.mark.usefixtures("redis_client")  # skips without a redis-server


@pytest.fixture(scope="module")
def own_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def small_service(tiny_artifact: Path, own_redis: RedisServer) -> Iterator[Service]:
    """A service whose local tier holds 8 embeddings, so most look-ups reach Redis."""
    svc = Service(
        tiny_artifact, {"REDIS_URL": own_redis.url, "DCMC_LOCAL_CACHE_SIZE": "8", "DCMC_REDIS_RETRY_S": "0.2"}
    )
    try:
        yield svc.wait_ready()
    finally:
        svc.stop()


def test_embeddings_are_in_redis_under_versioned_keys(
    small_service: Service, own_redis: RedisServer, tiny_artifact: Path
) -> None:
    artifact = load_artifact(tiny_artifact)
    client = redis.Redis.from_url(own_redis.url)
    v = artifact.model_version
    assert client.get(f"dcmc:{v}:loaded") == str(len(artifact.users) + len(artifact.items)).encode()
    for kind, table, ids in (
        ("user", artifact.user_embeddings, artifact.users.ids),
        ("item", artifact.item_embeddings, artifact.items.ids),
    ):
        raw = client.mget([f"dcmc:{v}:{kind}:{x}" for x in ids])
        np.testing.assert_array_equal(np.stack([np.frombuffer(b, np.float32) for b in raw]), table)


def test_local_miss_is_served_from_redis_and_double_miss_is_recomputed(
    small_service: Service, own_redis: RedisServer, tiny_artifact: Path
) -> None:
    artifact = load_artifact(tiny_artifact)
    client = redis.Redis.from_url(own_redis.url)
    redis_hits = small_service.metric("dcmc_embedding_cache_total", tier="redis", result="hit")
    r = small_service.client.post("/predict", json={"user": "u5", "items": ["i1", "i2", "i3"]})
    assert r.status_code == 200
    assert small_service.metric("dcmc_embedding_cache_total", tier="redis", result="hit") >= redis_hits + 4
    # Item i40 gone from Redis and never asked for: recomputed through the ONNX column branch.
    key = f"dcmc:{artifact.model_version}:item:i40"
    client.delete(key)
    computed = small_service.metric("dcmc_embeddings_computed_total", kind="item")
    r = small_service.client.post("/predict", json={"user": "u5", "items": ["i40"]})
    assert r.status_code == 200
    assert small_service.metric("dcmc_embeddings_computed_total", kind="item") == computed + 1
    restored = np.frombuffer(client.get(key), np.float32)  # written back to Redis
    np.testing.assert_allclose(restored, artifact.item_embeddings[artifact.items.index("i40")], atol=1e-4)


def test_redis_dying_mid_run_fails_no_request_and_recovers(
    small_service: Service, own_redis: RedisServer
) -> None:
    statuses: list[int] = []
    stop = threading.Event()

    def hammer() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            body = {"user": f"u{n % 60}", "items": [f"i{(n * 7 + j) % 50}" for j in range(12)]}
            try:
                statuses.append(small_service.client.post("/predict", json=body).status_code)
            except Exception:  # a transport error counts as a failed request
                statuses.append(-1)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    own_redis.kill()
    time.sleep(1.0)
    degraded = small_service.client.get("/health").json()
    own_redis.start()  # same port, empty
    deadline = time.monotonic() + 10
    while small_service.client.get("/health").json()["status"] != "ok" and time.monotonic() < deadline:
        time.sleep(0.1)
    recovered = small_service.client.get("/health").json()
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join()
    assert len(statuses) > 20
    assert set(statuses) == {200}
    assert degraded["status"] == "degraded"
    assert degraded["redis"] == "down"
    assert recovered == {**degraded, "status": "ok", "redis": "ok"}
    assert small_service.metric("dcmc_redis_errors_total") >= 1
    # After recovery the service re-seeds the empty Redis by itself.
    client = redis.Redis.from_url(own_redis.url)
    deadline = time.monotonic() + 10
    while not client.exists(f"dcmc:{recovered['model_version']}:loaded") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.exists(f"dcmc:{recovered['model_version']}:loaded")


def test_local_tier_is_a_bounded_lru() -> None:
    tier = LocalTier(2)
    a, b, c = (np.full(3, x, np.float32) for x in (1, 2, 3))
    tier.put_many([(("user", 0), a), (("user", 1), b)])
    assert tier.get_many([("user", 0)])[0] is a  # now most recent
    tier.put_many([(("item", 0), c)])
    assert tier.get_many([("user", 1), ("user", 0), ("item", 0)]) == [None, a, c]
    assert len(tier) == 2
