"""Training: batching, learning a low-rank matrix, resuming, data-parallel runs."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from model.artifact import load_artifact
from model.config import ConfigError, ModelConfig
from model.engine import nearest_level
from model.network import DCMC
from training.config import preset
from training.data import Entries, load_dataset
from training.evaluate import evaluate
from training.trainer import Block, RatingMatrix, epoch_blocks, train

REPO = Path(__file__).resolve().parents[2]


def _entries(n: int = 30, m: int = 20, seed: int = 0) -> Entries:
    rng = np.random.default_rng(seed)
    mask = rng.random((n, m)) < 0.4
    rows, cols = np.nonzero(mask)
    return Entries(
        rows.astype(np.int64), cols.astype(np.int64), rng.integers(1, 6, len(rows)).astype(np.float64)
    )


def test_blocks_cover_every_entry_once_and_reshuffle() -> None:
    entries = _entries()
    matrix = RatingMatrix(30, 20, entries)
    seen = []
    for block in epoch_blocks(matrix, "blocks", 8, 8, seed=0, epoch=0):
        assert 2 <= len(block.rows) <= 8 and len(block.cols) <= 8
        seen += list(zip(block.rows[block.node_rows], block.cols[block.node_cols], strict=True))
        assert np.all(matrix.by_row[block.rows[block.node_rows], block.cols[block.node_cols]] == block.values)
    expected = set(zip(entries.rows, entries.cols, strict=True))
    assert len(seen) <= len(expected) and set(seen) <= expected
    assert len(expected) - len(set(seen)) < 10  # only blocks with fewer than 2 entries are skipped
    again = epoch_blocks(matrix, "blocks", 8, 8, seed=0, epoch=0)
    other = epoch_blocks(matrix, "blocks", 8, 8, seed=0, epoch=1)
    assert [b.rows.tolist() for b in again] == [
        b.rows.tolist() for b in epoch_blocks(matrix, "blocks", 8, 8, 0, 0)
    ]
    assert [b.rows.tolist() for b in again] != [b.rows.tolist() for b in other]
    # The paper's count: an epoch is one pass over the row chunks.
    assert len(epoch_blocks(matrix, "pass", 8, 8, seed=0, epoch=0)) <= 4


def test_rating_matrix_reads_one_index_of_the_ratings() -> None:
    entries = _entries()
    matrix = RatingMatrix(30, 20, entries)
    dense = np.zeros((30, 20), dtype=np.float32)
    dense[entries.rows, entries.cols] = entries.values
    assert len(matrix.ratings) == len(entries) and matrix.ratings.n_users == 30
    np.testing.assert_array_equal(matrix.by_row.toarray(), dense)
    idx = np.array([3, 0, 29, 3])
    np.testing.assert_array_equal(matrix.rows(idx).numpy(), dense[idx])
    np.testing.assert_array_equal(matrix.sparse_rows(idx).dense().numpy(), dense[idx])
    np.testing.assert_array_equal(matrix.sparse_cols(idx[:3] % 20).dense().numpy(), dense.T[idx[:3] % 20])
    np.testing.assert_array_equal(matrix.cols(idx[:3] % 20).numpy(), dense.T[idx[:3] % 20])
    assert matrix.rows(idx).dtype == torch.float32


def test_split_overrides_routes_model_train_and_inference_settings() -> None:
    from training.pipeline import split_overrides

    model, train_over, inference = split_overrides(
        {
            "gamma": "0.1",
            "epochs": "3",
            "hidden": "8,4",
            "inference.crf.gamma": "2",
            "inference.mode": "exact",
        }
    )
    assert model == {"gamma": 0.1, "hidden": (8, 4)}
    assert train_over == {"epochs": 3}
    assert inference == {"crf.gamma": "2", "mode": "exact"}  # converted by InferenceConfig.with_overrides
    with pytest.raises(ConfigError, match="unknown setting 'gama'"):
        split_overrides({"gama": "1"})
    with pytest.raises(ConfigError, match="comes from the data"):
        split_overrides({"levels": "1,2"})
    # The first layer's input: a centre (a number, or `mean` for the training mean) and a scaling.
    assert split_overrides({"input_center": "mean", "input_scaling": "sqrt"})[0] == {
        "input_center": "mean",
        "input_scaling": "sqrt",
    }
    assert split_overrides({"input_center": "3.5"})[0] == {"input_center": 3.5}
    with pytest.raises(ConfigError, match="input_center='median'"):
        split_overrides({"input_center": "median"})
    with pytest.raises(ConfigError, match="input_scaling must be"):
        ModelConfig(n_users=2, n_items=2, levels=(1.0, 2.0), input_scaling="log")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="input_center must be a finite number"):
        ModelConfig(n_users=2, n_items=2, levels=(1.0, 2.0), input_center=float("nan"))


def test_level_index_picks_the_nearest_level() -> None:
    levels = np.array([0.5, 1.0, 1.5, 5.0])
    assert nearest_level(np.array([0.5, 1.0, 1.2, 1.3, 4.0, 5.0]), levels).tolist() == [0, 1, 1, 2, 3, 3]


def test_training_beats_global_mean_by_a_wide_margin(tiny_artifact: Path, synthetic_csv: Path) -> None:
    data = load_dataset("csv", synthetic_csv, split="random")
    global_mean = float(np.mean(data.train.values))
    baseline = float(np.sqrt(np.mean((data.test.values - global_mean) ** 2)))
    for mode in ("none", "paper", "exact"):
        result = evaluate(tiny_artifact, synthetic_csv, overrides={"mode": mode})
        assert result["n"] == len(data.test)
        assert result["rmse"] < 0.8 * baseline, (mode, result["rmse"], baseline)


def _tiny_setup(synthetic_csv: Path) -> tuple[ModelConfig, object, Entries]:
    data = load_dataset("csv", synthetic_csv, split="random")
    p = preset("csv", "tiny")
    cfg = ModelConfig(n_users=data.n_users, n_items=data.n_items, levels=tuple(data.levels), **p.model)
    return cfg, replace(p.train, epochs=4, checkpoint_every=2), data.train


def _interrupted_and_resumed(
    cfg: ModelConfig, train_cfg: Any, entries: Entries, val: Entries | None, ckpt: Path, after: int
) -> tuple[DCMC, Any]:
    """Train, stopped by an interrupt after epoch `after`, then resumed from the checkpoint to the end."""

    def interrupt(record: dict[str, float]) -> None:
        if record["epoch"] == after:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(cfg, train_cfg, entries, val, checkpoint_dir=ckpt, progress=False, on_epoch_end=interrupt)
    resumed, _, hist = train(cfg, train_cfg, entries, val, checkpoint_dir=ckpt, resume=True, progress=False)
    return resumed, hist


@pytest.mark.parametrize("ema_decay", [0.0, 0.9])
def test_resume_gives_the_same_state_as_an_uninterrupted_run(
    synthetic_csv: Path, tmp_path: Path, ema_decay: float
) -> None:
    torch.set_num_threads(1)
    cfg, train_cfg, entries = _tiny_setup(synthetic_csv)
    train_cfg = replace(train_cfg, ema_decay=ema_decay)
    full, _, full_hist = train(cfg, train_cfg, entries, None, checkpoint_dir=tmp_path / "a", progress=False)

    resumed, hist = _interrupted_and_resumed(cfg, train_cfg, entries, None, tmp_path / "b", after=2)
    assert [r["loss"] for r in hist.epochs] == [r["loss"] for r in full_hist.epochs]
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_weight_average_is_published_and_leaves_training_unchanged(
    synthetic_csv: Path, tmp_path: Path
) -> None:
    torch.set_num_threads(1)
    cfg, train_cfg, entries = _tiny_setup(synthetic_csv)
    runs = {}
    for decay in (0.0, 1e-12, 0.9):
        model, _, hist = train(
            cfg,
            replace(train_cfg, ema_decay=decay),
            entries,
            None,
            checkpoint_dir=tmp_path / str(decay),
            progress=False,
        )
        live = torch.load(tmp_path / str(decay) / "checkpoint.pt", weights_only=True)["model"]
        runs[decay] = (model.state_dict(), live, [r["loss"] for r in hist.epochs])
    plain, plain_live, plain_losses = runs[0.0]
    for _, live, losses in runs.values():
        assert losses == plain_losses  # the average never feeds back into training
        for name, value in live.items():
            assert torch.equal(value, plain_live[name]), name
    # decay -> 0: the average is the last step's weights; decay 0.9: an average of the last steps.
    tracked, live, _ = runs[1e-12]
    averaged, _, _ = runs[0.9]
    for name, value in plain.items():
        if value.is_floating_point():
            assert torch.allclose(tracked[name], live[name], atol=1e-6), name
    weight = "row_branch.0.weight"
    assert torch.equal(plain[weight], plain_live[weight])
    assert (averaged[weight] - live[weight]).abs().max() > 1e-4
    with pytest.raises(ConfigError, match="ema_decay"):
        replace(train_cfg, ema_decay=1.0)


def test_without_a_progress_bar_each_epoch_logs_its_loss_and_validation(
    synthetic_csv: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg, train_cfg, entries = _tiny_setup(synthetic_csv)
    val = entries.take(np.arange(40))
    with caplog.at_level(logging.INFO, logger="training.trainer"):
        _, _, hist = train(
            cfg, replace(train_cfg, epochs=3), entries, val, checkpoint_dir=tmp_path, progress=False
        )
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("epoch ")]
    assert [line.split(":")[0] for line in lines] == ["epoch 1/3", "epoch 2/3", "epoch 3/3"]
    assert f"validation RMSE {hist.epochs[-1]['val_rmse']:.4f}" in lines[-1]


def test_resume_refuses_a_different_configuration(synthetic_csv: Path, tmp_path: Path) -> None:
    from training.errors import TrainingError

    cfg, train_cfg, entries = _tiny_setup(synthetic_csv)
    with pytest.raises(TrainingError, match="no checkpoint"):
        train(cfg, train_cfg, entries, None, checkpoint_dir=tmp_path, resume=True, progress=False)
    train(cfg, replace(train_cfg, epochs=2), entries, None, checkpoint_dir=tmp_path, progress=False)
    with pytest.raises(TrainingError, match="different configuration"):
        train(cfg, train_cfg, entries, None, checkpoint_dir=tmp_path, resume=True, progress=False)


@pytest.mark.parametrize(
    "launcher",
    [
        ["--standalone", "--nproc_per_node=2"],
        # docs/scaling.md's several-machine form, with one machine: rendezvous on an endpoint
        [
            "--nnodes=1",
            "--nproc_per_node=2",
            "--node_rank=0",
            "--rdzv_backend=c10d",
            "--rdzv_endpoint=127.0.0.1:0",
        ],
    ],
    ids=["standalone", "rendezvous"],
)
def test_torchrun_two_processes_complete(synthetic_csv: Path, tmp_path: Path, launcher: list[str]) -> None:
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launcher,
        "-m",
        "training.cli",
        "train",
        "--dataset",
        "csv",
        "--data-dir",
        str(synthetic_csv),
        "--split",
        "random",
        "--out",
        str(out),
        "--preset",
        "tiny",
        "--epochs",
        "3",
        "--no-progress",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    art = load_artifact(out)
    assert art.meta["train"]["epochs"] == 3
    assert proc.stdout.count('"artifacts"') == 1  # only rank 0 reports and writes


_RANK_SCRIPT = """
import sys, torch, numpy as np, torch.distributed as dist
from model.config import ModelConfig
from training.config import TrainConfig
from training.data import Entries
from training.trainer import train
dist.init_process_group("gloo")
rng = np.random.default_rng(0)
rows, cols = np.nonzero(rng.random((40, 30)) < 0.3)
entries = Entries(rows, cols, rng.integers(1, 6, len(rows)).astype(np.float64))
cfg = ModelConfig(n_users=40, n_items=30, levels=(1.0, 2.0, 3.0, 4.0, 5.0), hidden=(16, 8), mf_layers=0)
tc = TrainConfig(epochs=2, block_rows=10, block_cols=10, seed=dist.get_rank())
model, _, _ = train(cfg, tc, entries, None, progress=False)
torch.save(model.state_dict(), sys.argv[1] + f"/rank{dist.get_rank()}.pt")
dist.barrier()  # as training/cli.py: leave together, or a rank exiting with gloo alive aborts now and then
dist.destroy_process_group()
"""


def test_torchrun_processes_keep_the_same_weights_sparse_ones_included(tmp_path: Path) -> None:
    # Each process seeds its own initialisation differently: the processes start from rank 0's weights and
    # every step averages the gradients, the input weights' sparse ones included, so the weights stay equal.
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    for name, value in a.items():
        if "running_" not in name and "num_batches" not in name:  # BatchNorm statistics: rank 0's each step
            assert torch.allclose(value, b[name], atol=1e-6), name
    start = torch.load(tmp_path / "rank0.pt", weights_only=True)["row_branch.0.weight"]
    assert start.abs().sum() > 0


def _small_net_and_block(mf_layers: int) -> tuple[torch.nn.Module, RatingMatrix, Block, np.ndarray]:
    """A seeded 16-8 network on a 30 x 20 matrix on 1..5, and the single block that covers the matrix."""
    matrix = RatingMatrix(30, 20, _entries())
    levels = np.arange(1.0, 6.0)
    cfg = ModelConfig(
        n_users=30, n_items=20, levels=tuple(levels), hidden=(16, 8), dropout=0.0, mf_layers=mf_layers
    )
    torch.manual_seed(0)
    block = epoch_blocks(matrix, "blocks", 30, 20, seed=0, epoch=0)[0]
    return DCMC(cfg), matrix, block, levels


def test_rating_mse_term_adds_the_scaled_squared_error_of_the_expected_rating() -> None:
    from training.trainer import block_loss

    net, matrix, block, levels = _small_net_and_block(mf_layers=1)
    net.eval()
    plain, parts = block_loss(net, matrix, block, levels, 1, 1.5, 3.5)
    assert "rating_mse" not in parts
    with_mse, parts = block_loss(net, matrix, block, levels, 1, 1.5, 3.5, rating_mse=2.0)
    # By hand: the expected rating under the last layer's distributions.
    node_rows, node_cols = torch.from_numpy(block.node_rows), torch.from_numpy(block.node_cols)
    _, log_q, _ = net(matrix.rows(block.rows), matrix.cols(block.cols), node_rows, node_cols, 1)
    expected = (log_q.exp() @ torch.tensor(levels, dtype=log_q.dtype)).detach().numpy()
    mse = float(np.mean(((expected - block.values) / 4.0) ** 2))
    assert parts["rating_mse"] == pytest.approx(mse, rel=1e-5)
    assert float(with_mse.detach()) == pytest.approx(float(plain.detach()) + 2.0 * mse, rel=1e-5)
    with_mse.backward()
    assert net.bilinear.grad is not None and float(net.bilinear.grad.abs().sum()) > 0


def test_the_similarity_loss_of_a_large_block_reads_a_uniform_sample_of_its_entries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import training.trainer as trainer

    net, matrix, block, levels = _small_net_and_block(mf_layers=0)
    net.eval()
    k = len(block.values)
    node_rows, node_cols = torch.from_numpy(block.node_rows), torch.from_numpy(block.node_cols)
    values = torch.from_numpy(block.values.astype(np.float32))
    rows, cols = matrix.sparse_rows(block.rows), matrix.sparse_cols(block.cols)

    def sim_mse(sample: torch.Tensor | None) -> float:
        _, _, sim = net(rows, cols, node_rows, node_cols, 0, sample=sample)
        v = values if sample is None else values[sample]
        return float(torch.mean((sim - torch.exp(-((v[:, None] - v[None, :]) ** 2) / 3.5)) ** 2))

    _, parts = trainer.block_loss(net, matrix, block, levels, 0, 1.5, 3.5)
    assert k <= trainer.SIMILARITY_SAMPLE and parts["sim"] == pytest.approx(sim_mse(None), rel=1e-5)
    monkeypatch.setattr(trainer, "SIMILARITY_SAMPLE", k // 4)
    torch.manual_seed(7)
    _, parts = trainer.block_loss(net, matrix, block, levels, 0, 1.5, 3.5)
    torch.manual_seed(7)
    sample = torch.randperm(k)[: k // 4]
    assert parts["sim"] == pytest.approx(sim_mse(sample), rel=1e-5)  # those entries' pairs only
    assert parts["sim"] != pytest.approx(sim_mse(None), rel=1e-3)
    # Unbiased: over many samples the mean comes back to the mean over all K x K pairs.
    draws = [trainer.block_loss(net, matrix, block, levels, 0, 1.5, 3.5)[1]["sim"] for _ in range(300)]
    assert np.mean(draws) == pytest.approx(sim_mse(None), rel=0.03)


def test_input_dropout_zeroes_and_rescales_the_branch_inputs_in_training_only() -> None:
    from training.trainer import block_loss

    net, matrix, block, levels = _small_net_and_block(mf_layers=0)
    net.train()
    seen: list[torch.Tensor] = []
    net.row_branch.register_forward_pre_hook(lambda _m, args: seen.append(args[0].dense()))
    plain, _ = block_loss(net, matrix, block, levels, 0, 0.0, 3.5)
    dropped, _ = block_loss(net, matrix, block, levels, 0, 0.0, 3.5, input_dropout=0.5)
    full, noisy = seen[0], seen[1]
    assert torch.equal(full, matrix.rows(block.rows))  # off: the rating rows as they are
    kept = noisy != 0
    assert 0 < int(kept.sum()) < int((full != 0).sum())  # some ratings dropped, some kept
    assert torch.allclose(noisy[kept], 2.0 * full[kept])  # the kept ones scaled by 1 / (1 - 0.5)
    assert float(plain.detach()) != float(dropped.detach())
    with pytest.raises(ConfigError, match="input_dropout"):
        replace(preset("ml-100k").train, input_dropout=1.0)


def test_default_presets_carry_no_inference_constants() -> None:
    # Every dataset's default preset searches its inference after training (training/tune.py), from one
    # generic start: the preset names the mode only, the same for all.
    for dataset in ("ml-100k", "douban", "flixster", "yahoo_music", "epinions", "csv"):
        chosen = preset(dataset)
        assert chosen.tune and chosen.inference == preset("ml-100k").inference
        assert (chosen.inference.mode, chosen.inference.kernel.known) == ("exact", "clamped")
        assert not preset(dataset, "paper").tune and not preset(dataset, "tiny").tune
    assert preset("flixster").train.ema_decay == 0.99 and preset("flixster", "paper").train.ema_decay == 0
    assert (
        preset("ml-100k").train.input_dropout == 0.1 and preset("ml-100k", "paper").train.input_dropout == 0
    )
    assert preset("flixster").train.input_dropout == 0
    assert preset("yahoo_music", "paper").inference.mode == "paper"
    # Folds where a 5% carve is small (benchmarks/results/folds.md), with the refit they choose for.
    assert {d: preset(d).train.folds for d in ("ml-100k", "douban", "flixster", "yahoo_music", "csv")} == {
        "ml-100k": 1,
        "douban": 1,
        "flixster": 5,
        "yahoo_music": 3,
        "csv": 1,
    }
    assert preset("flixster").train.refit and preset("flixster", "paper").train.folds == 1
    # Two searches' settings averaged on ML-100K (benchmarks/results/ensemble.md), one elsewhere.
    names = ("ml-100k", "douban", "flixster", "yahoo_music", "csv")
    assert {d: preset(d).train.searches for d in names} == {d: 2 if d == "ml-100k" else 1 for d in names}
    assert preset("ml-100k", "paper").train.searches == 1


def test_blocks_list_their_entries_as_the_canonical_csr_does() -> None:
    # The trainer's batches (and so its trained weights) depend on the order a block lists its entries:
    # row by row, by column, as scipy's canonical CSR of the same ratings does.
    import scipy.sparse as sp

    rng = np.random.default_rng(3)
    n, m = 40, 30
    flat = rng.choice(n * m, size=500, replace=False)
    entries = Entries(flat // m, flat % m, rng.integers(1, 6, size=500).astype(np.float64))
    matrix = RatingMatrix(n, m, entries)
    reference = sp.coo_matrix((entries.values, (entries.rows, entries.cols)), shape=(n, m)).tocsr()
    rows, cols = rng.permutation(n)[:17], rng.permutation(m)[:11]
    block, ref = matrix.block(rows, cols), reference[rows][:, cols].tocoo()
    np.testing.assert_array_equal(block.node_rows, ref.row)
    np.testing.assert_array_equal(block.node_cols, ref.col)
    np.testing.assert_array_equal(block.values, ref.data)


def test_line_adam_takes_sparse_adams_steps() -> None:
    from training.trainer import LineAdam

    torch.manual_seed(0)
    ours, theirs = torch.nn.Parameter(torch.randn(30, 4)), torch.nn.Parameter(torch.randn(30, 4))
    theirs.data.copy_(ours.data)
    start = ours.data.clone()
    touched: set[int] = set()
    opt_ours, opt_theirs = LineAdam([ours], lr=0.05), torch.optim.SparseAdam([theirs], lr=0.05)
    rng = np.random.default_rng(0)
    for _ in range(6):
        lines = torch.from_numpy(np.sort(rng.choice(30, 7, replace=False)))
        touched |= set(lines.tolist())
        grad = torch.sparse_coo_tensor(lines[None], torch.randn(7, 4), (30, 4))
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt_ours.step()
        opt_theirs.step()
        torch.testing.assert_close(ours.data, theirs.data, rtol=1e-5, atol=1e-6)
    # A gradient whose lines repeat (two products' gradients added up) is summed per line first.
    repeated = torch.sparse_coo_tensor(torch.tensor([[3, 1, 3]]), torch.randn(3, 4), (30, 4))
    touched |= {1, 3}
    ours.grad, theirs.grad = repeated.clone(), repeated.clone()
    opt_ours.step()
    opt_theirs.step()
    torch.testing.assert_close(ours.data, theirs.data, rtol=1e-5, atol=1e-6)
    never = sorted(set(range(30)) - touched)
    assert never and torch.equal(ours.data[never], start[never])  # lazy: lines without a gradient wait
    assert not torch.equal(ours.data, start)


def test_the_csv_presets_blocks_grow_with_the_sparsity_until_they_hold_1024_ratings() -> None:
    from training.config import BLOCK_ENTRIES, sized_blocks

    # Epinions' size: the 128 x 256 block would hold 4 ratings; grown (same aspect) it holds ~1,024.
    rows, cols = sized_blocks(128, 256, 40_163, 139_738, 498_618)
    assert rows * cols * 498_618 / (40_163 * 139_738) == pytest.approx(BLOCK_ENTRIES, rel=0.01)
    assert cols == pytest.approx(2 * rows, abs=1)
    assert sized_blocks(128, 256, 943, 1682, 75_000) == (128, 256)  # dense enough: as the preset says
    rows, cols = sized_blocks(128, 256, 300, 100_000, 600)
    assert rows == 300 and cols < 100_000  # never more than the matrix


def test_on_a_dense_matrix_the_csv_presets_blocks_are_capped_at_equal_chunks() -> None:
    from training.config import BLOCK_CHUNKS, sized_blocks

    # ml-10m's size: blocks of 1,024 ratings (226 x 451) would be 7,440 steps an epoch.
    rows, cols = sized_blocks(128, 256, 69_878, 10_677, 7_500_040)
    row_chunks, col_chunks = math.ceil(69_878 / rows), math.ceil(10_677 / cols)
    assert row_chunks == col_chunks == BLOCK_CHUNKS
    assert sized_blocks(128, 256, 40_163, 139_738, 498_618) == (2401, 4801)  # Epinions: under the cap


def test_base_predictions_in_chunks_equal_the_paired_expected_ratings() -> None:
    from training.trainer import base_predictions

    torch.manual_seed(0)
    model = DCMC(ModelConfig(n_users=30, n_items=20, levels=(1.0, 2.0, 3.0, 4.0), hidden=(8, 6)))
    entries = _entries()
    rng = np.random.default_rng(0)
    users = rng.normal(size=(30, 6)).astype(np.float32)
    items = rng.normal(size=(20, 6)).astype(np.float32)
    u, v = torch.from_numpy(users[entries.rows]), torch.from_numpy(items[entries.cols])
    expected = (torch.softmax(model.scores(u, v), dim=-1) @ model.levels).detach().numpy()
    for chunk in (7, 100, 10_000):  # chunks under and over the item count (paired, through the columns)
        got = base_predictions(model, users, items, entries, chunk=chunk)
        assert got.shape == (len(entries),)
        assert np.allclose(got, expected, atol=1e-5)


def test_the_csv_preset_trains_the_large_network_from_large_ratings_on(
    tmp_path: Path, synthetic_csv: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    import training.config as training_config
    from model.artifact import load_artifact
    from training.pipeline import run_training

    def trained(name: str, **settings: str) -> tuple[Any, dict[str, Any]]:
        out = tmp_path / name
        run_training(
            "csv", synthetic_csv, out, split="random", settings={"epochs": "2", **settings}, progress=False,
            tune=False,
        )  # fmt: skip
        return load_artifact(out), json.loads((out / "config.json").read_text())["train"]

    small, small_train = trained("small")  # 1,500 ratings: the paper's network
    assert small.config.hidden == (512, 128) and small.config.input_scaling == "none"
    assert small.config.input_center == 0.0 and small_train["beta"] == 1.5
    monkeypatch.setattr(training_config, "LARGE_RATINGS", 100)
    large, large_train = trained("large")
    assert large.config.hidden == (32,) and large.config.input_scaling == "sqrt"
    assert large.config.input_center == pytest.approx(float(large.train.values.mean()), abs=1e-6)
    assert large_train["beta"] == 0.0 and large_train["lr"] == 0.005 and large_train["input_dropout"] == 0.2
    # What the user sets wins over the size's choice.
    chosen, chosen_train = trained("chosen", beta="1.5", hidden="32,16", input_center="3")
    assert chosen.config.hidden == (32, 16) and chosen.config.input_center == 3.0
    assert chosen.config.input_scaling == "sqrt" and chosen_train["beta"] == 1.5


@pytest.mark.parametrize("ema_decay", [0.0, 0.9])
def test_keep_best_publishes_the_epoch_of_the_lowest_validation_rmse_also_after_a_resume(
    synthetic_csv: Path, tmp_path: Path, ema_decay: float
) -> None:
    from training.trainer import base_predictions, embed_all, rmse_mae

    torch.set_num_threads(1)
    cfg, train_cfg, _ = _tiny_setup(synthetic_csv)
    data = load_dataset("csv", synthetic_csv, split="random")
    # A learning rate high enough that the validation RMSE rises after its best epoch.
    train_cfg = replace(
        train_cfg, epochs=12, lr=0.05, keep_best=True, ema_decay=ema_decay, checkpoint_every=3
    )
    model, matrix, hist = train(
        cfg, train_cfg, data.train, data.val, checkpoint_dir=tmp_path / "a", progress=False
    )
    curve = [r["val_rmse"] for r in hist.epochs]
    best = int(np.argmin(curve)) + 1
    assert hist.best is not None and hist.best["epoch"] == best < len(curve)  # not the last epoch
    users, items = embed_all(model, matrix)
    rmse, _ = rmse_mae(base_predictions(model, users, items, data.val), data.val.values)
    assert rmse == pytest.approx(curve[best - 1], abs=1e-6)
    last, _, _ = train(cfg, replace(train_cfg, keep_best=False), data.train, data.val, progress=False)
    users, items = embed_all(last, matrix)
    rmse_last, _ = rmse_mae(base_predictions(last, users, items, data.val), data.val.values)
    assert rmse_last == pytest.approx(curve[-1], abs=1e-6) and rmse_last > rmse

    # Resumed after the best epoch, the checkpoint's best is kept.
    resumed, resumed_hist = _interrupted_and_resumed(
        cfg, train_cfg, data.train, data.val, tmp_path / "b", after=9
    )
    assert resumed_hist.best is not None and resumed_hist.best["epoch"] == best
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
