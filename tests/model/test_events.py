"""Events in the rating stream (model/stream.py `Event`): their entries parse back or are poison saying why;
`dismiss` events in a fold-in (model/online.py), its snapshots, the compacted head, and a retrain's read
of the stream (training/online.py) and compaction (training/compact.py) over a real Redis."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from model.artifact import Artifact, load_artifact
from model.online import FoldIn
from model.stream import (
    FORGET,
    Compacted,
    Entry,
    Event,
    Poison,
    entry_fields,
    event_fields,
    parse_entry,
)
from tests.model.test_online import EXACT, _fold
from training.compact import compact_stream
from training.online import read_online_ratings

REC = "0123456789abcdef" * 2
LEVELS = [1.0, 2.0, 3.0, 4.0, 5.0]


# -- entries ---------------------------------------------------------------------------------------------
def test_event_entries_parse_back_with_and_without_a_recommendation_id() -> None:
    fields = event_fields("u", "i", "click")
    assert fields == {"user": "u", "item": "i", "event": "click"}
    assert parse_entry("1-1", fields) == Event("1-1", "u", "i", "click", None)
    with_rec = event_fields("u", "i", "dismiss", REC)
    assert with_rec == {"user": "u", "item": "i", "event": "dismiss", "rec": REC}
    raw = {k.encode(): v.encode() for k, v in with_rec.items()}  # as Redis returns them
    parsed = parse_entry(b"2-0", raw)
    assert parsed == Event("2-0", "u", "i", "dismiss", REC)
    assert isinstance(parsed, Event) and parsed.fields() == with_rec
    assert parse_entry("3-0", {"user": "u", "item": "i", "event": "add-to-cart"}) == Event(
        "3-0", "u", "i", "add-to-cart"
    )


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"user": "u", "item": "i", "event": "Click"}, "event kind"),
        ({"user": "u", "item": "i", "event": "1st"}, "event kind"),
        ({"user": "u", "item": "i", "event": ""}, "event kind"),
        ({"user": "u", "item": "i", "event": "k" * 33}, "event kind"),
        ({"user": "u", "event": "click"}, "item id"),
        ({"user": "u", "item": "", "event": "click"}, "item id"),
        ({"item": "i", "event": "click"}, "user id"),
        ({"user": "u", "item": "i", "event": "click", "rec": "abc"}, "recommendation id"),
        ({"user": "u", "item": "i", "event": "click", "rec": "g" * 32}, "recommendation id"),
        ({"user": "u", "item": "i", "event": "click", "rec": REC + "0"}, "recommendation id"),
        ({"user": "u", "item": "i", "event": "click", "rec": REC.upper()}, "recommendation id"),
    ],
)
def test_a_bad_event_is_poison_saying_why(fields: dict[str, str], reason: str) -> None:
    parsed = parse_entry("4-0", fields)
    assert isinstance(parsed, Poison) and reason in parsed.reason, parsed
    assert parsed.id == "4-0" and parsed.fields == fields


def test_a_rating_naming_a_recommendation_is_still_a_rating() -> None:
    fields = entry_fields("u", "i", 4.0, REC)
    assert fields == {"user": "u", "item": "i", "rating": "4.0", "rec": REC}
    assert parse_entry("5-0", fields) == Entry("5-0", "u", "i", 4.0)
    assert entry_fields("u", "i", 4.0) == {"user": "u", "item": "i", "rating": "4.0"}
    assert entry_fields("u", "i", None, REC) == {"user": "u", "item": "i", "retract": "1"}
    assert entry_fields("u", FORGET, None, REC) == {"user": "u", "forget": "1"}


# -- a fold-in's dismissals ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def artifact(tiny_artifact: Path) -> Artifact:
    return load_artifact(tiny_artifact)


def test_a_dismissal_is_kept_once_and_a_forget_clears_the_earlier_ones(artifact: Artifact) -> None:
    fold, _ = _fold(artifact, EXACT)
    user, item = artifact.users.ids[0], artifact.items.ids[0]
    fold.apply([], dismissals=[(user, item)])
    state = fold.state
    assert dict(state.dismissed) == {user: frozenset({item})}
    assert state.dismissals_applied == 1 and state.writes == 1 and state.applied == 0
    fold.apply([], dismissals=[(user, item)])  # again: nothing changes
    assert fold.state is state and fold.state.dismissals_applied == 1
    fold.apply([], dismissals=[(user, item), ("newcomer", "x"), ("newcomer", "y"), ("newcomer", "x")])
    assert dict(fold.state.dismissed) == {user: frozenset({item}), "newcomer": frozenset({"x", "y"})}
    assert fold.state.dismissals_applied == 3
    # In one batch, in stream order: a forget after a dismissal clears it ...
    fold.apply([], dismissals=[("newcomer", "z"), ("newcomer", FORGET)])
    assert "newcomer" not in fold.state.dismissed and fold.state.dismissals_applied == 5
    fold.apply([], dismissals=[("nobody", FORGET)])  # a user without dismissals: nothing to forget
    assert fold.state.dismissals_applied == 5
    # ... and a dismissal after a forget stays.
    fold.apply([], dismissals=[(user, "other"), (user, FORGET), (user, "kept")])
    assert dict(fold.state.dismissed) == {user: frozenset({"kept"})}
    assert fold.state.dismissals_applied == 8 and fold.state.writes == 8


def test_dismissals_survive_ratings_and_a_snapshot_restores_them(artifact: Artifact) -> None:
    fold, onnx = _fold(artifact, EXACT)
    user, items = artifact.users.ids[1], artifact.items.ids
    fold.apply([], dismissals=[(user, items[2]), ("newcomer", items[3])])
    fold.apply([(user, items[4], 5.0), ("newcomer", items[5], 2.0)], dismissals=[(user, items[6])])
    state = fold.state
    assert state.applied == 2 and state.dismissals_applied == 3 and state.writes == 5
    assert dict(state.dismissed) == {user: frozenset({items[2], items[6]}), "newcomer": frozenset({items[3]})}
    fold.apply([(user, items[7], 4.0)])  # a batch of ratings alone keeps the dismissals
    assert fold.state.dismissed == state.dismissed and fold.state.dismissals_applied == 3
    writes, payload = fold.snapshot()
    assert writes == fold.state.writes == 6
    fresh = FoldIn(artifact, artifact.inference.with_overrides(EXACT), onnx.embed_users, onnx.embed_items)
    assert fresh.restore(payload) == 6
    assert dict(fresh.state.dismissed) == dict(fold.state.dismissed)
    assert fresh.state.dismissals_applied == 3 and fresh.state.applied == 3
    fresh.apply([], dismissals=[(user, FORGET)])  # it goes on from there
    assert user not in fresh.state.dismissed and fresh.state.dismissals_applied == 4


def test_a_snapshot_of_dismissals_alone_restores(artifact: Artifact) -> None:
    fold, onnx = _fold(artifact, EXACT)
    fold.apply([], dismissals=[("someone", "x")])
    writes, payload = fold.snapshot()
    fresh = FoldIn(artifact, artifact.inference.with_overrides(EXACT), onnx.embed_users, onnx.embed_items)
    assert writes == 1 and fresh.restore(payload) == 1
    assert dict(fresh.state.dismissed) == {"someone": frozenset({"x"})} and fresh.state.applied == 0


# -- the compacted head ----------------------------------------------------------------------------------
def test_the_compacted_head_keeps_the_dismissals() -> None:
    head = Compacted("7-0", "id", (("u", "i", 4.0),), (("u", "j"),), ("w",), (), (("u", "k"), ("w", "i")))
    again = Compacted.from_json(head.to_json())
    assert again == head and again.dismissed == (("u", "k"), ("w", "i"))
    older = '{"format": 1, "last": "5-0", "identity": null, "ratings": [], "retracted": [], "forgotten": []}'
    assert Compacted.from_json(older).dismissed == ()


# -- a retrain's read of a real stream -------------------------------------------------------------------
@pytest.fixture()
def stream() -> Iterator[tuple[str, str, redis.Redis]]:
    """(Redis URL, a key prefix of this test's own, a client): the shared Redis at 127.0.0.1:6379, or a
    throw-away redis-server where it does not answer. The prefix's keys are deleted afterwards."""
    url, server = "redis://127.0.0.1:6379/0", None
    client = redis.Redis.from_url(url, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.ConnectionError:
        from tests.service.conftest import RedisServer

        server = RedisServer().start()
        url = server.url
        client = redis.Redis.from_url(url)
    prefix = f"test-events-{uuid.uuid4().hex}"
    try:
        yield url, prefix, client
    finally:
        doomed = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if doomed:
            client.delete(*doomed)
        client.close()
        if server is not None:
            server.kill()


def _add(client: redis.Redis, key: str, fields: dict[str, str]) -> str:
    entry_id = client.xadd(key, fields)  # type: ignore[arg-type]
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)


def test_the_read_keeps_the_dismissals_since_each_users_last_forget(
    stream: tuple[str, str, redis.Redis],
) -> None:
    url, prefix, client = stream
    key = f"{prefix}:ratings"
    client.set(f"{key}:identity", "abc")
    ids = [
        _add(client, key, entry_fields("u1", "i1", 4.0)),
        _add(client, key, event_fields("u1", "i2", "dismiss")),
        _add(client, key, event_fields("u1", "i3", "click", REC)),
        _add(client, key, event_fields("u2", "i1", "dismiss", REC)),
        _add(client, key, entry_fields("u2", "i2", 5.0, REC)),
        _add(client, key, event_fields("u2", "i1", "dismiss")),  # again
        _add(client, key, entry_fields("u1", FORGET, None)),  # clears u1's i2
        _add(client, key, event_fields("u1", "i4", "dismiss")),  # after the forget: kept
        _add(client, key, entry_fields("u1", "i5", 3.0)),
        _add(client, key, event_fields("u2", "i3", "view")),
        _add(client, key, {"user": "u3", "item": "i1", "event": "Not-a-kind"}),  # poison
    ]
    online = read_online_ratings(url, prefix, levels=LEVELS)
    assert online.dismissed == (("u2", "i1"), ("u1", "i4"))
    assert online.skipped == 1  # the poison alone: events are not skipped
    assert online.entries == len(ids) and online.last_id == ids[-1]
    assert list(zip(online.users, online.items, online.values.tolist(), strict=True)) == [
        ("u2", "i2", 5.0),
        ("u1", "i5", 3.0),
    ]
    assert online.forgotten == ("u1",) and online.forgotten_now == () and online.retracted == ()
    assert online.identity == "abc"
    # Up to an id before the forget: u1's dismissal is still there.
    early = read_online_ratings(url, prefix, levels=LEVELS, up_to=ids[5])
    assert early.dismissed == (("u1", "i2"), ("u2", "i1")) and early.skipped == 0
    assert early.users == ["u1", "u2"] and early.forgotten == ()

    # Compacted up to there, the head keeps them; the read after it goes on from them.
    record = compact_stream(url, prefix, ids[5], LEVELS)
    assert record["compacted_up_to"] == ids[5] and record["dismissed"] == 2 and record["trimmed"] == 6
    head = Compacted.from_json(client.get(f"{key}:compacted"))  # type: ignore[arg-type]
    assert head.dismissed == (("u1", "i2"), ("u2", "i1")) and head.identity == "abc"
    again = read_online_ratings(url, prefix, levels=LEVELS)
    assert again.dismissed == online.dismissed and again.skipped == 1
    assert again.users == online.users and again.values.tolist() == online.values.tolist()
    # Compacted to the end: the forget has cleared u1's earlier one in the head too.
    compact_stream(url, prefix, ids[-1], LEVELS)
    head = Compacted.from_json(client.get(f"{key}:compacted"))  # type: ignore[arg-type]
    assert head.dismissed == (("u2", "i1"), ("u1", "i4")) and head.forgotten == ("u1",)
    assert client.xlen(key) == 0
    # A forget after the head clears that user's dismissals from it.
    _add(client, key, entry_fields("u2", FORGET, None))
    _add(client, key, event_fields("u2", "i9", "dismiss"))
    last = read_online_ratings(url, prefix, levels=LEVELS)
    assert last.dismissed == (("u1", "i4"), ("u2", "i9")) and last.users == ["u1"]
