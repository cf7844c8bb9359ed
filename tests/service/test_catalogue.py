"""The catalogue in the service: GET /items, filters on /recommend and /similar-items (service/catalogue.py),
hidden items, the popular fallback and `strict: false`; in process over `create_app` with the shared Redis,
checked against brute force over the records."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from model.artifact import Artifact, load_artifact, rewritten
from model.catalogue import ItemRecord, write_catalogue
from tests.service.conftest import REDIS_URL, App
from tests.service.test_recommend import expected_ranking, popular_ranking, rated_ids


def record(j: int) -> ItemRecord:
    """Item j's record: categories by residue, a year, a language, tags, a stock flag; every 7th hidden."""
    return ItemRecord(
        title=f"item {j}",
        categories=["odd" if j % 2 else "even", *(["three"] if j % 3 == 0 else [])],
        attributes={
            "year": 1990 + j % 20,
            "lang": "en" if j % 4 < 2 else "fr",
            "tags": [f"t{j % 5}", "all"],
            "in_stock": j % 5 != 0,
        },
        hidden=j % 7 == 0,
    )


@pytest.fixture(scope="module")
def catalogued(tiny_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny artifact with a catalogue: every item but the last three, and one item nobody rated."""
    directory = Path(shutil.copytree(tiny_artifact, tmp_path_factory.mktemp("catalogued") / "artifact"))
    ids = load_artifact(directory).items.ids
    records = {x: record(j) for j, x in enumerate(ids[:-3])}
    records["never-rated"] = ItemRecord(title="not rated yet", categories=["odd"])
    with rewritten(directory) as (tmp, _):
        write_catalogue(tmp, records)
    return directory


@pytest.fixture(scope="module")
def artifact(catalogued: Path) -> Artifact:
    return load_artifact(catalogued)


@pytest.fixture(scope="module")
def api(catalogued: Path, key_prefix: str) -> Iterator[App]:
    with App(catalogued, redis_url=REDIS_URL, redis_key_prefix=f"{key_prefix}:catalogue") as served:
        yield served


def passing(artifact: Artifact, holds: Any) -> set[str]:
    """The item ids whose record `holds` and which are not hidden (brute force over the records)."""
    assert artifact.catalogue is not None
    return {
        x
        for x in artifact.items.ids
        if (r := artifact.catalogue.get(x)) is not None and not r.hidden and holds(r)
    }


def visible(artifact: Artifact) -> set[str]:
    assert artifact.catalogue is not None
    return {x for x in artifact.items.ids if not (x in artifact.catalogue and artifact.catalogue[x].hidden)}


def test_items_are_read_one_by_one_and_by_page(api: App, artifact: Artifact) -> None:
    first = artifact.items.ids[1]
    body = api.client.get(f"/items/{first}").json()
    assert body == {"item": first, **record(1).model_dump(), "in_catalogue": True, "in_model": True}
    last = artifact.items.ids[-1]
    assert api.client.get(f"/items/{last}").json()["in_catalogue"] is False
    assert api.client.get("/items/never-rated").json()["in_model"] is False
    missing = api.client.get("/items/nobody-knows")
    assert missing.status_code == 404 and "nobody-knows" in missing.json()["detail"]["msg"]
    seen: list[str] = []
    cursor: int | None = 0
    while cursor is not None:
        page = api.client.get("/items", params={"cursor": cursor, "limit": 7, "category": "three"}).json()
        seen += [r["item"] for r in page["items"]]
        cursor = page.get("next")
    assert artifact.catalogue is not None
    assert seen == [x for x, r in artifact.catalogue.items() if "three" in r.categories]
    assert page["total"] == len(seen)
    hidden = api.client.get("/items", params={"hidden": "true", "limit": 1000}).json()
    assert {r["item"] for r in hidden["items"]} == {x for x, r in artifact.catalogue.items() if r.hidden}
    assert api.client.get("/items", params={"limit": 0}).status_code == 422


def test_hidden_items_are_never_recommended(api: App, artifact: Artifact) -> None:
    user = artifact.users.ids[0]
    ranking, ratings = expected_ranking(artifact, user)
    shown = visible(artifact)
    want = [x for x in ranking if x in shown][:10]
    body = api.client.get(f"/recommend/{user}", params={"k": 10}).json()
    assert [r["item"] for r in body["recommendations"]] == want
    np.testing.assert_allclose([r["rating"] for r in body["recommendations"]], [ratings[x] for x in want])
    popular, _ = popular_ranking(artifact)
    body = api.client.get("/recommend/a-new-user", params={"k": 10}).json()
    assert body["fallback"] == "popular"
    assert [r["item"] for r in body["recommendations"]] == [x for x in popular if x in shown][:10]
    similar = api.client.get(f"/similar-items/{artifact.items.ids[1]}", params={"k": 40}).json()["similar"]
    assert len(similar) == 40 and not {s["item"] for s in similar} - shown


@pytest.mark.parametrize("user_k", [0, 5])
def test_a_category_filter_is_applied_before_the_top_k_is_cut(
    api: App, artifact: Artifact, user_k: int
) -> None:
    user = artifact.users.ids[user_k]
    ranking, _ = expected_ranking(artifact, user)
    odd_not_three = passing(artifact, lambda r: "odd" in r.categories and "three" not in r.categories)
    want = [x for x in ranking if x in odd_not_three][:5]
    assert len(want) == 5  # k items whenever k pass
    got = api.client.get(
        f"/recommend/{user}", params={"k": 5, "category": "odd", "exclude_category": "three"}
    ).json()
    assert [r["item"] for r in got["recommendations"]] == want
    post = api.client.post(
        "/recommend",
        json={
            "user": user,
            "k": 5,
            "filter": {
                "op": "all",
                "of": [
                    {"op": "category", "any_of": ["odd"]},
                    {"op": "not", "filter": {"op": "category", "any_of": ["three"]}},
                ],
            },
        },
    ).json()
    assert post["recommendations"] == got["recommendations"]


FILTERS: list[tuple[dict[str, Any], Any]] = [
    ({"op": "range", "attribute": "year", "gte": 1995, "lt": 2000},
     lambda r: 1995 <= r.attributes["year"] < 2000),
    ({"op": "eq", "attribute": "lang", "value": "fr"}, lambda r: r.attributes["lang"] == "fr"),
    ({"op": "eq", "attribute": "tags", "value": "t2"}, lambda r: "t2" in r.attributes["tags"]),
    ({"op": "in", "attribute": "year", "values": [1991, 1993.0]},
     lambda r: r.attributes["year"] in (1991, 1993)),
    ({"op": "eq", "attribute": "in_stock", "value": False}, lambda r: not r.attributes["in_stock"]),
    ({"op": "exists", "attribute": "year"}, lambda r: True),
    (
        {
            "op": "any",
            "of": [
                {"op": "range", "attribute": "year", "lte": 1992},
                {"op": "all", "of": [{"op": "eq", "attribute": "lang", "value": "en"},
                                     {"op": "category", "any_of": ["three"]}]},
            ],
        },
        lambda r: r.attributes["year"] <= 1992 or (r.attributes["lang"] == "en" and "three" in r.categories),
    ),
]  # fmt: skip


@pytest.mark.parametrize(("chosen", "holds"), FILTERS)
def test_attribute_filters_select_what_the_records_say(
    api: App, artifact: Artifact, chosen: dict[str, Any], holds: Any
) -> None:
    user = artifact.users.ids[3]
    ranking, _ = expected_ranking(artifact, user)
    allowed = passing(artifact, holds)
    want = [x for x in ranking if x in allowed][:5]
    body = api.client.post("/recommend", json={"user": user, "k": 5, "filter": chosen}).json()
    assert [r["item"] for r in body["recommendations"]] == want
    popular, _ = popular_ranking(artifact)
    body = api.client.post("/recommend", json={"user": "nobody", "k": 5, "filter": chosen}).json()
    assert body["fallback"] == "popular"  # and the popular list obeys the filter
    assert [r["item"] for r in body["recommendations"]] == [x for x in popular if x in allowed][:5]


def test_not_strict_fills_a_short_list_and_says_which_items_are_outside(api: App, artifact: Artifact) -> None:
    user = artifact.users.ids[2]
    ranking, _ = expected_ranking(artifact, user)
    chosen = {"op": "eq", "attribute": "year", "value": 1991}
    inside = [x for x in ranking if x in passing(artifact, lambda r: r.attributes["year"] == 1991)]
    assert 0 < len(inside) < 6
    strict = api.client.post("/recommend", json={"user": user, "k": 6, "filter": chosen}).json()
    assert [r["item"] for r in strict["recommendations"]] == inside
    loose = api.client.post(
        "/recommend", json={"user": user, "k": 6, "filter": chosen, "strict": False}
    ).json()
    shown = visible(artifact)
    rest = [x for x in ranking if x in shown and x not in inside][: 6 - len(inside)]
    assert [r["item"] for r in loose["recommendations"]] == inside + rest
    assert [r.get("outside_filter", False) for r in loose["recommendations"]] == [False] * len(inside) + [
        True
    ] * len(rest)


def test_a_filter_on_what_no_item_has_matches_nothing_and_says_so(api: App, artifact: Artifact) -> None:
    user = artifact.users.ids[0]
    body = api.client.post(
        "/recommend", json={"user": user, "filter": {"op": "exists", "attribute": "colour"}}
    ).json()
    assert body["recommendations"] == []
    assert body["filter_notes"] == ["no item has the attribute 'colour'"]
    body = api.client.get(f"/recommend/{user}", params={"category": "Western"}).json()
    assert body["recommendations"] == [] and body["filter_notes"] == ["no item has the category Western"]


@pytest.mark.parametrize(
    ("chosen", "loc", "kind"),
    [
        ({"op": "like", "attribute": "lang"}, ["body", "filter"], "union_tag_invalid"),
        ({"op": "range", "attribute": "lang", "gte": 1}, ["body", "filter"], "range_on_non_number"),
        ({"op": "range", "attribute": "year"}, ["body", "filter"], "missing"),
        ({"op": "eq", "attribute": "year", "value": "1995"}, ["body", "filter", "value"], "type_mismatch"),
        (
            {"op": "all", "of": [{"op": "exists", "attribute": "year"},
                                 {"op": "in", "attribute": "lang", "values": ["en", 3]}]},
            ["body", "filter", "of", 1, "values", 1],
            "type_mismatch",
        ),
        ({"op": "range", "attribute": "year", "gte": "1990"}, ["body", "filter", "range", "gte"], None),
    ],
)  # fmt: skip
def test_a_bad_filter_is_a_422_that_names_the_part(
    api: App, artifact: Artifact, chosen: dict[str, Any], loc: list[Any], kind: str | None
) -> None:
    response = api.client.post("/recommend", json={"user": artifact.users.ids[0], "filter": chosen})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert any(d["loc"][: len(loc)] == loc and (kind is None or d["type"] == kind) for d in detail), detail


def test_a_filter_too_deep_or_too_large_is_refused(api: App, artifact: Artifact) -> None:
    deep: dict[str, Any] = {"op": "exists", "attribute": "year"}
    for _ in range(9):
        deep = {"op": "not", "filter": deep}
    response = api.client.post("/recommend", json={"user": artifact.users.ids[0], "filter": deep})
    assert response.status_code == 422 and response.json()["detail"][0]["type"] == "too_deep"
    wide = {"op": "any", "of": [{"op": "exists", "attribute": "year"}] * 40}
    response = api.client.post(
        "/recommend", json={"user": artifact.users.ids[0], "filter": {"op": "all", "of": [wide, wide]}}
    )
    assert response.status_code == 422 and response.json()["detail"][0]["type"] == "too_long"


def test_similar_items_take_the_category_short_form(api: App, artifact: Artifact) -> None:
    item = artifact.items.ids[2]
    everything = api.client.get(f"/similar-items/{item}", params={"k": 49}).json()["similar"]
    even = passing(artifact, lambda r: "even" in r.categories)
    got = api.client.get(f"/similar-items/{item}", params={"k": 5, "category": "even"}).json()["similar"]
    assert [s["item"] for s in got] == [s["item"] for s in everything if s["item"] in even][:5]


def test_an_artifact_without_a_catalogue_filters_to_nothing_but_says_why(
    app: App, tiny_artifact: Path
) -> None:
    user = load_artifact(tiny_artifact).users.ids[0]
    body = app.client.get(f"/recommend/{user}", params={"category": "odd"}).json()
    assert body["recommendations"] == [] and body["filter_notes"] == ["no item has the category odd"]
    assert len(app.client.get(f"/recommend/{user}").json()["recommendations"]) == 10
    assert rated_ids(load_artifact(tiny_artifact), user)  # (a user with ratings: not the popular list)


def test_boosts_move_items_up_and_the_answer_names_them(api: App, artifact: Artifact) -> None:
    user = artifact.users.ids[4]
    ranking, ratings = expected_ranking(artifact, user)
    french = passing(artifact, lambda r: r.attributes["lang"] == "fr")
    shown = visible(artifact)
    order = [x for x in ranking if x in shown]
    want = sorted(order, key=lambda x: -(ratings[x] + 10 * (x in french)))[:6]  # stable: ties keep order
    body = api.client.post(
        "/recommend",
        json={
            "user": user,
            "k": 6,
            "boosts": [
                {"name": "fr", "filter": {"op": "eq", "attribute": "lang", "value": "fr"}, "amount": 10}
            ],
        },
    ).json()
    assert [r["item"] for r in body["recommendations"]] == want
    assert [r.get("boost") for r in body["recommendations"]] == [10.0 if x in french else None for x in want]
    np.testing.assert_allclose([r["rating"] for r in body["recommendations"]], [ratings[x] for x in want])
    assert body["rules"] == ["boost:fr"]
    cut = float(np.median([ratings[x] for x in order]))
    body = api.client.get(f"/recommend/{user}", params={"k": 50, "min_rating": cut}).json()
    assert [r["item"] for r in body["recommendations"]] == [x for x in order if ratings[x] >= cut][:50]
    assert body["rules"] == ["min_rating"]


def test_deployment_rules_apply_to_every_request(
    catalogued: Path, key_prefix: str, artifact: Artifact
) -> None:
    rules = {
        "default_filter": {"op": "eq", "attribute": "in_stock", "value": True},
        "boosts": [
            {"name": "old", "filter": {"op": "range", "attribute": "year", "lt": 1995}, "amount": -10}
        ],
    }
    with App(catalogued, redis_url=REDIS_URL, redis_key_prefix=f"{key_prefix}:rules", **rules) as ruled:
        user = artifact.users.ids[1]
        ranking, ratings = expected_ranking(artifact, user)
        stocked = passing(artifact, lambda r: r.attributes["in_stock"])
        old = passing(artifact, lambda r: r.attributes["year"] < 1995)
        order = sorted((x for x in ranking if x in stocked), key=lambda x: -(ratings[x] - 10 * (x in old)))
        body = ruled.client.get(f"/recommend/{user}", params={"k": 10}).json()
        assert [r["item"] for r in body["recommendations"]] == order[:10]
        assert body["rules"][0] == "default_filter"
        assert ("boost:old" in body["rules"]) == any(x in old for x in order[:10])
        similar = ruled.client.get(f"/similar-items/{artifact.items.ids[0]}", params={"k": 20}).json()
        assert not {s["item"] for s in similar["similar"]} - stocked
        loose = {"user": user, "k": 50, "strict": False, "filter": {"op": "category", "any_of": ["three"]}}
        filled = ruled.client.post("/recommend", json=loose).json()["recommendations"]
        assert any(r.get("outside_filter") for r in filled)  # filled past the request's filter...
        assert not {r["item"] for r in filled} - stocked  # ...never past the deployment's


def mmr(
    items: list[str], relevance: dict[str, float], vectors: dict[str, np.ndarray], k: int, lam: float
) -> list[str]:
    """Maximal marginal relevance written out: each next item maximises (1 - lam) rel - lam max sim."""
    chosen = [items[0]]
    while len(chosen) < min(k, len(items)):

        def value(x: str) -> float:
            return (1 - lam) * relevance[x] - lam * max(float(vectors[x] @ vectors[c]) for c in chosen)

        chosen.append(max((x for x in items if x not in chosen), key=value))  # ties: the first
    return chosen


@pytest.mark.parametrize("lam", [0.0, 0.3, 0.8])
def test_diversity_re_ranks_the_top_by_maximal_marginal_relevance(
    api: App, artifact: Artifact, lam: float
) -> None:
    from model.engine import lift

    user = artifact.users.ids[6]
    ranking, ratings = expected_ranking(artifact, user)
    shown = [x for x in ranking if x in visible(artifact)]
    emb = np.asarray(artifact.item_embeddings, dtype=np.float64)
    lifted = lift(emb / np.linalg.norm(emb, axis=1, keepdims=True))
    vectors = {x: lifted[artifact.items.index(x)] for x in shown}
    lo, hi = artifact.levels[0], artifact.levels[-1]
    pool = shown[:50]
    want = mmr(pool, {x: (ratings[x] - lo) / (hi - lo) for x in pool}, vectors, 8, lam)
    body = api.client.get(f"/recommend/{user}", params={"k": 8, "diversity": lam}).json()
    assert [r["item"] for r in body["recommendations"]] == want
    assert ("diversity" in body.get("rules", [])) == (lam > 0)
    if lam == 0:
        assert want == shown[:8]
    assert api.client.get(f"/recommend/{user}", params={"diversity": 1.5}).status_code == 422


@pytest.mark.parametrize(
    "query", ["?k=5&category=odd", "?category=odd,three&exclude_category=even", "?exclude_category=three&k=8"]
)
def test_the_category_short_form_is_answered_by_the_fast_path_as_the_route_answers_it(
    api: App, artifact: Artifact, query: str
) -> None:
    from service.catalogue import short_filter
    from service.fastpath import _short_query
    from service.recommend import split_ids
    from service.routes.recommend import plain

    state = api.client.app.state  # type: ignore[attr-defined]
    user = artifact.users.ids[3]
    asked = _short_query(query[1:].encode())
    assert asked is not None
    chosen = short_filter(split_ids(asked.get("category")), split_ids(asked.get("exclude_category")))
    from tests.service.test_fastpath import _same_but_id

    fast = api.client.get(f"/recommend/{user}{query}")
    made = plain(state.scorer, state.settings, user, int(asked.get("k", 10)), chosen)
    assert _same_but_id(fast.content, made)
    via_route = api.client.get(f"/recommend/{user}{query}&exclude=")  # a parameter it leaves to the route
    assert via_route.status_code == 200 and _same_but_id(via_route.content, fast.content)
    for bad in ("?category=odd&category=even", f"?category={'x' * 65}", "?k=0&category=odd"):
        r = api.client.get(f"/recommend/{user}{bad}")  # the route's 422, worded by it
        assert r.status_code == 422, (bad, r.text)
