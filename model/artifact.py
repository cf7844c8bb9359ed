"""The on-disk contract between the trainer and the service.

An artifact is a directory of plain files (no pickles):

    manifest.json        format version, model version and the sha256 of every other file
    config.json          {"model": ModelConfig, "inference": InferenceConfig, "train": ..., "dataset": ...}
    levels.npy           (p,) float64 rating levels
    user_ids.json        external user ids, position = user_idx
    item_ids.json        external item ids, position = item_idx
    train_ratings.npz    rows, cols (int64), values (float64): the ratings the network was trained on
                         (its input rows and columns)
    held_out_ratings.npz the same for the validation ratings carved from the training split: not trained
                         on, but known at test time (absent in older artifacts)
    user_embeddings.npy  (n, d) float32
    item_embeddings.npy  (m, d) float32
    bilinear.npy         (p, d, d) float32 decoder weights
    weights.pt           torch state dict (load with weights_only=True)
    row_branch.onnx, col_branch.onnx, decoder.onnx   (when exported)
    metrics.json         training metrics
    known_field.npz      the converged `exact` field of the known entries for the artifact's inference
                         settings over all known ratings (trained on and held out): g (p, d+1, d+1),
                         h (d+1, d+1) and the settings it was computed for

It is written into a temporary sibling directory and renamed into place, so a crash never leaves a
half-written artifact; loading verifies every checksum.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from model.config import KERNEL_SETTINGS, ConfigError, InferenceConfig, ModelConfig
from model.engine import FieldKey, ScoringModel, compatibility_matrix
from model.exact import KnownField, LevelInterpolation
from model.ids import IdMap

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
KNOWN_FIELD = "known_field.npz"
HELD_OUT = "held_out_ratings.npz"


class ArtifactError(Exception):
    """An artifact is missing, incomplete, tampered with or of an unknown format."""


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextmanager
def artifact_writer(out: Path) -> Iterator[Path]:
    """Yield a temporary directory to fill; on success add the manifest and rename it to `out`."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        write_manifest(tmp)
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_manifest(directory: Path) -> dict[str, Any]:
    """Hash every file of `directory` into manifest.json; returns the manifest."""
    files = {
        p.name: sha256_file(p) for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST
    }
    version = hashlib.sha256("".join(f"{k}:{v};" for k, v in files.items()).encode()).hexdigest()[:12]
    manifest = {"format_version": FORMAT_VERSION, "model_version": version, "files": files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def verify(directory: Path) -> dict[str, Any]:
    """Check that every file listed in the manifest is present and unmodified; returns the manifest."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ArtifactError(f"artifact directory {directory} does not exist")
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise ArtifactError(f"{manifest_path} is missing: not a DCMC artifact, or an unfinished one")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        fmt = manifest["format_version"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ArtifactError(f"{manifest_path} is not a valid manifest: {exc}") from None
    if fmt != FORMAT_VERSION:
        raise ArtifactError(f"{directory}: artifact format {fmt}, this code reads {FORMAT_VERSION}")
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            raise ArtifactError(f"{path} is listed in the manifest but missing")
        actual = sha256_file(path)
        if actual != expected:
            raise ArtifactError(
                f"{path} fails its checksum (manifest {expected[:12]}..., file {actual[:12]}...): "
                "the artifact was modified or truncated; retrain or restore it"
            )
    return manifest


@dataclass
class Artifact:
    """A verified artifact loaded into numpy arrays."""

    path: Path
    model_version: str
    config: ModelConfig
    inference: InferenceConfig
    meta: dict[str, Any]
    users: IdMap
    items: IdMap
    train_rows: np.ndarray
    train_cols: np.ndarray
    train_values: np.ndarray
    user_embeddings: np.ndarray
    item_embeddings: np.ndarray
    bilinear: np.ndarray
    known_field: tuple[FieldKey, KnownField] | None = None
    held_out_rows: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    held_out_cols: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    held_out_values: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.float64))

    @property
    def levels(self) -> np.ndarray:
        """Rating levels, (p,) float64."""
        return np.asarray(self.config.levels, dtype=np.float64)

    def known(self, include_held_out: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The known ratings (rows, cols, values): those trained on, then the held-out validation ones."""
        if not include_held_out or len(self.held_out_rows) == 0:
            return self.train_rows, self.train_cols, self.train_values
        return (
            np.concatenate([self.train_rows, self.held_out_rows]),
            np.concatenate([self.train_cols, self.held_out_cols]),
            np.concatenate([self.train_values, self.held_out_values]),
        )

    def scoring_model(self, config: ModelConfig | None = None, include_held_out: bool = True) -> ScoringModel:
        """A ScoringModel over the stored embeddings and known ratings (with the stored known field).

        `config` replaces the model config (e.g. another T or gamma); the stored field then serves only
        the settings it was computed for. `include_held_out=False` leaves the held-out validation ratings
        out of the known ratings (scoring those very ratings), and the stored field, computed with them, too.
        """
        rows, cols, values = self.known(include_held_out)
        model = ScoringModel(
            config=config or self.config,
            user_emb=self.user_embeddings.astype(np.float64),
            item_emb=self.item_embeddings.astype(np.float64),
            bilinear=self.bilinear.astype(np.float64),
            known_rows=rows,
            known_cols=cols,
            known_values=values,
        )
        if self.known_field is not None and (include_held_out or len(self.held_out_rows) == 0):
            model.add_field(*self.known_field)
        return model


FIELD_KEY_NAMES = ("scaling", "known", "gamma", "layers", "scale", *KERNEL_SETTINGS[3:])
"""The names a known field's key (`ScoringModel.field_key`) is stored under, in order: the settings of
the `exact` CRF, with T and the scale after gamma."""


def save_known_field(path: Path, key: FieldKey, field: KnownField) -> None:
    """Write a known field and the settings it belongs to (plain arrays, no pickles)."""
    extra = {} if field.t is None else {"t": field.t}
    settings = {name: np.array(value) for name, value in zip(FIELD_KEY_NAMES, key, strict=True)}
    np.savez(path, **extra, **settings, g=field.g, h=field.h)


def _load_known_field(path: Path, config: ModelConfig) -> tuple[FieldKey, KnownField]:
    with np.load(path, allow_pickle=False) as z:
        key: FieldKey = (
            str(z["scaling"]),
            str(z["known"]),
            float(z["gamma"]),
            int(z["layers"]),
            float(z["scale"]),
            float(z["tau"]) if "tau" in z.files else config.tau,
            float(z["same_user"]) if "same_user" in z.files else 0.0,
            float(z["same_item"]) if "same_item" in z.files else 0.0,
            float(z["co_rating"]) if "co_rating" in z.files else 0.0,
            float(z["co_rating_power"]) if "co_rating_power" in z.files else 0.0,
            float(z["co_rating_prior"]) if "co_rating_prior" in z.files else 0.0,
            float(z["co_rating_user"]) if "co_rating_user" in z.files else 0.0,
            float(z["co_rating_shrink"]) if "co_rating_shrink" in z.files else 0.0,
        )
        if "co_rating_shrink" not in z.files and key[8] > 0:  # written before the shrinkage was a setting
            key = (*key[:12], 10.0)
        g, h = z["g"].astype(np.float64), z["h"].astype(np.float64)
        t = z["t"].astype(np.float64) if "t" in z.files else None
    dim = config.embedding_dim + 1
    if g.shape != (config.n_levels, dim, dim) or h.shape != (dim, dim):
        raise ValueError(f"known field shapes {g.shape}, {h.shape} do not match the model")
    if (key[6] > 0 or key[7] > 0 or key[8] > 0 or key[11] > 0) != (t is not None) or (
        t is not None and t.shape[1] != config.n_levels
    ):
        raise ValueError("known field: the line terms' distributions are missing or misshapen")
    interp = LevelInterpolation.of(compatibility_matrix(np.asarray(config.levels), key[5]))
    return key, KnownField(g=g, h=h, scaling=key[0], scale=key[4], t=t, interp=interp)


def read_config(directory: str | Path) -> tuple[ModelConfig, InferenceConfig]:
    """The model and inference settings of an artifact, without loading its arrays."""
    path = Path(directory) / "config.json"
    try:
        config = json.loads(path.read_text())
        return ModelConfig.from_dict(config["model"]), InferenceConfig.from_dict(config.get("inference", {}))
    except (OSError, KeyError, ValueError, ConfigError) as exc:
        raise ArtifactError(f"{path}: cannot read the configuration: {exc}") from None


def load_artifact(directory: str | Path) -> Artifact:
    """Verify checksums and load an artifact; raises ArtifactError with a clear message."""
    directory = Path(directory)
    manifest = verify(directory)
    try:
        config = json.loads((directory / "config.json").read_text())
        model_config = ModelConfig.from_dict(config["model"])
        inference = InferenceConfig.from_dict(config.get("inference", {}))
        users = IdMap("user", json.loads((directory / "user_ids.json").read_text()))
        items = IdMap("item", json.loads((directory / "item_ids.json").read_text()))
        with np.load(directory / "train_ratings.npz", allow_pickle=False) as z:
            rows, cols, values = z["rows"], z["cols"], z["values"]
        held_path = directory / HELD_OUT
        held = (np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0))
        if held_path.is_file():
            with np.load(held_path, allow_pickle=False) as z:
                held = (z["rows"], z["cols"], z["values"])
        user_emb = np.load(directory / "user_embeddings.npy", allow_pickle=False)
        item_emb = np.load(directory / "item_embeddings.npy", allow_pickle=False)
        bilinear = np.load(directory / "bilinear.npy", allow_pickle=False)
        field_path = directory / KNOWN_FIELD
        field = _load_known_field(field_path, model_config) if field_path.is_file() else None
    except (OSError, KeyError, ValueError, ConfigError) as exc:
        raise ArtifactError(f"{directory}: cannot read artifact: {exc}") from None
    d, p = model_config.embedding_dim, model_config.n_levels
    expected = {
        "user_embeddings.npy": (user_emb.shape, (len(users), d)),
        "item_embeddings.npy": (item_emb.shape, (len(items), d)),
        "bilinear.npy": (bilinear.shape, (p, d, d)),
    }
    for name, (got, want) in expected.items():
        if tuple(got) != want:
            raise ArtifactError(f"{directory / name}: shape {tuple(got)}, config says {want}")
    if len(users) != model_config.n_users or len(items) != model_config.n_items:
        raise ArtifactError(f"{directory}: id maps do not match the configured matrix size")
    if not len(held[0]) == len(held[1]) == len(held[2]):
        raise ArtifactError(f"{directory / HELD_OUT}: rows, cols and values differ in length")
    n_known = len(rows) + len(held[0])
    if field is not None and field[1].t is not None and len(field[1].t) != n_known:
        raise ArtifactError(
            f"{directory / KNOWN_FIELD}: {len(field[1].t)} known entries, the ratings hold {n_known}"
        )
    return Artifact(
        path=directory,
        model_version=manifest["model_version"],
        config=model_config,
        inference=inference,
        meta={k: v for k, v in config.items() if k not in ("model", "inference")},
        users=users,
        items=items,
        train_rows=rows.astype(np.int64),
        train_cols=cols.astype(np.int64),
        train_values=values.astype(np.float64),
        user_embeddings=user_emb,
        item_embeddings=item_emb,
        bilinear=bilinear,
        known_field=field,
        held_out_rows=held[0].astype(np.int64),
        held_out_cols=held[1].astype(np.int64),
        held_out_values=held[2].astype(np.float64),
    )
