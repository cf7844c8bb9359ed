"""GET /recommend/{user_id}: in process over `create_app` (the `app` fixture) with the shared Redis."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from model.artifact import Artifact, load_artifact
from model.config import InferenceConfig
from tests.service.conftest import App
from training.evaluate import predict_ratings

EXACT: dict[str, Any] = {"mode": "exact", "kernel": {"known": "clamped", "co_rating": 50.0}}


def mount(api: App) -> App:
    """The app as create_app builds it (which routes /recommend)."""
    return api


@pytest.fixture(scope="module")
def api(app: App) -> App:
    return mount(app)


@pytest.fixture(scope="module")
def artifact(tiny_artifact: Path) -> Artifact:
    return load_artifact(tiny_artifact)


def expected_ranking(
    artifact: Artifact, user: str, inference: InferenceConfig | None = None
) -> tuple[list[str], dict[str, float]]:
    """Brute force: every item the user has not rated, by predicted rating (all items in one call), ties
    by item index; and the predicted rating of every item."""
    n = len(artifact.items)
    u = artifact.users.index(user)
    ratings = predict_ratings(artifact, np.full(n, u), np.arange(n), inference or artifact.inference)
    ratings = np.clip(ratings, artifact.levels[0], artifact.levels[-1])
    known = artifact.known()
    rated = {int(c) for r, c in zip(known.rows, known.cols, strict=True) if r == u}
    unrated = sorted((j for j in range(n) if j not in rated), key=lambda j: (-ratings[j], j))
    return [artifact.items.external(j) for j in unrated], {
        artifact.items.external(j): float(ratings[j]) for j in range(n)
    }


def rated_ids(artifact: Artifact, user: str) -> set[str]:
    known = artifact.known()
    u = artifact.users.index(user)
    return {artifact.items.external(int(c)) for r, c in zip(known.rows, known.cols, strict=True) if r == u}


def popular_ranking(artifact: Artifact) -> tuple[list[str], dict[str, float]]:
    """Brute force: items by (sum + 10 mu) / (n + 10), ties by item index, with their scores."""
    known = artifact.known()
    mu = sum(known.values.tolist()) / len(known)
    per_item: dict[int, list[float]] = defaultdict(list)
    for c, v in zip(known.cols.tolist(), known.values.tolist(), strict=True):
        per_item[c].append(v)
    n = len(artifact.items)
    score = {j: (sum(per_item[j]) + 10 * mu) / (len(per_item[j]) + 10) for j in range(n)}
    order = sorted(range(n), key=lambda j: (-score[j], j))
    return [artifact.items.external(j) for j in order], {artifact.items.external(j): score[j] for j in order}


def check(
    body: dict[str, Any], user: str, ranking: list[str], ratings: dict[str, float], atol: float = 1e-12
) -> None:
    assert list(body) == ["user", "model_version", "inference", "recommendations", "recommendation_id"]
    assert re.fullmatch("[0-9a-f]{32}", body["recommendation_id"])
    assert body["user"] == user
    assert [r["item"] for r in body["recommendations"]] == ranking
    np.testing.assert_allclose(
        [r["rating"] for r in body["recommendations"]], [ratings[i] for i in ranking], rtol=0, atol=atol
    )


def test_recommendations_equal_a_brute_force_ranking(api: App, artifact: Artifact) -> None:
    for user, k in (("u0", 10), ("u7", 1), ("u59", 100)):
        r = api.client.get(f"/recommend/{user}", params={"k": k})
        assert r.status_code == 200, r.text
        ranking, ratings = expected_ranking(artifact, user)
        body = r.json()
        assert body["model_version"] == artifact.model_version
        assert body["inference"] == "paper"
        check(body, user, ranking[:k], ratings)
        assert not {x["item"] for x in body["recommendations"]} & rated_ids(artifact, user)
    # k beyond the unrated items: all of them; k defaults to 10
    r = api.client.get("/recommend/u59", params={"k": 100})
    assert len(r.json()["recommendations"]) == len(artifact.items) - len(rated_ids(artifact, "u59")) < 100
    assert len(api.client.get("/recommend/u3").json()["recommendations"]) == 10


def test_allow_list_and_exclude(api: App, artifact: Artifact) -> None:
    user = "u4"
    ranking, ratings = expected_ranking(artifact, user)
    rated = rated_ids(artifact, user)
    allow = ranking[::2] + sorted(rated)[:5]  # rated items stay out even when allowed
    exclude = [allow[0], allow[3], ranking[1]]
    r = api.client.get(f"/recommend/{user}", params={"items": ",".join(allow), "k": 100})
    assert r.status_code == 200, r.text
    check(r.json(), user, [i for i in ranking if i in allow], ratings)
    r = api.client.get(
        f"/recommend/{user}", params={"items": " , ".join(allow), "exclude": ",".join(exclude)}
    )
    assert r.status_code == 200, r.text
    check(r.json(), user, [i for i in ranking if i in allow and i not in exclude][:10], ratings)
    r = api.client.get(f"/recommend/{user}", params={"exclude": ",".join(exclude), "k": 3})
    check(r.json(), user, [i for i in ranking if i not in exclude][:3], ratings)
    # nothing left: an empty list
    r = api.client.get(f"/recommend/{user}", params={"items": ",".join(sorted(rated)[:3])})
    assert r.status_code == 200, r.text
    assert r.json()["recommendations"] == []


def test_unknown_user_gets_popular_items(api: App, artifact: Artifact) -> None:
    ranking, scores = popular_ranking(artifact)
    r = api.client.get("/recommend/nobody", params={"k": 7})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body.pop("fallback") == "popular"
    check(body, "nobody", ranking[:7], scores)
    exclude, allow = ranking[:2], ranking[1:30:3]
    r = api.client.get("/recommend/nobody", params={"items": ",".join(allow), "exclude": ",".join(exclude)})
    body = r.json()
    assert body.pop("fallback") == "popular"
    check(body, "nobody", [i for i in ranking if i in allow and i not in exclude][:10], scores)


def test_a_user_without_ratings_gets_popular_items(
    api: App, artifact: Artifact, monkeypatch: pytest.MonkeyPatch
) -> None:
    scorer = api.client.app.state.scorer  # type: ignore[attr-defined]
    monkeypatch.setattr(scorer, "rated_items", lambda user, state=None: np.empty(0, dtype=np.int64))
    ranking, scores = popular_ranking(artifact)
    body = api.client.get("/recommend/u0", params={"k": 5}).json()
    assert body.pop("fallback") == "popular"
    check(body, "u0", ranking[:5], scores)


@pytest.mark.parametrize(
    ("path", "status", "detail"),
    [
        (
            "/recommend/u1?items=i1,zz,i2&exclude=yy,zz",
            404,
            {"msg": "unknown item id(s): 'zz', 'yy'", "unknown_items": ["zz", "yy"]},
        ),
        (
            "/recommend/nobody?exclude=qq",
            404,
            {"msg": "unknown item id(s): 'qq'", "unknown_items": ["qq"]},
        ),
        *[
            (
                f"/recommend/u1?k={k}",
                422,
                [
                    {
                        "loc": ["query", "k"],
                        "type": "out_of_range",
                        "msg": f"k must lie in 1..100 (setting DCMC_MAX_K), got {k}",
                    }
                ],
            )
            for k in (0, 101, -3)
        ],
        (
            "/recommend/u1?items=,",
            422,
            [{"loc": ["query", "items"], "type": "too_short", "msg": "items lists no item ids"}],
        ),
        (
            "/recommend/u1?items=i1&items=i2",
            422,
            [
                {
                    "loc": ["query", "items"],
                    "type": "repeated",
                    "msg": "items is given 2 times; pass one comma-separated list (items=i1,i2)",
                }
            ],
        ),
    ],
)
def test_bad_requests(api: App, path: str, status: int, detail: object) -> None:
    r = api.client.get(path)
    assert r.status_code == status, r.text
    assert r.json() == {"detail": detail}


def test_k_must_be_an_integer(api: App) -> None:
    r = api.client.get("/recommend/u1?k=ten")
    assert r.status_code == 422
    assert "valid integer" in r.text


@pytest.fixture(scope="module")
def exact_api(tiny_artifact: Path) -> Iterator[App]:
    with App(tiny_artifact, inference=EXACT) as api:
        yield mount(api)


def test_exact_mode_ranking_and_openapi(exact_api: App, artifact: Artifact) -> None:
    flat = {f"kernel.{k}": v for k, v in EXACT["kernel"].items()}
    inference = artifact.inference.with_overrides({"mode": "exact", **flat})
    ranking, ratings = expected_ranking(artifact, "u5", inference)
    r = exact_api.client.get("/recommend/u5", params={"k": 12, "exclude": ranking[0]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["inference"] == "exact"
    check(body, "u5", ranking[1:13], ratings, atol=1e-6)  # the catalogue's read is float32
    spec = exact_api.client.get("/openapi.json").json()
    op = spec["paths"]["/recommend/{user_id}"]["get"]
    assert op["tags"] == ["recommendations"]
    assert {p["name"] for p in op["parameters"]} == {
        "user_id",
        "k",
        "items",
        "exclude",
        "category",
        "exclude_category",
        "diversity",
        "min_rating",
        "after",
        "explain",
        "authorization",
    }
    assert "comma-separated" in op["description"]
    schema = spec["components"]["schemas"]["RecommendResponse"]
    assert set(schema["properties"]) == {
        "user",
        "model_version",
        "inference",
        "fallback",
        "rules",
        "filter_notes",
        "recommendations",
        "recommendation_id",
        "experiment",
        "variant",
    }


def test_top_k_equals_a_full_sort_with_ties_by_index() -> None:
    from service.scoring import top_k

    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 60))
        scores = rng.integers(0, 6, n).astype(np.float64)  # many ties, at the cut too
        mask = rng.random(n) < 0.7
        k = int(rng.integers(0, n + 3))
        cand = np.flatnonzero(mask)
        expected = cand[np.lexsort((cand, -scores[cand]))][:k]
        np.testing.assert_array_equal(top_k(scores, mask, k), expected)


def test_popular_scores_read_the_ratings_alone_after_re_ratings() -> None:
    # Re-rated and taken-back pairs leave positions that hold no rating: the shrunk means skip them.
    from model.ratings import Ratings
    from service.recommend import shrunk_means

    known = Ratings(np.array([0, 1, 2, 0]), np.array([0, 0, 1, 2]), np.array([1.0, 2.0, 5.0, 4.0]), 4, 3)
    changed = known.changed(
        np.array([0]), np.array([5.0]), np.array([3]), np.array([1]), np.array([3.0]), 4, 3, np.array([3])
    )
    want = Ratings(np.array([1, 2, 3, 0]), np.array([0, 1, 1, 0]), np.array([2.0, 5.0, 3.0, 5.0]), 4, 3)
    np.testing.assert_allclose(shrunk_means(changed, 3), shrunk_means(want, 3), rtol=1e-12)
    mu = 15.0 / 4
    assert shrunk_means(changed, 3)[2] == pytest.approx(mu)  # its one rating taken back
