"""The online state on Redis Cluster (`REDIS_URL=redis://node:port/0?cluster=true`): three real
redis-server processes in cluster mode, the stream's keys spread over them. Writes, the tail, the
dead-letter stream, durability, fold-in snapshots, the trainer's read and compaction all run against it."""

from __future__ import annotations

import random
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from pydantic import ValidationError
from redis.cluster import RedisCluster

from model.stream import cluster_url
from service.settings import Settings
from tests.service.conftest import App, free_port
from training.data import DataError

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ITEMS = [f"i{j}" for j in range(0, 50, 5)]
LEVELS = [1.0, 2.0, 3.0, 4.0, 5.0]


def _node_port() -> int:
    """A free port whose cluster bus port (+10,000) is free too (free_port may pick one above 55,535)."""
    while True:
        port = random.randrange(20_000, 30_000)
        try:
            for p in (port, port + 10_000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port


class Cluster:
    """Three redis-server primaries in cluster mode (append-only, fsynced on every write), each in its own
    directory, joined by `redis-cli --cluster create`; stopped by their pids."""

    def __init__(self, directory: Path, nodes: int = 3) -> None:
        self.ports = [_node_port() for _ in range(nodes)]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.argvs: list[list[str]] = []
        for port in self.ports:
            node_dir = directory / str(port)
            node_dir.mkdir()
            argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
            argv += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--dir",
                str(node_dir),
            ]
            argv += ["--appendonly", "yes", "--appendfsync", "always", "--daemonize", "no"]
            argv += ["--cluster-node-timeout", "2000"]
            self.argvs.append(argv)
            self.procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        try:
            self._join()
        except BaseException:
            self.stop()  # a cluster that did not come up leaves no server behind
            raise
        self.url = f"redis://127.0.0.1:{self.ports[0]}/0?cluster=true"
        self.client = RedisCluster(host="127.0.0.1", port=self.ports[0], decode_responses=True)

    def _join(self) -> None:
        for port in self.ports:
            self._wait(lambda p=port: redis.Redis(port=p).ping())
        hosts = [f"127.0.0.1:{p}" for p in self.ports]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *hosts, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
        )
        for port in self.ports:
            self._wait(
                lambda p=port: redis.Redis(port=p).execute_command("CLUSTER INFO")["cluster_state"] == "ok"
            )

    @staticmethod
    def _wait(check, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while True:
            try:
                if check():
                    return
            except redis.RedisError:
                pass
            assert time.monotonic() < deadline, "the cluster did not come up"
            time.sleep(0.05)

    def kill(self) -> None:
        """`kill -9` of every node (the cluster is down)."""
        for proc in self.procs:
            proc.kill()
            proc.wait()

    def restart(self) -> None:
        """Every node again, from its files (it rejoins the cluster it was in)."""
        self.procs = [
            subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for argv in self.argvs
        ]
        for port in self.ports:
            self._wait(
                lambda p=port: redis.Redis(port=p).execute_command("CLUSTER INFO")["cluster_state"] == "ok"
            )

    def node_of(self, key: str) -> str:
        return str(self.client.get_node_from_key(key).name)

    def stop(self) -> None:
        if hasattr(self, "client"):
            self.client.close()
        for proc in self.procs:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    yield c
    c.stop()


def _app(tiny_artifact: Path, url: str, **settings: object) -> App:
    exact = {"inference": {"mode": "exact"}}  # its answers do not depend on the order users were indexed
    return App(tiny_artifact, redis_url=url, write_token=TOKEN, redis_retry_s=0.2, **exact, **settings)


def _write(client, ratings: list[tuple[str, str, float]]) -> str:  # type: ignore[no-untyped-def]
    body = {"ratings": [{"user": u, "item": i, "rating": r} for u, i, r in ratings]}
    r = client.post("/ratings", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    return str(r.json()["last_id"])


def _predict(client, user: str, after: str | None = None) -> np.ndarray:  # type: ignore[no-untyped-def]
    params = {"after": after} if after else None
    r = client.post("/predict", json={"user": user, "items": ITEMS}, params=params)
    assert r.status_code == 200, r.text
    return np.array([p["rating"] for p in r.json()["predictions"]])


def _wait_for(check, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_online_state_lives_on_a_cluster_across_shards(tiny_artifact: Path, cluster: Cluster) -> None:
    from training.compact import compact_stream
    from training.online import read_online_ratings

    prefix = "spread"  # no hash tag: the stream, its dead-letter stream and its snapshot on other shards
    stream = f"{prefix}:ratings"
    assert len({cluster.node_of(k) for k in (stream, f"{stream}:dead-letter", f"{stream}:identity")}) > 1
    users = ["clusterer", "u5", "latecomer"]
    with _app(tiny_artifact, cluster.url, redis_key_prefix=prefix, require_durable=True) as api:
        assert api.client.get("/ready").status_code == 200
        health = api.client.get("/health").json()
        assert health["status"] == "ok" and health["durable"] is True
        first = _write(api.client, [("clusterer", "i1", 5), ("clusterer", "i2", 1), ("u5", "i0", 1)])  # MULTI
        _wait_for(lambda: api.metric("dcmc_fold_in_snapshots_total", event="written") == 1)
        cluster.client.xadd(stream, {"user": "u5", "item": "i3"})  # poison: no rating
        last = _write(api.client, [("latecomer", "i4", 4)])  # one XADD
        answers = {user: _predict(api.client, user, after=last) for user in users}
        assert api.client.get("/health").json()["skipped_entries"] == 1
        assert api.metric("dcmc_ratings_applied_total") == 4
    assert cluster.client.xlen(stream) == 5
    assert [f["reason"] for _, f in cluster.client.xrange(f"{stream}:dead-letter")] == ["no rating field"]
    snapshots = list(cluster.client.scan_iter(f"{stream}:snapshot:*", target_nodes="all"))
    assert len(snapshots) == 1
    # A new worker starts from the snapshot and replays only the tail, to the same answers.
    with _app(tiny_artifact, cluster.url, redis_key_prefix=prefix) as restarted:
        assert restarted.metric("dcmc_fold_in_snapshots_total", event="restored") == 1
        assert restarted.metric("dcmc_ratings_applied_total") == 1
        for user in users:  # (a first answer may come from a row: the catalogue read in float32, ~1e-7)
            np.testing.assert_allclose(_predict(restarted.client, user), answers[user], rtol=0, atol=1e-6)
    # The trainer reads the stream from the cluster and compacts it there.
    online = read_online_ratings(cluster.url, prefix, levels=LEVELS)
    assert sorted(zip(online.users, online.items, strict=True)) == sorted(
        [("clusterer", "i1"), ("clusterer", "i2"), ("u5", "i0"), ("latecomer", "i4")]
    )
    record = compact_stream(cluster.url, prefix, first, levels=LEVELS)
    assert record["trimmed"] == 3 and cluster.client.xlen(stream) == 2
    with _app(tiny_artifact, cluster.url, redis_key_prefix=prefix, snapshot_interval_s=0) as fresh:
        for user in users:
            np.testing.assert_allclose(_predict(fresh.client, user), answers[user], rtol=0, atol=1e-6)


def test_every_primary_must_be_durable(tiny_artifact: Path, cluster: Cluster) -> None:
    lax = f"127.0.0.1:{cluster.ports[1]}"
    redis.Redis(port=cluster.ports[1]).config_set("appendfsync", "everysec")
    try:
        with _app(tiny_artifact, cluster.url, redis_key_prefix="lax", require_durable=True) as api:
            assert api.client.get("/health").json()["durable"] is False
            r = api.client.post(
                "/ratings", json={"ratings": [{"user": "u1", "item": "i1", "rating": 4}]}, headers=AUTH
            )
            assert r.status_code == 503 and f"appendfsync=everysec on {lax}" in r.json()["detail"]
    finally:
        redis.Redis(port=cluster.ports[1]).config_set("appendfsync", "always")


def test_a_cluster_that_is_down_at_start_up_is_waited_for(tiny_artifact: Path) -> None:
    with _app(tiny_artifact, f"redis://127.0.0.1:{free_port()}/0?cluster=true") as api:
        assert api.client.get("/ready").status_code == 503  # not ready until the stream is replayed
        assert api.client.post("/predict", json={"user": "u1", "items": ITEMS}).status_code == 200
        r = api.client.post(
            "/ratings", json={"ratings": [{"user": "u1", "item": "i1", "rating": 4}]}, headers=AUTH
        )
        assert r.status_code == 503


def test_a_cluster_flag_that_is_neither_true_nor_false_is_refused() -> None:
    assert cluster_url("redis://:pw@h:1/0?cluster=yes&ssl_cert_reqs=none") == (
        "redis://:pw@h:1/0?ssl_cert_reqs=none",
        True,
    )
    assert cluster_url("redis://h:1/0?cluster=false") == ("redis://h:1/0", False)
    with pytest.raises(ValidationError, match="cluster='maybe' is not true or false"):
        Settings(redis_url="redis://h:1/0?cluster=maybe")
    from training.online import read_online_ratings

    with pytest.raises(DataError, match="is not true or false"):
        read_online_ratings("redis://h:1/0?cluster=maybe", "dcmc")


def test_a_cluster_outage_after_connecting_is_a_503_and_the_service_recovers(
    tiny_artifact: Path, tmp_path: Path
) -> None:
    """Issue 56, defect 4: redis-py's cluster client raises RedisClusterUnreachableError, not a RedisError:
    writes and reads with `after` answered 500, /health said ok, a start-up during the outage crashed."""
    own = Cluster(tmp_path)
    try:
        with _app(tiny_artifact, own.url) as api:
            last = _write(api.client, [("u1", "i1", 4.0)])
            _predict(api.client, "u1", after=last)
            own.kill()
            r = api.client.post(
                "/ratings", json={"ratings": [{"user": "u2", "item": "i1", "rating": 4}]}, headers=AUTH
            )
            assert r.status_code == 503 and "Retry-After" in r.headers, r.text
            r = api.client.post("/predict", json={"user": "u1", "items": ITEMS}, params={"after": last})
            assert r.status_code == 200  # applied already: answered from memory
            r = api.client.post(
                "/predict", json={"user": "u1", "items": ITEMS}, params={"after": "99999999999999-0"}
            )
            assert r.status_code == 503, r.text  # cannot tell: waits its bound, then says so
            _wait_for(lambda: api.client.get("/health").json()["status"] == "degraded")
            assert api.client.get("/health").json()["redis"] == "down"
            with _app(tiny_artifact, own.url) as starting:  # a start-up during the outage
                assert starting.client.get("/ready").status_code == 503
                own.restart()
                _wait_for(lambda: starting.client.get("/ready").status_code == 200, timeout=30)
            _wait_for(lambda: api.client.get("/health").json()["status"] == "ok", timeout=30)
            last = _write(api.client, [("u2", "i1", 4.0)])
            _predict(api.client, "u2", after=last)
    finally:
        own.stop()
