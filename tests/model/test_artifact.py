"""The artifact contract: complete, checksummed, refused when tampered with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from model.artifact import (
    FIELD_KEY,
    FORMAT_VERSION,
    HELD_OUT,
    KNOWN_FIELD,
    ArtifactError,
    ArtifactUnavailable,
    artifact_writer,
    load_artifact,
    read_config,
    verify,
    write_manifest,
)
from model.config import InferenceConfig, ModelConfig
from model.engine import OnnxNetwork
from model.exact import ExactScorer
from model.ratings import Ratings
from model.scorers import artifact_scorer


@pytest.fixture
def artifact_copy(tiny_artifact: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(tiny_artifact, dst)
    return dst


def test_round_trip(tiny_artifact: Path) -> None:
    art = load_artifact(tiny_artifact)
    assert art.config.n_users == len(art.users) and art.config.n_items == len(art.items)
    assert art.user_embeddings.dtype == np.float32
    assert art.user_embeddings.shape == (art.config.n_users, art.config.embedding_dim)
    assert art.levels.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert ModelConfig.from_dict(art.config.to_dict()) == art.config
    assert InferenceConfig.from_dict(art.inference.to_dict()) == art.inference
    manifest = json.loads((tiny_artifact / "manifest.json").read_text())
    listed = set(manifest["files"])
    assert listed == {p.name for p in tiny_artifact.iterdir()} - {"manifest.json"}
    assert {"weights.pt", "row_branch.onnx", "col_branch.onnx", "decoder.onnx", "metrics.json"} <= listed
    assert art.model_version == manifest["model_version"]
    assert manifest["format_version"] == FORMAT_VERSION == 2
    # The known ratings: those trained on, then the held-out ones, one index of each.
    assert isinstance(art.train, Ratings) and isinstance(art.held_out, Ratings)
    assert len(art.train) > 0 and len(art.held_out) > 0
    known = art.known()
    assert len(known) == len(art.train) + len(art.held_out)
    np.testing.assert_array_equal(known.rows[: len(art.train)], art.train.rows)
    np.testing.assert_array_equal(known.values[len(art.train) :], art.held_out.values)
    assert art.known() is known and art.known(include_held_out=False) is art.train
    assert (known.n_users, known.n_items) == (art.config.n_users, art.config.n_items)
    assert read_config(tiny_artifact) == (art.config, art.inference)


def test_tampered_file_is_refused(artifact_copy: Path) -> None:
    emb = np.load(artifact_copy / "user_embeddings.npy")
    emb[0, 0] += 1.0
    np.save(artifact_copy / "user_embeddings.npy", emb)
    with pytest.raises(ArtifactError, match=r"user_embeddings.npy fails its checksum"):
        load_artifact(artifact_copy)


def test_truncated_file_is_refused(artifact_copy: Path) -> None:
    data = (artifact_copy / "row_branch.onnx").read_bytes()
    (artifact_copy / "row_branch.onnx").write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError, match=r"row_branch\.onnx fails its checksum"):
        verify(artifact_copy)


def test_missing_file_and_manifest_are_refused(artifact_copy: Path, tmp_path: Path) -> None:
    (artifact_copy / "bilinear.npy").unlink()
    with pytest.raises(ArtifactError, match=r"bilinear\.npy is listed in the manifest but missing"):
        load_artifact(artifact_copy)
    (artifact_copy / "manifest.json").unlink()
    with pytest.raises(ArtifactError, match=r"manifest\.json is missing"):
        load_artifact(artifact_copy)
    with pytest.raises(ArtifactError, match="does not exist"):
        load_artifact(tmp_path / "nowhere")


def _relist(directory: Path, edit: Any) -> None:
    """Rewrite `directory`'s manifest with `edit(files)` applied to its file list (checksums kept)."""
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest["files"])
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["../outside.npy", "/etc/hostname", "sub/x.npy", "..", ".", "", "a\\b"])
def test_a_manifest_name_outside_the_artifact_is_refused(
    artifact_copy: Path, tmp_path: Path, name: str
) -> None:
    (tmp_path / "outside.npy").write_bytes(b"not read")
    _relist(artifact_copy, lambda files: files.update({name: "0" * 64}))
    with pytest.raises(ArtifactError, match="a file name must be a plain name inside the artifact") as info:
        verify(artifact_copy)
    assert info.value.reason == "a manifest name outside the artifact"


