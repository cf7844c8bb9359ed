"""The `dcmc` command as a user meets it: JSON output, and one-line errors instead of tracebacks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
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
        "--publish",
        str(tmp_path / "current"),
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["epochs"] == 3 and summary["n_train"] > 0
    assert (out / "manifest.json").is_file()
    assert (tmp_path / "current").resolve() == out.resolve()  # published: what a service would serve
    version = json.loads((out / "manifest.json").read_text())["model_version"]
    assert summary["published"] == {"link": str(tmp_path / "current"), "model_version": version}
    proc = dcmc("publish", "--artifacts", str(tmp_path / "nope"), "--link", str(tmp_path / "current"))
    _assert_clean_error(proc, "does not exist")
    assert (tmp_path / "current").resolve() == out.resolve()
    assert (tmp_path / "art.ckpt" / "checkpoint.pt").is_file()
    for mode in ("paper", "none"):
        proc = dcmc(
            "evaluate",
            "--artifacts",
            str(out),
            "--data-dir",
            str(synthetic_csv),
            "--set",
            f"inference.mode={mode}",
        )
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.strip().splitlines()
        assert len(lines) == 1
        result = json.loads(lines[0])
        assert result["inference"] == mode and result["settings"]["mode"] == mode
        assert {"rmse", "mae", "n"} <= result.keys() and result["n"] > 0
        assert 0 < result["mae"] <= result["rmse"] < 2.0
    # The same artifact twice is an ensemble of two equal members: the same figures.
    proc = dcmc("evaluate", "--artifacts", str(out), str(out), "--data-dir", str(synthetic_csv),
                "--set", "inference.mode=none")  # fmt: skip
    both = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [m["rmse"] for m in both["members"]] == [result["rmse"]] * 2
    assert both["rmse"] == pytest.approx(result["rmse"])


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


def _evaluate_argv(artifact: Path, data: Path, *settings: str) -> list[str]:
    argv = ["evaluate", "--artifacts", str(artifact), "--data-dir", str(data)]
    for setting in settings:
        argv += ["--set", f"inference.{setting}"]
    return argv


def test_evaluate_takes_the_co_rating_prior_and_refuses_a_negative_one(
    tiny_artifact: Path, synthetic_csv: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from training.cli import main

    argv = _evaluate_argv(tiny_artifact, synthetic_csv, "mode=exact", "kernel.co_rating=5")
    results = []
    for prior in ("0", "0.5"):
        assert main([*argv, "--set", f"inference.kernel.co_rating_prior={prior}"]) == 0
        results.append(json.loads(capsys.readouterr().out))
    assert [r["settings"]["kernel"]["co_rating_prior"] for r in results] == [0.0, 0.5]
    assert results[0]["rmse"] != results[1]["rmse"]
    assert main([*argv, "--set", "inference.kernel.co_rating_prior=-1"]) == 2
    err = capsys.readouterr().err
    assert "kernel.co_rating_prior" in err and "Traceback" not in err


def test_evaluate_takes_the_bias_baseline_and_refuses_a_weight_above_one(
    tiny_artifact: Path, synthetic_csv: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from training.cli import main

    argv = _evaluate_argv(tiny_artifact, synthetic_csv, "mode=exact", "output.baseline_item_shrink=3")
    results = []
    for weight in ("0", "0.5", "1"):
        assert main([*argv, "--set", f"inference.output.baseline={weight}"]) == 0
        results.append(json.loads(capsys.readouterr().out))
    assert [r["settings"]["output"]["baseline"] for r in results] == [0.0, 0.5, 1.0]
    assert {r["settings"]["output"]["baseline_item_shrink"] for r in results} == {3.0}
    assert len({r["rmse"] for r in results}) == 3
    assert main([*argv, "--set", "inference.output.baseline=1.5"]) == 2
    err = capsys.readouterr().err
    assert "output.baseline" in err and "less than or equal to 1" in err and "Traceback" not in err


def test_evaluate_refuses_a_misspelt_setting_listing_the_valid_ones(
    tiny_artifact: Path, synthetic_csv: Path
) -> None:
    from model.config import setting_names

    proc = dcmc(*_evaluate_argv(tiny_artifact, synthetic_csv, "crf.gama=1"))
    _assert_clean_error(proc, "dcmc evaluate: error:", "unknown inference setting 'crf.gama'")
    for name in setting_names():
        assert name in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("key", ["gamma", "crf.gamma", "inference", "model.gamma"])
def test_evaluate_takes_only_inference_settings(
    tiny_artifact: Path, synthetic_csv: Path, capsys: pytest.CaptureFixture[str], key: str
) -> None:
    from training.cli import main

    argv = ["evaluate", "--artifacts", str(tiny_artifact), "--data-dir", str(synthetic_csv)]
    assert main([*argv, "--set", f"{key}=1"]) == 2
    captured = capsys.readouterr()
    assert f"inference settings (inference.<group>.<name>), got {key!r}" in captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_evaluate_refuses_a_setting_the_mode_does_not_read(
    tiny_artifact: Path, synthetic_csv: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from training.cli import main

    # The tiny artifact infers with `paper`, which has no kernel.
    assert main(_evaluate_argv(tiny_artifact, synthetic_csv, "kernel.co_rating=1")) == 2
    err = capsys.readouterr().err
    assert "does not read kernel.co_rating" in err and "inference.mode" in err


def test_train_refuses_an_unknown_inference_setting(synthetic_csv: Path, tmp_path: Path) -> None:
    # Refused before any training (test_export's exact artifact is trained with valid ones).
    proc = dcmc(
        "train", "--dataset", "csv", "--data-dir", str(synthetic_csv), "--split", "random",
        "--out", str(tmp_path / "o"), "--preset", "tiny", "--set", "inference.crf.gama=1",
    )  # fmt: skip
    _assert_clean_error(proc, "dcmc train: error:", "unknown inference setting 'crf.gama'", "crf.gamma")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.ckpt").exists()


def test_demo_prints_the_online_loop() -> None:
    from training.cli import demo_commands

    text = demo_commands("http://127.0.0.1:8000", "u0", ["i1", "i2"], "tok")
    assert "curl -s 'http://127.0.0.1:8000/recommend/newcomer?k=5'" in text
    assert "-X POST http://127.0.0.1:8000/ratings -H 'authorization: Bearer tok'" in text
    assert '"user": "newcomer", "item": "i1", "rating": 5' in text
    assert text.index("/recommend/newcomer") < text.index("/ratings") < text.rindex("/recommend/newcomer")
    assert "/ratings" not in demo_commands("http://h:1", "u0", ["i1"], None)  # no Redis: no writes


def test_demo_trains_with_the_search_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The demo's artifact gets its inference from the search (default preset, enough validation
    # ratings), not `mode=none`: the generated matrix's random split holds 5% of 12,000 ratings.
    import training.pipeline
    from training.cli import main as cli_main
    from training.data import load_dataset

    calls: list[dict[str, object]] = []
    monkeypatch.setattr(training.pipeline, "run_training", lambda *a, **k: calls.append({"args": a, **k}))
    for var in ("DCMC_WRITE_TOKEN", "REDIS_URL", "DCMC_REDIS_KEY_PREFIX"):  # the demo sets them: undone after
        monkeypatch.setenv(var, os.environ.get(var, ""))
    assert cli_main(["demo", "--no-serve", "--out", str(tmp_path / "demo")]) == 0
    (call,) = calls
    assert call.get("preset_name", "default") == "default" and call.get("tune", True) is True
    dataset, data = call["args"][0], call["args"][1]
    split = load_dataset(str(dataset), str(data), split=str(call["split"]))
    from training.tune import MIN_VALIDATION

    assert split.val is not None and len(split.val) >= MIN_VALIDATION


def test_explain_prints_what_the_scorer_explains(
    tiny_artifact: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from model.artifact import load_artifact
    from model.scorers import artifact_scorer
    from training.cli import main

    exact = ["--set", "inference.mode=exact", "--set", "inference.kernel.known=clamped"]
    exact += ["--set", "inference.kernel.same_user=20"]
    argv = ["explain", "--artifacts", str(tiny_artifact), "--user", "u4", "--item", "i7", "--item", "i30"]
    assert main([*argv, *exact, "-k", "3"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    artifact = load_artifact(tiny_artifact)
    settings = {"mode": "exact", "kernel.known": "clamped", "kernel.same_user": 20}
    inference = artifact.inference.with_overrides(settings)
    _, scorer = artifact_scorer(artifact, inference)
    items = artifact.items.indices(["i7", "i30"])
    expected = scorer.explain(int(artifact.users.indices(["u4"])[0]), items, 3)
    assert [line["item"] for line in lines] == ["i7", "i30"]
    for line, e in zip(lines, expected, strict=True):
        assert line["rating"] == e.rating and line["explanation"]["network"] == e.network
        because = line["explanation"]["because"]
        assert [b["effect"] for b in because] == e.effects.tolist() and len(because) == 3
        known = artifact.known()
        assert [(b["user"], b["item"]) for b in because] == [
            (artifact.users.ids[int(known.rows[p])], artifact.items.ids[int(known.cols[p])]) for p in e.known
        ]
    assert main(argv) == 2  # the tiny preset serves `paper`: a clean error, no traceback
    err = capsys.readouterr().err
    assert "cannot explain" in err and "Traceback" not in err


def test_demo_shows_titles_and_a_filtered_list_where_the_artifact_has_a_catalogue(
    tiny_artifact: Path,
) -> None:
    from model.artifact import load_artifact
    from model.catalogue import ItemRecord
    from training.cli import demo_commands, demo_showcase
    from training.evaluate import predict_ratings

    art = load_artifact(tiny_artifact)
    art.catalogue = {x: ItemRecord(title=f"Title {x}", categories=["odd" if j % 2 else "even"],
                                   hidden=j == 0) for j, x in enumerate(art.items.ids)}  # fmt: skip
    user = art.users.ids[0]
    text = demo_showcase(art, user, "odd", k=3)
    n = len(art.items)
    ratings = predict_ratings(art, np.full(n, 0), np.arange(n), art.settings())
    known = art.known()
    rated = set(known.cols[known.by_row.of(0)].tolist())
    odd = [j for j in sorted(range(n), key=lambda j: (-ratings[j], j)) if j % 2 and j not in rated][:3]
    tail = text.split("among odd (GET /recommend with diversity=0):\n")[1].splitlines()
    assert [line.split("  ")[-1] for line in tail] == [f"Title {art.items.ids[j]}" for j in odd]
    assert f"Title {art.items.ids[0]}" not in text.split("top 3")[1]  # hidden: never listed
    assert "/recommend/u0?k=5&category=odd" in demo_commands("http://h:1", "u0", ["i1"], None, "odd")
