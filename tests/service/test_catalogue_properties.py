"""Property tests of the catalogue's filters and rules: random catalogues and filters against a brute-force
evaluation of each record (`CatalogueIndex.select`), and random filters, boosts, cuts and users against a
brute-force ranking over HTTP-shaped requests to the in-process service (`/recommend`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model.artifact import Artifact
from model.catalogue import ItemRecord
from service.catalogue import CatalogueIndex
from tests.service.conftest import App
from tests.service.test_catalogue import api, artifact, catalogued, visible  # noqa: F401  (fixtures)
from tests.service.test_recommend import expected_ranking, popular_ranking

CATEGORIES = ["a", "b", "c", "d"]
STRINGS = ["x", "y", "z"]

records = st.builds(
    ItemRecord,
    categories=st.lists(st.sampled_from(CATEGORIES), max_size=3),
    attributes=st.fixed_dictionaries(
        {},
        optional={
            "n": st.integers(0, 9) | st.floats(0, 9, allow_nan=False),
            "s": st.sampled_from(STRINGS),
            "f": st.booleans(),
            "t": st.lists(st.sampled_from(STRINGS), max_size=2),
        },
    ),
    hidden=st.booleans(),
)

leaves = st.one_of(
    st.builds(
        lambda c: {"op": "category", "any_of": c},
        st.lists(st.sampled_from([*CATEGORIES, "zz"]), min_size=1, max_size=3),
    ),
    st.builds(lambda v: {"op": "eq", "attribute": "s", "value": v}, st.sampled_from(STRINGS)),
    st.builds(lambda v: {"op": "eq", "attribute": "f", "value": v}, st.booleans()),
    st.builds(lambda v: {"op": "eq", "attribute": "t", "value": v}, st.sampled_from(STRINGS)),
    st.builds(
        lambda v: {"op": "in", "attribute": "s", "values": v},
        st.lists(st.sampled_from(STRINGS), min_size=1, max_size=2),
    ),
    st.builds(
        lambda lo, hi: {"op": "range", "attribute": "n", "gte": lo, "lt": hi},
        st.integers(0, 9),
        st.integers(0, 10),
    ),
    st.builds(lambda a: {"op": "exists", "attribute": a}, st.sampled_from(["n", "s", "f", "t", "missing"])),
)

filters = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.builds(lambda of: {"op": "all", "of": of}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda of: {"op": "any", "of": of}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda f: {"op": "not", "filter": f}, inner),
    ),
    max_leaves=6,
)


def holds(f: dict[str, Any], r: ItemRecord | None) -> bool:
    """A filter on one record, written out clause by clause."""
    op = f["op"]
    if op == "all":
        return all(holds(c, r) for c in f["of"])
    if op == "any":
        return any(holds(c, r) for c in f["of"])
    if op == "not":
        return not holds(f["filter"], r)
    if r is None:
        return False
    if op == "category":
        return bool(set(f["any_of"]) & set(r.categories))
    value = r.attributes.get(f["attribute"])
    if op == "exists":
        return f["attribute"] in r.attributes
    if value is None:
        return False
    if op == "range":
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return number and f.get("gte", -np.inf) <= value < f.get("lt", np.inf)
    wanted = [f["value"]] if op == "eq" else f["values"]
    if isinstance(value, list):
        return any(w in value for w in wanted)
    return any(type(w) is type(value) and w == value for w in wanted)


def as_filter(f: dict[str, Any]) -> Any:
    from pydantic import TypeAdapter

    from service.catalogue import Filter

    return TypeAdapter(Filter).validate_python(f)


@settings(max_examples=150, deadline=None)
@given(st.lists(records | st.none(), min_size=1, max_size=30), filters)
def test_a_filter_selects_exactly_the_records_it_holds_for(
    catalogue: list[ItemRecord | None], f: dict[str, Any]
) -> None:
    kept = {str(j): r for j, r in enumerate(catalogue) if r is not None}
    index = CatalogueIndex(kept, len(catalogue), str)
    try:
        mask, _ = index.select(as_filter(f), ["filter"])
    except Exception as exc:  # a clause the catalogue's types rule out: the one 422 it may raise
        assert getattr(exc, "status_code", None) == 422, exc
        return
    assert mask.tolist() == [holds(f, r) for r in catalogue]
    assert index.visible.tolist() == [r is None or not r.hidden for r in catalogue]
    grown = CatalogueIndex(kept, len(catalogue), str, CatalogueIndex(kept, len(catalogue) // 2, str))
    assert grown.select(as_filter(f), ["filter"])[0].tolist() == mask.tolist()  # only new items read
    assert grown.visible.tolist() == index.visible.tolist()


@settings(max_examples=150, deadline=None)
@given(
    st.lists(records | st.none(), min_size=1, max_size=30),
    st.dictionaries(st.integers(0, 29), records | st.none(), max_size=10),
    st.integers(0, 10),
    filters,
)
def test_an_index_updated_for_changed_records_is_the_index_built_afresh(
    catalogue: list[ItemRecord | None], changes: dict[int, ItemRecord | None], grown: int, f: dict[str, Any]
) -> None:
    before = {str(j): r for j, r in enumerate(catalogue) if r is not None}
    after = dict(before)
    for j, r in changes.items():
        if r is None:
            after.pop(str(j), None)
        else:
            after[str(j)] = r
    n = len(catalogue) + grown  # items the new state has: some new ones too
    fresh = CatalogueIndex(after, n, str)
    base = CatalogueIndex(before, len(catalogue), str)
    updated = CatalogueIndex(after, n, str, base, sorted(changes), version=1)
    assert updated.visible.tolist() == fresh.visible.tolist()
    assert updated.has_record.tolist() == fresh.has_record.tolist()
    assert set(updated.categories) == set(fresh.categories)
    for name, a in fresh._attributes.items():
        assert updated._attributes[name].kinds == a.kinds
    outcomes = []
    for index in (fresh, updated):
        try:
            outcomes.append(index.select(as_filter(f), ["filter"])[0].tolist())
        except Exception as exc:  # a clause the catalogue's types rule out: alike in both
            assert getattr(exc, "status_code", None) == 422, exc
            outcomes.append("422")
    assert outcomes[0] == outcomes[1]
    assert base.visible.tolist() == [r is None or not r.hidden for r in catalogue]  # the base is untouched


def rec_filter() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.builds(
            lambda c: {"op": "category", "any_of": c},
            st.lists(st.sampled_from(["odd", "even", "three"]), min_size=1, max_size=2),
        ),
        st.builds(lambda lo: {"op": "range", "attribute": "year", "gte": lo}, st.integers(1990, 2010)),
        st.builds(lambda v: {"op": "eq", "attribute": "lang", "value": v}, st.sampled_from(["en", "fr"])),
        st.builds(
            lambda v: {"op": "eq", "attribute": "tags", "value": v}, st.sampled_from(["t0", "t1", "t4"])
        ),
    )


@pytest.mark.usefixtures("api")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    user=st.integers(0, 59) | st.just(-1),
    k=st.integers(1, 15),
    chosen=st.none() | rec_filter(),
    boost=st.none() | st.tuples(rec_filter(), st.floats(-2, 2, allow_nan=False)),
    cut=st.none() | st.floats(1, 5, allow_nan=False),
)
def test_recommend_equals_a_brute_force_over_the_records(
    api: App,  # noqa: F811
    artifact: Artifact,  # noqa: F811
    user: int,
    k: int,
    chosen: dict[str, Any] | None,
    boost: tuple[dict[str, Any], float] | None,
    cut: float | None,
) -> None:
    assert artifact.catalogue is not None
    shown = visible(artifact)
    if user < 0:
        uid = "someone-new"
        order, scores = popular_ranking(artifact)
    else:
        uid = artifact.users.ids[user % len(artifact.users)]
        order, scores = expected_ranking(artifact, uid)

    def passes(x: str) -> bool:
        return chosen is None or holds(chosen, artifact.catalogue.get(x))

    def rank(x: str) -> float:
        extra = boost[1] if boost is not None and holds(boost[0], artifact.catalogue.get(x)) else 0.0
        return scores[x] + extra

    candidates = [x for x in order if x in shown and passes(x) and (cut is None or scores[x] >= cut)]
    want = sorted(candidates, key=lambda x: -rank(x))[:k]  # stable: ties keep the order (by index)
    body: dict[str, Any] = {"user": uid, "k": k, "diversity": 0}
    if chosen is not None:
        body["filter"] = chosen
    if boost is not None:
        body["boosts"] = [{"name": "b", "filter": boost[0], "amount": boost[1]}]
    if cut is not None:
        body["min_rating"] = cut
    got = api.client.post("/recommend", json=body).json()
    items = [r["item"] for r in got["recommendations"]]
    assert all(x in shown and passes(x) for x in items)  # every item passes, none hidden
    got_ranks = [rank(x) for x in items]
    np.testing.assert_allclose(got_ranks, [rank(x) for x in want], atol=1e-9)  # the true top k of those
    assert len(items) == len(want)