def test_a_linked_file_is_refused(artifact_copy: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.npy"
    (artifact_copy / "bilinear.npy").rename(elsewhere)
    (artifact_copy / "bilinear.npy").symlink_to(elsewhere)  # same bytes, so the same checksum
    with pytest.raises(ArtifactError, match="is a symbolic link"):
        load_artifact(artifact_copy)


def test_every_file_the_loader_opens_is_listed_and_checked(artifact_copy: Path) -> None:
    # A file on disk that the manifest does not list is never read: here the held-out ratings.
    _relist(artifact_copy, lambda files: files.pop(HELD_OUT))
    art = load_artifact(artifact_copy)
    assert (artifact_copy / HELD_OUT).is_file() and len(art.held_out) == 0
    assert HELD_OUT not in art.files and "bilinear.npy" in art.files
    with pytest.raises(ArtifactError, match=rf"{HELD_OUT} is not listed in manifest.json"):
        art.files.path(HELD_OUT)
    # The ONNX graphs are opened through the listing too.
    _relist(artifact_copy, lambda files: files.pop("decoder.onnx"))
    with pytest.raises(ArtifactError, match=r"decoder\.onnx is not listed in manifest.json"):
        OnnxNetwork(load_artifact(artifact_copy).files)
    # A required file missing from the listing stops the load, even when it is on disk.
    _relist(artifact_copy, lambda files: files.pop("bilinear.npy"))
    with pytest.raises(ArtifactError, match=r"bilinear\.npy is not listed in manifest.json"):
        load_artifact(artifact_copy)


def test_a_tampered_or_missing_file_may_be_retried_and_bad_contents_not(artifact_copy: Path) -> None:
    # ArtifactUnavailable: what a directory being written or replaced shows (the reloader retries it).
    data = (artifact_copy / "bilinear.npy").read_bytes()
    (artifact_copy / "bilinear.npy").write_bytes(data[:-8])
    with pytest.raises(ArtifactUnavailable) as info:
        load_artifact(artifact_copy)
    assert info.value.reason == "a file fails its checksum" and "/" not in info.value.reason
    (artifact_copy / "bilinear.npy").unlink()
    with pytest.raises(ArtifactUnavailable, match="listed in the manifest but missing"):
        load_artifact(artifact_copy)
    (artifact_copy / "bilinear.npy").write_bytes(data)
    load_artifact(artifact_copy)
    # Verified, but wrong inside: a plain ArtifactError (refused for good).
    np.save(artifact_copy / "bilinear.npy", np.zeros((1, 1, 1), np.float32))
    write_manifest(artifact_copy)
    with pytest.raises(ArtifactError, match="shape") as bad:
        load_artifact(artifact_copy)
    assert not isinstance(bad.value, ArtifactUnavailable) and bad.value.reason == "invalid contents"


def test_crash_while_writing_leaves_no_artifact(tmp_path: Path) -> None:
    out = tmp_path / "art"
    with pytest.raises(RuntimeError), artifact_writer(out) as tmp:
        (tmp / "a.txt").write_text("half")
        raise RuntimeError("crash")
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_rewrite_replaces_previous_artifact(tmp_path: Path) -> None:
    out = tmp_path / "art"
    for text in ("one", "two"):
        with artifact_writer(out) as tmp:
            (tmp / "a.txt").write_text(text)
    assert (out / "a.txt").read_text() == "two"
    assert verify(out)["files"].keys() == {"a.txt"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


FLAT_INFERENCE = {
    "mode": "exact",
    "subset_rows": 8,
    "subset_cols": 8,
    "repeats": 3,
    "seed": 0,
    "scaling": "normalized",
    "known": "clamped",
    "gamma": 1.5,
    "tau": None,
    "same_user": 0.0,
    "same_item": 0.0,
    "co_rating": 2.0,
    "co_rating_power": 5.0,
    "co_rating_shrink": 10.0,
    "co_rating_user": 0.0,
    "co_rating_prior": 0.0,
    "baseline": 0.0,
    "baseline_user_shrink": 2.0,
    "baseline_item_shrink": 5.0,
}
"""The inference settings as a format-1 artifact's config.json held them: flat."""


def _as_format_1(directory: Path) -> None:
    """Rewrite an artifact as format 1 wrote it: flat inference settings, a known field whose key lies in
    the npz itself (no known_field.json), and format_version 1."""
    config = json.loads((directory / "config.json").read_text())
    config["inference"] = FLAT_INFERENCE
    (directory / "config.json").write_text(json.dumps(config))
    art_d = config["model"]["hidden"][-1] + 1
    p = len(config["model"]["levels"])
    old_key = {"scaling": "normalized", "known": "clamped", "gamma": 1.5, "layers": 5, "scale": 0.0}
    np.savez(directory / KNOWN_FIELD, g=np.zeros((p, art_d, art_d)), h=np.eye(art_d), **old_key)
    (directory / FIELD_KEY).unlink(missing_ok=True)
    write_manifest(directory)
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["format_version"] = 1
    (directory / "manifest.json").write_text(json.dumps(manifest))


def test_a_format_1_artifact_still_loads(artifact_copy: Path) -> None:
    _as_format_1(artifact_copy)
    art = load_artifact(artifact_copy)
    inference = art.inference
    assert inference.mode == "exact" and inference.crf.gamma == 1.5 and inference.crf.tau is None
    assert (inference.paper.subset_rows, inference.paper.repeats) == (8, 3)
    assert (inference.kernel.known, inference.kernel.co_rating, inference.kernel.co_rating_power) == (
        "clamped",
        2.0,
        5.0,
    )
    assert read_config(artifact_copy)[1] == inference
    # Its stored field has no JSON key: it is not used, but recomputed.
    assert art.known_field is None
    _, scorer = artifact_scorer(art)
    assert isinstance(scorer, ExactScorer) and scorer.field_source == "computed"
    assert scorer.crf.gamma == 1.5
    assert np.abs(scorer.field.g).max() > 0  # not the zeros written above


def test_an_unknown_format_is_refused(artifact_copy: Path) -> None:
    manifest = json.loads((artifact_copy / "manifest.json").read_text())
    manifest["format_version"] = FORMAT_VERSION + 1
    (artifact_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=f"artifact format {FORMAT_VERSION + 1}"):
        load_artifact(artifact_copy)


def test_bad_inference_settings_are_an_artifact_error(artifact_copy: Path) -> None:
    config = json.loads((artifact_copy / "config.json").read_text())
    config["inference"]["crf"]["gamma"] = -1.0
    (artifact_copy / "config.json").write_text(json.dumps(config))
    write_manifest(artifact_copy)
    with pytest.raises(ArtifactError, match=r"crf\.gamma"):
        load_artifact(artifact_copy)
    with pytest.raises(ArtifactError, match=r"crf\.gamma"):
        read_config(artifact_copy)
