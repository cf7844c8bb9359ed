"""The on-disk contract between the trainer and the service.

An artifact is a directory of plain files (no pickles):

    manifest.json        format version, model version and the sha256 of every other file
    config.json          {"model": ModelConfig, "inference": InferenceConfig, "train": ..., "dataset": ...}
                         and, where the training averaged several searches (`TrainConfig.searches`),
                         "inference_averaged": [InferenceConfig, ...], the other searches' settings
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
    items.jsonl          the item catalogue, one JSON record per line (model/catalogue.py), where the
                         training was given one (`dcmc train --items`, or MovieLens-100K's u.item)
    known_field.npz      the converged `exact` field of the known entries for the artifact's inference
                         settings over all known ratings (trained on and held out): g (p, d+1, d+1),
                         h (d+1, d+1) and, with line terms, t (N, p)
    known_field.json     the settings that field was computed for (model.exact.FieldKey); a scorer whose
                         settings differ recomputes the field
    co_rating_{items,users}_{indptr,indices,data}.npy
                         the sparse co-rating tables that field was computed with (CSR: int64, int32,
                         float32), memory-mapped read-only by every reader, so a service's workers share
                         one copy in the page cache (older artifacts held them in known_field.npz)

Format 1 (before the inference settings were grouped) still loads: its flat inference settings are read
into groups, and its stored field, whose key was a tuple, is recomputed.

It is written into a temporary sibling directory and renamed into place, so a crash never leaves a
half-written artifact; loading verifies every checksum.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from model.catalogue import CATALOGUE, ItemRecord, load_catalogue
from model.config import ConfigError, InferenceConfig, ModelConfig
from model.ids import IdMap
from model.ratings import Ratings

FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
MANIFEST = "manifest.json"
KNOWN_FIELD = "known_field.npz"
FIELD_KEY = "known_field.json"
HELD_OUT = "held_out_ratings.npz"
AVERAGED = "inference_averaged"
"""config.json's list of the settings averaged with "inference"'s (`Artifact.averaged`)."""
BASELINE = "baseline.npz"
"""The bias baseline's fit to the known ratings with the fold-in's penalties (`save_baseline`): what a
service worker would otherwise refit at every start-up (37 s of a 40 s start-up on the synthetic ml-10m)."""
TABLE_PARTS = (("indptr", np.int64), ("indices", np.int32), ("data", np.float32))
"""The CSR arrays of a stored co-rating table and their dtypes on disk."""


def table_file(what: str, part: str) -> str:
    """The file of one CSR array of the `items` or `users` co-rating table."""
    return f"co_rating_{what}_{part}.npy"


def is_known_field_file(name: str) -> bool:
    """Whether an artifact file belongs to the stored known field (rewritten with it)."""
    return name in (KNOWN_FIELD, FIELD_KEY) or (name.startswith("co_rating_") and name.endswith(".npy"))


class ArtifactError(Exception):
    """An artifact is missing, incomplete, tampered with or of an unknown format. `reason` says what in
    a few words without any path (what a public status page may show); the message says where."""

    def __init__(self, message: str, reason: str = "the artifact cannot be read") -> None:
        super().__init__(message)
        self.reason = reason


class ArtifactUnavailable(ArtifactError):
    """The artifact's files could not be verified as its manifest lists them (missing, or failing a
    checksum). It may be one that is being written or replaced: a later try may succeed."""


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


@contextmanager
def rewritten(
    directory: str | Path, drop: Callable[[str], bool] = lambda name: False
) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Rewrite the artifact at `directory` atomically (`artifact_writer`): yields (the new directory, its
    config.json as a dict). Every file is copied but those `drop` names and the manifest; the caller changes
    the config and writes what it adds; on exit the config is written, then a new manifest, so the result
    is a new model version."""
    directory = Path(directory)
    with artifact_writer(directory) as tmp:
        for path in directory.iterdir():
            if path.is_file() and path.name != MANIFEST and not drop(path.name):
                shutil.copy2(path, tmp / path.name)
        config = json.loads((directory / "config.json").read_text())
        yield tmp, config
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_manifest(directory: Path) -> dict[str, Any]:
    """Hash every file of `directory` into manifest.json; returns the manifest."""
    files = {
        p.name: sha256_file(p) for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST
    }
    version = hashlib.sha256("".join(f"{k}:{v};" for k, v in files.items()).encode()).hexdigest()[:12]
    manifest = {"format_version": FORMAT_VERSION, "model_version": version, "files": files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def check_file_name(name: object, manifest: Path) -> None:
    """A manifest's file name must name a plain file of the artifact directory itself: relative, one
    component, not `.` or `..`, no path separator (ArtifactError otherwise: nothing outside is read)."""
    if (
        not isinstance(name, str)
        or name in ("", ".", "..", MANIFEST)
        or "/" in name
        or "\\" in name
        or "\0" in name
        or Path(name).is_absolute()
    ):
        raise ArtifactError(
            f"{manifest} lists {name!r}: a file name must be a plain name inside the artifact",
            "a manifest name outside the artifact",
        )


def verify(directory: Path) -> dict[str, Any]:
    """Check that every file listed in the manifest is present and unmodified; returns the manifest."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ArtifactUnavailable(f"artifact directory {directory} does not exist", "no artifact directory")
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise ArtifactUnavailable(
            f"{manifest_path} is missing: not a DCMC artifact, or an unfinished one", "no manifest"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        fmt = manifest["format_version"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ArtifactUnavailable(
            f"{manifest_path} is not a valid manifest: {exc}", "invalid manifest"
        ) from None
    if fmt not in READABLE_FORMATS:
        raise ArtifactError(
            f"{directory}: artifact format {fmt}, this code reads {READABLE_FORMATS}",
            f"artifact format {fmt}",
        )
    if not isinstance(files, dict):
        raise ArtifactError(
            f"{manifest_path} is not a valid manifest: `files` is not an object", "invalid manifest"
        )
    for name, expected in files.items():
        check_file_name(name, manifest_path)
        path = directory / name
        if path.is_symlink():
            raise ArtifactError(
                f"{path} is a symbolic link: an artifact holds its own files", "a linked file"
            )
        if not path.is_file():
            raise ArtifactUnavailable(
                f"{path} is listed in the manifest but missing", "a listed file is missing"
            )
        actual = sha256_file(path)
        if actual != expected:
            raise ArtifactUnavailable(
                f"{path} fails its checksum (manifest {expected[:12]}..., file {actual[:12]}...): "
                "the artifact was modified or truncated; retrain or restore it",
                "a file fails its checksum",
            )
    out: dict[str, Any] = manifest
    return out


@dataclass(frozen=True)
class StoredBiases:
    """The bias baseline's fit to the known ratings (`model.exact.bias_baseline`) and its penalties."""

    user_shrink: float
    item_shrink: float
    mu: float
    users: np.ndarray  # (n,) float64
    items: np.ndarray  # (m,) float64


@dataclass(frozen=True)
class StoredField:
    """A known field as the artifact stores it: the settings it was computed for and its arrays."""

    key: dict[str, Any]
    g: np.ndarray  # (p, d+1, d+1) float64
    h: np.ndarray  # (d+1, d+1)
    t: np.ndarray | None  # (N, p), present when the kernel has line terms
    tables: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    """The sparse co-rating tables ("items", "users") the field was computed with, as CSR (indptr,
    indices, data): what would take minutes to rebuild at every start-up on a large catalogue."""
    biases: StoredBiases | None = None
    """The bias baseline of the chosen output, fitted to the same known ratings (otherwise refitted at
    every start-up: alternating sweeps over all of them)."""


@dataclass(frozen=True)
class ArtifactFiles:
    """The files a verified manifest lists: the only files of an artifact that are ever opened."""

    directory: Path
    names: frozenset[str]

    @classmethod
    def present(cls, directory: Path) -> ArtifactFiles:
        """Every file now in `directory`, unchecked: for one being written, before it has a manifest."""
        directory = Path(directory)
        return cls(directory, frozenset(p.name for p in directory.iterdir() if p.is_file()))

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def path(self, name: str) -> Path:
        """The path of a listed file; ArtifactError for a file the manifest does not list (its bytes were
        not checked, so it is not read)."""
        if name not in self.names:
            raise ArtifactError(
                f"{self.directory}: {name} is not listed in {MANIFEST}; retrain or restore it",
                "a file the manifest does not list",
            )
        return self.directory / name


@dataclass
class Artifact:
    """A verified artifact loaded into numpy arrays."""

    path: Path
    files: ArtifactFiles
    """The files its manifest lists and checked (`files.path(name)` opens one, e.g. an ONNX graph)."""
    model_version: str
    config: ModelConfig
    inference: InferenceConfig
    meta: dict[str, Any]
    users: IdMap
    items: IdMap
    train: Ratings
    """The ratings the network was trained on (its input rows and columns)."""
    held_out: Ratings
    """Validation ratings carved from the training split: not trained on, but known at test time."""
    user_embeddings: np.ndarray
    item_embeddings: np.ndarray
    bilinear: np.ndarray
    known_field: StoredField | None = None
    baseline: StoredBiases | None = None
    """The bias baseline's fit to the known ratings (`BASELINE`), where the artifact holds one."""
    catalogue: dict[str, ItemRecord] | None = None
    """The items' records (`CATALOGUE`, model/catalogue.py), where the training was given them."""
    averaged: tuple[InferenceConfig, ...] = ()
    """The settings of the training's other searches (`TrainConfig.searches`), whose final distributions
    are averaged with `inference`'s (config.json `inference_averaged`); none for a single setting."""
    _known: Ratings | None = field(default=None, init=False, repr=False)

    def settings(self, overrides: Mapping[str, Any] | None = None) -> tuple[InferenceConfig, ...]:
        """Every inference setting the artifact serves, `inference` first, each with `overrides` (dotted
        names) applied: one, or those of several searches whose predictions are averaged."""
        return tuple(s.with_overrides(dict(overrides or {})) for s in (self.inference, *self.averaged))

    @property
    def levels(self) -> np.ndarray:
        """Rating levels, (p,) float64."""
        return np.asarray(self.config.levels, dtype=np.float64)

    def online_snapshot(self, stream: str, identity: str | None = None) -> str:
        """The id of the last rating of the Redis stream `stream` that this artifact was trained on
        (`dcmc train --online-ratings`), or "0" when it holds none of that stream's ratings: another key,
        or another stream of that key (the artifact recorded an identity and the stream's, `identity`, is
        another)."""
        online = self._online_record(stream, identity)
        return str(online.get("last_id", "0")) if online else "0"

    def online_held_out(self, stream: str, identity: str | None = None) -> list[tuple[str, str, float]]:
        """The ratings of that stream, up to `online_snapshot`, of pairs the dataset holds out (validation
        or test): not trained on, known to the served model (the service folds them in first)."""
        online = self._online_record(stream, identity)
        return [(str(u), str(i), float(r)) for u, i, r in online.get("held_out_pairs", [])]

    def _online_record(self, stream: str, identity: str | None) -> dict[str, Any]:
        online = (self.meta.get("dataset") or {}).get("online_ratings") or {}
        recorded = online.get("stream_identity")
        if online.get("stream") != stream or (recorded is not None and recorded != identity):
            return {}
        out: dict[str, Any] = online
        return out

    def known(self, include_held_out: bool = True) -> Ratings:
        """The known ratings: those trained on, then the held-out validation ones (unless excluded)."""
        if not include_held_out or len(self.held_out) == 0:
            return self.train
        if self._known is None:
            self._known = Ratings(
                np.concatenate([self.train.rows, self.held_out.rows]),
                np.concatenate([self.train.cols, self.held_out.cols]),
                np.concatenate([self.train.values, self.held_out.values]),
                self.config.n_users,
                self.config.n_items,
            )
        return self._known

    def stored_field(self, include_held_out: bool = True) -> StoredField | None:
        """The stored known field, where it was computed over the same known ratings."""
        return self.known_field if include_held_out or len(self.held_out) == 0 else None


def save_known_field(
    directory: Path,
    key: dict[str, Any],
    g: np.ndarray,
    h: np.ndarray,
    t: np.ndarray | None,
    tables: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None,
    biases: StoredBiases | None = None,
) -> None:
    """Write a known field (plain arrays, no pickles), its sparse co-rating tables if any (one .npy file
    per CSR array, to be memory-mapped), the bias baseline's fit if any, and, as JSON, the settings the
    field belongs to."""
    arrays = {"g": g, "h": h} if t is None else {"g": g, "h": h, "t": t}
    if biases is not None:
        arrays.update(
            bias_shrink=np.array([biases.user_shrink, biases.item_shrink]),
            bias_mu=np.array([biases.mu]),
            bias_users=biases.users,
            bias_items=biases.items,
        )
    np.savez(directory / KNOWN_FIELD, **arrays)  # type: ignore[arg-type]
    for what, csr in (tables or {}).items():
        for (part, dtype), array in zip(TABLE_PARTS, csr, strict=True):
            np.save(directory / table_file(what, part), np.asarray(array, dtype=dtype))
    (directory / FIELD_KEY).write_text(json.dumps(key, indent=2) + "\n")


def save_baseline(directory: Path, biases: StoredBiases) -> None:
    """Write the bias baseline's fit to the known ratings (plain arrays) as `BASELINE`."""
    np.savez(
        directory / BASELINE,
        shrink=np.array([biases.user_shrink, biases.item_shrink]),
        mu=np.array([biases.mu]),
        users=np.asarray(biases.users, dtype=np.float64),
        items=np.asarray(biases.items, dtype=np.float64),
    )


def _load_baseline(files: ArtifactFiles, config: ModelConfig) -> StoredBiases | None:
    if BASELINE not in files:
        return None
    with np.load(files.path(BASELINE), allow_pickle=False) as z:
        (user_shrink, item_shrink), mu, users, items = z["shrink"], z["mu"], z["users"], z["items"]
    if users.shape != (config.n_users,) or items.shape != (config.n_items,):
        raise ValueError(f"{BASELINE}: biases of {users.shape} users and {items.shape} items")
    return StoredBiases(float(user_shrink), float(item_shrink), float(mu[0]), users, items)


def _load_known_field(files: ArtifactFiles, config: ModelConfig, n_known: int) -> StoredField | None:
    """The stored field and its key; None for a format-1 field (no JSON key: it is recomputed)."""
    if FIELD_KEY not in files:
        return None
    key_path = files.path(FIELD_KEY)
    key = json.loads(key_path.read_text())
    if not isinstance(key, dict):
        raise ValueError(f"{key_path} does not hold a JSON object")
    with np.load(files.path(KNOWN_FIELD), allow_pickle=False) as z:
        g, h = z["g"].astype(np.float64), z["h"].astype(np.float64)
        # A field of clamped entries never reads a stored t (it follows from the labels; artifacts written
        # before that hold one): not read, not held.
        t = z["t"].astype(np.float64) if "t" in z.files and key.get("known") != "clamped" else None
        biases = None
        if "bias_users" in z.files:
            (user_shrink, item_shrink), users, items = z["bias_shrink"], z["bias_users"], z["bias_items"]
            if users.shape != (config.n_users,) or items.shape != (config.n_items,):
                raise ValueError(f"known field: biases of {users.shape} users and {items.shape} items")
            biases = StoredBiases(
                float(user_shrink), float(item_shrink), float(z["bias_mu"][0]), users, items
            )
        tables = {
            what: (z[f"{what}_indptr"], z[f"{what}_indices"], z[f"{what}_data"].astype(np.float32))
            for what in ("items", "users")
            if f"{what}_indptr" in z.files  # an artifact written before the tables had their own files
        }
    for what in ("items", "users"):
        if table_file(what, "indptr") in files:
            # Read-only maps of the files: the pages are shared by every process that maps them.
            loaded = [np.load(files.path(table_file(what, part)), mmap_mode="r") for part, _ in TABLE_PARTS]
            tables[what] = (loaded[0], loaded[1], loaded[2])
    for what, (indptr, _, _) in tables.items():
        size = config.n_items if what == "items" else config.n_users
        if len(indptr) != size + 1:
            raise ValueError(f"known field: the {what} table has {len(indptr) - 1} lines, the model {size}")
    dim = config.embedding_dim + 1
    if g.shape != (config.n_levels, dim, dim) or h.shape != (dim, dim):
        raise ValueError(f"known field shapes {g.shape}, {h.shape} do not match the model")
    if t is not None and t.shape != (n_known, config.n_levels):
        raise ValueError(f"known field: t has shape {t.shape}, the ratings hold {n_known} known entries")
    return StoredField(key=key, g=g, h=h, t=t, tables=tables, biases=biases)


def read_config(directory: str | Path) -> tuple[ModelConfig, InferenceConfig]:
    """The model and inference settings of an artifact, without loading its arrays."""
    path = Path(directory) / "config.json"
    try:
        config = json.loads(path.read_text())
        return ModelConfig.from_dict(config["model"]), InferenceConfig.from_dict(config.get("inference", {}))
    except (OSError, KeyError, ValueError, ConfigError) as exc:
        raise ArtifactError(f"{path}: cannot read the configuration: {exc}") from None


def load_staged(directory: Path, config: dict[str, Any]) -> Artifact:
    """The artifact being written in `directory` (an `artifact_writer`'s temporary one), loaded as it
    stands with `config` as its config.json: what the training's search and fold-in choice read before
    the artifact is written once, instead of writing it, reading it back and rewriting it."""
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_manifest(directory)
    return load_artifact(directory)


def load_artifact(directory: str | Path) -> Artifact:
    """Verify checksums and load an artifact; raises ArtifactError with a clear message.

    Give it a resolved directory (`os.path.realpath` of a published link) when a publish may repoint
    the link meanwhile: every file is then read from that one directory."""
    directory = Path(directory)
    manifest = verify(directory)
    files = ArtifactFiles(directory, frozenset(manifest["files"]))
    try:
        config = json.loads(files.path("config.json").read_text())
        model_config = ModelConfig.from_dict(config["model"])
        inference = InferenceConfig.from_dict(config.get("inference", {}))
        averaged = tuple(InferenceConfig.from_dict(d) for d in config.get(AVERAGED, []))
        users = IdMap("user", json.loads(files.path("user_ids.json").read_text()))
        items = IdMap("item", json.loads(files.path("item_ids.json").read_text()))
        with np.load(files.path("train_ratings.npz"), allow_pickle=False) as z:
            rows, cols, values = z["rows"], z["cols"], z["values"]
        held = (np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0))
        if HELD_OUT in files:
            with np.load(files.path(HELD_OUT), allow_pickle=False) as z:
                held = (z["rows"], z["cols"], z["values"])
        # Read-only maps: the float32 embeddings a service keeps are shared by its workers' page cache.
        user_emb = np.load(files.path("user_embeddings.npy"), mmap_mode="r", allow_pickle=False)
        item_emb = np.load(files.path("item_embeddings.npy"), mmap_mode="r", allow_pickle=False)
        bilinear = np.load(files.path("bilinear.npy"), allow_pickle=False)
        n, m = model_config.n_users, model_config.n_items
        train = Ratings(rows, cols, values, n, m)
        held_out = Ratings(*held, n, m)
        field = None
        if KNOWN_FIELD in files:
            field = _load_known_field(files, model_config, len(train) + len(held_out))
        baseline = _load_baseline(files, model_config)
        catalogue = load_catalogue(files.path(CATALOGUE)) if CATALOGUE in files else None
    except OSError as exc:  # a file gone since it was verified: the directory is being replaced
        raise ArtifactUnavailable(
            f"{directory}: cannot read artifact: {exc}", "a file went missing"
        ) from None
    except (KeyError, ValueError, ConfigError) as exc:  # CatalogueError is a ValueError
        raise ArtifactError(f"{directory}: cannot read artifact: {exc}", "invalid contents") from None
    d, p = model_config.embedding_dim, model_config.n_levels
    expected = {
        "user_embeddings.npy": (user_emb.shape, (len(users), d)),
        "item_embeddings.npy": (item_emb.shape, (len(items), d)),
        "bilinear.npy": (bilinear.shape, (p, d, d)),
    }
    for name, (got, want) in expected.items():
        if tuple(got) != want:
            raise ArtifactError(
                f"{directory / name}: shape {tuple(got)}, config says {want}", "invalid contents"
            )
    if len(users) != model_config.n_users or len(items) != model_config.n_items:
        raise ArtifactError(
            f"{directory}: id maps do not match the configured matrix size", "invalid contents"
        )
    return Artifact(
        path=directory,
        files=files,
        model_version=manifest["model_version"],
        config=model_config,
        inference=inference,
        meta={k: v for k, v in config.items() if k not in ("model", "inference", AVERAGED)},
        users=users,
        items=items,
        train=train,
        held_out=held_out,
        user_embeddings=user_emb,
        item_embeddings=item_emb,
        bilinear=bilinear,
        known_field=field,
        baseline=baseline,
        catalogue=catalogue,
        averaged=averaged,
    )


def publish(directory: str | Path, link: str | Path) -> str:
    """Point the symlink `link` (e.g. ARTIFACTS/current, what `dcmc serve` serves and polls) at the
    artifact `directory`, atomically: a new symlink renamed over the old one, so a reader sees either the
    old target or the new one. The artifact is verified first (ArtifactError: nothing changes); the link
    is relative when both sit in one folder (it survives a volume mounted elsewhere). Returns the model
    version now published."""
    directory, link = Path(directory), Path(link)
    version = str(load_artifact(directory).model_version)
    if link.exists() and not link.is_symlink():
        raise ArtifactError(f"{link} exists and is not a symlink: move it aside, then publish")
    link.parent.mkdir(parents=True, exist_ok=True)
    target = os.path.relpath(directory.resolve(), link.parent.resolve())
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)
    return version
