"""The per-user row cache (service.rows.UserRows): admission on a second miss, the byte budget, a new
model state emptying it or, within DCMC_ANSWER_STALENESS_S, a row of an earlier state answering while the
user's own version holds, and answers equal to the uncached path's before and after online ratings."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.rows import UserRow, UserRows
from tests.service.conftest import App, RedisServer, set_prices, until_filled

TOKEN = "rows-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ITEMS = [f"i{j}" for j in range(0, 50, 3)]
FEW = [f"i{j}" for j in range(1, 50, 5)]
EXACT = {
    "mode": "exact",
    "kernel": {"co_rating": 50.0, "co_rating_user": 50.0, "same_item": 1.0},
    "output": {"baseline": 0.4},  # a cached row keeps the CRF and the baseline apart: mixed when read
}


@dataclass
class FakeState:
    applied: int
    published: float = field(default_factory=time.monotonic)
    versions: dict[int, tuple[int, int]] = field(default_factory=dict)

    def user_version(self, user: int) -> tuple[int, int]:
        return self.versions.get(user, (0, 0))


def _row(n: int) -> UserRow:
    return UserRow(np.zeros(n), np.zeros((n, 5)), np.zeros(n, dtype=bool), False)


def _unread(rows: UserRows, state: FakeState) -> None:
    """PAYBACK_ROWS rows of other users that ended unread (replaced): rows do not pay back, a return buys
    none."""
    for user in range(10_000, 10_000 + UserRows.PAYBACK_ROWS):
        rows.put(state, user, _row(10))  # type: ignore[arg-type]
        rows.put(state, user, _row(10))  # type: ignore[arg-type]  # the first ended unread
    assert rows.hits_per_row == 0


def test_a_row_is_computed_once_the_misses_of_a_state_add_up_to_its_size() -> None:
    rows, state = UserRows(10**6), FakeState(0)
    _unread(rows, state)
    assert not rows.admit(state, 7, 40, 100)  # type: ignore[arg-type]
    assert not rows.admit(state, 7, 40, 100)  # type: ignore[arg-type]  # 80 of the row's 100 entries
    assert not rows.admit(state, 8, 90, 100)  # type: ignore[arg-type]  # each user's misses on their own
    assert rows.admit(state, 7, 40, 100)  # type: ignore[arg-type]  # 120 >= 100: the row is worth it
    assert not rows.admit(state, 9, 100, 100)  # type: ignore[arg-type]  # a first miss never buys
    rows.put(state, 7, _row(10))  # type: ignore[arg-type]
    assert rows.get(state, 7) is not None  # type: ignore[arg-type]
    newer = FakeState(1)
    assert rows.get(newer, 7) is None  # type: ignore[arg-type]
    assert not rows.admit(newer, 8, 90, 100)  # type: ignore[arg-type]  # a new state: misses count anew
    assert len(rows) == 0  # (rows last one state here: every row went)
    rows.put(state, 8, _row(10))  # type: ignore[arg-type]  # a request still on the old state
    assert len(rows) == 0 and rows.get(state, 8) is None  # type: ignore[arg-type]


def test_a_return_buys_a_row_while_rows_pay_back() -> None:
    rows, state = UserRows(10**9), FakeState(0)
    # Before any row ended: a user's second miss buys one.
    assert [rows.admit(state, 1, 10, 100) for _ in range(2)] == [False, True]  # type: ignore[arg-type]
    for user in range(UserRows.PAYBACK_ROWS):  # rows read 20 times each, then replaced: each saved 200
        rows.put(state, user, _row(10))  # type: ignore[arg-type]
        for _ in range(20):
            assert rows.get(state, user) is not None  # type: ignore[arg-type]
        rows.put(state, user, _row(10))  # type: ignore[arg-type]
    assert rows.hits_per_row == 20
    assert [rows.admit(state, 100, 10, 100) for _ in range(2)] == [False, True]  # type: ignore[arg-type]
    # Misses that cost less than 1/20 of a row each: the rows' hits did not save a row's cost.
    assert [rows.admit(state, 101, 10, 300) for _ in range(3)] == [False] * 3  # type: ignore[arg-type]
    # Rows that ended unread: the misses must add up to the row's cost.
    idle, fresh = UserRows(10**9), FakeState(0)
    _unread(idle, fresh)
    assert [idle.admit(fresh, 500, 10, 100) for _ in range(10)] == [False] * 9 + [True]  # type: ignore[arg-type]
    # Rows that end with a new state (rows last one state here) count too.
    one = UserRows(10**9)
    for k in range(UserRows.PAYBACK_ROWS):
        one.put(FakeState(k), k, _row(10))  # type: ignore[arg-type]
    assert one.admit(FakeState(UserRows.PAYBACK_ROWS), 5, 10, 100) is False  # type: ignore[arg-type]
    assert one.hits_per_row == 0
    # A budget that dropped a row before PAYBACK_ROWS ended: no return buys one either.
    small = UserRows(2 * _row(10).nbytes)
    for user in range(3):
        small.put(fresh, user, _row(10))  # type: ignore[arg-type]
    assert len(small) == 2
    assert [small.admit(fresh, 7, 10, 30) for _ in range(3)] == [False, False, True]  # type: ignore[arg-type]


def test_a_row_of_an_earlier_state_answers_while_young_and_the_users_version_holds() -> None:
    rows, first = UserRows(10**6, max_age_s=0.3), FakeState(3)
    rows.put(first, 7, _row(10))  # type: ignore[arg-type]
    rows.put(first, 8, _row(10))  # type: ignore[arg-type]
    later = FakeState(5, versions={8: (5, 0)})  # another user's rating; user 8 rated
    held = rows.get(later, 7)  # type: ignore[arg-type]
    assert held is not None and held[1] is True  # of an earlier state
    assert rows.get(later, 7, exact=True) is None  # type: ignore[arg-type]
    assert rows.get(later, 8) is None and len(rows) == 1  # type: ignore[arg-type]  # 8's own changed: gone
    assert rows.get(first, 7) == (held[0], False)  # type: ignore[arg-type]  # its own state: exact
    assert rows.get(FakeState(1), 7) is None  # type: ignore[arg-type]  # a request on an older state
    items = FakeState(6, versions={7: (0, 6)})  # an item was added: user 7's version moved
    assert rows.get(items, 7) is None  # type: ignore[arg-type]
    rows.put(later, 7, _row(10))  # type: ignore[arg-type]
    time.sleep(0.35)
    assert rows.get(FakeState(9), 7) is None and len(rows) == 0  # type: ignore[arg-type]  # too old
    assert rows.admit(FakeState(9), 7, 10, 100)  # type: ignore[arg-type]  # it aged out: bought at once
    assert not rows.admit(FakeState(9), 4, 60, 100)  # type: ignore[arg-type]
    assert rows.admit(FakeState(10), 4, 60, 100)  # type: ignore[arg-type]  # misses add up across states


def test_the_byte_budget_drops_the_least_recently_used_rows() -> None:
    one = _row(100).nbytes
    rows, state = UserRows(3 * one), FakeState(0)
    for user in range(3):
        rows.put(state, user, _row(100))  # type: ignore[arg-type]
    assert rows.get(state, 0) is not None  # type: ignore[arg-type]  # 0 is now the most recent
    rows.put(state, 3, _row(100))  # type: ignore[arg-type]
    assert len(rows) == 3
    assert rows.get(state, 1) is None  # type: ignore[arg-type]
    assert all(rows.get(state, u) is not None for u in (0, 2, 3))  # type: ignore[arg-type]
    rows.put(state, 9, _row(400))  # type: ignore[arg-type]  # larger than the whole budget: not kept
    assert rows.get(state, 9) is None  # type: ignore[arg-type]
    off = UserRows(0)
    assert not off.admit(state, 1, 100, 100) and not off.admit(state, 1, 100, 100)  # type: ignore[arg-type]


@pytest.fixture()
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.kill()


def _app(artifact: Path, server: RedisServer, inference: dict[str, Any] = EXACT, **settings: Any) -> App:
    return App(artifact, redis_url=server.url, write_token=TOKEN, inference=inference, **settings)


def _predict(api: App, user: str, after: str | None = None, items: list[str] = ITEMS) -> np.ndarray:
    params = {"after": after} if after else None
    r = api.client.post("/predict", json={"user": user, "items": items, "distribution": True}, params=params)
    assert r.status_code == 200, r.text
    return np.array([[p["rating"], *p["distribution"]] for p in r.json()["predictions"]])


def test_cached_rows_answer_as_the_uncached_path_before_and_after_a_rating(
    tiny_artifact: Path, redis_server: RedisServer
) -> None:
    with (
        _app(tiny_artifact, redis_server, answer_staleness_s=0) as api,  # every answer of the newest state
        _app(tiny_artifact, redis_server, user_cache_mb=0) as plain,
    ):
        # A row costs three misses here, but the user's second request (a return, while rows pay back)
        # computes it; the next reads it.
        set_prices(api, 3, len(ITEMS))
        answers = until_filled(api, lambda: _predict(api, "u3"))
        assert len(answers) == 2
        answers.append(_predict(api, "u3"))
        assert api.metric("dcmc_user_rows_total", event="fill") == 1
        assert api.metric("dcmc_user_rows_total", event="hit") == 1
        third = answers[-1]
        reference = _predict(plain, "u3")
        assert plain.metric("dcmc_user_rows_total", event="hit") == 0
        for got in answers:
            np.testing.assert_allclose(got, reference, rtol=0, atol=1e-9)
        # Another user's rating moves every answer (the known field is global): the cached row must go.
        r = api.client.post(
            "/ratings",
            json={"ratings": [{"user": "u9", "item": item, "rating": 1} for item in ITEMS[:5]]},
            headers=AUTH,
        )
        assert r.status_code == 200, r.text
        after = _predict(api, "u3", after=r.json()["last_id"])
        assert np.abs(after - third).max() > 1e-6
        assert api.metric("dcmc_user_rows_total", event="hit") == 1  # not answered from the old row
        plain.client.app.state.scorer.replica.catch_up()  # type: ignore[attr-defined]  # its stream reader
        np.testing.assert_allclose(after, _predict(plain, "u3"), rtol=0, atol=1e-9)
        assert len(until_filled(api, lambda: _predict(api, "u3"), fills=2)) == 1  # `after` was the first
        np.testing.assert_allclose(_predict(api, "u3"), after, rtol=0, atol=1e-9)
        assert api.metric("dcmc_user_rows_total", event="hit") == 2


def test_within_the_staleness_a_row_of_an_earlier_state_answers_other_users_ratings_later(
    tiny_artifact: Path, redis_server: RedisServer
) -> None:
    with (
        _app(tiny_artifact, redis_server, answer_staleness_s=1.5) as api,
        _app(tiny_artifact, redis_server, user_cache_mb=0) as plain,
    ):
        set_prices(api, 3, len(ITEMS))  # one miss alone never buys a row
        before = until_filled(api, lambda: _predict(api, "u3"))[-1]  # the last computed the row
        np.testing.assert_allclose(before, _predict(plain, "u3"), rtol=0, atol=1e-9)  # the state's answer
        r = api.client.post(
            "/ratings", json={"ratings": [{"user": "u9", "item": "i1", "rating": 1}]}, headers=AUTH
        )
        assert r.status_code == 200, r.text
        last = r.json()["last_id"]
        newest = _predict(api, "u3", after=last)  # `after`: of the newest state, never an earlier row
        assert np.abs(newest - before).max() > 1e-6
        plain.client.app.state.scorer.replica.catch_up()  # type: ignore[attr-defined]
        np.testing.assert_allclose(newest, _predict(plain, "u3"), rtol=0, atol=1e-9)
        # Without `after`: the row of the state before u9's rating, exactly that state's answer.
        np.testing.assert_allclose(_predict(api, "u3"), before, rtol=0, atol=0)
        assert api.metric("dcmc_user_rows_total", event="stale_hit") == 1
        # u3's own rating reaches its answers at once: its row is of no later state.
        r = api.client.post(
            "/ratings", json={"ratings": [{"user": "u3", "item": "i2", "rating": 5}]}, headers=AUTH
        )
        own = _predict(api, "u3", after=r.json()["last_id"])
        assert api.metric("dcmc_user_rows_total", event="stale_hit") == 1
        plain.client.app.state.scorer.replica.catch_up()  # type: ignore[attr-defined]
        np.testing.assert_allclose(own, _predict(plain, "u3"), rtol=0, atol=1e-9)
        np.testing.assert_allclose(_predict(api, "u3"), own, rtol=0, atol=1e-9)  # not the old row
        assert api.metric("dcmc_user_rows_total", event="stale_hit") == 1
        # Past the staleness no earlier row answers: a new rating of another user, then 1.5 s.
        for _ in range(3):  # a row of this state, if none is held
            _predict(api, "u3")
        r = api.client.post(
            "/ratings", json={"ratings": [{"user": "u8", "item": "i3", "rating": 2}]}, headers=AUTH
        )
        _predict(api, "u3", after=r.json()["last_id"])
        time.sleep(1.6)
        plain.client.app.state.scorer.replica.catch_up()  # type: ignore[attr-defined]
        np.testing.assert_allclose(_predict(api, "u3"), _predict(plain, "u3"), rtol=0, atol=1e-9)


def test_recommend_fills_the_row_that_predict_reads(tiny_artifact: Path, redis_server: RedisServer) -> None:
    with _app(tiny_artifact, redis_server) as api:
        r = api.client.get("/recommend/u4", params={"k": 5})
        assert r.status_code == 200, r.text
        assert api.metric("dcmc_user_rows_total", event="fill") == 1
        rated = {i["item"]: i["rating"] for i in r.json()["recommendations"]}
        got = api.client.post("/predict", json={"user": "u4", "items": list(rated)}).json()["predictions"]
        assert api.metric("dcmc_user_rows_total", event="hit") == 1
        assert [p["rating"] for p in got] == pytest.approx(list(rated.values()), abs=1e-12)


def test_a_cached_row_keeps_the_baseline_of_a_new_item(
    tiny_artifact: Path, redis_server: RedisServer
) -> None:
    with _app(tiny_artifact, redis_server) as api:
        r = api.client.post(
            "/ratings", json={"ratings": [{"user": "stranger", "item": "fresh", "rating": 5}]}, headers=AUTH
        )
        assert r.status_code == 200, r.text
        body = {"user": "u5", "items": ["i1", "fresh"], "distribution": True}
        wait = {"after": r.json()["last_id"]}

        # Until the misses add up to the row's cost, then one from the row.
        def ask() -> list[dict[str, object]]:
            predictions: list[dict[str, object]] = api.client.post("/predict", json=body, params=wait).json()[
                "predictions"
            ]
            return predictions

        answers = [*until_filled(api, ask), ask()]
        assert api.metric("dcmc_user_rows_total", event="fill") == 1
        assert api.metric("dcmc_user_rows_total", event="hit") == 1  # the last came from the row
        for first, fresh in answers:
            assert "fallback" not in first and fresh["fallback"] == "baseline"
        ratings = [[p["rating"] for p in a] for a in answers]
        # (a row reads the whole catalogue's item embeddings in float32: equal to about 1e-7)
        np.testing.assert_allclose(ratings[-1], ratings[0], rtol=0, atol=1e-6)
        dists = [[p["distribution"] for p in a] for a in answers]  # the new item's: the baseline's alone
        np.testing.assert_allclose(dists[-1], dists[0], rtol=0, atol=1e-6)


def test_whole_catalogue_rows_answer_as_misses_in_every_online_state(
    tiny_artifact: Path, redis_server: RedisServer
) -> None:
    # A row over the catalogue (/recommend, no row cache: whole lines in matrix products) equals the
    # fused path's answers for a few items (/predict misses: loops over the queries), before and after
    # random writes (re-ratings, new users, a new item).
    rng = np.random.default_rng(5)
    users = [f"u{k}" for k in range(0, 40, 4)]
    clamped = {**EXACT, "kernel": {**EXACT["kernel"], "known": "clamped"}}  # the fused path's

    def check(api: App, user: str, after: str | None) -> None:
        params = {"k": 8, **({"after": after} if after else {})}
        r = api.client.get(f"/recommend/{user}", params=params)
        assert r.status_code == 200, r.text
        top = {i["item"]: i["rating"] for i in r.json()["recommendations"]}
        fused = _predict(api, user, after, list(top))[:, 0]
        np.testing.assert_allclose(list(top.values()), fused, rtol=0, atol=1e-9)

    with _app(tiny_artifact, redis_server, clamped, user_cache_mb=0) as api:
        for user in users:
            check(api, user, None)
        raters = ["u8", "u20", "newcomer"]
        for step in range(4):
            batch = [
                {
                    "user": raters[k % 3],
                    "item": f"i{int(rng.integers(50))}",
                    "rating": int(rng.integers(1, 6)),
                }
                for k in range(6)
            ]
            if step == 2:
                batch.append({"user": "u20", "item": "brand-new", "rating": 4})
            r = api.client.post("/ratings", json={"ratings": batch}, headers=AUTH)
            assert r.status_code == 200, r.text
            last = r.json()["last_id"]
            for user in users:
                check(api, user, last)
