"""Training loop: block mini-batches, cross-entropy + similarity loss, checkpoints, DDP.

A mini-batch is a block of sampled rows x sampled columns. Its CRF nodes are the block's observed
entries; the network sees the full rating rows and columns of the sampled users and items (missing = 0).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from tqdm import tqdm

from model.config import ModelConfig
from model.engine import nearest_level
from model.network import DCMC, RatingInput, SparseRows, fuse
from model.ratings import LineIndex, Ratings
from training.config import TrainConfig
from training.data import Entries
from training.errors import TrainingError

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"


@dataclass
class Block:
    """One mini-batch: sampled rows and columns and the observed entries inside them."""

    rows: np.ndarray  # (br,) user_idx
    cols: np.ndarray  # (bc,) item_idx
    node_rows: np.ndarray  # (K,) positions in `rows`
    node_cols: np.ndarray  # (K,) positions in `cols`
    values: np.ndarray  # (K,) ratings


@dataclass
class History:
    """Per-epoch records of a run."""

    epochs: list[dict[str, float]] = field(default_factory=list)
    best: dict[str, Any] | None = None
    """With `keep_best`: the epoch of the lowest validation RMSE so far ("epoch", "val_rmse") and the
    published network's state then ("state")."""
    members: list[History] = field(default_factory=list)
    """An ensemble's (`train_ensemble`): each member network's own history."""


class RatingMatrix:
    """The training ratings as the trainer reads them: input rows (row branch) and columns (column branch),
    compressed (`sparse_rows`, what training reads) or dense, from the one index of known ratings
    (model.ratings.Ratings), and the observed entries of a block through a scipy view of the same
    compressed rows."""

    def __init__(self, n_users: int, n_items: int, entries: Entries) -> None:
        self.ratings = Ratings(entries.rows, entries.cols, entries.values, n_users, n_items)
        data, indices, indptr = self.ratings.csr_arrays("row")
        self.by_row = sp.csr_matrix((data.astype(np.float32), indices, indptr), shape=(n_users, n_items))
        self.by_row.sort_indices()  # canonical order: a block lists its entries row by row, by column
        self.n_users, self.n_items = n_users, n_items
        self._values = self.ratings.values.astype(np.float32)  # what the compressed rows carry

    def rows(self, idx: np.ndarray) -> torch.Tensor:
        """Dense rating rows: (len(idx), m)."""
        return torch.from_numpy(self.ratings.dense_rows(idx))

    def cols(self, idx: np.ndarray) -> torch.Tensor:
        """Dense rating columns: (len(idx), n)."""
        return torch.from_numpy(self.ratings.dense_cols(idx))

    def sparse_rows(self, idx: np.ndarray) -> SparseRows:
        """Compressed rating rows: what `rows` holds, as (indptr, indices, values)."""
        return _lines(self.ratings.by_row, self.ratings.cols, self._values, idx, self.n_items)

    def sparse_cols(self, idx: np.ndarray) -> SparseRows:
        """Compressed rating columns: what `cols` holds."""
        return _lines(self.ratings.by_col, self.ratings.rows, self._values, idx, self.n_users)

    def block(self, rows: np.ndarray, cols: np.ndarray) -> Block:
        """The observed entries of rows x cols."""
        sub = self.by_row[rows][:, cols].tocoo()
        return Block(
            rows, cols, sub.row.astype(np.int64), sub.col.astype(np.int64), sub.data.astype(np.float64)
        )


def _lines(
    index: LineIndex, minor: np.ndarray, values: np.ndarray, lines: np.ndarray, width: int
) -> SparseRows:
    lines = np.asarray(lines, dtype=np.int64)
    members, counts = index.members(lines)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return SparseRows(indptr, minor[members], torch.from_numpy(values[members]), width)


def _chunks(order: np.ndarray, size: int) -> list[np.ndarray]:
    """Split `order` into ceil(len/size) nearly equal chunks (no chunk of 1 row for BatchNorm)."""
    count = max(1, math.ceil(len(order) / size))
    return [c for c in np.array_split(order, count) if len(c)]


