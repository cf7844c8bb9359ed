"""HTTP API: in process over `create_app` (the `app` fixture) with the shared Redis, and end to end against
a real `dcmc serve` process (the `service` fixture) where the test is about serving over a socket."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from model.artifact import load_artifact
from model.calibration import tempered
from model.config import ConfigError
from tests.service.conftest import App, Service, set_prices, until_filled
from training.evaluate import predict_ratings

ITEMS = ["i3", "i0", "i17", "i42", "i8", "i25", "i31", "i3", "i49", "i11"]


@pytest.mark.parametrize("over", ["process", "http"])
def test_predictions_equal_the_offline_evaluator(
    over: str, app: App, service: Service, tiny_artifact: Path
) -> None:
    client = app.client if over == "process" else service.client
    artifact = load_artifact(tiny_artifact)
    assert artifact.inference.mode == "paper"
    for user in ("u0", "u7", "u59"):
        r = client.post("/predict", json={"user": user, "items": ITEMS, "distribution": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["user"] == user
        assert body["model_version"] == artifact.model_version
        assert [p["item"] for p in body["predictions"]] == ITEMS
        rows = artifact.users.indices([user] * len(ITEMS))
        cols = artifact.items.indices(ITEMS)
        expected = predict_ratings(artifact, rows, cols, artifact.inference)
        got = np.array([p["rating"] for p in body["predictions"]])
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
        levels = artifact.levels
        assert ((got >= levels[0]) & (got <= levels[-1])).all()
        dist = np.array([p["distribution"] for p in body["predictions"]])
        np.testing.assert_allclose(dist.sum(axis=1), 1.0, atol=1e-9)
        # The served distribution is tempered by the artifact's calibration (model/calibration.py); the
        # rating is the expected rating of the untempered one.
        temperature = float((artifact.meta.get("calibration") or {}).get("temperature", 1.0))
        np.testing.assert_allclose(tempered(dist, 1 / temperature) @ levels, got, atol=1e-9)


def test_distribution_is_omitted_unless_asked(app: App) -> None:
    r = app.client.post("/predict", json={"user": "u1", "items": ["i1", "i2"]})
    assert r.status_code == 200
    assert all("distribution" not in p for p in r.json()["predictions"])


def test_similar_users_equal_a_brute_force_ranking(app: App, tiny_artifact: Path) -> None:
    artifact = load_artifact(tiny_artifact)
    emb = artifact.user_embeddings.astype(np.float64)
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    for user, k in (("u0", 10), ("u33", 5), ("u12", 59), ("u12", 100)):
        r = app.client.get(f"/similar-users/{user}", params={"k": k})
        assert r.status_code == 200, r.text
        i = artifact.users.index(user)
        scores = {artifact.users.external(j): (1 + unit[i] @ unit[j]) / 2 for j in range(len(unit)) if j != i}
        ranking = sorted(scores, key=lambda u: -scores[u])[: min(k, len(unit) - 1)]
        got = r.json()["similar"]
        assert [s["user"] for s in got] == ranking
        np.testing.assert_allclose([s["score"] for s in got], [scores[u] for u in ranking], atol=1e-12)


@pytest.mark.parametrize("over", ["process", "http"])
def test_ops_routes(over: str, app: App, service: Service, redis_client: redis.Redis) -> None:
    api: App | Service = app if over == "process" else service
    assert api.client.get("/ready").json()["ready"] is True
    health = api.client.get("/health").json()
    assert health == {
        "status": "ok",
        "model_version": health["model_version"],
        "redis": "ok",
        # as the shared Redis is set up (test_online.py checks both ways on servers of its own)
        "durable": (redis_client.config_get("appendonly"), redis_client.config_get("appendfsync"))
        == ({"appendonly": "yes"}, {"appendfsync": "always"}),
        "durability": health["durability"],
        "writes": "off: no DCMC_WRITE_TOKEN",
        "ready": True,
        "replication": {
            "phase": "following",
            "ready": True,
            "reason": None,
            "applied_up_to": health["replication"]["applied_up_to"],
            "gaps": 0,
            "lost_gaps": 0,
            "last_gap": None,
            "rebuild": None,
        },
        "online_ratings": 0,
        "catalogue_changes": 0,
        "skipped_entries": 0,
        "last_skipped_entry": None,
        "loading_model_version": None,
        "reload_error": None,
    }
    assert api.client.get("/docs").status_code == 200
    assert "/predict" in api.client.get("/openapi.json").json()["paths"]
    api.client.post("/predict", json={"user": "u1", "items": ["i1"]})
    assert api.metric("dcmc_http_requests_total", route="/predict", method="POST", status="200") >= 1
    assert api.metric("dcmc_http_request_duration_seconds_count", route="/predict", method="POST") >= 1


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"user": "nobody", "items": ["i1"]}, 404, "unknown user id(s): 'nobody'"),
        ({"user": "u1", "items": ["i1", "zz", "yy", "zz"]}, 404, "unknown item id(s): 'zz', 'yy'"),
        ({"user": "u1", "items": []}, 422, "at least 1 item"),
        ({"user": "u1", "items": ["i1"] * 1001}, 422, "at most 1000"),
        ({"user": True, "items": ["i1"]}, 422, "valid string or integer id"),
        ({"user": "u1", "items": "i1"}, 422, "valid list"),
        ({"user": "u1", "items": [None]}, 422, "valid string"),
        ({"user": "u1"}, 422, "Field required"),
        ({"user": "u1", "items": ["i1"], "distribution": "maybe"}, 422, "valid boolean"),
        ({"user": "u1", "items": ["i1"], "extra": 1}, 422, "Extra inputs"),
        ([1, 2], 422, "valid dictionary"),
    ],
)
def test_predict_rejects_bad_input(app: App, body: object, status: int, needle: str) -> None:
    r = app.client.post("/predict", json=body)
    assert r.status_code == status, r.text
    assert needle in r.text


def test_unknown_user_and_items_are_listed_together(app: App) -> None:
    r = app.client.post("/predict", json={"user": "nobody", "items": ["i1", "zz"]})
    assert r.status_code == 404
    assert r.json()["detail"]["unknown_users"] == ["nobody"]
    assert r.json()["detail"]["unknown_items"] == ["zz"]


def test_malformed_json_is_a_422(app: App) -> None:
    r = app.client.post("/predict", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert "JSON decode error" in r.text


@pytest.mark.parametrize(
    ("path", "status", "needle"),
    [
        ("/similar-users/nobody", 404, "unknown user id(s): 'nobody'"),
        ("/similar-users/u1?k=0", 422, "k must lie in 1..100"),
        ("/similar-users/u1?k=101", 422, "k must lie in 1..100"),
        ("/similar-users/u1?k=ten", 422, "valid integer"),
        ("/no-such-route", 404, "Not Found"),
    ],
)
def test_get_routes_reject_bad_input(app: App, path: str, status: int, needle: str) -> None:
    r = app.client.get(path)
    assert r.status_code == status, r.text
    assert needle in r.text


def test_two_hundred_concurrent_requests_all_succeed(service: Service) -> None:
    async def fire() -> list[int]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=service.url, timeout=60, limits=limits) as client:
            bodies = [
                {"user": f"u{n % 60}", "items": [f"i{(n + j) % 50}" for j in range(20)]} for n in range(200)
            ]
            calls = [client.post("/predict", json=body) for body in bodies]
            return [r.status_code for r in await asyncio.gather(*calls)]

    assert asyncio.run(fire()) == [200] * 200


@pytest.mark.parametrize(
    "kernel",
    [
        {"scaling": "normalized", "known": "predicted"},
        {"scaling": "sum", "known": "clamped"},
        {"known": "clamped", "same_user": 3.0, "same_item": 1.0},
        {"known": "clamped", "co_rating": 50.0, "co_rating_power": 3.0},
        {"known": "clamped", "co_rating": 50.0, "co_rating_user": 30.0, "co_rating_prior": 0.5},
        {"known": "clamped", "same_user": 3.0, "same_item": 1.0, "baseline": 0.4},
    ],
)
def test_exact_predictions_equal_the_offline_evaluator(tiny_artifact: Path, kernel: dict[str, Any]) -> None:
    # The overrides travel as the service reads them: DCMC_INFERENCE__<GROUP>__<NAME>, nested.
    # (the baseline's penalty only where a baseline is mixed in: it is read only then)
    output = {"baseline": kernel.pop("baseline"), "baseline_user_shrink": 1.5} if "baseline" in kernel else {}
    # gamma 2 with normalized messages; summed messages over every known entry already saturate at the
    # model's gamma, so that case keeps it
    crf = {"gamma": 2.0} if kernel.get("scaling") != "sum" else {}
    nested = {"mode": "exact", "crf": crf, "kernel": kernel, "output": output}
    with App(tiny_artifact, inference=nested) as api:
        artifact = load_artifact(tiny_artifact)
        set_prices(api, 3, len(ITEMS))  # the first requests are misses, answered for their items alone
        r = api.client.post("/predict", json={"user": "u5", "items": ITEMS})
        assert r.status_code == 200, r.text
        assert r.json()["inference"] == "exact"
        flat = {f"{g}.{k}": v for g, sub in nested.items() if isinstance(sub, dict) for k, v in sub.items()}
        inference = artifact.inference.with_overrides({"mode": "exact", **flat})
        rows, cols = artifact.users.indices(["u5"] * len(ITEMS)), artifact.items.indices(ITEMS)
        expected = predict_ratings(artifact, rows, cols, inference)
        got = np.array([p["rating"] for p in r.json()["predictions"]])
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)

        # Misses count until they add up to the row's cost; the one that does computes the row, the next
        # reads it.
        def again() -> list[float]:
            r = api.client.post("/predict", json={"user": "u5", "items": ITEMS})
            return [p["rating"] for p in r.json()["predictions"]]

        # (a row without the fused path reads the catalogue's item embeddings in float32: to about 1e-7)
        fused = kernel.get("known") == "clamped"
        for answer in [*until_filled(api, again), again()]:
            np.testing.assert_allclose(answer, expected, rtol=0, atol=1e-9 if fused else 1e-6)
        assert api.metric("dcmc_user_rows_total", event="hit") == 1
        none = predict_ratings(artifact, rows, cols, inference.with_overrides({"mode": "none"}))
        assert not np.allclose(got, none)  # the known entries' messages do move the predictions
        # Each override reaches the answer: with any one of them back at its default, the answer changes
        # (summed messages saturate the tiny model's CRF whatever the rest, so that case checks parity only).
        for name in flat if kernel.get("scaling") != "sum" else ():
            group, _, setting = name.partition(".")
            default = type(getattr(inference, group)).model_fields[setting].default
            if default != flat[name]:
                off = inference.with_overrides({name: default})
                assert not np.allclose(got, predict_ratings(artifact, rows, cols, off)), name


def test_an_unknown_inference_override_stops_start_up(tiny_artifact: Path) -> None:
    message = re.escape("unknown inference setting 'crf.gama'; valid: mode, crf.gamma")
    with pytest.raises(ConfigError, match=message), App(tiny_artifact, inference={"crf": {"gama": 1.0}}):
        pass


def test_an_oversized_body_is_refused_before_parsing(tiny_artifact: Path) -> None:
    with App(tiny_artifact, max_body_bytes=2000) as api:
        body = json.dumps({"user": "u1", "items": ["i1"] * 500}).encode()  # ~3.5 kB of valid JSON
        r = api.client.post("/predict", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted while it streams in
            yield body[:1500]
            yield body[1500:]

        r = api.client.post("/predict", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        small = {"user": "u1", "items": ["i1", "i2"]}
        assert api.client.post("/predict", json=small).status_code == 200


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b'{"user": "u1", "items": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),  # deeply nested
        (b'{"user": "u1\xff\xfe", "items": ["i1"]}', 400),  # not UTF-8
        (b'{"user": 1' + b"0" * 5000 + b', "items": ["i1"]}', 400),  # an integer of 5000 digits
        (b'{"user": "' + b"x" * 10_000 + b'", "items": ["i1"]}', 422),  # an id of 10k characters
        (b'{"user": "u1", "items": ["' + b"y" * 10_000 + b'"]}', 422),
        (b'{"user": "u1", "items": ["i1"], "distribution": NaN}', 422),
    ],
)
def test_hostile_bodies_get_a_clear_4xx(app: App, body: bytes, status: int) -> None:
    r = app.client.post("/predict", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text[:300]
    assert "detail" in r.json()


def test_a_repeated_item_is_answered_at_each_place(app: App) -> None:
    r = app.client.post("/predict", json={"user": "u1", "items": ["i2", "i1", "i2"]})
    assert r.status_code == 200, r.text
    got = r.json()["predictions"]
    assert [p["item"] for p in got] == ["i2", "i1", "i2"] and got[0] == got[2]
