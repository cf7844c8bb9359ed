"""The ONNX export agrees with torch, and the artifact's embeddings are the network's."""

from __future__ import annotations

import dataclasses
import json
import mmap
from pathlib import Path

import numpy as np
import pytest
import torch

from model.artifact import (
    KNOWN_FIELD,
    ArtifactError,
    ArtifactFiles,
    _load_known_field,
    load_artifact,
    save_known_field,
)
from model.engine import Network, OnnxNetwork, expected_rating, label_probabilities, nearest_level
from model.exact import ClampedRows, ExactScorer, FieldKey
from model.network import DCMC
from model.scorers import artifact_scorer, build_scorer, load_network, predict_distributions
from training.data import load_dataset
from training.evaluate import held_out, map_entries, predict_ratings
from training.export import save_exact_field


def _dense(art, by: str) -> np.ndarray:  # type: ignore[no-untyped-def]
    n, m = art.config.n_users, art.config.n_items
    dense = np.zeros((n, m), dtype=np.float32)
    dense[art.train.rows, art.train.cols] = art.train.values
    return dense if by == "row" else dense.T.copy()


def _exact_scorer(network: Network, known, inference, stored=None) -> ExactScorer:  # type: ignore[no-untyped-def]
    scorer = build_scorer(network, known, inference, stored)
    assert isinstance(scorer, ExactScorer)
    return scorer


def test_onnx_matches_torch_and_the_stored_embeddings(tiny_artifact: Path) -> None:
    art = load_artifact(tiny_artifact)
    metrics = json.loads((tiny_artifact / "metrics.json").read_text())
    assert 0 <= metrics["onnx_parity_max_abs_diff"] <= 1e-5

    model = DCMC(art.config)
    model.load_state_dict(torch.load(tiny_artifact / "weights.pt", weights_only=True))
    model.eval()
    onnx = OnnxNetwork(tiny_artifact)
    rows, cols = _dense(art, "row"), _dense(art, "col")
    # The branches' inputs as the service builds them, from the one index of the known ratings.
    np.testing.assert_array_equal(art.train.dense_rows(np.arange(art.config.n_users)), rows)
    np.testing.assert_array_equal(art.train.dense_cols(np.arange(art.config.n_items)), cols)
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


