"""The paper's analyses (benchmarks/experiments.py): a --quick run of each on a generated matrix, and the
kNN wiring of the learned similarities checked against a hand-computed neighbour average."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("surprise", reason="needs the `experiments` extra")
pytest.importorskip("matplotlib", reason="needs the `experiments` extra")

from training.data import Entries

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "experiments.py"
sys.path.insert(0, str(SCRIPT.parent))  # the scripts import their sibling harness.py by name


def _module():
    spec = importlib.util.spec_from_file_location("experiments", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["experiments"] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


def test_learned_similarity_is_the_scaled_cosine() -> None:
    exp = _module()
    emb = np.random.default_rng(0).normal(size=(7, 4))
    s = exp.learned_similarity(emb)
    assert s.shape == (7, 7) and np.allclose(s, s.T)
    assert np.allclose(np.diag(s), 1.0) and s.min() >= 0.0 and s.max() <= 1.0 + 1e-12
    u = emb[2] / np.linalg.norm(emb[2])
    v = emb[5] / np.linalg.norm(emb[5])
    assert s[2, 5] == pytest.approx((1 + u @ v) / 2)


def test_knn_uses_the_learned_similarity_of_the_right_ids() -> None:
    exp = _module()
    users, items = ["a", "b", "c"], ["x", "y"]
    # user a rated y; b and c rated x and y; query: a on x.
    train = Entries(np.array([0, 1, 1, 2, 2]), np.array([1, 0, 1, 0, 1]), np.array([3.0, 5, 3, 1, 3]))
    test = Entries(np.array([0]), np.array([0]), np.array([2.0]))
    sims = {("a", "b"): 0.9, ("a", "c"): 0.1, ("b", "c"): 0.5}

    def learned(raw: list[str]) -> np.ndarray:
        return np.array([[1.0 if x == y else sims.get((x, y), sims.get((y, x))) for y in raw] for x in raw])

    def rmse(k: int, table: dict) -> float:
        sims.clear()
        sims.update(table)
        out = exp.knn_rmse(
            train, test, users, items, (1.0, 5.0), user_based=True, sim="learned", ks=[k], learned=learned
        )
        return out[k]

    # k=1: the single most similar rater of x predicts (b: 5, or c: 1 when c is the closer one).
    assert rmse(1, {("a", "b"): 0.9, ("a", "c"): 0.1, ("b", "c"): 0.5}) == pytest.approx(3.0)
    assert rmse(1, {("a", "b"): 0.1, ("a", "c"): 0.9, ("b", "c"): 0.5}) == pytest.approx(1.0)
    # k=2: the similarity-weighted mean (0.9 * 5 + 0.1 * 1) / 1.0 = 4.6.
    assert rmse(2, {("a", "b"): 0.9, ("a", "c"): 0.1, ("b", "c"): 0.5}) == pytest.approx(2.6)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from training.synthetic import low_rank_ratings, write_csv

    root = tmp_path_factory.mktemp("experiments")
    data = write_csv(root / "ratings.csv", low_rank_ratings(80, 60, 3, 0.4))
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "all",
            "--quick",
            "--data-dir",
            str(data),
            "--runs",
            str(root / "runs"),
            "--results",
            str(root / "results"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "results"


def test_quick_ablation(quick_run: Path) -> None:
    res = json.loads((quick_run / "experiments" / "ablation.json").read_text())
    assert res["quick"] is True and res["commit"]
    variants = {(r["train_mf"], r["test"]) for r in res["rows"]}
    assert variants == {(t, m) for t in (False, True) for m in ("none", "paper", "exact/normalized")}
    for r in res["rows"]:
        assert 0 < r["mae"] <= r["rmse"] < 3 and r["n"] > 0
    # Two different models were trained: their base-network scores differ.
    none = [r["rmse"] for r in res["rows"] if r["test"] == "none"]
    assert none[0] != none[1]


def test_quick_sweep(quick_run: Path) -> None:
    res = json.loads((quick_run / "experiments" / "sweep.json").read_text())
    by_param: dict[str, list[float]] = {}
    for r in res["rows"]:
        by_param.setdefault(r["param"], []).append(r["value"])
        assert 0 < r["paper_rmse"] < 3 and 0 < r["none_rmse"] < 3
    assert by_param == {"beta": [0.0, 1.5], "gamma": [0.01, 0.05], "mf_layers": [1, 3]}
    # The gamma = 0.01 point of the gamma sweep is the beta = 1.5 point of the beta sweep (one model).
    same = [
        r["artifact"] for r in res["rows"] if (r["param"], r["value"]) in (("beta", 1.5), ("gamma", 0.01))
    ]
    assert len(same) == 2 and same[0] == same[1]


def test_quick_similarity_and_report(quick_run: Path) -> None:
    res = json.loads((quick_run / "experiments" / "similarity.json").read_text())
    ((ds, d),) = res["datasets"].items()
    for side in ("user", "item"):
        assert set(d["curves"][side]) == {"learned", "cosine", "msd", "pearson", "pearson_baseline"}
        for curve in d["curves"][side].values():
            assert set(curve) == {"2", "5"} and all(0 < v < 3 for v in curve.values())
    report = (quick_run / "experiments.md").read_text()
    for heading in ("## Train/test ablation", "## Sensitivity sweeps", "## Quality of the learned"):
        assert heading in report
    for png in (f"similarity-{ds}.png", "sweep.png"):
        assert f"]({png})" in report
        assert (quick_run / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_rebuild_keeps_the_discussion(quick_run: Path) -> None:
    report = quick_run / "experiments.md"
    report.write_text(report.read_text() + "Hand-written hypothesis.\n")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "report", "--quick", "--results", str(quick_run)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    text = report.read_text()
    assert text.count("<!-- discussion -->") == 1 and text.endswith("Hand-written hypothesis.\n")
    assert "## Sensitivity sweeps" in text
