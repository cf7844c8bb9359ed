"""benchmarks/resplit.py: Surprise on the same re-split the pipeline trains on, and the summary table."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.training.test_data import small_monti, write_monti_mat

pytest.importorskip("surprise")  # the `experiments` extra

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "resplit.py"
sys.path.insert(0, str(SCRIPT.parent))  # the scripts import their sibling harness.py by name
_spec = importlib.util.spec_from_file_location("resplit", SCRIPT)
assert _spec is not None and _spec.loader is not None
resplit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(resplit)


def test_surprise_scores_the_resampled_test_part(tmp_path: Path) -> None:
    m, train, test = small_monti(np.arange(1.0, 6.0), shape=(30, 25), seed=4)
    write_monti_mat(tmp_path / "monti" / "douban" / "training_test_dataset.mat", m, train, test)
    a = resplit.surprise("douban", 0, str(tmp_path))
    b = resplit.surprise("douban", 1, str(tmp_path))
    assert set(a) == {"baseline_only", "svdpp", "baseline_only_seconds", "svdpp_seconds"}
    assert 0 < a["baseline_only"] < 4 and 0 < a["svdpp"] < 4
    assert a["baseline_only"] != b["baseline_only"]  # another split, another test part


def test_the_summary_counts_the_splits_dcmc_wins() -> None:
    rows = [
        {"dataset": "douban", "seed": s, "dcmc": 0.70 + s / 100, "dcmc_network": 0.75, "dcmc_mode": "exact",
         "baseline_only": 0.80, "svdpp": 0.72, "train_seconds": 10.0, "commit": "abc"}
        for s in range(4)
    ]  # fmt: skip
    text = resplit.summarise(rows, "python benchmarks/resplit.py")
    line = next(x for x in text.splitlines() if x.startswith("| douban | 0,1,2,3 |"))
    assert line.endswith("| 2 of 4 |")  # 0.70 and 0.71 beat 0.72; 0.72 and 0.73 do not
    assert "0.7150 ± 0.0129" in line
