"""Service fixtures: the app in process (FastAPI's TestClient over `create_app`, with its lifespan) and,
for the end-to-end tests, a real `dcmc serve` process over HTTP; real Redis servers; the tiny artifact."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import redis
from fastapi.testclient import TestClient

from service.main import create_app
from service.rows import MISS_FIXED_ITEMS, Costs
from service.settings import Settings

T = TypeVar("T")

REDIS_URL = "redis://127.0.0.1:6379/0"
DCMC = str(Path(sys.executable).with_name("dcmc"))


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_argv(artifacts: Path | str, port: int, workers: int = 1) -> list[str]:
    """The `dcmc serve` command line the tests run (docker-compose's api runs the same flags)."""
    return [
        DCMC,
        "serve",
        "--artifacts",
        str(artifacts),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        str(workers),
    ]


def set_prices(api: App, misses_per_row: int, asked: int) -> None:
    """Fix the ski rental's prices (`service.rows.Costs`, else measured): a row costs `misses_per_row`
    misses of `asked` items, so a test knows which request computes it."""
    scorer = api.client.app.state.scorer  # type: ignore[attr-defined]
    scorer.costs = Costs(1.0, misses_per_row * (asked + MISS_FIXED_ITEMS), learning=False)


def until_filled(api: App, ask: Callable[[], T], fills: int = 1) -> list[T]:
    """`ask()` again and again until the service has computed `fills` user rows in all (the ski rental
    of `UserRows.admit` buys one once a user's misses cost what the row does, as this worker measured
    them): the answers, the last the one that computed it. At most 100 asks."""
    answers = []
    while api.metric("dcmc_user_rows_total", event="fill") < fills:
        assert len(answers) < 100, "no row was computed after 100 misses"
        answers.append(ask())
    return answers


def read_metric(client: httpx.Client | TestClient, name: str, **labels: str) -> float:
    """The current value of one sample of /metrics (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == (f"{name}{{{want}}}" if want else name):
            return float(value)
    return 0.0


class App:
    """The service in this process: `create_app(Settings(...))` behind a TestClient, lifespan included
    (the artifact is loaded and the tiers seeded on entry), against the real Redis and ONNX Runtime."""

    def __init__(self, artifacts: Path, **settings: Any) -> None:
        self.settings = Settings(artifacts=artifacts, log_level="warning", **settings)
        self.client = TestClient(create_app(self.settings))

    def __enter__(self) -> App:
        self.client.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.__exit__(*exc)

    def metric(self, name: str, **labels: str) -> float:
        """The current value of one sample of /metrics (0 when absent)."""
        return read_metric(self.client, name, **labels)


class Service:
    """`dcmc serve` as a child process, the way docker-compose runs it."""

    def __init__(self, artifacts: Path, env: dict[str, str], workers: int = 1) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = serve_argv(artifacts, self.port, workers)
        clean = {k: v for k, v in os.environ.items() if not k.startswith("DCMC_") and k != "REDIS_URL"}
        self.proc = subprocess.Popen(
            self.argv,
            env={**clean, "DCMC_LOG_LEVEL": "warning", **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.client = httpx.Client(base_url=self.url, timeout=30)

    def wait_ready(self, timeout: float = 60) -> Service:
        """Block until /ready answers 200 (fails with the process output if it exits)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"service exited with {self.proc.returncode}:\n{self.proc.stdout.read()}")  # type: ignore[union-attr]
            try:
                if self.client.get("/ready").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.url} not ready after {timeout}s")

    def metric(self, name: str, **labels: str) -> float:
        """The current value of one sample of /metrics (0 when absent)."""
        return read_metric(self.client, name, **labels)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class RedisServer:
    """A throw-away redis-server on its own port: no persistence, or (`directory` given) an append-only
    file fsynced on every write in that directory, as the compose file runs it."""

    def __init__(
        self,
        port: int | None = None,
        directory: Path | None = None,
        password: str | None = None,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.port = port or free_port()
        self.url = f"redis://{f':{password}@' if password else ''}127.0.0.1:{self.port}/0"
        self.directory = directory
        self.password = password
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        self._scratch: str | None = None

    def start(self) -> RedisServer:
        # Its own directory even without persistence: a test that turns the append-only file on later
        # (CONFIG SET) must not write it into the working directory.
        self._scratch = None if self.directory is not None else tempfile.mkdtemp(prefix="dcmc-redis-")
        persistence = ["--appendonly", "no", "--dir", str(self._scratch)]
        if self.directory is not None:
            persistence = ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.directory)]
        if self.password:
            persistence += ["--requirepass", self.password]
        persistence += list(self.extra)
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                *persistence,
                "--daemonize",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url)
        for _ in range(100):
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def kill(self) -> None:
        """SIGKILL (`kill -9`): nothing is flushed but what the server already wrote."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_client() -> Iterator[redis.Redis]:
    """The shared Redis at 127.0.0.1:6379. Without one the tests that need it skip, or fail where
    DCMC_REQUIRE_REDIS=1 (CI sets it: a green run has run them all). Tests that start their own
    redis-server (RedisServer) do not use it."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.ConnectionError:
        message = f"no Redis at {REDIS_URL} (README: Redis)"
        if os.environ.get("DCMC_REQUIRE_REDIS") == "1":
            pytest.fail(f"{message}, and DCMC_REQUIRE_REDIS=1")
        pytest.skip(message)
    yield client
    client.close()


@pytest.fixture(scope="session")
def key_prefix(redis_client: redis.Redis) -> Iterator[str]:
    """A Redis key prefix of this test session; its keys are deleted at the end."""
    prefix = f"dcmc-test-{uuid.uuid4().hex[:8]}"
    yield prefix
    keys = list(redis_client.scan_iter(f"{prefix}:*", count=1000))
    if keys:
        redis_client.delete(*keys)


@pytest.fixture(scope="session")
def app(tiny_artifact: Path, key_prefix: str, redis_client: redis.Redis) -> Iterator[App]:
    """The service in process on the tiny artifact with the shared Redis."""
    with App(tiny_artifact, redis_url=REDIS_URL, redis_key_prefix=key_prefix) as api:
        yield api


@pytest.fixture(scope="session")
def service(tiny_artifact: Path, key_prefix: str) -> Iterator[Service]:
    """`dcmc serve` on the tiny artifact with the shared Redis."""
    svc = Service(tiny_artifact, {"REDIS_URL": REDIS_URL, "DCMC_REDIS_KEY_PREFIX": key_prefix})
    try:
        yield svc.wait_ready()
    finally:
        svc.stop()


@pytest.fixture()
def artifact_copy(tiny_artifact: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny artifact, safe to tamper with."""
    return Path(shutil.copytree(tiny_artifact, tmp_path / "artifact"))


@pytest.fixture()
def durable_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test with an append-only file fsynced on every write."""
    server = RedisServer(directory=tmp_path).start()
    yield server
    server.kill()
