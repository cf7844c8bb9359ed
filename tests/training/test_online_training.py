"""`dcmc train --online-ratings`: the service's rating stream as extra training ratings, the stream point
recorded in the artifact, and a service on the new artifact replaying only the later ratings."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import redis

from model.artifact import load_artifact
from tests.service.conftest import App, RedisServer
from training.cli import main
from training.data import DataError, Entries, RatingSplit
from training.online import OnlineRatings, read_online_ratings, with_online
from training.pipeline import run_training

TOKEN = "online-train-token"


def _split() -> RatingSplit:
    train = Entries(np.array([0, 0, 1]), np.array([0, 1, 1]), np.array([4.0, 2.0, 5.0]))
    val = Entries(np.array([1]), np.array([0]), np.array([3.0]))
    test = Entries(np.array([0]), np.array([2]), np.array([1.0]))
    levels = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    return RatingSplit("t", ["a", "b"], ["x", "y", "z"], levels, train, val, test)


def _online(triples: list[tuple[str, str, float]]) -> OnlineRatings:
    return OnlineRatings(
        users=[u for u, _, _ in triples],
        items=[i for _, i, _ in triples],
        values=np.array([r for _, _, r in triples]),
        last_id="5-0",
        entries=len(triples),
        key="dcmc:ratings",
    )


def test_online_ratings_join_the_training_part_and_never_a_held_out_pair() -> None:
    online = _online(
        [("a", "y", 1.0), ("new", "x", 5.0), ("b", "fresh", 2.0), ("b", "x", 4.0), ("a", "z", 5.0)]
    )
    data, record = with_online(_split(), online)
    assert data.user_ids == ["a", "b", "new"] and data.item_ids == ["x", "y", "z", "fresh"]
    got = {
        (data.user_ids[r], data.item_ids[c]): v for r, c, v in zip(*data.train.__dict__.values(), strict=True)
    }
    assert got == {("a", "x"): 4.0, ("a", "y"): 1.0, ("b", "y"): 5.0, ("new", "x"): 5.0, ("b", "fresh"): 2.0}
    assert data.val is not None and len(data.val) == 1 and len(data.test) == 1  # untouched
    assert record["ratings"] == 3 and record["replaced_training_ratings"] == 1
    assert record["left_out_held_out"] == 2  # (b, x) is validation, (a, z) is test
    assert record["new_users"] == 1 and record["new_items"] == 1 and record["last_id"] == "5-0"
    assert record["held_out_pairs"] == [["b", "x", 4.0], ["a", "z", 5.0]]  # kept for the service
    with pytest.raises(DataError, match="not one of the dataset's levels"):
        with_online(_split(), _online([("a", "y", 4.5)]))
    # Retractions: the dataset's training rating of (a, x), its validation rating of (b, x) (validation
    # ratings are known to the served model) and the online (b, fresh) are taken back; a test pair's
    # rating stays (what the model is scored on, never served), and unknown ids change nothing.
    taken = replace(
        _online([("b", "fresh", 2.0)]), retracted=(("a", "x"), ("b", "fresh"), ("zz", "x"), ("b", "x"))
    )
    taken = replace(taken, users=[], items=[], values=np.empty(0))
    data, record = with_online(_split(), taken)
    got = {
        (data.user_ids[r], data.item_ids[c]) for r, c in zip(data.train.rows, data.train.cols, strict=True)
    }
    assert got == {("a", "y"), ("b", "y")} and record["retracted_training_ratings"] == 1
    assert record["retractions"] == 4 and record["replaced_training_ratings"] == 0
    assert len(data.val) == 0 and record["retracted_validation_ratings"] == 1 and len(data.test) == 1
    # Forgetting b: every rating of b goes, the held-out ones too; b's ratings after it stay.
    gone = replace(_online([("b", "z", 3.0)]), forgotten=("b",))
    data, record = with_online(_split(), gone)
    got = {
        (data.user_ids[r], data.item_ids[c]) for r, c in zip(data.train.rows, data.train.cols, strict=True)
    }
    assert got == {("a", "x"), ("a", "y"), ("b", "z")} and len(data.val) == 0 and len(data.test) == 1
    assert record["forgotten_requests"] == 1 and record["forgotten_ratings"] == 2
    assert record["forgotten_users"] == []  # b rated again after it: known again
    # A user forgotten for good is recorded by id: the service keeps it unknown (model/online.py).
    _, record = with_online(_split(), replace(_online([]), forgotten=("b",), forgotten_now=("b",)))
    assert record["forgotten_users"] == ["b"]


@pytest.fixture()
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.kill()


def test_the_stream_is_read_whole_with_re_ratings_replacing(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    client.xadd("p:ratings", {"user": "u3", "item": "i1", "rating": "5.0"})
    client.xadd("p:ratings", {"user": "u3", "item": "i1", "retract": "1"})  # taken back
    client.xadd("p:ratings", {"user": "u4", "item": "i2", "retract": "1"})
    client.xadd("p:ratings", {"user": "u4", "item": "i2", "rating": "1.0"})  # and rated again
    client.xadd("p:ratings", {"user": "u5", "item": "i2"})  # poison (the service skips it): skipped
    client.xadd("p:ratings", {"user": "u5", "item": "i3", "rating": "nan"})  # so is each of these
    client.xadd("p:ratings", {"user": "u5", "item": "i4", "rating": "4.5"})  # off the levels
    client.xadd("p:ratings", {"user": "u" * 257, "item": "i4", "rating": "4.0"})
    client.xadd("p:ratings", {"user": "u6", "item": "i2", "rating": "2.0"})
    client.xadd("p:ratings", {"user": "u6", "forget": "1"})  # u6 forgotten: its rating before it goes
    for user, item, rating in [("u1", "i1", 4), ("u2", "i1", 3), ("u1", "i1", 2)]:
        last = client.xadd("p:ratings", {"user": user, "item": item, "rating": repr(float(rating))})
    online = read_online_ratings(redis_server.url, "p", levels=[1.0, 2.0, 3.0, 4.0, 5.0])
    assert list(zip(online.users, online.items, online.values.tolist(), strict=True)) == [
        ("u4", "i2", 1.0),
        ("u2", "i1", 3.0),
        ("u1", "i1", 2.0),
    ]
    assert online.retracted == (("u3", "i1"),) and online.forgotten == ("u6",)
    assert online.last_id == last.decode() and online.entries == 13 and online.identity is None
    assert online.skipped == 4  # as the service: the same parser (model.stream.parse_entry), the same levels
    client.set("p:ratings:identity", "abc")  # what a service sets when it first follows the stream
    assert read_online_ratings(redis_server.url, "p").identity == "abc"
    empty = read_online_ratings(redis_server.url, "nothing")
    assert empty.last_id == "0" and len(empty.values) == 0
    with pytest.raises(DataError, match="cannot read the online ratings"):
        read_online_ratings("redis://127.0.0.1:1/0", timeout_s=0.5)


def test_a_password_redis_is_read_from_redis_url_and_its_password_never_shown(
    tmp_path: Path, synthetic_csv: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    server = RedisServer(password="pa55word").start()
    try:
        redis.Redis.from_url(server.url).xadd("dcmc:ratings", {"user": "zed", "item": "i1", "rating": "5.0"})
        with pytest.raises(DataError, match=r"NOAUTH|Authentication|authenticated"):  # no password: refused
            read_online_ratings(f"redis://127.0.0.1:{server.port}/0", timeout_s=2)
        wrong = f"redis://:wr0ng-pa55@127.0.0.1:{server.port}/0"
        with pytest.raises(DataError) as info:
            read_online_ratings(wrong, timeout_s=2)
        assert "wr0ng-pa55" not in str(info.value) and ":***@127.0.0.1" in str(info.value)
        # `--online-ratings` without a URL reads REDIS_URL (the compose retrainer's way).
        from training.cli import main

        monkeypatch.delenv("REDIS_URL", raising=False)
        argv = ["train", "--dataset", "csv", "--data-dir", str(synthetic_csv), "--split", "random"]
        argv += [
            "--preset",
            "tiny",
            "--no-tune",
            "--no-progress",
            "--out",
            str(tmp_path / "a"),
            "--online-ratings",
        ]
        assert main(argv) == 2
        assert "REDIS_URL, which is unset" in capsys.readouterr().err
        monkeypatch.setenv("REDIS_URL", server.url)
        assert main(argv) == 0
        artifact = load_artifact(tmp_path / "a")
        assert "zed" in artifact.users and artifact.meta["dataset"]["online_ratings"]["ratings"] == 1
        assert "pa55word" not in (tmp_path / "a" / "config.json").read_text()
        assert "pa55word" not in "".join(capsys.readouterr())
    finally:
        server.kill()


def test_a_service_on_the_retrained_artifact_replays_only_the_later_ratings(
    synthetic_csv: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    for item, rating in (("i1", 5), ("i2", 1), ("i3", 5)):
        client.xadd("dcmc:ratings", {"user": "newcomer", "item": item, "rating": repr(float(rating))})
    out = tmp_path / "retrained"
    run_training("csv", synthetic_csv, out, split="random", preset_name="tiny", epochs=2, progress=False,
                 online_ratings=redis_server.url)  # fmt: skip
    artifact = load_artifact(out)
    record = json.loads((out / "config.json").read_text())["dataset"]["online_ratings"]
    assert record["ratings"] == 3 and record["new_users"] == 1 and record["stream"] == "dcmc:ratings"
    assert artifact.online_snapshot("dcmc:ratings") == record["last_id"] != "0"
    assert artifact.online_snapshot("other:ratings") == "0"
    newcomer = artifact.users.index("newcomer")
    assert len(artifact.known().by_row.of(newcomer)) == 3  # trained on, known to the CRF
    with App(out, redis_url=redis_server.url, write_token=TOKEN) as api:
        r = api.client.post("/predict", json={"user": "newcomer", "items": ["i1"]})
        assert r.status_code == 200 and r.json()["online_ratings"] == 0  # in the artifact, not replayed
        assert api.client.get("/health").json()["online_ratings"] == 0
        later = {"ratings": [{"user": "newcomer", "item": "i4", "rating": 2}]}
        r = api.client.post("/ratings", json=later, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200
        after = {"after": r.json()["last_id"]}
        body = api.client.post("/predict", json={"user": "newcomer", "items": ["i1"]}, params=after).json()
        assert body["online_ratings"] == 1
        answer = body["predictions"][0]["rating"]
    # `dcmc compact` on the published artifact: the entries it read go, the later one stays, and a worker
    # of it answers as before; a retrain reads what it read before.
    before = read_online_ratings(redis_server.url)
    assert main(["compact", "--artifacts", str(out), "--online-ratings", redis_server.url]) == 0
    assert client.xlen("dcmc:ratings") == 1
    again = read_online_ratings(redis_server.url)
    assert (again.users, again.items, again.values.tolist()) == (
        before.users,
        before.items,
        before.values.tolist(),
    )
    with App(out, redis_url=redis_server.url, write_token=TOKEN, snapshot_interval_s=0) as api:
        body = api.client.post("/predict", json={"user": "newcomer", "items": ["i1"]}).json()
        assert body["online_ratings"] == 1 and body["predictions"][0]["rating"] == pytest.approx(
            answer, abs=1e-9
        )


def test_held_out_pairs_stay_known_after_a_retrain_and_another_stream_is_replayed_whole(
    synthetic_csv: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    first = tmp_path / "first"
    run_training("csv", synthetic_csv, first, split="random", preset_name="tiny", epochs=1, progress=False)
    held = load_artifact(first).held_out  # the split is seeded: the retrain holds the same pairs out
    user, item = (
        load_artifact(first).users.external(int(held.rows[0])),
        load_artifact(first).items.external(int(held.cols[0])),
    )
    value = 1.0 if held.values[0] != 1.0 else 5.0
    with App(first, redis_url=redis_server.url, write_token=TOKEN) as api:  # sets the stream's identity
        ratings = [
            {"user": user, "item": item, "rating": value},
            {"user": "newcomer", "item": "i1", "rating": 4},
        ]
        r = api.client.post(
            "/ratings", json={"ratings": ratings}, headers={"Authorization": f"Bearer {TOKEN}"}
        )
        assert r.status_code == 200, r.text
    out = tmp_path / "retrained"
    run_training("csv", synthetic_csv, out, split="random", preset_name="tiny", epochs=1, progress=False,
                 online_ratings=redis_server.url)  # fmt: skip
    record = load_artifact(out).meta["dataset"]["online_ratings"]
    assert record["held_out_pairs"] == [[user, item, value]] and record["ratings"] == 1
    identity = redis.Redis.from_url(redis_server.url).get("dcmc:ratings:identity")
    assert identity is not None and record["stream_identity"] == identity.decode()

    def known_value(api: App) -> list[float]:
        scorer = api.client.app.state.scorer  # type: ignore[attr-defined]
        known = scorer.known
        pos = known.by_row.of(scorer.user_index(user))
        return known.values[pos][known.cols[pos] == int(scorer.item_indices([item])[0])].tolist()

    with App(out, redis_url=redis_server.url, write_token=TOKEN) as api:
        assert known_value(api) == [value]  # not trained on, still known to the served model
        assert api.client.get("/health").json()["online_ratings"] == 1  # that one; the newcomer's is trained
    # The same key on a stream begun again (another identity): the artifact's place in it means nothing.
    redis.Redis.from_url(redis_server.url).set("dcmc:ratings:identity", "another")
    with App(out, redis_url=redis_server.url, write_token=TOKEN) as api:
        assert api.client.get("/health").json()["online_ratings"] == 2  # the whole stream replayed


def test_compaction_keeps_what_a_retrain_reads(redis_server: RedisServer) -> None:
    from training.compact import compact_stream

    client = redis.Redis.from_url(redis_server.url)
    client.set("c:ratings:identity", "abc")
    entries = [
        {"user": "u1", "item": "i1", "rating": "4.0"},
        {"user": "u2", "item": "i1", "rating": "3.0"},
        {"user": "u1", "item": "i1", "rating": "2.0"},  # a re-rating
        {"user": "u3", "item": "i2", "rating": "5.0"},
        {"user": "u3", "item": "i2", "retract": "1"},  # taken back
        {"user": "u4", "item": "i9", "rating": "4.5"},  # off the levels: skipped
        {"user": "u5", "item": "i3", "rating": "1.0"},
        {"user": "u5", "forget": "1"},  # forgotten
        {"user": "u5", "item": "i4", "rating": "3.0"},  # a new history
        {"user": "u6", "item": "i1", "rating": "5.0"},
    ]
    ids = [client.xadd("c:ratings", fields).decode() for fields in entries]  # type: ignore[arg-type]
    levels = [1.0, 2.0, 3.0, 4.0, 5.0]

    def read() -> tuple[object, ...]:
        o = read_online_ratings(redis_server.url, "c", levels=levels)
        return o.users, o.items, o.values.tolist(), o.retracted, o.forgotten, o.last_id, o.identity

    before = read()
    record = compact_stream(redis_server.url, "c", ids[6], levels)
    assert record["compacted_up_to"] == ids[6] and record["trimmed"] == 7
    assert client.xlen("c:ratings") == 3
    assert read() == before  # the head, then the stream after it
    assert compact_stream(redis_server.url, "c", ids[-1], levels)["trimmed"] == 3  # the head absorbs it
    assert client.xlen("c:ratings") == 0 and read() == before
    client.xadd("c:ratings", {"user": "u1", "item": "i1", "rating": "5.0"})  # after the compaction
    users, items, values, *_ = read()
    assert (users[-1], items[-1], values[-1]) == ("u1", "i1", 5.0) and values.count(5.0) == 2
    client.set("c:ratings:identity", "other")  # the stream begun again: the head is not its own
    assert read()[0] == ["u1"]
    client.close()


def test_a_forgotten_user_and_a_retracted_validation_rating_stay_gone_after_the_retrain(
    synthetic_csv: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    """Issue 56, defect 6: the artifact recorded no forgotten set, the fold-in started with none, and the
    forget entry lay before the new artifact's place, so after the reload the user answered again. And
    defect 8: on a csv split a retracted validation rating came back through the retrain."""
    first = tmp_path / "first"
    run_training("csv", synthetic_csv, first, split="random", preset_name="tiny", epochs=1, progress=False)
    art = load_artifact(first)
    held = art.held_out  # the split is seeded: the retrain holds the same pairs out
    val_user, val_item = art.users.external(int(held.rows[0])), art.items.external(int(held.cols[0]))
    leaver = next(
        art.users.external(int(u)) for u in art.train.rows if art.users.external(int(u)) != val_user
    )
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with App(first, redis_url=redis_server.url, write_token=TOKEN) as api:
        assert api.client.delete(f"/users/{leaver}", headers=auth).status_code == 200
        r = api.client.delete("/ratings", params={"user": val_user, "item": val_item}, headers=auth)
        assert r.status_code == 200, r.text
    out = tmp_path / "retrained"
    run_training("csv", synthetic_csv, out, split="random", preset_name="tiny", epochs=1, progress=False,
                 online_ratings=redis_server.url)  # fmt: skip
    record = json.loads((out / "config.json").read_text())["dataset"]["online_ratings"]
    assert record["forgotten_users"] == [leaver] and record["retracted_validation_ratings"] == 1
    with App(out, redis_url=redis_server.url, write_token=TOKEN) as api:
        assert api.client.post("/predict", json={"user": leaver, "items": ["i1"]}).status_code == 404
        assert leaver not in {
            s["user"] for s in api.client.get(f"/similar-users/{val_user}?k=100").json()["similar"]
        }
        held = {
            x["item"] for x in api.client.get(f"/users/{val_user}/ratings", headers=auth).json()["ratings"]
        }
        assert val_item not in held


def test_catalogue_changes_survive_compaction_and_a_retrain_takes_them_into_the_artifact(
    synthetic_csv: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    from training.compact import compact_stream

    first = tmp_path / "first"
    run_training("csv", synthetic_csv, first, split="random", preset_name="tiny", epochs=1, progress=False)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    changes = [
        {"item": "i1", "record": {"title": "one", "categories": ["c"], "attributes": {"year": 1990}}},
        {"item": "i2", "patch": {"hidden": True}},
        {"item": "i1", "patch": {"attributes": {"year": None, "lang": "en"}}},
        {"item": "only-here", "record": {"categories": ["c"]}},
    ]
    with App(first, redis_url=redis_server.url, write_token=TOKEN) as api:
        r = api.client.post("/items", json={"items": changes}, headers=auth)
        assert r.status_code == 200, r.text
        rated = {"ratings": [{"user": "newcomer", "item": "i1", "rating": 4}]}
        last = api.client.post("/ratings", json=rated, headers=auth).json()["last_id"]
    online = read_online_ratings(redis_server.url, levels=[1.0, 2.0, 3.0, 4.0, 5.0])
    composed = {item: change.applied_to(None) for item, change in online.item_changes}
    assert [item for item, _ in online.item_changes] == ["i1", "i2", "only-here"]
    assert composed["i1"].attributes == {"lang": "en"} and composed["i1"].title == "one"
    assert composed["i2"].hidden and online.entries == 5 and online.skipped == 0
    record = compact_stream(redis_server.url, "dcmc", last, [1.0, 2.0, 3.0, 4.0, 5.0])
    assert record["item_changes"] == 3 and record["trimmed"] == 5
    assert redis.Redis.from_url(redis_server.url).xlen("dcmc:ratings") == 0
    with App(first, redis_url=redis_server.url, snapshot_interval_s=0) as api:  # folds the head in
        assert api.client.get("/items/i1").json()["attributes"] == {"lang": "en"}
        assert api.client.get("/items/i2").json()["hidden"] is True
    out = tmp_path / "retrained"
    run_training("csv", synthetic_csv, out, split="random", preset_name="tiny", epochs=1, progress=False,
                 online_ratings=redis_server.url)  # fmt: skip
    artifact = load_artifact(out)
    assert artifact.catalogue is not None and artifact.meta["dataset"]["online_ratings"]["item_changes"] == 3
    assert artifact.catalogue["i1"].attributes == {"lang": "en"} and artifact.catalogue["i2"].hidden
    assert artifact.catalogue["only-here"].categories == ["c"]
    with App(out, redis_url=redis_server.url, snapshot_interval_s=0) as api:
        assert api.client.get("/items/only-here").json()["in_catalogue"] is True
        assert api.client.app.state.scorer.state.records_applied == 0  # in the artifact, not replayed