def epoch_blocks(
    matrix: RatingMatrix, mode: str, block_rows: int, block_cols: int, seed: int, epoch: int
) -> list[Block]:
    """The epoch's mini-batches, reshuffled each epoch and the same on every process."""
    rng = np.random.default_rng([seed, epoch])
    row_chunks = _chunks(rng.permutation(matrix.n_users), block_rows)
    col_chunks = _chunks(rng.permutation(matrix.n_items), block_cols)
    if mode == "pass":
        steps = max(len(row_chunks), len(col_chunks))
        pairs = [(row_chunks[s % len(row_chunks)], col_chunks[s % len(col_chunks)]) for s in range(steps)]
    else:
        pairs = [(r, c) for r in row_chunks for c in col_chunks]
        rng.shuffle(pairs)  # type: ignore[arg-type]
    blocks = [matrix.block(r, c) for r, c in pairs]
    return [b for b in blocks if len(b.values) >= 2]


SIMILARITY_SAMPLE = 2048
"""Most entries of a block whose pairs the similarity loss reads when no mean-field layer needs them all
(`block_loss`): 4M pairs. Blocks of dense matrices hold several thousand entries (ml-10m's ~7,000), and
their K x K similarities and targets would be most of a step's time and memory."""


def block_loss(
    model: torch.nn.Module,
    matrix: RatingMatrix,
    block: Block,
    levels: np.ndarray,
    mf_layers: int,
    beta: float,
    sigma2: float,
    rating_mse: float = 0.0,
    input_dropout: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy of the last layer plus beta times the similarity MSE on one block, plus (when
    `rating_mse` > 0) that weight times the squared error of the expected rating, in units of the rating
    range: mean(((sum_u L_u Q_u - M) / (L_p - L_1))^2). `input_dropout` > 0 applies dropout to the rating
    rows and columns the branches read (without rescaling the kept ones when the first layer centres or
    normalises its input)."""
    node_rows = torch.from_numpy(block.node_rows)
    node_cols = torch.from_numpy(block.node_cols)
    rows, cols = matrix.sparse_rows(block.rows), matrix.sparse_cols(block.cols)
    if input_dropout > 0:
        config = getattr(model, "module", model).config  # unwrapped from DistributedDataParallel
        rescale = config.input_center == 0 and config.input_scaling == "none"
        rows, cols = rows.dropout(input_dropout, rescale), cols.dropout(input_dropout, rescale)
    # With beta = 0 and no mean-field layers the K x K similarities would only add zeros to the gradients
    # (and most of a block's time): they are not computed.
    # Without mean-field layers the similarities serve the loss alone: on a block of more than
    # SIMILARITY_SAMPLE entries, the mean over a uniform sample's pairs estimates the mean over all pairs
    # (unbiased) at a fraction of the K x K cost.
    k = len(block.values)
    sampled = beta > 0 and mf_layers == 0 and k > SIMILARITY_SAMPLE
    sample = torch.randperm(k)[:SIMILARITY_SAMPLE] if sampled else None
    _, log_q, sim = model(rows, cols, node_rows, node_cols, mf_layers, similarity=beta > 0, sample=sample)
    labels = torch.from_numpy(nearest_level(block.values, levels))
    ce = F.nll_loss(log_q, labels)
    values = torch.from_numpy(block.values.astype(np.float32))
    loss = ce
    parts = {"ce": float(ce.detach())}
    if beta > 0:
        paired = values if sample is None else values[sample]
        target = torch.exp(-((paired[:, None] - paired[None, :]) ** 2) / sigma2)  # (K, K)
        sim_loss = F.mse_loss(sim, target)
        loss = loss + beta * sim_loss
        parts["sim"] = float(sim_loss.detach())
    if rating_mse > 0:
        span = float(levels[-1] - levels[0])
        expected = log_q.exp() @ torch.as_tensor(levels, dtype=log_q.dtype)
        mse = torch.mean(((expected - values) / span) ** 2)
        loss = loss + rating_mse * mse
        parts["rating_mse"] = float(mse.detach())
    return loss, parts


def train_step(
    net: torch.nn.Module,
    model: DCMC,
    matrix: RatingMatrix,
    block: Block,
    levels: np.ndarray,
    mf_layers: int,
    cfg: TrainConfig,
    optimizers: list[torch.optim.Optimizer],
    ema: AveragedModel | None = None,
    reduce: Callable[[], None] | None = None,
) -> torch.Tensor:
    """One optimisation step on one block: the loss of `net` (the model, or its distributed wrapper), its
    gradients (then `reduce`, which all-reduces them across processes), every optimizer's step and the
    weight average's update of `model`. Returns the loss."""
    loss, _ = block_loss(
        net, matrix, block, levels, mf_layers, cfg.beta, cfg.sigma2, cfg.rating_mse, cfg.input_dropout
    )
    for o in optimizers:
        o.zero_grad(set_to_none=True)
    loss.backward()
    if reduce is not None:
        reduce()
    for o in optimizers:
        o.step()
    if ema is not None:
        ema.update_parameters(model)
    return loss


@torch.no_grad()
def embed_all(model: DCMC, matrix: RatingMatrix, chunk: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """Eval-mode embeddings of every user and item: (n, d), (m, d) float32."""
    was_training = model.training
    model.eval()
    users = [
        model.embed_rows(matrix.sparse_rows(np.arange(s, min(s + chunk, matrix.n_users))))
        for s in range(0, matrix.n_users, chunk)
    ]
    items = [
        model.embed_cols(matrix.sparse_cols(np.arange(s, min(s + chunk, matrix.n_items))))
        for s in range(0, matrix.n_items, chunk)
    ]
    model.train(was_training)
    return torch.cat(users).numpy(), torch.cat(items).numpy()


@torch.no_grad()
def base_predictions(
    model: DCMC, user_emb: np.ndarray, item_emb: np.ndarray, entries: Entries, chunk: int = 1 << 16
) -> np.ndarray:
    """Expected ratings of the base network on `entries`: (K,), `chunk` entries at a time (each holds a
    (chunk, p, d) float32 product: 335 MB at 2^16 entries of 10 levels and d = 128)."""
    u, v = torch.from_numpy(user_emb), torch.from_numpy(item_emb)
    out = np.empty(len(entries))
    for s in range(0, len(entries), chunk):
        rows = torch.from_numpy(entries.rows[s : s + chunk])
        cols = torch.from_numpy(entries.cols[s : s + chunk])
        probs = torch.softmax(model.block_scores(u, v, rows, cols), dim=-1)
        out[s : s + chunk] = (probs @ model.levels).numpy()
    return out


def rmse_mae(pred: np.ndarray, truth: np.ndarray) -> tuple[float, float]:
    """RMSE and MAE."""
    err = pred - truth
    return float(np.sqrt(np.mean(err**2))), float(np.mean(np.abs(err)))


def _state(model: torch.nn.Module) -> DCMC:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model  # type: ignore[return-value]


def train(
    model_config: ModelConfig,
    train_config: Any,
    train_entries: Entries,
    val_entries: Entries | None,
    *,
    checkpoint_dir: Path | None = None,
    resume: bool = False,
    progress: bool = True,
    on_epoch_end: Callable[[dict[str, float]], None] | None = None,
) -> tuple[DCMC, RatingMatrix, History]:
    """Train a DCMC model; returns the model (eval mode), the rating matrix and the history.

    `on_epoch_end` is called with each epoch's record after its checkpoint is written.
    """
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    cfg = train_config
    torch.manual_seed(cfg.seed)
    model = DCMC(model_config)
    optimizers = make_optimizers(model, cfg.lr, cfg.weight_decay)
    schedulers = [
        torch.optim.lr_scheduler.StepLR(o, step_size=cfg.lr_halve_every, gamma=0.5) for o in optimizers
    ]
    history = History()
    # The weight average evaluated and published instead of the live weights (ema_decay > 0).
    ema = (
        AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(cfg.ema_decay), use_buffers=True)
        if cfg.ema_decay > 0
        else None
    )
    start_epoch = 0
    ckpt_path = checkpoint_dir / CHECKPOINT if checkpoint_dir else None
    if resume:
        if ckpt_path is None or not ckpt_path.is_file():
            raise TrainingError(f"--resume: no checkpoint at {ckpt_path}; start without --resume")
        state = torch.load(ckpt_path, weights_only=True)
        if state["model_config"] != model_config.to_dict() or state["train_config"] != cfg.to_dict():
            raise TrainingError(f"--resume: {ckpt_path} was written with a different configuration")
        model.load_state_dict(state["model"])
        for o, o_state in zip(optimizers, state["optimizers"], strict=True):
            o.load_state_dict(o_state)
        for sched, s_state in zip(schedulers, state["schedulers"], strict=True):
            sched.load_state_dict(s_state)
        if ema is not None:
            ema.load_state_dict(state["ema"])
        history.epochs = list(state["history"])
        history.best = state.get("best")
        start_epoch = int(state["epoch"])
        if rank == 0:
            log.info("resumed from %s after epoch %d", ckpt_path, start_epoch)
    net: torch.nn.Module = model
    if distributed:
        # DDP handles dense gradients only: the input weights are left out of it, start from rank 0's
        # values as DDP's own do, and their sparse gradients are averaged by `_all_reduce_sparse`.
        sparse = [(n, p) for n, p in model.named_parameters() if id(p) in _sparse_ids(model)]
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, [n for n, _ in sparse]
        )
        for _, p in sparse:
            dist.broadcast(p.data, src=0)
        net = torch.nn.parallel.DistributedDataParallel(model)
    matrix = RatingMatrix(model_config.n_users, model_config.n_items, train_entries)
    levels = np.asarray(model_config.levels, dtype=np.float64)
    mf_layers = model_config.mf_layers if cfg.train_mf else 0
    bar = tqdm(
        range(start_epoch, cfg.epochs),
        initial=start_epoch,
        total=cfg.epochs,
        desc="train",
        unit="epoch",
        disable=not progress or rank != 0,
        dynamic_ncols=True,
    )
    for epoch in bar:
        t0 = time.perf_counter()
        torch.manual_seed(cfg.seed * 100_003 + epoch)  # dropout stream: a function of (seed, epoch)
        blocks = epoch_blocks(matrix, cfg.epoch_mode, cfg.block_rows, cfg.block_cols, cfg.seed, epoch)
        if distributed:
            per_rank = len(blocks) // world
            if per_rank == 0:
                raise TrainingError(
                    f"only {len(blocks)} non-empty blocks for {world} processes; use smaller blocks"
                )
            blocks = blocks[rank * per_rank : (rank + 1) * per_rank]
        net.train()
        losses: list[float] = []
        reduce = (lambda: _all_reduce_sparse(model, world)) if distributed else None
        for block in blocks:
            loss = train_step(net, model, matrix, block, levels, mf_layers, cfg, optimizers, ema, reduce)
            losses.append(float(loss.detach()))
        for sched in schedulers:
            sched.step()
        if not np.isfinite(losses).all():
            raise TrainingError(f"loss became NaN/inf in epoch {epoch + 1}; lower the learning rate")
        record: dict[str, float] = {
            "epoch": epoch + 1,
            "loss": float(np.mean(losses)),
            "seconds": time.perf_counter() - t0,
        }
        if rank == 0 and val_entries is not None and len(val_entries):
            scored = _published(model, ema)
            user_emb, item_emb = embed_all(scored, matrix)
            record["val_rmse"], record["val_mae"] = rmse_mae(
                base_predictions(scored, user_emb, item_emb, val_entries), val_entries.values
            )
        history.epochs.append(record)
        better = history.best is None or record.get("val_rmse", math.inf) < history.best["val_rmse"]
        if cfg.keep_best and "val_rmse" in record and better:
            state = {k: v.detach().clone() for k, v in _published(model, ema).state_dict().items()}
            history.best = {"epoch": epoch + 1, "val_rmse": record["val_rmse"], "state": state}
        bar.set_postfix({k: f"{v:.4f}" for k, v in record.items() if k in ("loss", "val_rmse")})
        if not progress and rank == 0:  # no bar (a log file, a batch job): one line an epoch instead
            log.info(
                "epoch %d/%d: loss %.4f, %s%.0f s",
                epoch + 1,
                cfg.epochs,
                record["loss"],
                f"validation RMSE {record['val_rmse']:.4f}, " if "val_rmse" in record else "",
                record["seconds"],
            )
        last = epoch + 1 == cfg.epochs
        if ckpt_path is not None and ((epoch + 1) % cfg.checkpoint_every == 0 or last):
            if rank == 0:
                save_checkpoint(
                    ckpt_path, model, optimizers, schedulers, epoch + 1, history, model_config, cfg, ema
                )
            if distributed:
                dist.barrier()
        if on_epoch_end is not None:
            on_epoch_end(record)
    bar.close()
    model = _published(model, ema)
    if history.best is not None and history.best["epoch"] != len(history.epochs):
        # keep_best: the network of the epoch with the lowest validation RMSE, not the last one.
        model.load_state_dict(history.best["state"])
        if rank == 0:
            log.info(
                "kept epoch %d's network (validation RMSE %.4f)",
                history.best["epoch"],
                history.best["val_rmse"],
            )
    model.eval()
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            raise TrainingError(f"parameter {name} holds NaN/inf after training")
    return model, matrix, history


