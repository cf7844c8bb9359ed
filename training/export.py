"""Publish a trained model: ONNX export with a parity check, embeddings, id maps and the manifest."""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from model.artifact import HELD_OUT, StoredBiases, artifact_writer, save_baseline, save_known_field
from model.catalogue import ItemRecord, write_catalogue
from model.config import InferenceConfig, ModelConfig
from model.engine import Network, OnnxNetwork
from model.exact import BiasModel, ExactScorer
from model.network import DCMC
from model.online import ITEM_SHRINK, USER_SHRINK
from model.ratings import Ratings
from model.scorers import build_scorer
from training.data import Entries
from training.errors import ExportError
from training.trainer import RatingMatrix, embed_all

log = logging.getLogger(__name__)

PARITY_TOLERANCE = 1e-5


class _Decoder(nn.Module):
    """Bilinear decoder + softmax as a standalone graph."""

    def __init__(self, model: DCMC) -> None:
        super().__init__()
        self.model = model

    def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.model.scores(user, item), dim=-1)


def export_onnx(model: DCMC, directory: Path) -> None:
    """Write row_branch.onnx, col_branch.onnx and decoder.onnx with a dynamic batch axis."""
    model.eval()
    cfg = model.config
    d = cfg.embedding_dim
    graphs: list[tuple[str, nn.Module, tuple[torch.Tensor, ...], list[str]]] = [
        ("row_branch.onnx", model.row_branch, (torch.zeros(2, cfg.n_items),), ["ratings"]),
        ("col_branch.onnx", model.col_branch, (torch.zeros(2, cfg.n_users),), ["ratings"]),
        ("decoder.onnx", _Decoder(model), (torch.zeros(2, d), torch.zeros(2, d)), ["user", "item"]),
    ]
    for name, module, args, inputs in graphs:
        axes = {k: {0: "batch"} for k in [*inputs, "output"]}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                module,
                args,
                str(directory / name),
                input_names=inputs,
                output_names=["output"],
                dynamic_axes=axes,
                opset_version=17,
                dynamo=False,
            )


@torch.no_grad()
def check_parity(
    model: DCMC, matrix: RatingMatrix, directory: Path, samples: int = 64, seed: int = 0
) -> float:
    """Compare ONNX Runtime with torch on real rows/columns; returns the largest absolute difference."""
    model.eval()
    rng = np.random.default_rng(seed)
    rows = rng.choice(matrix.n_users, size=min(samples, matrix.n_users), replace=False)
    cols = rng.choice(matrix.n_items, size=min(samples, matrix.n_items), replace=False)
    x_rows, x_cols = matrix.rows(rows), matrix.cols(cols)
    onnx = OnnxNetwork(directory)
    u_t, v_t = model.embed_rows(x_rows), model.embed_cols(x_cols)
    k = min(len(rows), len(cols))
    p_t = torch.softmax(model.scores(u_t[:k], v_t[:k]), dim=-1)
    u_o, v_o = onnx.embed_users(x_rows.numpy()), onnx.embed_items(x_cols.numpy())
    p_o = onnx.probabilities(u_t[:k].numpy(), v_t[:k].numpy())
    worst = 0.0
    for what, a, b in (
        ("user embeddings", u_t, u_o),
        ("item embeddings", v_t, v_o),
        ("probabilities", p_t, p_o),
    ):
        scale = max(1.0, float(a.abs().max()))
        diff = float(np.abs(a.numpy() - b).max()) / scale
        worst = max(worst, diff)
        if diff > PARITY_TOLERANCE:
            raise ExportError(f"ONNX {what} differ from torch by {diff:.2e} (> {PARITY_TOLERANCE})")
    return worst


def save_exact_field(scorer: ExactScorer, directory: Path) -> None:
    """Write an `exact` scorer's field into an artifact directory (`model.artifact.save_known_field`), with
    its sparse co-rating tables and its bias baseline's fit; t only where it is an array (clamped
    entries' follows from their labels)."""
    f = scorer.field
    t = f.t if isinstance(f.t, np.ndarray) else None
    biases = None if scorer.biases is None else _stored(scorer.biases)
    save_known_field(directory, scorer.key.to_json(), f.g, f.h, t, scorer.sparse_tables(), biases)


