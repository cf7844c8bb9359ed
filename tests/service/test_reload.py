"""Hot reload (service/reload.py, `dcmc publish`): a new artifact behind the served symlink is swapped in
with the online ratings replayed onto it; a tampered one is refused while the old model serves on; under a
load of 32 concurrent requests no request fails and every answer is wholly the old model's or the new's."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from model.artifact import ArtifactError, load_artifact, publish, write_manifest
from service.main import _load
from service.reload import Reloader
from tests.service.conftest import App, RedisServer, Service

TOKEN = "reload-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BODY = {"user": "u3", "items": ["i0", "i4", "i9", "i17"]}


def _variant(source: Path, out: Path, inference: dict[str, Any]) -> Path:
    """A copy of `source` with another inference setting: a valid artifact with another model version."""
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    config["inference"] = inference
    (out / "config.json").write_text(json.dumps(config))
    write_manifest(out)
    return out


@pytest.fixture()
def artifacts(tiny_artifact: Path, tmp_path: Path) -> dict[str, Path]:
    a = _variant(tiny_artifact, tmp_path / "a", {"mode": "exact"})
    b = _variant(tiny_artifact, tmp_path / "b", {"mode": "exact", "kernel": {"co_rating": 50.0}})
    c = _variant(tiny_artifact, tmp_path / "c", {"mode": "none"})
    with open(c / "bilinear.npy", "r+b") as f:  # tampered after its manifest was written
        f.seek(-8, os.SEEK_END)
        f.write(b"\x00" * 8)
    current = tmp_path / "current"
    publish(a, current)
    return {"a": a, "b": b, "c": c, "current": current}


@pytest.fixture()
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.kill()


def _version(client: Any) -> str:
    return str(client.get("/health").json()["model_version"])


def _wait(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_publish_refuses_a_tampered_artifact_and_a_real_directory(artifacts: dict[str, Path]) -> None:
    with pytest.raises(ArtifactError, match="fails its checksum"):
        publish(artifacts["c"], artifacts["current"])
    assert artifacts["current"].resolve() == artifacts["a"].resolve()  # unchanged
    with pytest.raises(ArtifactError, match="not a symlink"):
        publish(artifacts["b"], artifacts["a"])
    assert os.readlink(artifacts["current"]) == "a"  # relative: survives a volume mounted elsewhere


def test_a_published_artifact_is_swapped_in_with_the_online_ratings_and_a_tampered_one_refused(
    artifacts: dict[str, Path], redis_server: RedisServer
) -> None:
    settings = {"redis_url": redis_server.url, "write_token": TOKEN, "reload_poll_s": 0.05}
    version_a = load_artifact(artifacts["a"]).model_version
    version_b = load_artifact(artifacts["b"]).model_version
    with App(artifacts["current"], **settings) as api:
        assert _version(api.client) == version_a
        rating = {
            "ratings": [{"user": "u3", "item": "i9", "rating": 1}, {"user": "new", "item": "i4", "rating": 5}]
        }
        assert api.client.post("/ratings", json=rating, headers=AUTH).status_code == 200
        publish(artifacts["b"], artifacts["current"])
        _wait(lambda: _version(api.client) == version_b)
        r = api.client.post("/predict", json=BODY).json()
        assert r["model_version"] == version_b and r["online_ratings"] == 1  # replayed onto the new model
        assert api.client.post("/predict", json={"user": "new", "items": ["i1"]}).status_code == 200
        with App(artifacts["b"], redis_url=redis_server.url, reload_poll_s=0) as fresh:  # B, replayed
            expected = fresh.client.post("/predict", json=BODY).json()["predictions"]
        np.testing.assert_allclose(
            [p["rating"] for p in r["predictions"]], [p["rating"] for p in expected], rtol=0, atol=1e-12
        )
        # A tampered artifact behind the link: refused, said in /health, and B serves on.
        tmp = artifacts["current"].with_name("swap")
        os.symlink("c", tmp)
        os.replace(tmp, artifacts["current"])
        _wait(lambda: api.client.get("/health").json()["reload_error"] is not None)
        health = api.client.get("/health").json()
        assert "fails its checksum" in health["reload_error"] and health["model_version"] == version_b
        assert "/" not in health["reload_error"]  # which version and why, never where the files are
        assert api.client.post("/predict", json=BODY).json()["model_version"] == version_b


def test_a_reload_under_load_fails_no_request_and_mixes_no_answers(
    artifacts: dict[str, Path], redis_server: RedisServer
) -> None:
    env = {"REDIS_URL": redis_server.url, "DCMC_RELOAD_POLL_S": "0.1"}
    svc = Service(artifacts["current"], env, workers=2)
    try:
        svc.wait_ready()
        reference: dict[str, list[float]] = {}

        async def load(
            n: int, until: str | None = None, swap_after: int | None = None
        ) -> list[tuple[int, str, list[float]]]:
            """`n` requests from 32 concurrent clients; with `until`, go on until `n` answers came from
            that model version (at most 60 s); with `swap_after`, publish B once that many answers came."""
            out: list[tuple[int, str, list[float]]] = []
            deadline = time.monotonic() + 60

            def done() -> bool:
                if until is None:
                    return len(out) >= n
                return sum(v == until for _, v, _ in out) >= n or time.monotonic() > deadline

            async with httpx.AsyncClient(base_url=svc.url, timeout=30) as client:

                async def worker() -> None:
                    while not done():
                        r = await client.post("/predict", json=BODY)
                        body = r.json() if r.status_code == 200 else {}
                        ratings = [p["rating"] for p in body.get("predictions", [])]
                        out.append((r.status_code, body.get("model_version", ""), ratings))
                        if swap_after is not None and len(out) == swap_after:  # mid-load, under way
                            publish(artifacts["b"], artifacts["current"])

                await asyncio.gather(*(worker() for _ in range(32)))
            return out

        before = asyncio.run(load(50))
        reference[before[0][1]] = before[0][2]
        version_b = load_artifact(artifacts["b"]).model_version
        during = asyncio.run(load(500, until=version_b, swap_after=50))  # B published under load
        _wait(lambda: all(_version(svc.client) == version_b for _ in range(8)))  # both workers
        after = asyncio.run(load(50))
        reference[after[0][1]] = after[0][2]
        results = before + during + after
        assert {status for status, _, _ in results} == {200}
        assert set(reference) == {load_artifact(artifacts["a"]).model_version, version_b}
        assert {version for _, version, _ in during} == set(reference)  # the swap happened under load
        first, second = reference.values()
        # To 1e-6: an answer from a user's cached row read the catalogue in float32 (about 1e-7 off), while
        # the two models' answers differ by more than ten times that.
        assert np.abs(np.subtract(first, second)).max() > 1e-5
        for _, version, ratings in results:  # each answer wholly from the model it names
            np.testing.assert_allclose(ratings, reference[version], rtol=0, atol=1e-6)
    finally:
        svc.stop()


def _reloader(api: App, load: Any) -> Reloader:
    """A reloader of the app's served link that loads through `load(path)` (no polling thread)."""
    state = api.client.app.state  # type: ignore[attr-defined]
    return Reloader(state, state.settings.artifacts, 0, load)


