"""Who may read what (service/auth.py): explanations that name only the asking user's ratings, the read
token on every read route, a user's ratings behind the write token, forgetting that deletes the user's
entries from Redis, and ids with `/` (the real Redis, in process)."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

import service.scoring
from model.artifact import load_artifact
from model.stream import entry_fields
from tests.service.conftest import REDIS_URL, App, RedisServer
from tests.service.test_online import _app as online_app

TOKEN = "privacy-write-token"
READ = "privacy-read-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
READER = {"Authorization": f"Bearer {READ}"}
EXACT = {
    "mode": "exact",
    "kernel": {"known": "clamped", "same_user": 20.0, "same_item": 5.0, "co_rating": 50.0},
}
ITEMS = ["i1", "i7", "i30", "i42"]


def _app(artifact: Path, **settings: Any) -> App:
    prefix = f"dcmc-test-privacy-{uuid.uuid4().hex[:8]}"
    settings = {"write_token": TOKEN, "inference": EXACT, **settings}
    return App(artifact, redis_url=REDIS_URL, redis_key_prefix=prefix, **settings)


def _explained(api: App, headers: dict[str, str] | None = None, **body: Any) -> list[dict[str, Any]]:
    r = api.client.post(
        "/predict", json={"user": "u4", "items": ITEMS, "explain": True, **body}, headers=headers
    )
    assert r.status_code == 200, r.text
    return [p["explanation"] for p in r.json()["predictions"]]


def test_an_explanation_names_other_users_ratings_only_for_the_write_token(
    tiny_artifact: Path, redis_client: redis.Redis
) -> None:
    """Issue 56, defect 9: `because` listed other users' ratings with their ids to anonymous clients."""
    others_weigh = {"mode": "exact", "kernel": {"known": "clamped", "same_user": 1.0, "same_item": 30.0}}
    with _app(tiny_artifact, explain_k=8, inference=others_weigh) as api:
        full, shown = _explained(api, AUTH), _explained(api)
        for whole, anonymous in zip(full, shown, strict=True):
            assert len(whole["because"]) == 8 and "others" not in whole
            mine = [b for b in whole["because"] if b["user"] == "u4"]
            assert anonymous["because"] == mine  # the asking user's own, as they are
            theirs = [b for b in whole["because"] if b["user"] != "u4"]
            assert theirs, "the tiny artifact's item terms should reach other users' ratings"
            grouped: dict[tuple[str, float], list[float]] = {}
            for b in theirs:
                grouped.setdefault((b["item"], b["rating"]), []).append(b["effect"])
            others = anonymous["others"]
            assert all(set(g) == {"item", "rating", "users", "effect"} for g in others)  # no user id
            assert {(g["item"], g["rating"]): g["users"] for g in others} == {
                k: len(v) for k, v in grouped.items()
            }
            for g in others:
                assert g["effect"] == pytest.approx(sum(grouped[g["item"], g["rating"]]), abs=1e-12)
        r = api.client.get("/recommend/u4", params={"k": 2, "explain": "true"})
        assert r.status_code == 200 and "u4" not in {
            b["user"] for rec in r.json()["recommendations"] for b in rec["explanation"]["because"]
        } - {"u4"}