def write_known_field(
    directory: Path,
    cfg: ModelConfig,
    user_emb: np.ndarray,
    item_emb: np.ndarray,
    bilinear: np.ndarray,
    known: Entries,
    inference: InferenceConfig,
) -> None:
    """Precompute the `exact` field of every known entry (the service's per-version G_u), from exactly the
    float32 arrays the artifact stores, so it equals what a loader would compute. Other modes need none."""
    if inference.mode != "exact":
        return
    network = Network(
        cfg,
        np.asarray(user_emb, np.float32),
        np.asarray(item_emb, np.float32),
        np.asarray(bilinear, np.float32),
    )
    ratings = Ratings(known.rows, known.cols, known.values, cfg.n_users, cfg.n_items)
    scorer = build_scorer(network, ratings, inference)
    if isinstance(scorer, ExactScorer):
        save_exact_field(scorer, directory)


def write_baseline(directory: Path, cfg: ModelConfig, known: Entries) -> None:
    """The bias baseline's fit to the known ratings with the fold-in's penalties (`model.online`), which
    every service worker would otherwise fit at start-up (`model.artifact.BASELINE`)."""
    rows, cols, values = known.rows.astype(np.int64), known.cols.astype(np.int64), known.values
    b = BiasModel.fit(
        rows, cols, np.asarray(values, np.float64), cfg.n_users, cfg.n_items, USER_SHRINK, ITEM_SHRINK
    )
    save_baseline(directory, _stored(b))


def _stored(biases: BiasModel) -> StoredBiases:
    """A bias model in the artifact's on-disk form."""
    return StoredBiases(biases.user_shrink, biases.item_shrink, biases.mu, biases.users, biases.items)


def write_artifact(
    out: Path,
    model: DCMC,
    matrix: RatingMatrix,
    train_entries: Entries,
    *,
    held_out: Entries | None = None,
    user_ids: list[str],
    item_ids: list[str],
    inference: InferenceConfig,
    train_config: dict[str, Any],
    dataset: dict[str, Any],
    metrics: dict[str, Any],
    known_field: bool = True,
    catalogue: dict[str, ItemRecord] | None = None,
    finish: Callable[[Path, dict[str, Any]], None] | None = None,
) -> Path:
    """Write a complete artifact directory atomically; returns its path.

    `known_field=False` leaves the `exact` field out (the search that follows writes the one of its
    choice: on a large catalogue the field of the starting settings would cost minutes for nothing).

    `held_out`: the validation ratings carved from the training split. The network never trained on them,
    but they are known ratings at test time: the CRF's known field and the service use them.

    `finish(directory, config)`: called once every file is written, before the one atomic rename, with the
    directory being written and its config; it may load it as it stands (`model.artifact.load_staged`),
    add files and change the config (the training's search and fold-in choice)."""
    model.eval()
    cfg: ModelConfig = model.config
    user_emb, item_emb = embed_all(model, matrix)
    with artifact_writer(out) as tmp:
        torch.save(model.state_dict(), tmp / "weights.pt")
        config = {
            "model": cfg.to_dict(),
            "inference": inference.to_dict(),
            "train": train_config,
            "dataset": dataset,
        }
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        np.save(tmp / "levels.npy", np.asarray(cfg.levels, dtype=np.float64))
        (tmp / "user_ids.json").write_text(json.dumps(user_ids))
        (tmp / "item_ids.json").write_text(json.dumps(item_ids))
        np.savez(
            tmp / "train_ratings.npz",
            rows=train_entries.rows.astype(np.int64),
            cols=train_entries.cols.astype(np.int64),
            values=train_entries.values.astype(np.float64),
        )
        if held_out is not None and len(held_out):
            np.savez(
                tmp / HELD_OUT,
                rows=held_out.rows.astype(np.int64),
                cols=held_out.cols.astype(np.int64),
                values=held_out.values.astype(np.float64),
            )
        known = train_entries if held_out is None else Entries.concat([train_entries, held_out])
        np.save(tmp / "user_embeddings.npy", user_emb.astype(np.float32))
        np.save(tmp / "item_embeddings.npy", item_emb.astype(np.float32))
        bilinear = model.bilinear.detach().numpy().astype(np.float32)
        np.save(tmp / "bilinear.npy", bilinear)
        if known_field:
            write_known_field(tmp, cfg, user_emb, item_emb, bilinear, known, inference)
        write_baseline(tmp, cfg, known)
        export_onnx(model, tmp)
        metrics = {**metrics, "onnx_parity_max_abs_diff": check_parity(model, matrix, tmp)}
        (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        if catalogue is not None:
            write_catalogue(tmp, catalogue)
        if finish is not None:
            finish(tmp, config)
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    log.info("wrote artifact %s", out)
    return out