def test_a_publish_during_a_load_reads_every_file_from_the_directory_it_resolved(
    artifacts: dict[str, Path], tmp_path: Path
) -> None:
    a2 = _variant(artifacts["a"], tmp_path / "a2", {"mode": "exact", "crf": {"gamma": 0.5}})
    version_a2 = load_artifact(a2).model_version
    with App(artifacts["current"], reload_poll_s=0) as api:
        state = api.client.app.state  # type: ignore[attr-defined]
        seen: list[Path] = []

        def load(path: Path) -> Any:
            seen.append(path)
            if len(seen) == 1:  # B is published while A2 loads
                publish(artifacts["b"], artifacts["current"])
            return _load(state.settings, state.metrics, path)

        reloader = _reloader(api, load)
        publish(a2, artifacts["current"])
        assert reloader.check()
        assert seen == [a2.resolve()]
        assert state.scorer.version == version_a2 and state.scorer.inference.crf.gamma == 0.5  # A2's, whole
        assert reloader.refused == set() and reloader.last_error is None
        assert reloader.check()  # then B, at the next poll
        assert state.scorer.version == load_artifact(artifacts["b"]).model_version
        assert state.scorer.inference.kernel.co_rating == 50.0


def test_files_that_cannot_be_verified_yet_are_retried_and_a_bad_artifact_refused(
    artifacts: dict[str, Path], tmp_path: Path
) -> None:
    b = artifacts["b"]
    with App(artifacts["current"], reload_poll_s=0) as api:
        state = api.client.app.state  # type: ignore[attr-defined]
        loads: list[Path] = []

        def load(path: Path) -> Any:
            loads.append(path)
            return _load(state.settings, state.metrics, path)

        reloader = _reloader(api, load)
        (b / "bilinear.npy").rename(tmp_path / "aside.npy")  # B's directory, still being written
        publish_unverified = tmp_path / "link"
        os.symlink(b, publish_unverified)
        os.replace(publish_unverified, artifacts["current"])
        assert not reloader.check() and not reloader.check()
        assert len(loads) == 2 and reloader.refused == set()  # tried at every poll, not refused
        health = api.client.get("/health").json()
        assert health["reload_error"] is None  # the app's own reloader has not polled
        assert reloader.last_error is not None and "a listed file is missing; retrying" in reloader.last_error
        (tmp_path / "aside.npy").rename(b / "bilinear.npy")  # the write completes
        version_b = load_artifact(b).model_version
        assert reloader.check() and state.scorer.version == version_b and reloader.last_error is None
        # An artifact that verifies and still cannot serve (an unknown inference mode) is refused for good.
        bad = _variant(artifacts["a"], tmp_path / "bad", {"mode": "nonsense"})
        publish_bad = tmp_path / "link2"
        os.symlink(bad, publish_bad)
        os.replace(publish_bad, artifacts["current"])
        tries = len(loads)
        assert not reloader.check()
        version_bad = json.loads((bad / "manifest.json").read_text())["model_version"]
        assert reloader.refused == {version_bad} and reloader.last_error is not None
        assert (
            reloader.last_error.startswith(f"model {version_bad} refused: ")
            and "/" not in reloader.last_error
        )
        assert not reloader.check() and len(loads) == tries + 1  # not loaded again
        assert state.scorer.version == version_b
