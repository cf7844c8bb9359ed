"""POST /ratings and the online state in Redis: fold-in on every server process on the same Redis, replay at
start-up, tokens, validation, deletes, snapshots (real redis-server processes). Redis failures and durability:
test_online_faults.py."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from tests.service.conftest import App, RedisServer, Service

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ITEMS = [f"i{j}" for j in range(0, 50, 5)]


def _app(tiny_artifact: Path, server: RedisServer, **settings: object) -> App:
    # A Redis call taking longer than the default 0.25 s on a loaded CI machine would degrade the worker and
    # fold in early on recovery: these tests are not about slow replies (test_online_faults.py is).
    defaults = {"redis_retry_s": 0.2, "redis_timeout_s": 2.0}
    return App(tiny_artifact, redis_url=server.url, write_token=TOKEN, **{**defaults, **settings})


def _ratings(user: str, pairs: list[tuple[str, float]]) -> dict[str, object]:
    return {"ratings": [{"user": user, "item": item, "rating": rating} for item, rating in pairs]}


def _predict(client, user: str, after: str | None = None) -> np.ndarray:  # type: ignore[no-untyped-def]
    """The user's ratings of ITEMS; with `after`, once the worker has applied that stream entry."""
    params = {"after": after} if after else None
    r = client.post("/predict", json={"user": user, "items": ITEMS}, params=params)
    assert r.status_code == 200, r.text
    return np.array([p["rating"] for p in r.json()["predictions"]])


