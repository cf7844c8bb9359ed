"""Explanations over HTTP: POST /predict and GET /recommend with `explain`, their fallbacks, the modes that
cannot explain, and an online rating that shows up in its user's explanations. These read as the write
token's holder (every rating named); what others see: test_privacy.py."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from model.artifact import load_artifact
from tests.service.conftest import REDIS_URL, App

TOKEN = "explain-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXACT = {
    "mode": "exact",
    "kernel": {"known": "clamped", "same_user": 20.0, "same_item": 5.0, "co_rating": 50.0},
    "output": {"baseline": 0.3},
}
ITEMS = ["i1", "i7", "i30", "i42"]


def _app(artifact: Path, inference: dict[str, Any] = EXACT, **settings: Any) -> App:
    prefix = f"dcmc-test-explain-{uuid.uuid4().hex[:8]}"
    return App(artifact, redis_url=REDIS_URL, redis_key_prefix=prefix, write_token=TOKEN, inference=inference,
               **settings)  # fmt: skip


def _predict(api: App, body: dict[str, Any], after: str | None = None) -> Any:
    r = api.client.post("/predict", json=body, params={"after": after} if after else None, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()["predictions"]


def test_each_prediction_says_which_known_ratings_moved_it(
    tiny_artifact: Path, redis_client: redis.Redis
) -> None:
    art = load_artifact(tiny_artifact)
    known = art.known()
    rated = {art.items.ids[j] for j in known.cols[known.by_row.of(art.users.indices(["u4"])[0])]}
    with _app(tiny_artifact, explain_k=3) as api:
        plain = _predict(api, {"user": "u4", "items": ITEMS})
        explained = _predict(api, {"user": "u4", "items": ITEMS, "explain": True})
        for p, q in zip(plain, explained, strict=True):
            assert "explanation" not in p
            assert q["rating"] == pytest.approx(p["rating"], abs=1e-9)  # explaining changes no answer
            why = q["explanation"]
            assert set(why) == {"network", "because"} and 1.0 <= why["network"] <= 5.0
            because = why["because"]
            assert len(because) == 3
            assert all(set(b) == {"user", "item", "rating", "effect"} for b in because)
            effects = [abs(b["effect"]) for b in because]
            assert effects == sorted(effects, reverse=True) and effects[0] > 0
            assert not any(b["user"] == "u4" and b["item"] == q["item"] for b in because)  # never itself
            # the same-user term weighs the user's own ratings by lambda_u: they lead
            assert any(b["user"] == "u4" and b["item"] in rated for b in because)


def test_a_recommendation_is_explained_and_the_popular_list_says_why(
    tiny_artifact: Path, redis_client: redis.Redis
) -> None:
    with _app(tiny_artifact) as api:
        r = api.client.get("/recommend/u4", params={"k": 3, "explain": "true"}, headers=AUTH)
        assert r.status_code == 200, r.text
        recs = r.json()["recommendations"]
        assert len(recs) == 3 and all(len(rec["explanation"]["because"]) == 5 for rec in recs)
        direct = _predict(api, {"user": "u4", "items": [rec["item"] for rec in recs], "explain": True})
        for rec, p in zip(recs, direct, strict=True):
            assert [b["effect"] for b in rec["explanation"]["because"]] == pytest.approx(
                [b["effect"] for b in p["explanation"]["because"]], abs=1e-9
            )
        stranger = api.client.get("/recommend/nobody-at-all", params={"k": 2, "explain": "true"}).json()
        assert stranger["fallback"] == "popular"
        assert all(rec["explanation"]["reason"].startswith("popular:") for rec in stranger["recommendations"])
        plain = api.client.get("/recommend/u4", params={"k": 3}).json()["recommendations"]
        assert all("explanation" not in rec for rec in plain)


@pytest.mark.parametrize("mode", ["paper", "none"])
def test_modes_that_cannot_explain_answer_422(
    tiny_artifact: Path, redis_client: redis.Redis, mode: str
) -> None:
    with _app(tiny_artifact, inference={"mode": mode}) as api:
        r = api.client.post("/predict", json={"user": "u4", "items": ITEMS, "explain": True})
        assert r.status_code == 422, r.text
        assert f"mode '{mode}' cannot explain" in r.json()["detail"][0]["msg"]
        assert api.client.post("/predict", json={"user": "u4", "items": ITEMS}).status_code == 200
        r = api.client.get("/recommend/u4", params={"explain": "true"})
        assert r.status_code == 422 and "cannot explain" in r.text


def test_an_online_rating_appears_in_its_users_explanations(
    tiny_artifact: Path, redis_client: redis.Redis
) -> None:
    with _app(tiny_artifact, explain_k=1000) as api:
        ratings = [("newcomer", "i7", 5), ("u4", "i8", 1), ("stranger", "brand-new", 4)]
        body = {"ratings": [{"user": u, "item": i, "rating": v} for u, i, v in ratings]}
        r = api.client.post("/ratings", json=body, headers=AUTH)
        assert r.status_code == 200, r.text
        after = r.json()["last_id"]
        for user, item, rating in (("newcomer", "i7", 5.0), ("u4", "i8", 1.0)):
            (p,) = _predict(api, {"user": user, "items": ["i30"], "explain": True}, after)
            mine = [b for b in p["explanation"]["because"] if b["user"] == user and b["item"] == item]
            assert len(mine) == 1 and mine[0]["rating"] == rating and abs(mine[0]["effect"]) > 0
        # a new item nobody the network knows has rated: the bias baseline answers, and says so
        (p,) = _predict(api, {"user": "u4", "items": ["brand-new"], "explain": True}, after)
        assert p["fallback"] == "baseline" and p["explanation"]["reason"].startswith("baseline:")
        assert "because" not in p["explanation"]
        np.testing.assert_array_less(0.0, p["rating"])
