"""The fold-in snapshot store (service/snapshot.py) against a real Redis: payloads in parts, replaced whole,
the previous parts deleted, damaged or half-replaced payloads never trusted."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import redis

import service.snapshot
from service.snapshot import SnapshotStore, Untrusted


@pytest.fixture
def store(redis_client: redis.Redis, key_prefix: str) -> Iterator[SnapshotStore]:
    yield SnapshotStore(redis_client, redis_client, f"{key_prefix}:ratings", "v1", "s1")
    for key in redis_client.scan_iter(f"{key_prefix}:*"):
        redis_client.delete(key)


def _parts(client: redis.Redis, store: SnapshotStore) -> list[bytes]:
    return sorted(client.scan_iter(f"{store.part_prefix}:*"))


def test_a_payload_larger_than_a_part_is_stored_in_parts_and_read_back_whole(
    store: SnapshotStore, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service.snapshot, "PART_BYTES", 1000)
    data = os.urandom(4500)
    store.write("5-0", 7, "identity", data)
    parts = _parts(redis_client, store)
    assert len(parts) == 5  # no command carried more than a part
    assert max(redis_client.strlen(k) for k in parts) == 1000
    assert redis_client.hkeys(store.key) == [b"meta"]
    assert all(0 < redis_client.ttl(k) <= service.snapshot.KEEP_S for k in [store.key, *parts])
    got = store.load("identity")
    assert got is not None and (got.last, got.applied, got.data) == ("5-0", 7, data)
    # A write replaces it whole and deletes the parts it replaced.
    store.write("9-0", 9, "identity", b"x" * 1500)
    assert len(_parts(redis_client, store)) == 2 and not set(parts) & set(_parts(redis_client, store))
    got = store.load("identity")
    assert got is not None and (got.last, got.data) == ("9-0", b"x" * 1500)
    with pytest.raises(Untrusted, match="stream_identity"):
        store.load("another stream")


def test_a_damaged_or_missing_part_is_not_trusted(
    store: SnapshotStore, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service.snapshot, "PART_BYTES", 100)
    store.write("5-0", 3, None, os.urandom(350))
    first, *rest = _parts(redis_client, store)
    redis_client.set(first, b"not the payload", keepttl=True)
    with pytest.raises(Untrusted, match="checksum"):
        store.load(None)
    redis_client.delete(rest[0])
    with pytest.raises(Untrusted, match="missing"):
        store.load(None)


def test_a_snapshot_replaced_while_it_is_read_is_read_again_as_the_newer_one(
    store: SnapshotStore, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service.snapshot, "PART_BYTES", 100)
    store.write("5-0", 3, None, b"a" * 350)
    payload, replaced = store._payload, []

    def racing(generation: str, parts: int) -> bytes | None:
        if not replaced:  # another worker's write lands between this reader's meta and its parts
            replaced.append(True)
            store.write("8-0", 4, None, b"b" * 250)
        return payload(generation, parts)

    monkeypatch.setattr(store, "_payload", racing)
    got = store.load(None)
    assert got is not None and (got.last, got.applied, got.data) == ("8-0", 4, b"b" * 250)


def test_a_snapshot_of_the_single_key_layout_is_ignored(
    store: SnapshotStore, redis_client: redis.Redis
) -> None:
    """Format 1 kept the payload in the meta's hash: a worker of this code replays instead."""
    redis_client.hset(store.key, mapping={"meta": '{"format": 1, "last": "5-0"}', "data": b"old"})
    with pytest.raises(Untrusted, match="format"):
        store.load(None)
    store.write("6-0", 1, None, b"new")
    assert redis_client.hkeys(store.key) == [b"meta"]