def _write(client, body: dict[str, object]) -> str:  # type: ignore[no-untyped-def]
    """POST /ratings (200 expected); the stream id to read after."""
    r = client.post("/ratings", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    return str(r.json()["last_id"])


def test_a_new_user_is_folded_in_from_its_first_ratings(
    tiny_artifact: Path, durable_redis: RedisServer
) -> None:
    with _app(tiny_artifact, durable_redis) as api:
        r = api.client.post("/predict", json={"user": "newbie", "items": ITEMS})
        assert r.status_code == 404 and r.json()["detail"]["unknown_users"] == ["newbie"]
        r = api.client.post("/ratings", json=_ratings("newbie", [("i1", 5), ("i2", 1)]), headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["accepted"] == 2 and r.json()["model_version"]
        last = r.json()["last_id"]
        first = _predict(api.client, "newbie", after=last)
        r = api.client.post("/predict", json={"user": "newbie", "items": ITEMS})
        assert r.json()["online_ratings"] == 2
        assert np.isfinite(first).all()
        similar = api.client.get("/similar-users/newbie", params={"k": 3})
        assert similar.status_code == 200 and len(similar.json()["similar"]) == 3
        # Another rating moves the newcomer's embedding and so its predictions.
        last = _write(api.client, _ratings("newbie", [("i3", 5)]))
        assert not np.allclose(_predict(api.client, "newbie", after=last), first)
        assert api.metric("dcmc_ratings_written_total") == 3
        health = api.client.get("/health").json()
        assert health["durable"] is True and health["writes"] == "enabled"


def test_a_known_users_rating_changes_its_predictions_and_a_restart_replays_it(
    tiny_artifact: Path, durable_redis: RedisServer
) -> None:
    with _app(tiny_artifact, durable_redis) as api:
        before = _predict(api.client, "u5")
        last = _write(api.client, _ratings("u5", [("i0", 1), ("i5", 1), ("i10", 1)]))
        after = _predict(api.client, "u5", after=last)
        assert not np.allclose(after, before)
    with _app(tiny_artifact, durable_redis) as restarted:  # replays the stream before it is ready
        assert restarted.client.get("/ready").json()["ready"] is True
        np.testing.assert_allclose(_predict(restarted.client, "u5"), after, rtol=0, atol=1e-12)


def test_a_rating_reaches_a_second_server_process(tiny_artifact: Path, durable_redis: RedisServer) -> None:
    env = {"REDIS_URL": durable_redis.url, "DCMC_WRITE_TOKEN": TOKEN}
    writer, reader = Service(tiny_artifact, env), Service(tiny_artifact, env)
    try:
        writer.wait_ready()
        reader.wait_ready()
        before = _predict(reader.client, "u7")
        last = _write(writer.client, _ratings("u7", [("i0", 5), ("i1", 5), ("i2", 5)]))
        written = _predict(writer.client, "u7", after=last)
        np.testing.assert_allclose(_predict(reader.client, "u7", after=last), written, rtol=0, atol=1e-12)
        assert not np.allclose(written, before)
    finally:
        writer.stop()
        reader.stop()


@pytest.mark.parametrize(
    ("body", "headers", "status", "needle"),
    [
        (_ratings("u1", [("i1", 4)]), {}, 401, "Authorization: Bearer"),
        (_ratings("u1", [("i1", 4)]), {"Authorization": "Bearer wrong"}, 401, "Authorization: Bearer"),
        (_ratings("u1", [("i1", 4)]), {"Authorization": TOKEN}, 401, "Authorization: Bearer"),
        (_ratings("u1", [("i1", 4.5)]), AUTH, 422, "not one of the model's rating levels: 1, 2, 3, 4, 5"),
        (_ratings("u1", [("i1", 0)]), AUTH, 422, "rating 0 is not one of"),
        ({"ratings": []}, AUTH, 422, "at least 1 item"),
        (_ratings("u1", [("i1", 4)] * 4), AUTH, 422, "at most 3 are allowed (setting DCMC_MAX_RATINGS)"),
        ({"ratings": [{"user": "u1", "item": "i1"}]}, AUTH, 422, "Field required"),
        ({"ratings": [{"user": "u1", "item": "i1", "rating": "four"}]}, AUTH, 422, "valid number"),
        ({"ratings": [{"user": "", "item": "i1", "rating": 4}]}, AUTH, 422, "user"),
    ],
)
def test_bad_writes_are_refused_with_a_clear_body(
    tiny_artifact: Path,
    durable_redis: RedisServer,
    body: object,
    headers: dict[str, str],
    status: int,
    needle: str,
) -> None:
    with _app(tiny_artifact, durable_redis, max_ratings=3) as api:
        r = api.client.post("/ratings", json=body, headers=headers)
        assert r.status_code == status, r.text
        assert needle in r.text
        if status == 401:
            assert r.headers["www-authenticate"] == "Bearer"
        assert redis.Redis.from_url(durable_redis.url).xlen("dcmc:ratings") == 0  # nothing half-applied


def test_nan_and_infinite_ratings_are_refused(tiny_artifact: Path, durable_redis: RedisServer) -> None:
    with _app(tiny_artifact, durable_redis) as api:
        for raw in (b"NaN", b"Infinity"):
            body = b'{"ratings": [{"user": "u1", "item": "i1", "rating": ' + raw + b"}]}"
            r = api.client.post(
                "/ratings", content=body, headers={**AUTH, "content-type": "application/json"}
            )
            assert r.status_code == 422, r.text


def test_writes_are_off_without_a_token(tiny_artifact: Path, durable_redis: RedisServer) -> None:
    with App(tiny_artifact, redis_url=durable_redis.url) as api:
        r = api.client.post("/ratings", json=_ratings("u1", [("i1", 4)]), headers=AUTH)
        assert r.status_code == 403 and "set DCMC_WRITE_TOKEN" in r.json()["detail"]
        assert api.client.get("/health").json()["writes"] == "off: no DCMC_WRITE_TOKEN"


def test_a_new_item_is_predicted_by_the_baseline_until_a_trained_user_rates_it(
    tiny_artifact: Path, durable_redis: RedisServer
) -> None:
    with _app(tiny_artifact, durable_redis) as api:
        assert api.client.post("/predict", json={"user": "u5", "items": ["fresh"]}).status_code == 404
        # Rated by a user the model never saw: the column branch (which reads trained users) cannot embed it.
        last = _write(api.client, _ratings("stranger", [("fresh", 5)]))
        r = api.client.post("/predict", json={"user": "u5", "items": ["i1", "fresh"]}, params={"after": last})
        assert r.status_code == 200, r.text
        first, fresh = r.json()["predictions"]
        assert "fallback" not in first and fresh["fallback"] == "baseline"
        assert api.client.get("/similar-items/fresh").status_code == 200
        # Once a trained user rates it, it has an embedding and is scored by the model.
        last = _write(api.client, _ratings("u3", [("fresh", 4)]))
        r = api.client.post("/predict", json={"user": "u5", "items": ["fresh"]}, params={"after": last})
        assert "fallback" not in r.json()["predictions"][0]
        embedded = r.json()["predictions"][0]["rating"]
        recs = api.client.get("/recommend/u5", params={"items": "fresh,i1", "k": 2}).json()["recommendations"]
        assert {x["item"] for x in recs} <= {"fresh", "i1"} and "fresh" in {x["item"] for x in recs}
        rated = api.client.get("/recommend/u3", params={"items": "fresh"}).json()["recommendations"]
        assert rated == []  # u3 rated it
    with _app(tiny_artifact, durable_redis) as fresh_app:  # the replay embeds it the same way
        r = fresh_app.client.post("/predict", json={"user": "u5", "items": ["fresh"]})
        assert r.json()["predictions"][0]["rating"] == pytest.approx(embedded, abs=1e-12)


def test_reads_racing_writes_of_new_users_and_items_never_fail(
    tiny_artifact: Path, durable_redis: RedisServer
) -> None:
    # A user or item being folded in is unknown (404) until its state is published, then answered: never
    # a 5xx in between.
    with _app(tiny_artifact, durable_redis) as api:
        statuses: list[int] = []
        online_counts: list[int] = []
        stop = threading.Event()

        def read() -> None:
            n = 0
            while not stop.is_set():
                n += 1
                user, item = f"racer{n % 15}", f"gizmo{n % 15}"
                statuses.append(
                    api.client.post("/predict", json={"user": user, "items": ["i1", item]}).status_code
                )
                statuses.append(api.client.get(f"/recommend/{user}", params={"k": 3}).status_code)
                statuses.append(api.client.get(f"/similar-users/{user}").status_code)
                # A trained user who rates the new items: its rated items must come from the state that
                # answers (an unpublished new item would index past the published catalogue).
                r = api.client.get("/recommend/u2", params={"k": 5})
                statuses.append(r.status_code)
                if r.status_code == 200:
                    body = api.client.post("/predict", json={"user": "u2", "items": ["i1"]}).json()
                    online_counts.append(body["online_ratings"])
                statuses.append(api.client.get(f"/similar-items/{item}").status_code)

        reader = threading.Thread(target=read)
        reader.start()
        for n in range(15):
            body = _ratings(f"racer{n}", [("i1", 4), (f"gizmo{n}", 5)])
            body["ratings"].append({"user": "u2", "item": f"gizmo{n}", "rating": 3})  # a trained rater
            assert api.client.post("/ratings", json=body, headers=AUTH).status_code == 200
        stop.set()
        reader.join()
        assert statuses and set(statuses) <= {200, 404}
        assert 200 in statuses
        assert online_counts == sorted(online_counts)  # states only grow, and each count is one state's


def test_the_popular_fallback_counts_online_ratings(tiny_artifact: Path, durable_redis: RedisServer) -> None:
    with _app(tiny_artifact, durable_redis) as api:
        before = api.client.get("/recommend/nobody", params={"k": 50}).json()
        assert before["fallback"] == "popular"
        last = before["recommendations"][-1]["item"]  # the lowest shrunk mean rating
        # Twenty trained users give it 5 stars: (sum + 10 mu) / (n + 10) now tops every other item.
        batch = [{"user": f"u{i}", "item": last, "rating": 5} for i in range(20)]
        written = _write(api.client, {"ratings": batch})
        after = api.client.get("/recommend/nobody", params={"k": 1, "after": written}).json()
        assert after["fallback"] == "popular" and after["recommendations"][0]["item"] == last


def test_new_users_and_items_are_taken_up_to_their_limits(
    tiny_artifact: Path, durable_redis: RedisServer
) -> None:
    with _app(tiny_artifact, durable_redis, max_new_users=2, max_new_items=1) as api:
        ok = _ratings("n1", [("i1", 4), ("gadget", 5)])
        ok["ratings"].append({"user": "n2", "item": "i2", "rating": 3})
        assert api.client.post("/ratings", json=ok, headers=AUTH).status_code == 200
        stored = redis.Redis.from_url(durable_redis.url).xlen("dcmc:ratings")
        r = api.client.post("/ratings", json=_ratings("n3", [("i1", 4)]), headers=AUTH)
        assert r.status_code == 422
        (error,) = r.json()["detail"]
        assert (
            error["type"] == "too_many_new_users"
            and "DCMC_MAX_NEW_USERS" in error["msg"]
            and "'n3'" in error["msg"]
        )
        r = api.client.post("/ratings", json=_ratings("n1", [("widget", 4), ("i3", 2)]), headers=AUTH)
        assert r.status_code == 422 and r.json()["detail"][0]["type"] == "too_many_new_items"
        assert redis.Redis.from_url(durable_redis.url).xlen("dcmc:ratings") == stored  # nothing of either
        # Known ids (the artifact's, or those added before) are never limited.
        again = _ratings("n2", [("gadget", 2), ("i4", 1)])
        again["ratings"].append({"user": "u7", "item": "gadget", "rating": 5})
        assert api.client.post("/ratings", json=again, headers=AUTH).status_code == 200


def test_a_read_with_after_waits_for_its_write_and_says_when_it_cannot(
    tiny_artifact: Path, durable_redis: RedisServer
) -> None:
    with _app(tiny_artifact, durable_redis, read_after_timeout_s=0.3) as api:
        before = _predict(api.client, "u9")
        last = _write(api.client, _ratings("u9", [("i0", 1), ("i5", 1)]))
        after = _predict(api.client, "u9", after=last)
        assert not np.allclose(after, before)
        recs = api.client.get("/recommend/u9", params={"after": last, "k": 50}).json()["recommendations"]
        assert not {"i0", "i5"} & {x["item"] for x in recs}  # rated: never recommended
        # An id this stream never had: 422 at once, not a wait.
        r = api.client.post(
            "/predict", json={"user": "u9", "items": ["i1"]}, params={"after": "99999999999999-0"}
        )
        assert r.status_code == 422 and r.json()["detail"][0]["type"] == "no_such_rating"
        r = api.client.get("/recommend/u9", params={"after": "not-an-id"})
        assert r.status_code == 422
        # A rating this worker has not applied yet: the replica stopped, the read waits its bound, then 503.
        api.client.app.state.scorer.replica.stop()  # type: ignore[attr-defined]
        pending = _write(api.client, _ratings("u9", [("i7", 5)]))
        started = time.monotonic()
        r = api.client.post("/predict", json={"user": "u9", "items": ["i1"]}, params={"after": pending})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert f"not applied rating {pending} yet" in r.json()["detail"]
        assert 0.3 <= time.monotonic() - started < 2.0
        assert _predict(api.client, "u9").tolist() == after.tolist()  # without `after`: what it has applied
    with App(tiny_artifact) as offline:  # no Redis: there is nothing to wait for
        r = offline.client.post("/predict", json={"user": "u9", "items": ["i1"]}, params={"after": "1-0"})
        assert r.status_code == 422 and r.json()["detail"][0]["type"] == "no_online_ratings"


def test_ratings_arriving_within_the_interval_are_folded_in_together(
    tiny_artifact: Path, durable_redis: RedisServer
) -> None:
    with _app(tiny_artifact, durable_redis, fold_in_interval_s=0.5) as api:
        replica = api.client.app.state.scorer.replica  # type: ignore[attr-defined]
        batches: list[int] = []
        apply = replica.apply
        replica.apply = lambda entries: (batches.append(len(entries)), apply(entries))[1]
        for n in range(5):  # five writes well inside one interval
            last = _write(api.client, _ratings(f"gather{n}", [("i1", 4)]))
        body = api.client.post("/predict", json={"user": "gather4", "items": ["i1"]}, params={"after": last})
        assert body.status_code == 200
        assert batches == [5]  # one fold-in, one new model state


def test_a_read_after_a_write_folds_it_in_without_waiting_out_the_interval(
    tiny_artifact: Path, durable_redis: RedisServer
) -> None:
    # The interval (5 s) is far past the read's bound (1 s): a read with `after` cuts it short and is
    # answered, while a read without it still sees the state before the write.
    with _app(tiny_artifact, durable_redis, fold_in_interval_s=5.0, read_after_timeout_s=1.0) as api:
        before = _predict(api.client, "u4")
        last = _write(api.client, _ratings("u4", [("i5", 1.0), ("i10", 1.0)]))
        time.sleep(0.3)  # the tail has read the write and waits out its interval
        np.testing.assert_array_equal(_predict(api.client, "u4"), before)
        assert np.abs(_predict(api.client, "u4", after=last) - before).max() > 1e-6


def test_delete_takes_a_rating_back_everywhere_and_after_a_restart(
    tiny_artifact: Path, durable_redis: RedisServer
) -> None:
    with _app(tiny_artifact, durable_redis) as api:
        before = _predict(api.client, "u3")
        last = _write(api.client, _ratings("u3", [("i7", 1.0)]))
        rated = _predict(api.client, "u3", after=last)
        assert np.abs(rated - before).max() > 1e-6
        r = api.client.delete("/ratings", params={"user": "u3", "item": "i7"})
        assert r.status_code == 401  # writes need the token, taking back too
        r = api.client.delete("/ratings", params={"user": "u3", "item": "i7"}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["retracted"] == 1
        back = _predict(api.client, "u3", after=r.json()["last_id"])
        scorer = api.client.app.state.scorer  # type: ignore[attr-defined]
        user = scorer.user_index("u3")
        pos = scorer.known.by_row.of(user)
        j, v = int(scorer.known.cols[pos[0]]), float(scorer.known.values[pos[0]])  # trained with it
        # As if never given: the same as a service (another stream) where u3 only re-rated one of its
        # ratings as it was, so that its embedding was computed again from the same ratings.
        with _app(tiny_artifact, durable_redis, redis_key_prefix="touch") as touched:
            last = _write(touched.client, _ratings("u3", [(scorer.item_id(j), v)]))
            np.testing.assert_allclose(back, _predict(touched.client, "u3", after=last), rtol=0, atol=1e-9)
        assert np.abs(back - rated).max() > 1e-6
        r = api.client.delete("/ratings", params={"user": "u3", "item": scorer.item_id(j)}, headers=AUTH)
        assert r.status_code == 200
        final = _predict(api.client, "u3", after=r.json()["last_id"])
        assert j not in scorer.known.cols[scorer.known.by_row.of(user)].tolist()
        r = api.client.delete("/ratings", params={"user": "nobody", "item": "i7"}, headers=AUTH)
        assert r.status_code == 404 and r.json()["detail"]["unknown_users"] == ["nobody"]
        r = api.client.delete("/ratings", params={"user": "u3"}, headers=AUTH)
        assert r.status_code == 422
    with _app(tiny_artifact, durable_redis) as again:  # a fresh process replays the retractions
        scorer = again.client.app.state.scorer  # type: ignore[attr-defined]
        np.testing.assert_allclose(_predict(again.client, "u3"), final, rtol=0, atol=1e-9)
        assert j not in scorer.known.cols[scorer.known.by_row.of(scorer.user_index("u3"))].tolist()
        assert again.client.get("/health").json()["skipped_entries"] == 0


def test_forgetting_a_user_answers_404_for_them_and_never_lists_them(
    tiny_artifact: Path, durable_redis: RedisServer
) -> None:
    with _app(tiny_artifact, durable_redis) as api:
        last = _write(api.client, _ratings("u3", [("i7", 5.0)]))
        _predict(api.client, "u3", after=last)
        others = api.client.get("/similar-users/u5", params={"k": 59}).json()["similar"]
        assert "u3" in [o["user"] for o in others]
        assert api.client.delete("/users/u3").status_code == 401
        r = api.client.delete("/users/u3", headers=AUTH)
        assert r.status_code == 200 and r.json()["forgotten"] == "u3"
        after = {"after": r.json()["last_id"]}
        r = api.client.post("/predict", json={"user": "u3", "items": ITEMS}, params=after)
        assert r.status_code == 404 and r.json()["detail"]["unknown_users"] == ["u3"]
        r = api.client.get("/recommend/u3")  # as for any user it does not know: the popular items
        assert r.status_code == 200 and r.json()["fallback"] == "popular"
        assert api.client.get("/similar-users/u3").status_code == 404
        others = api.client.get("/similar-users/u5", params={"k": 59}).json()["similar"]
        assert "u3" not in [o["user"] for o in others] and len(others) == 58
        scorer = api.client.app.state.scorer  # type: ignore[attr-defined]
        assert len(scorer.known.by_row.of(scorer.fold._user_index["u3"])) == 0
        assert api.client.delete("/users/nobody", headers=AUTH).status_code == 404
    with _app(tiny_artifact, durable_redis) as again:  # a fresh process replays it
        assert again.client.post("/predict", json={"user": "u3", "items": ITEMS}).status_code == 404
        assert again.client.get("/health").json()["skipped_entries"] == 0


def _wait_for(check, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_worker_starts_from_the_fold_in_snapshot_and_replays_only_what_follows(
    tiny_artifact: Path, durable_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    users = ["snapper", "u5", "latecomer"]
    with _app(tiny_artifact, durable_redis, snapshot_interval_s=3600) as api:
        first = (
            _ratings("snapper", [("i1", 5), ("i2", 1)])["ratings"]
            + _ratings("u5", [("i0", 1), ("i7", 2)])["ratings"]
        )
        _write(api.client, {"ratings": [*first, {"user": "u5", "item": "gadget", "rating": 4}]})  # a new item
        # No snapshot stored yet: the first is due at once; the next only after an hour or 50,000 ratings.
        _wait_for(lambda: api.metric("dcmc_fold_in_snapshots_total", event="written") == 1)
        last = _write(api.client, _ratings("latecomer", [("i3", 4), ("i4", 2)]))  # the tail
        last = _write(api.client, _ratings("snapper", [("i9", 3)]))
        answers = {user: _predict(api.client, user, after=last) for user in users}
        assert api.metric("dcmc_fold_in_snapshots_total", event="written") == 1
    with (
        caplog.at_level(logging.INFO, logger="service.replication"),
        _app(tiny_artifact, durable_redis) as restarted,
    ):
        assert restarted.metric("dcmc_fold_in_snapshots_total", event="restored") == 1
        assert restarted.metric("dcmc_ratings_applied_total") == 3  # the tail's entries alone
        for user in users:
            np.testing.assert_allclose(_predict(restarted.client, user), answers[user], rtol=0, atol=1e-9)
    assert any("started from the fold-in snapshot of 5 online writes" in r.message for r in caplog.records)
    # A damaged snapshot is not trusted: the worker replays the whole stream, to the same answers.
    client = redis.Redis.from_url(durable_redis.url)
    (part,) = client.keys("dcmc:ratings:snapshot-part:*")  # a small payload: one part
    client.set(part, b"not the payload", keepttl=True)
    client.close()
    with (
        caplog.at_level(logging.WARNING, logger="service.scoring"),
        _app(tiny_artifact, durable_redis) as again,
    ):
        assert again.metric("dcmc_fold_in_snapshots_total", event="ignored") == 1
        assert again.metric("dcmc_ratings_applied_total") == 8
        for user in users:
            np.testing.assert_allclose(_predict(again.client, user), answers[user], rtol=0, atol=1e-9)
    assert any("does not match its checksum" in r.message for r in caplog.records)


def test_a_snapshot_of_other_settings_or_another_stream_is_not_used(
    tiny_artifact: Path, durable_redis: RedisServer
) -> None:
    with _app(tiny_artifact, durable_redis, snapshot_interval_s=3600) as api:
        last = _write(api.client, _ratings("snapper", [("i1", 5), ("i2", 1)]))
        _wait_for(lambda: api.metric("dcmc_fold_in_snapshots_total", event="written") == 1)
        answer = _predict(api.client, "snapper", after=last)
    # Other inference settings shape another state: that worker keeps its own snapshot key.
    other = {"inference": {"crf": {"gamma": 2.0}}}
    with _app(tiny_artifact, durable_redis, **other) as changed:
        assert changed.metric("dcmc_fold_in_snapshots_total", event="restored") == 0
        assert changed.metric("dcmc_ratings_applied_total") == 2
    # The stream emptied and begun again (another identity): the snapshot is of the old one.
    client = redis.Redis.from_url(durable_redis.url)
    client.delete("dcmc:ratings", "dcmc:ratings:identity")
    client.close()
    with _app(tiny_artifact, durable_redis, snapshot_interval_s=3600) as fresh:
        assert fresh.metric("dcmc_fold_in_snapshots_total", event="ignored") == 1
        assert fresh.client.post("/predict", json={"user": "snapper", "items": ITEMS}).status_code == 404
        # and the new stream gets its own snapshot, the old one's count notwithstanding
        _write(fresh.client, _ratings("other", [("i1", 4)]))
        _wait_for(lambda: fresh.metric("dcmc_fold_in_snapshots_total", event="written") == 1)
    with _app(tiny_artifact, durable_redis) as again:
        assert again.metric("dcmc_fold_in_snapshots_total", event="restored") == 1
    assert np.isfinite(answer).all()


def test_after_compaction_a_worker_of_an_older_artifact_folds_in_the_compacted_head(
    tiny_artifact: Path, durable_redis: RedisServer
) -> None:
    from training.compact import compact_stream

    users = ["compacter", "u5", "latecomer"]
    # `exact`: its answers do not depend on the users' indexes (the forgotten user has one in the stream's
    # replay, none from the head), where `paper` draws its random blocks over the matrix as indexed.
    exact = {"inference": {"mode": "exact"}}
    with _app(tiny_artifact, durable_redis, snapshot_interval_s=3600, **exact) as api:
        first = _ratings("compacter", [("i1", 5), ("i2", 1)])["ratings"] + [
            {"user": "u5", "item": "i0", "rating": 1},
            {"user": "u5", "item": "gadget", "rating": 4},  # a new item
            {"user": "leaver", "item": "i3", "rating": 2},
        ]
        _write(api.client, {"ratings": first})
        _wait_for(lambda: api.metric("dcmc_fold_in_snapshots_total", event="written") == 1)  # of 5
        _write(api.client, _ratings("compacter", [("i1", 3)]))  # a re-rating
        r = api.client.delete("/ratings", params={"user": "u5", "item": "i0"}, headers=AUTH)
        assert r.status_code == 200, r.text
        r = api.client.delete("/users/leaver", headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["purged_entries"] == 1  # leaver's rating left the stream with the forget
        up_to = r.json()["last_id"]
        last = _write(api.client, _ratings("latecomer", [("i4", 4)]))  # after the compacted head
        answers = {user: _predict(api.client, user, after=last) for user in users}
    record = compact_stream(durable_redis.url, "dcmc", up_to, levels=[1.0, 2.0, 3.0, 4.0, 5.0])
    assert record["trimmed"] == 7  # the 7 entries left up to the forget; the latecomer's stays
    # The artifact read none of the stream, and the snapshot ends before the head: it is not used.
    with _app(tiny_artifact, durable_redis, snapshot_interval_s=0, **exact) as fresh:
        assert fresh.metric("dcmc_fold_in_snapshots_total", event="ignored") == 1
        assert fresh.metric("dcmc_ratings_applied_total") == 1  # the stream after the head
        for user in users:
            np.testing.assert_allclose(_predict(fresh.client, user), answers[user], rtol=0, atol=1e-9)
        assert fresh.client.post("/predict", json={"user": "leaver", "items": ITEMS}).status_code == 404


def test_an_ensemble_artifact_serves_and_folds_in_like_any_other(
    tmp_path: Path, synthetic_csv: Path, durable_redis: RedisServer
) -> None:
    """`--set ensemble=2`: one fused network of twice the width; the service reads it as any artifact."""
    from model.artifact import load_artifact
    from training.evaluate import predict_ratings
    from training.pipeline import run_training

    out = tmp_path / "pair"
    run_training("csv", synthetic_csv, out, split="random", preset_name="tiny", settings={"ensemble": "2"},
                 progress=False)  # fmt: skip
    artifact = load_artifact(out)
    assert artifact.config.hidden == (64, 32) and artifact.meta["train"]["ensemble"] == 2  # tiny: (32, 16)
    assert artifact.user_embeddings.shape[1] == 32
    with _app(out, durable_redis) as api:
        rows = artifact.users.indices(["u3"] * len(ITEMS))
        expected = predict_ratings(artifact, rows, artifact.items.indices(ITEMS), artifact.inference)
        np.testing.assert_allclose(_predict(api.client, "u3"), expected, rtol=0, atol=1e-12)
        last = _write(api.client, _ratings("fresh", [("i1", 5), ("i2", 1), ("i7", 4)]))
        first = _predict(api.client, "fresh", after=last)
        assert np.isfinite(first).all()
        assert len(api.client.get("/similar-users/fresh", params={"k": 3}).json()["similar"]) == 3
    with _app(out, durable_redis) as restarted:  # the stream replayed through the fused row branch
        np.testing.assert_allclose(_predict(restarted.client, "fresh"), first, rtol=0, atol=1e-12)


def test_an_averaged_artifact_serves_explains_and_folds_in_its_settings_mean(
    tmp_path: Path, tiny_artifact: Path, durable_redis: RedisServer
) -> None:
    """`--set searches=2`: the artifact's two settings (config.json `inference_averaged`) are served as the
    mean of their final distributions, on every path (a cold answer, a cached row, explanations, fold-in,
    a restarted worker's replay)."""
    import shutil

    from model.artifact import AVERAGED, load_artifact, rewritten
    from model.config import InferenceConfig
    from training.evaluate import predict_ratings

    both = {"mode": "exact", "kernel.known": "clamped", "kernel.scaling": "normalized"}
    a = InferenceConfig().with_overrides({**both, "crf.gamma": 2.0, "kernel.same_user": 20.0,
                                          "output.baseline": 0.3})  # fmt: skip
    b = InferenceConfig().with_overrides({**both, "crf.gamma": 0.7, "kernel.co_rating": 50.0})
    out = tmp_path / "averaged"
    shutil.copytree(tiny_artifact, out)
    with rewritten(out) as (_, config):
        config["inference"], config[AVERAGED] = a.to_dict(), [b.to_dict()]
    artifact = load_artifact(out)
    rows, cols = artifact.users.indices(["u3"] * len(ITEMS)), artifact.items.indices(ITEMS)
    expected = predict_ratings(artifact, rows, cols, artifact.settings())
    assert np.abs(expected - predict_ratings(artifact, rows, cols, a)).max() > 1e-3  # not the first alone
    with _app(out, durable_redis) as api:
        for _ in range(3):  # cold, then from the cached row
            np.testing.assert_allclose(_predict(api.client, "u3"), expected, rtol=0, atol=1e-6)
        r = api.client.post("/predict", json={"user": "u3", "items": ITEMS[:3], "explain": True})
        assert r.status_code == 200, r.text
        for p, want in zip(r.json()["predictions"], expected[:3], strict=True):
            assert p["rating"] == pytest.approx(want, abs=1e-6) and len(p["explanation"]["because"]) > 0
        last = _write(api.client, _ratings("fresh", [("i1", 5), ("i2", 1), ("i7", 4)]))
        first = _predict(api.client, "fresh", after=last)
        assert np.isfinite(first).all()
    with _app(out, durable_redis) as restarted:  # the stream replayed into both settings' scorers
        np.testing.assert_allclose(_predict(restarted.client, "fresh"), first, rtol=0, atol=1e-12)