def test_artifact_stores_the_known_field_of_its_exact_settings(exact_artifact: Path) -> None:
    art = load_artifact(exact_artifact)
    assert art.inference.mode == "exact" and art.inference.crf.gamma == 0.5  # --set inference.crf.gamma=0.5
    assert art.known_field is not None
    stored = art.known_field
    # The field covers every known rating: those trained on and the held-out validation ratings.
    assert len(art.held_out) > 0
    known = art.known()
    assert len(known) == len(art.train) + len(art.held_out)
    fresh = _exact_scorer(load_network(art), known, art.inference)
    assert fresh.field_source == "computed"
    assert FieldKey.from_json(stored.key) == fresh.key and fresh.key.n_known == len(known)
    assert fresh.key.gamma == 0.5 != art.config.gamma
    d = art.config.embedding_dim + 1
    assert stored.g.shape == (art.config.n_levels, d, d)
    np.testing.assert_allclose(stored.g, fresh.field.g, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(stored.h, fresh.field.h, rtol=1e-12, atol=1e-12)
    assert stored.t is None  # no line terms
    # A loaded artifact serves these settings without recomputing, and only these.
    _, scorer = artifact_scorer(art)
    assert isinstance(scorer, ExactScorer) and scorer.field_source == "artifact"
    assert scorer.field.g is stored.g
    other = art.inference.with_overrides({"crf.gamma": art.config.gamma * 2 + 0.1})
    _, recomputed = artifact_scorer(art, other)
    assert isinstance(recomputed, ExactScorer) and recomputed.field_source == "computed"
    # The tiny artifact's compatibility is truncated: every level's G is read.
    assert scorer.field.interp is None


def test_a_paper_artifact_stores_no_known_field(tiny_artifact: Path) -> None:
    art = load_artifact(tiny_artifact)
    assert art.inference.mode == "paper"
    assert art.known_field is None
    assert not (tiny_artifact / KNOWN_FIELD).exists()


def test_known_field_with_line_terms_round_trips(tiny_artifact: Path, tmp_path: Path) -> None:
    art = load_artifact(tiny_artifact)
    lines_cfg = art.inference.with_overrides(
        {
            "mode": "exact",
            "kernel.known": "predicted",
            "kernel.same_user": 2.0,
            "kernel.same_item": 0.5,
            "kernel.co_rating": 3.0,
            "kernel.co_rating_user": 2.0,
            "kernel.co_rating_prior": 0.2,
            "kernel.co_rating_shrink": 4.0,
        }
    )
    network, known = load_network(art), art.known()
    scorer = _exact_scorer(network, known, lines_cfg)
    key, field = scorer.key, scorer.field
    assert field.t is not None and field.t.shape == (len(known), art.config.n_levels)
    save_known_field(tmp_path, key.to_json(), field.g, field.h, field.t)
    loaded = _load_known_field(ArtifactFiles.present(tmp_path), art.config, len(known))
    assert loaded is not None and FieldKey.from_json(loaded.key) == key
    # pseudo-count, user term, shrinkage
    assert (key.co_rating_prior, key.co_rating_user, key.co_rating_shrink) == (0.2, 2.0, 4.0)
    np.testing.assert_array_equal(loaded.t, field.t)
    untruncated = lines_cfg.with_overrides({"crf.tau": 1e9})  # a loaded field reads 3 anchor levels
    plain = _exact_scorer(network, known, untruncated)
    assert plain.field.interp is not None
    (tmp_path / "untruncated").mkdir()
    save_known_field(
        tmp_path / "untruncated", plain.key.to_json(), plain.field.g, plain.field.h, plain.field.t
    )
    again = _load_known_field(ArtifactFiles.present(tmp_path / "untruncated"), art.config, len(known))
    from_stored = _exact_scorer(network, known, untruncated, again)
    assert from_stored.field_source == "artifact" and from_stored.field.interp is not None
    fresh = _exact_scorer(network, known, lines_cfg, loaded)
    assert fresh.field_source == "artifact"
    rows, cols = art.train.rows[:5], (art.train.cols[:5] + 1) % art.config.n_items
    np.testing.assert_allclose(
        predict_distributions(network, fresh, rows, cols),
        predict_distributions(network, scorer, rows, cols),
        rtol=1e-12,
    )
    # Distributions of another number of known entries are refused.
    np.savez(tmp_path / KNOWN_FIELD, g=field.g, h=field.h, t=field.t[1:])
    with pytest.raises(ValueError, match="t has shape"):
        _load_known_field(ArtifactFiles.present(tmp_path), art.config, len(known))


def test_a_stored_field_missing_the_line_terms_distributions_is_refused_or_recomputed(
    tiny_artifact: Path, tmp_path: Path
) -> None:
    # A field whose key has line terms but that lacks their distributions is not served from.
    art = load_artifact(tiny_artifact)
    lines_cfg = art.inference.with_overrides({"mode": "exact", "kernel.same_user": 2.0})
    network, known = load_network(art), art.known()
    scorer = _exact_scorer(network, known, lines_cfg)
    save_known_field(tmp_path, scorer.key.to_json(), scorer.field.g, scorer.field.h, None)
    try:
        loaded = _load_known_field(ArtifactFiles.present(tmp_path), art.config, len(known))
    except (ValueError, ArtifactError):
        return  # refused at load
    served = _exact_scorer(network, known, lines_cfg, loaded)
    assert served.field_source == "computed"
    rows, cols = art.train.rows[:5], (art.train.cols[:5] + 1) % art.config.n_items
    predict_distributions(network, served, rows, cols)


def test_a_clamped_field_stores_no_distributions_and_serves_from_its_labels(
    tiny_artifact: Path, tmp_path: Path
) -> None:
    # Clamped known entries' t = C[labels] follows from the ratings: the artifact does not store the
    # (N, p) array, nor does a scorer hold one (640 MB per worker on ml-10m), and the answers are the same.
    art = load_artifact(tiny_artifact)
    cfg = art.inference.with_overrides(
        {"mode": "exact", "kernel.known": "clamped", "kernel.same_user": 2.0, "kernel.same_item": 0.5}
    )
    network, known = load_network(art), art.known()
    scorer = _exact_scorer(network, known, cfg)
    assert isinstance(scorer.field.t, ClampedRows) and scorer.field.t.shape == (len(known), 5)
    labels = nearest_level(known.values, network.levels)
    np.testing.assert_array_equal(scorer.field.t[np.arange(len(known))], scorer.compat[labels])
    save_exact_field(scorer, tmp_path)
    with np.load(tmp_path / KNOWN_FIELD) as z:
        assert sorted(z.files) == ["g", "h"]
    loaded = _load_known_field(ArtifactFiles.present(tmp_path), art.config, len(known))
    served = _exact_scorer(network, known, cfg, loaded)
    assert served.field_source == "artifact" and isinstance(served.field.t, ClampedRows)
    # An artifact written before this stored t: it is not read.
    np.savez(tmp_path / KNOWN_FIELD, g=scorer.field.g, h=scorer.field.h, t=scorer.compat[labels])
    older = _load_known_field(ArtifactFiles.present(tmp_path), art.config, len(known))
    assert older is not None and older.t is None
    assert _exact_scorer(network, known, cfg, older).field_source == "artifact"
    rows = np.concatenate([art.train.rows[:6], np.full(art.config.n_items, 2)])  # many users, one's catalogue
    cols = np.concatenate([(art.train.cols[:6] + 1) % art.config.n_items, np.arange(art.config.n_items)])
    for q_rows, q_cols in ((rows[:6], cols[:6]), (rows[6:], cols[6:])):
        np.testing.assert_allclose(
            predict_distributions(network, served, q_rows, q_cols),
            predict_distributions(network, scorer, q_rows, q_cols),
            rtol=1e-12,
        )


def test_held_out_ratings_are_known_at_test_time_but_not_when_scored(
    exact_artifact: Path, synthetic_csv: Path
) -> None:
    art = load_artifact(exact_artifact)
    ds = art.meta["dataset"]
    split = load_dataset(ds["name"], synthetic_csv, split=ds["split"], seed=ds["seed"])
    val = held_out(art, split, "val")
    rows, cols = map_entries(art, split.user_ids, split.item_ids, val)
    # The artifact keeps exactly the validation ratings the trainer carved, apart from the trained-on ones.
    assert sorted(zip(art.held_out.rows, art.held_out.cols, strict=True)) == sorted(
        zip(rows, cols, strict=True)
    )
    trained = set(zip(art.train.rows, art.train.cols, strict=True))
    assert not trained & set(zip(rows, cols, strict=True))
    _, with_held = artifact_scorer(art)
    _, without = artifact_scorer(art, include_held_out=False)
    assert isinstance(with_held, ExactScorer) and isinstance(without, ExactScorer)
    assert len(with_held.known) == len(art.train) + len(val)
    np.testing.assert_array_equal(without.known.rows, art.train.rows)
    # Scoring the validation ratings leaves them out of the known ratings (and out of the stored field,
    # computed with them): dcmc evaluate --on val equals a model over the trained-on ratings alone.
    assert with_held.field_source == "artifact" and without.field_source == "computed"
    exact_cfg = art.inference.with_overrides({"kernel.known": "clamped", "kernel.co_rating": 5.0})
    network = Network(
        art.config,
        art.user_embeddings.astype(np.float64),
        art.item_embeddings.astype(np.float64),
        art.bilinear.astype(np.float64),
    )
    fresh = build_scorer(network, art.train, exact_cfg)
    expected = expected_rating(predict_distributions(network, fresh, rows, cols), art.levels)
    np.testing.assert_allclose(predict_ratings(art, rows, cols, exact_cfg, include_held_out=False), expected)
    assert not np.allclose(predict_ratings(art, rows, cols, exact_cfg), expected)  # their own labels leak


def _mapped(array: np.ndarray) -> bool:
    """Whether `array` is a read-only view of a memory-mapped file."""
    base: object = array
    while isinstance(base, np.ndarray) and not isinstance(base, np.memmap):
        base = base.base
    return (isinstance(base, (np.memmap, mmap.mmap))) and not array.flags.writeable


def test_sparse_co_rating_tables_are_stored_with_the_field_and_read_back(
    synthetic_csv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A catalogue above DENSE_TABLE_MAX: the artifact stores the neighbour tables its field was computed
    # with, and a loader takes them instead of rebuilding them (minutes on Epinions' 139,738 items).
    from model import exact
    from training.pipeline import run_training

    monkeypatch.setattr(exact.affinity, "DENSE_TABLE_MAX", 10)
    monkeypatch.setattr(exact.affinity, "CO_RATING_NEIGHBOURS", 4)
    out = tmp_path / "sparse"
    settings = {
        "inference.mode": "exact",
        "inference.kernel.co_rating": "1",
        "inference.kernel.co_rating_user": "1",
    }
    run_training(
        "csv", synthetic_csv, out, split="random", preset_name="tiny", progress=False, settings=settings
    )
    art = load_artifact(out)
    assert art.known_field is not None and set(art.known_field.tables) == {"items", "users"}
    network = load_network(art)
    built = _exact_scorer(network, art.known(), art.inference)  # no stored field: built here

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the stored tables were rebuilt")

    monkeypatch.setattr(exact.CoRatingGram, "of", refuse)
    _, scorer = artifact_scorer(art)
    assert isinstance(scorer, ExactScorer) and scorer.lines is not None
    assert isinstance(scorer.lines.affinity, exact.SparseAffinity)
    assert isinstance(scorer.lines.user_affinity, exact.SparseAffinity)
    assert (
        built.lines is not None and built.lines.affinity is not None and built.lines.user_affinity is not None
    )
    # Stored in float32, and read as read-only maps of their files (shared by a service's workers).
    for stored, fresh in (
        (scorer.lines.affinity, built.lines.affinity),
        (scorer.lines.user_affinity, built.lines.user_affinity),
    ):
        assert isinstance(stored, exact.SparseAffinity) and isinstance(fresh, exact.SparseAffinity)
        assert _mapped(stored.matrix.data) and _mapped(stored.matrix.indices)
        np.testing.assert_array_equal(stored.toarray(), fresh.toarray().astype(np.float32))
    rows, cols = art.held_out.rows, art.held_out.cols
    probs = network.probabilities(rows, cols)
    answers = built.predict(rows, cols, probs)
    np.testing.assert_allclose(scorer.predict(rows, cols, probs), answers, atol=1e-6)
    # An artifact written before the tables had their own files held them in known_field.npz: still read.
    with np.load(out / KNOWN_FIELD) as z:
        arrays = dict(z)
    for what, csr in art.known_field.tables.items():
        arrays.update({f"{what}_indptr": csr[0], f"{what}_indices": csr[1], f"{what}_data": csr[2]})
    np.savez(tmp_path / "field.npz", **arrays)
    for path in out.glob("co_rating_*.npy"):
        path.unlink()
    (tmp_path / "field.npz").replace(out / KNOWN_FIELD)
    older = _load_known_field(ArtifactFiles.present(out), art.config, len(art.known()))
    assert older is not None and set(older.tables) == {"items", "users"}
    for what, csr in older.tables.items():
        np.testing.assert_array_equal(csr[2], art.known_field.tables[what][2])
        assert not _mapped(csr[2])


def test_a_centred_normalised_input_is_exported_and_centred_on_the_mean_trained_on(
    tmp_path: Path, synthetic_csv: Path
) -> None:
    from training.pipeline import run_training

    out = tmp_path / "centred"
    settings = {"input_center": "mean", "input_scaling": "sqrt", "epochs": "3"}
    run_training(
        "csv", synthetic_csv, out, split="random", preset_name="tiny", settings=settings, progress=False
    )
    art = load_artifact(out)
    assert art.config.input_scaling == "sqrt"
    # The training ratings' mean (the artifact's train split holds the ratings trained on).
    assert art.config.input_center == pytest.approx(float(art.train.values.mean()), abs=1e-6)
    model = DCMC(art.config)
    model.load_state_dict(torch.load(out / "weights.pt", weights_only=True))
    model.eval()
    rows, cols = _dense(art, "row"), _dense(art, "col")
    with torch.no_grad():
        u_torch = model.embed_rows(torch.from_numpy(rows)).numpy()
        v_torch = model.embed_cols(torch.from_numpy(cols)).numpy()
        plain = DCMC(dataclasses.replace(art.config, input_center=0.0, input_scaling="none"))
        plain.load_state_dict(model.state_dict())
        plain.eval()
        assert not np.allclose(plain.embed_rows(torch.from_numpy(rows)).numpy(), u_torch, atol=1e-3)
    onnx = OnnxNetwork(out)
    np.testing.assert_allclose(onnx.embed_users(rows), u_torch, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(onnx.embed_items(cols), v_torch, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(art.user_embeddings, u_torch, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(art.item_embeddings, v_torch, atol=1e-5, rtol=1e-5)