def test_explanations_are_bounded_in_items_and_computed_in_chunks(
    tiny_artifact: Path, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _app(tiny_artifact, max_explain_items=3) as api:
        r = api.client.post("/predict", json={"user": "u4", "items": ITEMS, "explain": True})
        assert r.status_code == 422 and "DCMC_MAX_EXPLAIN_ITEMS" in r.text
        assert api.client.post("/predict", json={"user": "u4", "items": ITEMS}).status_code == 200
        whole = _explained(api, AUTH, items=ITEMS[:3])
        monkeypatch.setattr(service.scoring, "EXPLAIN_BYTES", 1)  # one item per call into the scorer
        chunked = _explained(api, AUTH, items=ITEMS[:3])
        for a, b in zip(
            chunked, whole, strict=True
        ):  # the same lists; effects to rounding (smaller products)
            assert [(x["user"], x["item"]) for x in a["because"]] == [
                (x["user"], x["item"]) for x in b["because"]
            ]
            np.testing.assert_allclose(
                [x["effect"] for x in a["because"]], [x["effect"] for x in b["because"]], rtol=0, atol=1e-12
            )


def test_the_read_token_guards_every_read_route(tiny_artifact: Path, redis_client: redis.Redis) -> None:
    reads = [
        ("POST", "/predict", {"json": {"user": "u4", "items": ITEMS}}),  # the fast path's shape
        ("POST", "/predict", {"json": {"user": 4, "items": ITEMS}}),  # the route's
        ("GET", "/recommend/u4", {}),
        ("GET", "/similar-users/u4", {}),
        ("GET", "/similar-items/i1", {}),
    ]
    with _app(tiny_artifact, read_token=READ) as api:
        for method, path, kw in reads:
            r = api.client.request(method, path, **kw)
            assert r.status_code == 401 and "DCMC_READ_TOKEN" in r.text, (path, r.text)
            for headers in (READER, AUTH):
                assert api.client.request(method, path, headers=headers, **kw).status_code in (200, 404), path
        for path in ("/health", "/ready", "/metrics", "/openapi.json"):
            assert api.client.get(path).status_code == 200
        assert api.client.get("/users/u4/ratings", headers=READER).status_code == 401  # the write token's
    with _app(tiny_artifact, read_token="") as api:  # empty: reads are open
        assert api.client.post("/predict", json={"user": "u4", "items": ITEMS}).status_code == 200


def test_a_users_ratings_are_shown_to_the_write_token_alone(
    tiny_artifact: Path, redis_client: redis.Redis
) -> None:
    art = load_artifact(tiny_artifact)
    known = art.known()
    u4 = art.users.indices(["u4"])[0]
    pos = known.by_row.of(u4)
    stored = {art.items.ids[j]: float(v) for j, v in zip(known.cols[pos], known.values[pos], strict=True)}
    with _app(tiny_artifact) as api:
        assert api.client.get("/users/u4/ratings").status_code == 401
        r = api.client.get("/users/u4/ratings", headers=AUTH)
        assert r.status_code == 200
        assert {x["item"]: x["rating"] for x in r.json()["ratings"]} == stored
        assert not any(x["online"] for x in r.json()["ratings"])
        gone = next(iter(stored))
        body = {"ratings": [{"user": "u4", "item": "brand-new", "rating": 2}]}
        assert api.client.post("/ratings", json=body, headers=AUTH).status_code == 200
        r = api.client.delete("/ratings", params={"user": "u4", "item": gone}, headers=AUTH)
        assert r.status_code == 200
        r = api.client.get("/users/u4/ratings", params={"after": r.json()["last_id"]}, headers=AUTH)
        held = {x["item"]: (x["rating"], x["online"]) for x in r.json()["ratings"]}
        assert held == {**{i: (v, False) for i, v in stored.items() if i != gone}, "brand-new": (2.0, True)}
        assert api.client.get("/users/nobody/ratings", headers=AUTH).status_code == 404
    with _app(tiny_artifact, write_token=None) as api:
        assert api.client.get("/users/u4/ratings").status_code == 403


def test_ids_with_a_slash_are_rated_read_and_forgotten(
    tiny_artifact: Path, redis_client: redis.Redis
) -> None:
    """Issue 56, defect 8: POST /ratings took `a/b`, which no route with the id in its path could reach."""
    with _app(tiny_artifact) as api:
        body = {
            "ratings": [
                {"user": "team/ana", "item": "i1", "rating": 5},
                {"user": "team/ana", "item": "i7", "rating": 1},
            ]
        }
        last = api.client.post("/ratings", json=body, headers=AUTH).json()["last_id"]
        r = api.client.post("/predict", json={"user": "team/ana", "items": ITEMS}, params={"after": last})
        assert r.status_code == 200, r.text
        assert api.client.get("/recommend/team/ana", params={"k": 3}).json()["user"] == "team/ana"
        assert api.client.get("/similar-users/team/ana").status_code == 200
        assert len(api.client.get("/users/team/ana/ratings", headers=AUTH).json()["ratings"]) == 2
        r = api.client.delete("/users/team%2Fana", headers=AUTH)  # encoded or not, the same id
        assert r.status_code == 200 and r.json()["forgotten"] == "team/ana"
        r = api.client.post(
            "/predict", json={"user": "team/ana", "items": ITEMS}, params={"after": r.json()["last_id"]}
        )
        assert r.status_code == 404


def test_forgetting_deletes_the_users_entries_and_their_dead_letters(
    tiny_artifact: Path, durable_redis: RedisServer
) -> None:
    """Issue 56, defect 8: a forgotten user's ratings stayed in the stream until a compaction (for ever
    with COMPACT=0), and in the dead-letter stream for ever."""
    client = redis.Redis.from_url(durable_redis.url, decode_responses=True)
    client.xadd("dcmc:ratings", {"user": "leaver", "item": "i2", "rating": "9"})  # poison: dead-lettered
    with online_app(tiny_artifact, durable_redis) as api:
        body = {
            "ratings": [
                {"user": "leaver", "item": "i1", "rating": 5},
                {"user": "stayer", "item": "i1", "rating": 1},
            ]
        }
        api.client.post("/ratings", json=body, headers={"Authorization": "Bearer s3cret-token"})
        assert client.xlen("dcmc:ratings:dead-letter") == 1
        r = api.client.delete("/users/leaver", headers={"Authorization": "Bearer s3cret-token"})
        assert r.status_code == 200, r.text
        assert r.json()["purged_entries"] == 2 and r.json()["purged_dead_letters"] == 1
    entries = [fields for _, fields in client.xrange("dcmc:ratings")]
    assert [e.get("user") for e in entries] == ["stayer", "leaver"] and "forget" in entries[-1]
    assert client.xlen("dcmc:ratings:dead-letter") == 0
    with online_app(tiny_artifact, durable_redis) as again:  # a replay: stayer as before, leaver unknown
        assert again.client.post("/predict", json={"user": "leaver", "items": ["i1"]}).status_code == 404
        assert again.client.post("/predict", json={"user": "stayer", "items": ["i1"]}).status_code == 200


def test_a_user_another_worker_just_wrote_is_taken_back_and_forgotten_at_once(
    tiny_artifact: Path, durable_redis: RedisServer
) -> None:
    """Issue 56, defect 8: DELETE /users/{id} and DELETE /ratings answered 404, storing nothing, for a user
    another worker had written and this one had not folded in yet."""
    auth = {"Authorization": "Bearer s3cret-token"}
    with (
        online_app(tiny_artifact, durable_redis) as a,
        online_app(tiny_artifact, durable_redis, fold_in_interval_s=10) as b,
    ):
        b.client.get("/health")  # b's replica now waits for entries, then gathers for 10 s
        body = {
            "ratings": [
                {"user": "quick", "item": "i1", "rating": 5},
                {"user": "quick", "item": "i2", "rating": 2},
            ]
        }
        assert a.client.post("/ratings", json=body, headers=auth).status_code == 200
        r = b.client.delete("/ratings", params={"user": "quick", "item": "i1"}, headers=auth)
        assert r.status_code == 200, r.text
        r = b.client.delete("/users/quick", headers=auth)
        assert r.status_code == 200, r.text
        assert b.client.delete("/users/never-seen", headers=auth).status_code == 404


def test_the_new_user_limit_holds_under_concurrent_batches(
    tiny_artifact: Path, durable_redis: RedisServer
) -> None:
    """Issue 56, defect 10: the limit was checked before the awaited write and counted after it, so
    concurrent batches passed it."""
    auth = {"Authorization": "Bearer s3cret-token"}
    with online_app(tiny_artifact, durable_redis, max_new_users=10) as api:
        statuses: list[int] = []

        def post(k: int) -> None:
            body = {"ratings": [{"user": f"c{k}-{n}", "item": "i1", "rating": 4} for n in range(4)]}
            statuses.append(api.client.post("/ratings", json=body, headers=auth).status_code)

        threads = [threading.Thread(target=post, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert statuses.count(200) == 2 and statuses.count(422) == 6  # 2 x 4 new users fit in 10
    users = {fields[b"user"] for _, fields in redis.Redis.from_url(durable_redis.url).xrange("dcmc:ratings")}
    assert len(users) == 8


def test_a_hurried_replica_folds_in_at_most_once_per_interval(
    tiny_artifact: Path, durable_redis: RedisServer
) -> None:
    """Issue 56, defect 10: anonymous reads with `after` forced a fold-in per write (and polled every 2 ms):
    a read now wakes when its write is applied, and hurried fold-ins are HURRY_MIN_S apart at least."""
    from service.replication import HURRY_MIN_S

    stream = redis.Redis.from_url(durable_redis.url)
    with online_app(tiny_artifact, durable_redis, fold_in_interval_s=2.0) as api:
        replica = api.client.app.state.scorer.replica  # type: ignore[attr-defined]
        times: list[float] = []
        apply = replica.apply
        replica.apply = lambda entries: (times.append(__import__("time").monotonic()), apply(entries))[1]
        stop = threading.Event()

        def hurry() -> None:
            while not stop.is_set():
                replica.hurry()

        hurrier = threading.Thread(target=hurry)
        hurrier.start()
        try:
            for n in range(30):
                stream.xadd("dcmc:ratings", entry_fields(f"h{n}", "i1", 4.0))  # type: ignore[arg-type]
                __import__("time").sleep(0.005)
            last = stream.xadd("dcmc:ratings", entry_fields("h-last", "i1", 4.0)).decode()  # type: ignore[arg-type, union-attr]
            r = api.client.post("/predict", json={"user": "h-last", "items": ["i1"]}, params={"after": last})
            assert r.status_code == 200
        finally:
            stop.set()
            hurrier.join()
        gaps = np.diff(times)
        assert len(times) >= 2 and gaps.min() >= HURRY_MIN_S * 0.9
