"""Compaction under concurrency (training/compact.py): one at a time, a compare-and-set on the head, and
readers (a retrain) that never skip what a compaction trimmed under them (a real redis-server)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

import training.compact
import training.online
from model.stream import Compacted
from tests.service.conftest import RedisServer
from training.compact import compact_stream, lock_key
from training.data import DataError
from training.online import read_online_ratings

LEVELS = [1.0, 2.0, 3.0, 4.0, 5.0]


@pytest.fixture()
def server() -> Iterator[RedisServer]:
    s = RedisServer().start()
    yield s
    s.kill()


def _fill(client: redis.Redis, users: int, start: int = 0) -> list[str]:
    return [
        client.xadd("c:ratings", {"user": f"u{k}", "item": "i1", "rating": "4.0"}).decode()  # type: ignore[arg-type, union-attr]
        for k in range(start, start + users)
    ]


def test_a_compaction_that_overlaps_another_writes_nothing_and_loses_nothing(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 56, defect 2: with no lock and no compare, A read up to Y1, B wrote its head up to Y2 and
    trimmed to Y2, then A wrote its head ending at Y1: the ratings between were in neither."""
    client = redis.Redis.from_url(server.url)
    client.set("c:ratings:identity", "abc")
    ids = _fill(client, 30)
    read = training.compact.read_online_ratings
    inner: list[Any] = []

    def overlapped(*args: Any, **kwargs: Any) -> Any:
        got = read(*args, **kwargs)  # A has read up to ids[9] ...
        if not inner:
            client.delete(lock_key("c:ratings"))  # ... and its lease expired: B runs whole meanwhile
            monkeypatch.setattr(training.compact, "read_online_ratings", read)
            inner.append(compact_stream(server.url, "c", ids[19], LEVELS))
        return got

    monkeypatch.setattr(training.compact, "read_online_ratings", overlapped)
    with pytest.raises(DataError, match="changed while this compaction read"):
        compact_stream(server.url, "c", ids[9], LEVELS)  # A: its older head is not written
    assert inner[0]["compacted_up_to"] == ids[19] and inner[0]["trimmed"] == 20
    head = Compacted.from_json(client.get("c:ratings:compacted"))  # type: ignore[arg-type]
    assert head.last == ids[19] and len(head.ratings) == 20
    assert len(read_online_ratings(server.url, "c", levels=LEVELS).users) == 30  # the next retrain: all


def test_compactions_run_one_at_a_time_and_an_older_one_never_moves_the_head_back(
    server: RedisServer,
) -> None:
    client = redis.Redis.from_url(server.url)
    client.set("c:ratings:identity", "abc")
    ids = _fill(client, 10)
    client.set(lock_key("c:ratings"), "another", px=60_000)  # another compaction holds the lease
    with pytest.raises(DataError, match="another compaction of c:ratings is running"):
        compact_stream(server.url, "c", ids[4], LEVELS)
    assert client.xlen("c:ratings") == 10 and client.get("c:ratings:compacted") is None
    client.delete(lock_key("c:ratings"))
    assert compact_stream(server.url, "c", ids[7], LEVELS)["trimmed"] == 8
    older = compact_stream(server.url, "c", ids[4], LEVELS)  # an older artifact's place: nothing to do
    assert older["reason"] == "nothing to compact" and older["compacted_up_to"] == ids[7]
    assert Compacted.from_json(client.get("c:ratings:compacted")).last == ids[7]  # type: ignore[arg-type]
    assert client.get(lock_key("c:ratings")) is None  # the lease is given back


def test_a_retrain_reading_while_a_compaction_trims_starts_again_from_the_head(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The retrain's read saw the head, then the stream after it: a compaction between the two trimmed
    entries it had not read yet, and they were skipped."""
    client = redis.Redis.from_url(server.url)
    client.set("c:ratings:identity", "abc")
    ids = _fill(client, 12)
    monkeypatch.setattr(training.online, "PAGE", 4)
    page, pages = training.online.read_page, []

    def compacting(*args: Any, **kwargs: Any) -> Any:
        pages.append(1)
        if len(pages) == 2:  # between the first and the second page of the read
            compact_stream(server.url, "c", ids[9], LEVELS)
        return page(*args, **kwargs)

    monkeypatch.setattr(training.online, "read_page", compacting)
    got = read_online_ratings(server.url, "c", levels=LEVELS)
    assert sorted(got.users) == sorted(f"u{k}" for k in range(12)) and got.last_id == ids[-1]
