"""The `dcmc` command as a user meets it: JSON output, and one-line errors instead of tracebacks."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def dcmc(*args: str, timeout: int = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "training.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_train_then_evaluate(synthetic_csv: Path, tmp_path: Path) -> None:
    out = tmp_path / "art"
    proc = dcmc(
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
        "--seed",
        "1",
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["epochs"] == 3 and summary["n_train"] > 0
    assert (out / "manifest.json").is_file()
    assert (tmp_path / "art.ckpt" / "checkpoint.pt").is_file()
    for mode in ("paper", "none"):
        proc = dcmc(
            "evaluate", "--artifacts", str(out), "--data-dir", str(synthetic_csv), "--inference", mode
        )
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.strip().splitlines()
        assert len(lines) == 1
        result = json.loads(lines[0])
        assert result["inference"] == mode
        assert {"rmse", "mae", "n"} <= result.keys() and result["n"] > 0
        assert 0 < result["mae"] <= result["rmse"] < 2.0


def _assert_clean_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


def test_missing_data_is_a_clear_error(tmp_path: Path) -> None:
    proc = dcmc(
        "train", "--dataset", "ml-100k", "--data-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "o")
    )
    _assert_clean_error(proc, "dcmc train: error:", "u.data")
    assert not (tmp_path / "o").exists()


def test_malformed_csv_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("user,item,rating\n1,2,3\n1,3,four\n")
    proc = dcmc("train", "--dataset", "csv", "--data-dir", str(bad), "--out", str(tmp_path / "o"))
    _assert_clean_error(proc, "bad.csv", "line 3")


def test_unknown_setting_is_rejected(synthetic_csv: Path, tmp_path: Path) -> None:
    proc = dcmc(
        "train",
        "--dataset",
        "csv",
        "--data-dir",
        str(synthetic_csv),
        "--split",
        "random",
        "--out",
        str(tmp_path / "o"),
        "--set",
        "gamma_typo=1",
    )
    _assert_clean_error(proc, "unknown setting 'gamma_typo'")
    proc = dcmc(
        "train",
        "--dataset",
        "csv",
        "--data-dir",
        str(synthetic_csv),
        "--split",
        "random",
        "--out",
        str(tmp_path / "o"),
        "--set",
        "epochs=many",
    )
    _assert_clean_error(proc, "epochs='many'")


def test_resume_without_checkpoint_is_a_clear_error(synthetic_csv: Path, tmp_path: Path) -> None:
    proc = dcmc(
        "train",
        "--dataset",
        "csv",
        "--data-dir",
        str(synthetic_csv),
        "--split",
        "random",
        "--out",
        str(tmp_path / "o"),
        "--preset",
        "tiny",
        "--resume",
    )
    _assert_clean_error(proc, "no checkpoint")


@pytest.mark.parametrize("victim", ["user_embeddings.npy", "config.json"])
def test_evaluate_refuses_a_tampered_artifact(
    tiny_artifact: Path, synthetic_csv: Path, tmp_path: Path, victim: str
) -> None:
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    with open(art / victim, "ab") as f:
        f.write(b"\0")
    proc = dcmc("evaluate", "--artifacts", str(art), "--data-dir", str(synthetic_csv))
    _assert_clean_error(proc, f"{victim} fails its checksum")


def test_evaluate_refuses_co_rating_on_too_many_items(
    tiny_artifact: Path,
    synthetic_csv: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from model import exact
    from training.cli import main

    monkeypatch.setattr(exact, "CO_RATING_MAX_ITEMS", 5)
    argv = ["evaluate", "--artifacts", str(tiny_artifact), "--data-dir", str(synthetic_csv)]
    assert main([*argv, "--inference", "exact", "--co-rating", "1"]) == 2
    assert "items exceed 5" in capsys.readouterr().err


def test_evaluate_takes_the_co_rating_prior_and_refuses_a_negative_one(
    tiny_artifact: Path, synthetic_csv: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from training.cli import main

    argv = ["evaluate", "--artifacts", str(tiny_artifact), "--data-dir", str(synthetic_csv)]
    argv += ["--inference", "exact", "--co-rating", "5"]
    results = []
    for prior in ("0", "0.5"):
        assert main([*argv, "--co-rating-prior", prior]) == 0
        results.append(json.loads(capsys.readouterr().out))
    assert [r["co_rating_prior"] for r in results] == [0.0, 0.5]
    assert results[0]["rmse"] != results[1]["rmse"]
    assert main([*argv, "--co-rating-prior", "-1"]) == 2
    err = capsys.readouterr().err
    assert "co_rating_prior" in err and "Traceback" not in err


def test_evaluate_takes_the_bias_baseline_and_refuses_a_weight_above_one(
    tiny_artifact: Path, synthetic_csv: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from training.cli import main

    argv = ["evaluate", "--artifacts", str(tiny_artifact), "--data-dir", str(synthetic_csv)]
    argv += ["--inference", "exact", "--baseline-item-shrink", "3"]
    results = []
    for weight in ("0", "0.5", "1"):
        assert main([*argv, "--baseline", weight]) == 0
        results.append(json.loads(capsys.readouterr().out))
    assert [r["baseline"] for r in results] == [0.0, 0.5, 1.0]
    assert {r["baseline_item_shrink"] for r in results} == {3.0}
    assert len({r["rmse"] for r in results}) == 3
    assert main([*argv, "--baseline", "1.5"]) == 2
    err = capsys.readouterr().err
    assert "baseline must lie in [0, 1]" in err and "Traceback" not in err
