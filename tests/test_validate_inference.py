"""benchmarks/validate_inference.py and similar_users.py on a tiny artifact: --score-fraction scores a
carve inside the held-out ratings; the kNN probe scores the held-out ratings with the learned neighbours."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from training.data import carve_validation, load_dataset
from training.synthetic import low_rank_ratings, write_csv

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "validate_inference.py"


@pytest.fixture(scope="module")
def carved_artifact(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny artifact whose trainer carved 20% of the training entries (a csv directory without val.csv)."""
    from training.pipeline import run_training

    triples = low_rank_ratings()
    data = tmp_path_factory.mktemp("carve-data")
    write_csv(data / "train.csv", triples[: len(triples) * 4 // 5])
    write_csv(data / "test.csv", triples[len(triples) * 4 // 5 :])
    out = tmp_path_factory.mktemp("carve-art") / "tiny"
    settings = {"val_fraction": "0.2", "epochs": "2"}
    run_training("csv", data, out, split="u1", preset_name="tiny", settings=settings, progress=False)
    return out, data


def _run(artifact: Path, data: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(SCRIPT), "--artifacts", str(artifact), "--data-dir", str(data)]
    cmd += [
        "--skip-paper",
        "--grid",
        "mode=exact",
        "--grid",
        "kernel.known=clamped",
        "--grid",
        "crf.gamma=0.1",
    ]
    cmd += extra
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_score_fraction_scores_the_smaller_carve(carved_artifact: tuple[Path, Path]) -> None:
    artifact, data = carved_artifact
    n_train = len(load_dataset("csv", data, split="u1").train)
    whole = [json.loads(line) for line in _run(artifact, data).stdout.splitlines()]
    part_run = _run(artifact, data, "--score-fraction", "0.1")
    assert part_run.returncode == 0, part_run.stderr
    part = [json.loads(line) for line in part_run.stdout.splitlines()]
    assert [r["mode"] for r in part] == ["none", "exact"]
    assert {r["n"] for r in whole} == {round(0.2 * n_train)}
    assert {r["n"] for r in part} == {round(0.1 * n_train)}
    # The smaller carve of the same seed lies inside the ratings the trainer held out.
    split = load_dataset("csv", data, split="u1")
    big = carve_validation(split.train, 0.2, 0)[1]
    small = carve_validation(split.train, 0.1, 0)[1]
    held = set(zip(big.rows.tolist(), big.cols.tolist(), strict=True))
    assert set(zip(small.rows.tolist(), small.cols.tolist(), strict=True)) <= held


def test_score_fraction_beyond_the_held_out_share_is_refused(carved_artifact: tuple[Path, Path]) -> None:
    artifact, data = carved_artifact
    run = _run(artifact, data, "--score-fraction", "0.3")
    assert run.returncode == 2
    assert "--score-fraction must lie in (0, 0.2]" in run.stderr
    assert "Traceback" not in run.stderr


def test_similar_users_probe_scores_the_held_out_ratings(carved_artifact: tuple[Path, Path]) -> None:
    pytest.importorskip("surprise", reason="needs the `experiments` extra")
    artifact, data = carved_artifact
    script = REPO / "benchmarks" / "similar_users.py"
    cmd = [
        sys.executable,
        str(script),
        "--artifacts",
        str(artifact),
        "--data-dir",
        str(data),
        "--ks",
        "5",
        "50",
    ]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert [(r["side"], r["similarity"]) for r in lines] == [
        ("user", "learned"),
        ("user", "pearson_baseline"),
        ("item", "learned"),
        ("item", "pearson_baseline"),
    ]
    n_train = len(load_dataset("csv", data, split="u1").train)
    assert {r["n"] for r in lines} == {round(0.2 * n_train)}
    for r in lines:
        assert set(r["val_rmse"]) == {"5", "50"}
        assert all(0.0 < v < 4.0 for v in r["val_rmse"].values())  # ratings on 1..5
    # Learned and reference neighbours differ, so do their predictions.
    assert lines[0]["val_rmse"] != lines[1]["val_rmse"]
