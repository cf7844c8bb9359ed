"""The replica (service/replication.py): readiness decided by one state machine, a stream trimmed or purged
under a lagging worker, fold-ins that fail, an unreadable compacted head, and the supervisor that
reloads or rebuilds a model (real redis-server processes, killed and restarted by these tests)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

import service.online
import service.replication
from model.stream import Poison, compacted_key, entry_fields, stream_key
from service.online import RatingLog
from tests.service.conftest import App, RedisServer
from tests.service.test_online import AUTH, ITEMS, TOKEN, _app, _predict, _ratings, _write

EXACT = {"inference": {"mode": "exact"}}
"""Answers that depend on the ratings alone, not on the users' indexes (a replay and a head fold-in give
the same numbers)."""


def _wait(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _ready(api: App) -> bool:
    return bool(api.client.get("/ready").status_code == 200)


def _replication(api: App) -> dict[str, Any]:
    return dict(api.client.get("/health").json()["replication"])


def _held(api: App, user: str) -> dict[str, float]:
    r = api.client.get(f"/users/{user}/ratings", headers=AUTH)
    assert r.status_code == 200, r.text
    return {x["item"]: x["rating"] for x in r.json()["ratings"]}


def test_a_worker_started_while_redis_is_down_is_ready_once_redis_is_back(
    tiny_artifact: Path, durable_redis: RedisServer
) -> None:
    """Defect 1 of issue 56: before, `replayed` was set only by a start-up catch-up or by a later rating,
    so a worker started during an outage stayed unready until another rating arrived."""
    stream = redis.Redis.from_url(durable_redis.url)
    for n in range(3):
        stream.xadd("dcmc:ratings", entry_fields(f"early{n}", "i1", 4.0))  # type: ignore[arg-type]
    durable_redis.kill()
    with _app(tiny_artifact, durable_redis, redis_retry_s=0.1) as api:
        assert not _ready(api)
        assert _replication(api)["phase"] == "degraded"
        durable_redis.start()  # from its append-only file; no rating arrives after it
        _wait(lambda: _ready(api))
        assert _replication(api)["phase"] == "following"
        assert _held(api, "early2") == {"i1": 4.0}


def test_a_replay_that_fails_half_way_is_not_ready_until_it_reaches_the_end(
    tiny_artifact: Path, durable_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect 1 (second part): a start-up replay that failed after its first chunk must not be ready."""
    stream = redis.Redis.from_url(durable_redis.url)
    for n in range(12):
        stream.xadd("dcmc:ratings", entry_fields(f"chunk{n}", "i2", 3.0))  # type: ignore[arg-type]
    monkeypatch.setattr(service.online, "READ_CHUNK", 5)
    read, calls, broken = RatingLog.read, [], [True]

    def flaky(self: RatingLog, after: str) -> Any:
        calls.append(after)
        if len(calls) >= 2 and broken[0]:  # from the second chunk of the start-up replay on, until mended
            raise redis.ConnectionError("Connection reset by peer (a test's fault)")
        return read(self, after)

    monkeypatch.setattr(RatingLog, "read", flaky)
    with _app(tiny_artifact, durable_redis, redis_retry_s=0.1) as api:
        _wait(lambda: len(calls) >= 3)  # it failed and tried again
        assert api.client.get("/health").json()["online_ratings"] == 5  # the first chunk only
        assert not _ready(api)
        broken[0] = False
        _wait(lambda: _ready(api))
        assert api.client.get("/health").json()["online_ratings"] == 12