def member_seed(seed: int, k: int) -> int:
    """The seed of member k of an ensemble of the run seeded `seed`: seed + 1000 k. Member 0 is the single
    network of that seed, and runs of seeds 0..999 share no member."""
    return seed + 1000 * k


def train_ensemble(
    model_config: ModelConfig,
    train_config: TrainConfig,
    train_entries: Entries,
    val_entries: Entries | None,
    *,
    checkpoint_dir: Path | None = None,
    resume: bool = False,
    progress: bool = True,
) -> tuple[DCMC, RatingMatrix, History]:
    """`train` for `TrainConfig.ensemble` networks: each trains on its own (`member_seed`;
    member 0's checkpoints in `checkpoint_dir`, member k's beside it as `<name>.m<k>`), and the published
    network is their fusion (model.network.fuse). Its history's epochs hold the members' mean loss and, at
    the last, the fused network's validation figures; `members` each member's history."""
    n = train_config.ensemble
    if n == 1:
        return train(model_config, train_config, train_entries, val_entries, checkpoint_dir=checkpoint_dir,
                     resume=resume, progress=progress)  # fmt: skip
    networks, histories = [], []
    for k in range(n):
        member_cfg = replace(train_config, seed=member_seed(train_config.seed, k), ensemble=1)
        ckpt = checkpoint_dir if k == 0 or checkpoint_dir is None else (
            checkpoint_dir.parent / f"{checkpoint_dir.name}.m{k}"
        )  # fmt: skip
        log.info("ensemble member %d of %d (seed %d)", k + 1, n, member_cfg.seed)
        network, matrix, history = train(model_config, member_cfg, train_entries, val_entries,
                                         checkpoint_dir=ckpt, resume=resume, progress=progress)  # fmt: skip
        networks.append(network)
        histories.append(history)
    fused = fuse(networks)
    epochs = [
        {
            "epoch": records[0]["epoch"],
            "loss": float(np.mean([r["loss"] for r in records])),
            "seconds": float(sum(r["seconds"] for r in records)),
        }
        for records in zip(*(h.epochs for h in histories), strict=True)
    ]
    if epochs and val_entries is not None and len(val_entries):
        user_emb, item_emb = embed_all(fused, matrix)
        pred = base_predictions(fused, user_emb, item_emb, val_entries)
        epochs[-1]["val_rmse"], epochs[-1]["val_mae"] = rmse_mae(pred, val_entries.values)
    return fused, matrix, History(epochs=epochs, members=histories)


