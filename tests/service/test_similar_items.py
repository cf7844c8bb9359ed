"""GET /similar-items/{id}: the k nearest items by the scaled cosine s_c of the item embeddings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from model.artifact import load_artifact
from model.engine import lift
from service.schemas import MAX_ID_LENGTH
from service.scoring import nearest
from tests.service.conftest import App


@pytest.fixture()
def api(app: App) -> App:
    """The service in process (create_app routes /similar-items)."""
    return app


def test_similar_items_equal_a_brute_force_ranking(api: App, tiny_artifact: Path) -> None:
    artifact = load_artifact(tiny_artifact)
    emb = artifact.item_embeddings.astype(np.float64)
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    for item, k in (("i0", 10), ("i33", 5), ("i12", 49), ("i12", 100), ("i7", 1)):
        r = api.client.get(f"/similar-items/{item}", params={"k": k})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["item"] == item
        assert body["model_version"] == artifact.model_version
        j = artifact.items.index(item)
        scores = {artifact.items.external(x): (1 + unit[j] @ unit[x]) / 2 for x in range(len(unit)) if x != j}
        ranking = sorted(scores, key=lambda i: -scores[i])[: min(k, len(unit) - 1)]
        got = body["similar"]
        assert [s["item"] for s in got] == ranking
        np.testing.assert_allclose([s["score"] for s in got], [scores[i] for i in ranking], atol=1e-12)
        assert all(0.0 <= s["score"] <= 1.0 for s in got)


def test_k_defaults_to_ten(api: App) -> None:
    r = api.client.get("/similar-items/i3")
    assert r.status_code == 200, r.text
    assert len(r.json()["similar"]) == 10


def test_ties_go_by_index_at_the_cut_too() -> None:
    # rows 1, 2, 4 and 5 are the same direction: equally similar to row 0
    unit = np.array([[1.0, 0.0], [0.6, 0.8], [0.6, 0.8], [0.0, -1.0], [0.6, 0.8], [0.6, 0.8], [1.0, 0.0]])
    unit = lift(unit)
    idx, scores = nearest(unit, 0, 3)
    assert idx.tolist() == [6, 1, 2]
    np.testing.assert_allclose(scores, [1.0, 0.8, 0.8])
    idx, _ = nearest(unit, 0, 100)
    assert idx.tolist() == [6, 1, 2, 4, 5, 3]
    idx, scores = nearest(unit[:1], 0, 5)
    assert idx.tolist() == [] and scores.tolist() == []


def test_an_unknown_item_is_a_404(api: App) -> None:
    r = api.client.get("/similar-items/nobody")
    assert r.status_code == 404, r.text
    assert r.json() == {"detail": {"msg": "unknown item id(s): 'nobody'", "unknown_items": ["nobody"]}}


@pytest.mark.parametrize("k", [0, -1, 101])
def test_k_out_of_range_is_a_422(api: App, k: int) -> None:
    r = api.client.get("/similar-items/i1", params={"k": k})
    assert r.status_code == 422, r.text
    assert r.json() == {
        "detail": [
            {
                "loc": ["query", "k"],
                "type": "out_of_range",
                "msg": f"k must lie in 1..100 (setting DCMC_MAX_K), got {k}",
            }
        ]
    }


@pytest.mark.parametrize(
    ("path", "loc", "needle"),
    [
        ("/similar-items/i1?k=ten", ["query", "k"], "valid integer"),
        (f"/similar-items/{'x' * (MAX_ID_LENGTH + 1)}", ["path", "item_id"], "at most 256 characters"),
    ],
)
def test_malformed_requests_are_a_422(api: App, path: str, loc: list[str], needle: str) -> None:
    r = api.client.get(path)
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == loc
    assert needle in error["msg"]
