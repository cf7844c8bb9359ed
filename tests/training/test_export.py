"""The ONNX export agrees with torch, and the artifact's embeddings are the network's."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from model.artifact import KNOWN_FIELD, _load_known_field, load_artifact, save_known_field
from model.engine import OnnxNetwork, ScoringModel, expected_rating, label_probabilities, predict_entries
from model.network import DCMC
from training.data import load_dataset
from training.evaluate import held_out, map_entries, predict_ratings


def _dense(art, by: str) -> np.ndarray:  # type: ignore[no-untyped-def]
    n, m = art.config.n_users, art.config.n_items
    dense = np.zeros((n, m), dtype=np.float32)
    dense[art.train_rows, art.train_cols] = art.train_values
    return dense if by == "row" else dense.T.copy()


def test_onnx_matches_torch_and_the_stored_embeddings(tiny_artifact: Path) -> None:
    art = load_artifact(tiny_artifact)
    metrics = json.loads((tiny_artifact / "metrics.json").read_text())
    assert 0 <= metrics["onnx_parity_max_abs_diff"] <= 1e-5

    model = DCMC(art.config)
    model.load_state_dict(torch.load(tiny_artifact / "weights.pt", weights_only=True))
    model.eval()
    onnx = OnnxNetwork(tiny_artifact)
    rows, cols = _dense(art, "row"), _dense(art, "col")
    with torch.no_grad():
        u_torch = model.embed_rows(torch.from_numpy(rows)).numpy()
        v_torch = model.embed_cols(torch.from_numpy(cols)).numpy()
    u_onnx, v_onnx = onnx.embed_users(rows), onnx.embed_items(cols)
    np.testing.assert_allclose(u_onnx, u_torch, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(v_onnx, v_torch, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(art.user_embeddings, u_torch, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(art.item_embeddings, v_torch, atol=1e-5, rtol=1e-5)

    # Dynamic batch axis: any batch size works; the decoder equals the numpy engine's bilinear softmax.
    k = np.arange(7)
    probs_onnx = onnx.probabilities(u_onnx[k], v_onnx[k])
    probs_np = label_probabilities(
        art.user_embeddings.astype(np.float64),
        art.item_embeddings.astype(np.float64),
        art.bilinear.astype(np.float64),
        k,
        k,
    )
    np.testing.assert_allclose(probs_onnx, probs_np, atol=1e-5)
    assert onnx.embed_users(rows[:1]).shape == (1, art.config.embedding_dim)


def test_artifact_stores_the_known_field_of_its_exact_settings(tiny_artifact: Path) -> None:
    art = load_artifact(tiny_artifact)
    exact_cfg = replace(art.inference, mode="exact")
    assert art.known_field is not None
    stored_key, stored = art.known_field
    # The field covers every known rating: those trained on and the held-out validation ratings.
    assert len(art.held_out_rows) > 0
    rows, cols, values = art.known()
    assert len(rows) == len(art.train_rows) + len(art.held_out_rows)
    fresh_model = ScoringModel(
        config=art.config,
        user_emb=art.user_embeddings.astype(np.float64),
        item_emb=art.item_embeddings.astype(np.float64),
        bilinear=art.bilinear.astype(np.float64),
        known_rows=rows,
        known_cols=cols,
        known_values=values,
    )
    assert stored_key == fresh_model.field_key(exact_cfg)
    fresh = fresh_model.known_field(exact_cfg)
    d = art.config.embedding_dim + 1
    assert stored.g.shape == (art.config.n_levels, d, d)
    np.testing.assert_allclose(stored.g, fresh.g, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(stored.h, fresh.h, rtol=1e-12, atol=1e-12)
    # A loaded model serves these settings without recomputing, and only these.
    model = art.scoring_model()
    assert model.has_field(exact_cfg)
    assert not model.has_field(replace(exact_cfg, gamma=art.config.gamma * 2 + 0.1))
    assert model.known_field(exact_cfg) is stored
    # The tiny artifact's compatibility is truncated: every level's G is read.
    assert stored.interp is None


def test_known_field_with_line_terms_round_trips(tiny_artifact: Path, tmp_path: Path) -> None:
    art = load_artifact(tiny_artifact)
    lines_cfg = replace(art.inference, mode="exact", known="predicted", same_user=2.0, same_item=0.5)
    lines_cfg = replace(
        lines_cfg, co_rating=3.0, co_rating_user=2.0, co_rating_prior=0.2, co_rating_shrink=4.0
    )
    model = art.scoring_model()
    key, field = model.field_key(lines_cfg), model.known_field(lines_cfg)
    assert field.t is not None and field.t.shape == (len(art.known()[0]), art.config.n_levels)
    save_known_field(tmp_path / KNOWN_FIELD, key, field)
    loaded_key, loaded = _load_known_field(tmp_path / KNOWN_FIELD, art.config)
    assert loaded_key == key and key[-3:] == (0.2, 2.0, 4.0)  # pseudo-count, user term, shrinkage
    np.testing.assert_array_equal(loaded.t, field.t)
    untruncated = replace(lines_cfg, tau=1e9)  # a loaded field reads 3 anchor levels, like a fresh one
    save_known_field(
        tmp_path / "untruncated.npz", model.field_key(untruncated), model.known_field(untruncated)
    )
    assert model.known_field(untruncated).interp is not None
    assert _load_known_field(tmp_path / "untruncated.npz", art.config)[1].interp is not None
    fresh = art.scoring_model()
    fresh.add_field(loaded_key, loaded)
    rows, cols = art.train_rows[:5], (art.train_cols[:5] + 1) % art.config.n_items
    np.testing.assert_allclose(
        predict_entries(fresh, rows, cols, lines_cfg),
        predict_entries(model, rows, cols, lines_cfg),
        rtol=1e-12,
    )
    # Weights without the known entries' distributions (or the reverse) are refused.
    zeros = {k: np.float64(0) for k in ("same_user", "same_item", "co_rating", "co_rating_user")}
    np.savez(tmp_path / "broken.npz", **{**dict(np.load(tmp_path / KNOWN_FIELD)), **zeros})
    with pytest.raises(ValueError, match="line terms"):
        _load_known_field(tmp_path / "broken.npz", art.config)


def test_held_out_ratings_are_known_at_test_time_but_not_when_scored(
    tiny_artifact: Path, synthetic_csv: Path
) -> None:
    art = load_artifact(tiny_artifact)
    ds = art.meta["dataset"]
    split = load_dataset(ds["name"], synthetic_csv, split=ds["split"], seed=ds["seed"])
    val = held_out(art, split, "val")
    rows, cols = map_entries(art, split.user_ids, split.item_ids, val)
    # The artifact keeps exactly the validation ratings the trainer carved, apart from the trained-on ones.
    assert sorted(zip(art.held_out_rows, art.held_out_cols, strict=True)) == sorted(
        zip(rows, cols, strict=True)
    )
    trained = set(zip(art.train_rows, art.train_cols, strict=True))
    assert not trained & set(zip(rows, cols, strict=True))
    with_held = art.scoring_model()
    without = art.scoring_model(include_held_out=False)
    assert len(with_held.known_rows) == len(art.train_rows) + len(val)
    np.testing.assert_array_equal(without.known_rows, art.train_rows)
    # Scoring the validation ratings leaves them out of the known ratings (and out of the stored field,
    # computed with them): dcmc evaluate --on val equals a model over the trained-on ratings alone.
    exact_cfg = replace(art.inference, mode="exact", known="clamped", co_rating=5.0)
    assert not without.has_field(replace(art.inference, mode="exact"))
    fresh = ScoringModel(
        config=art.config,
        user_emb=art.user_embeddings.astype(np.float64),
        item_emb=art.item_embeddings.astype(np.float64),
        bilinear=art.bilinear.astype(np.float64),
        known_rows=art.train_rows,
        known_cols=art.train_cols,
        known_values=art.train_values,
    )
    expected = expected_rating(predict_entries(fresh, rows, cols, exact_cfg), art.levels)
    np.testing.assert_allclose(predict_ratings(art, rows, cols, exact_cfg, include_held_out=False), expected)
    assert not np.allclose(predict_ratings(art, rows, cols, exact_cfg), expected)  # their own labels leak