def _sparse_ids(model: DCMC) -> set[int]:
    """The parameters that get sparse gradients: the branches' input weights."""
    return {id(m.weight) for m in model.modules() if isinstance(m, RatingInput)}


def _all_reduce_sparse(model: DCMC, world: int) -> None:
    """Average the sparse gradients over the processes, as DDP does the dense ones (a process whose blocks
    touched none of a weight's lines contributes an empty gradient)."""
    sparse = _sparse_ids(model)
    for p in model.parameters():
        if id(p) not in sparse:
            continue
        grad = (
            p.grad
            if p.grad is not None
            else torch.sparse_coo_tensor(
                torch.empty(1, 0, dtype=torch.int64), torch.empty(0, *p.shape[1:]), p.shape
            )
        )
        dist.all_reduce(grad)
        p.grad = (grad / world).coalesce()


def _lines_of(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lines, values) of a gradient sparse over its lines, each line once. Autograd's accumulation drops
    the coalesced flag of `_SparseProduct`'s gradient, whose lines are already sorted and distinct: that is
    checked in O(lines) instead of coalescing (a copy of the values: 10% of an ml-10m step)."""
    if not grad.is_coalesced():
        lines = grad._indices()[0]
        if bool((lines[1:] > lines[:-1]).all()):
            return lines, grad._values()
        grad = grad.coalesce()
    return grad.indices()[0], grad.values()


class LineAdam(torch.optim.Optimizer):
    """Lazy Adam for weights whose gradients are sparse over their lines (the branches' input weights):
    the moments and weights of the lines a step touched are updated, the rest wait, as in
    torch.optim.SparseAdam (same arithmetic), with plain row gathers and scatters instead of its sparse
    masks: half the step's time on Epinions-sized catalogues."""

    def __init__(self, params: Any, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                lines, values = _lines_of(p.grad)
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                avg = state["exp_avg"].index_select(0, lines).lerp_(values, 1 - beta1)
                sq = state["exp_avg_sq"].index_select(0, lines).mul_(beta2)
                sq.addcmul_(values, values, value=1 - beta2)
                state["exp_avg"].index_copy_(0, lines, avg)
                state["exp_avg_sq"].index_copy_(0, lines, sq)
                bias1, bias2 = 1 - beta1 ** state["step"], 1 - beta2 ** state["step"]
                denom = sq.sqrt_().div_(math.sqrt(bias2)).add_(group["eps"])
                p.index_add_(0, lines, avg.div_(denom), alpha=-group["lr"] / bias1)


def make_optimizers(model: DCMC, lr: float, weight_decay: float) -> list[torch.optim.Optimizer]:
    """Adam for every parameter but the branches' input weights, which get sparse gradients (the lines of
    the columns a block rated) and lazy Adam (`LineAdam`: moments and weights of the touched lines only),
    so that a step costs the block's ratings, not the catalogue. `weight_decay` applies to the Adam part
    only."""
    ids = _sparse_ids(model)
    sparse = [p for p in model.parameters() if id(p) in ids]
    dense = [p for p in model.parameters() if id(p) not in ids]
    return [torch.optim.Adam(dense, lr=lr, weight_decay=weight_decay), LineAdam(sparse, lr=lr)]


def _published(model: DCMC, ema: AveragedModel | None) -> DCMC:
    """The network that is validated and written out: the weight average when there is one."""
    return model if ema is None else ema.module  # type: ignore[return-value]


def save_checkpoint(
    path: Path,
    model: DCMC,
    optimizers: list[torch.optim.Optimizer],
    schedulers: list[Any],
    epoch: int,
    history: History,
    model_config: ModelConfig,
    train_config: Any,
    ema: AveragedModel | None = None,
) -> None:
    """Atomically write a resumable checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    extra = {} if ema is None else {"ema": ema.state_dict()}
    torch.save(
        {
            **extra,
            "model": model.state_dict(),
            "optimizers": [o.state_dict() for o in optimizers],
            "schedulers": [sched.state_dict() for sched in schedulers],
            "epoch": epoch,
            "history": history.epochs,
            **({} if history.best is None else {"best": history.best}),
            "model_config": model_config.to_dict(),
            "train_config": train_config.to_dict(),
        },
        tmp,
    )
    tmp.replace(path)