def test_a_compaction_past_a_lagging_worker_is_folded_in_from_its_head(
    tiny_artifact: Path, durable_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect 3: a follower whose place was trimmed read on after it (`XRANGE (last`) and silently skipped
    every trimmed entry; now it folds the compacted head in (in chunks) and says so."""
    from training.compact import compact_stream

    monkeypatch.setattr(service.replication, "HEAD_CHUNK", 2)
    with (
        _app(tiny_artifact, durable_redis, **EXACT) as writer,
        _app(tiny_artifact, durable_redis, **EXACT) as lag,
    ):
        replica = lag.client.app.state.scorer.replica  # type: ignore[attr-defined]
        first = _write(writer.client, _ratings("before", [("i1", 5)]))
        _predict(lag.client, "before", after=first)
        replica.stop()  # a partition: it reads nothing more
        _write(writer.client, _ratings("during", [("i2", 1), ("i3", 4)]))
        _write(writer.client, _ratings("before", [("i1", 2)]))  # a re-rating, consolidated by the head
        assert (
            writer.client.delete(
                "/ratings", params={"user": "during", "item": "i3"}, headers=AUTH
            ).status_code
            == 200
        )
        up_to = _write(writer.client, _ratings("during", [("i4", 3)]))
        record = compact_stream(durable_redis.url, "dcmc", up_to, levels=[1.0, 2.0, 3.0, 4.0, 5.0])
        assert record["trimmed"] == 6
        last = _write(writer.client, _ratings("after", [("i5", 5)]))
        replica.catch_up()  # the partition heals
        assert _replication(lag)["gaps"] == 1 and _replication(lag)["lost_gaps"] == 0
        assert _held(lag, "during") == {"i2": 1.0, "i4": 3.0} and _held(lag, "before")["i1"] == 2.0
        for user in ("before", "during", "after"):
            np.testing.assert_allclose(
                _predict(lag.client, user, after=last), _predict(writer.client, user, after=last), atol=1e-9
            )


def test_entries_a_forget_purged_under_a_lagging_worker_are_no_gap(
    tiny_artifact: Path, durable_redis: RedisServer
) -> None:
    with (
        _app(tiny_artifact, durable_redis, **EXACT) as writer,
        _app(tiny_artifact, durable_redis, **EXACT) as lag,
    ):
        replica = lag.client.app.state.scorer.replica  # type: ignore[attr-defined]
        replica.stop()
        _write(writer.client, _ratings("leaver", [("i1", 5), ("i2", 4)]))
        _write(writer.client, _ratings("stayer", [("i1", 1)]))
        r = writer.client.delete("/users/leaver", headers=AUTH)
        assert r.status_code == 200 and r.json()["purged_entries"] == 2
        replica.catch_up()
        assert _replication(lag)["gaps"] == 0 and _replication(lag)["lost_gaps"] == 0
        assert lag.client.post("/predict", json={"user": "leaver", "items": ITEMS}).status_code == 404
        last = r.json()["last_id"]
        expected = _predict(writer.client, "stayer", after=last)
        np.testing.assert_allclose(_predict(lag.client, "stayer", after=last), expected, atol=1e-9)


def test_a_fold_in_that_fails_for_a_passing_reason_is_retried_never_dead_lettered(
    tiny_artifact: Path, durable_redis: RedisServer
) -> None:
    """Defect 7: before, a transient failure (memory, ONNX Runtime) sent the follower entry by entry and
    dead-lettered valid ratings, half applied."""
    with _app(tiny_artifact, durable_redis, redis_retry_s=0.1) as api:
        scorer = api.client.app.state.scorer  # type: ignore[attr-defined]
        embed, failures = scorer.onnx.embed_users, []

        def failing(rows: Any) -> Any:
            if len(failures) < 3:
                failures.append(1)
                raise RuntimeError("ONNX Runtime: out of memory (a test's fault)")
            return embed(rows)

        scorer.onnx.embed_users = failing
        last = _write(api.client, _ratings("fragile", [("i1", 5), ("i2", 2)]))
        r = api.client.post("/predict", json={"user": "fragile", "items": ITEMS}, params={"after": last})
        _wait(lambda: api.client.get("/health").json()["replication"]["phase"] == "following")
        r = api.client.post("/predict", json={"user": "fragile", "items": ITEMS}, params={"after": last})
        assert r.status_code == 200, r.text
        assert len(failures) == 3
        assert _held(api, "fragile") == {"i1": 5.0, "i2": 2.0}
        health = api.client.get("/health").json()
        assert health["skipped_entries"] == 0
        assert redis.Redis.from_url(durable_redis.url).xlen("dcmc:ratings:dead-letter") == 0


def test_a_poison_entry_older_than_the_newest_dead_letter_is_still_copied(durable_redis: RedisServer) -> None:
    """Defect 7 (second part): `dead_letter` took "equal or smaller id" as "copied already"."""
    log = RatingLog(durable_redis.url, "dcmc", 1.0)
    try:
        assert log.dead_letter(Poison("9-0", {"user": "a"}, "no item field"))
        assert log.dead_letter(Poison("5-0", {"user": "b"}, "no item field"))  # another worker's, older
        assert not log.dead_letter(Poison("9-0", {"user": "a"}, "no item field"))  # copied already
        dead = redis.Redis.from_url(durable_redis.url, decode_responses=True).xrange(
            "dcmc:ratings:dead-letter"
        )
        assert [fields.get("entry_id", i) for i, fields in dead] == ["9-0", "5-0"]
    finally:
        log.close()


def test_an_unreadable_compacted_head_keeps_a_worker_that_needs_it_unready(
    tiny_artifact: Path, durable_redis: RedisServer
) -> None:
    """Defect 10: the service dropped a corrupt head (an older artifact's worker lost every compacted
    rating) where the trainer refuses it; now it waits for it, degraded and saying why."""
    client = redis.Redis.from_url(durable_redis.url)
    client.set(compacted_key(stream_key("dcmc")), b"{not json")
    with _app(tiny_artifact, durable_redis, redis_retry_s=0.1) as api:
        assert not _ready(api)
        replication = _replication(api)
        assert replication["phase"] == "degraded" and "compacted head" in replication["reason"]
        client.delete(compacted_key(stream_key("dcmc")))  # an operator restores it (here: there was none)
        _wait(lambda: _ready(api))


def test_a_stream_begun_again_rebuilds_the_model(tiny_artifact: Path, durable_redis: RedisServer) -> None:
    with _app(tiny_artifact, durable_redis, reload_poll_s=0) as api:
        _write(api.client, _ratings("old", [("i1", 5)]))
        last = _write(api.client, _ratings("old", [("i2", 4)]))
        _predict(api.client, "old", after=last)
        first = api.client.app.state.scorer  # type: ignore[attr-defined]
        redis.Redis.from_url(durable_redis.url).flushdb()  # the stream, its identity: all gone
        last = _write(api.client, _ratings("new", [("i1", 3)]))  # its id is before the old place
        _wait(lambda: api.client.app.state.scorer is not first)  # type: ignore[attr-defined]
        _wait(lambda: _ready(api))
        _predict(api.client, "new", after=last)
        assert api.client.post("/predict", json={"user": "old", "items": ITEMS}).status_code == 404


def test_a_reload_is_retried_after_a_passing_failure_and_waits_for_redis_as_a_candidate(
    tiny_artifact: Path, tmp_path: Path, durable_redis: RedisServer
) -> None:
    """Defect 10: a reload that failed for a passing reason was refused for good, and one during a Redis
    outage re-read the whole artifact at every poll."""
    import shutil

    from model.artifact import load_artifact, publish
    from service.main import _load
    from service.reload import Reloader
    from tests.service.test_reload import _variant

    a = Path(shutil.copytree(tiny_artifact, tmp_path / "a"))
    link = tmp_path / "current"
    publish(a, link)
    b = _variant(a, tmp_path / "b", {"crf": {"gamma": 0.5}})
    with App(link, redis_url=durable_redis.url, write_token=TOKEN, reload_poll_s=0, redis_retry_s=0.1) as api:
        state = api.client.app.state  # type: ignore[attr-defined]
        loads: list[Path] = []

        def load(path: Path) -> Any:
            loads.append(path)
            if len(loads) == 1:
                raise MemoryError("a test's fault")
            return _load(state.settings, state.metrics, path)

        reloader = Reloader(state, link, 0, load)
        publish(b, link)
        assert not reloader.check() and reloader.refused == set()
        assert reloader.last_error is not None and "retrying" in reloader.last_error
        durable_redis.kill()
        assert not reloader.check()  # loaded, and not caught up: the candidate
        assert reloader.loading == load_artifact(b).model_version
        assert not reloader.check() and not reloader.tick()
        assert len(loads) == 2  # its files were read once
        durable_redis.start()
        _wait(lambda: reloader.tick() or state.scorer.version == load_artifact(b).model_version)
        assert state.scorer.version == load_artifact(b).model_version and reloader.candidate is None
        reloader.stop()


def test_the_dead_letter_stream_is_bounded(
    durable_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 56, defect 8: the dead-letter stream kept every poison entry's raw fields for ever."""
    monkeypatch.setattr(service.online, "DEAD_LETTER_MAX", 10)
    log = RatingLog(durable_redis.url, "dcmc", 1.0)
    try:
        for n in range(1, 401):
            assert log.dead_letter(Poison(f"{n}-0", {"user": f"p{n}"}, "no item field"))
        kept = redis.Redis.from_url(durable_redis.url).xlen("dcmc:ratings:dead-letter")
        assert kept < 400 and kept <= 10 + 100  # about the bound (trimmed by whole stream nodes)
    finally:
        log.close()
