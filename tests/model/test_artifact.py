"""The artifact contract: complete, checksummed, refused when tampered with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from model.artifact import ArtifactError, artifact_writer, load_artifact, verify
from model.config import InferenceConfig, ModelConfig


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
