"""benchmarks/serve.py floor's arithmetic: the floor of a run and the targets read from it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from serve import floor, targets


def _run(rps: float, p50: float, p99: float) -> dict[str, Any]:
    return {"rps": rps, "p50_ms": p50, "p99_ms": p99}


def test_the_floor_is_the_better_bare_measurement_per_figure() -> None:
    first = {"health@1": _run(5000, 0.20, 0.40), "health@32": _run(15000, 2.0, 6.0)}
    last = {"health@1": _run(5200, 0.15, 0.50), "health@32": _run(17000, 2.2, 5.0)}
    assert floor(first, last) == {"health@1": _run(5200, 0.15, 0.40), "health@32": _run(17000, 2.0, 5.0)}


def test_targets_compare_the_service_with_the_floor() -> None:
    record = {
        "bare": {"health@1": _run(5000, 0.15, 0.3), "health@32": _run(16000, 2.0, 5.0)},
        "dcmc": {
            "health@1": _run(4000, 0.20, 0.4),
            "predict100@1": _run(3000, 0.30, 0.6),
            "predict100@32": _run(7900, 3.0, 31.0),
        },
    }
    got = targets(record)
    assert got["predict100_p50_vs_floor"] == (0.30 / 0.15, 2.0, True)
    assert got["predict100_rps_share"] == (7900 / 16000, 0.5, False)
    assert got["predict100_p99_over_p50"][2] is False  # 31 / 3 > 10
    assert got["health_p50_vs_floor"][2] is False  # 0.20 / 0.15 > 1.3
