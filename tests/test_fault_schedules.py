"""The fault-schedule checker's short form (benchmarks/faults.py, whose long form runs 200 schedules:
benchmarks/results/faults.md): three fixed schedules and two drawn at random (their seeds are in the tests'
ids, so a failure can be replayed with `python benchmarks/faults.py --seeds SEED --flavour F --steps N`). Each
runs real redis-server and `dcmc serve` processes, retrains and compactions, and checks every invariant
against what was acknowledged.

- seed 272, single node, 3 steps: a pinned worker partitioned while a retrain is published and compacted,
  two retrains compacted at once, every worker started while Redis is down (the code before issue 56's
  fixes broke `replay`, `retrain` and `ready` on such schedules);
- seed 595, single node, 3 steps: the same kinds, the older of the two compactions slow and first (the code
  before broke `ready` and lost 69 acknowledged ratings from the retrain: defect 2, its head overwrote the
  newer one's after that one trimmed);
- seed 11, a three-primary cluster, 3 steps: a retrain, two retrains compacted at once, a primary down
  and back.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the scripts import their siblings (harness.py) by name


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]  # dataclasses resolve their module by name
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


faults = _load("faults")

DRAWN = random.SystemRandom().randrange(1_000_000)
SCHEDULES = [
    (272, "single", 3),
    (595, "single", 3),
    (11, "cluster", 3),
    (DRAWN, "single", 3),
    (DRAWN + 1, "cluster", 3),
]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The checker's dataset and tiny artifact, made once."""
    return faults.base_run(tmp_path_factory.mktemp("faults"))  # type: ignore[no-any-return]


@pytest.mark.parametrize(("seed", "flavour", "steps"), SCHEDULES, ids=lambda v: str(v))
def test_a_schedule_of_faults_breaks_no_invariant(
    base: tuple[Path, Path], seed: int, flavour: str, steps: int
) -> None:
    csv, artifact = base
    record = faults.run_schedule(seed, csv, artifact, flavour, steps)
    assert not record["violations"], (
        f"seed {seed} ({flavour}, {steps} steps: {[s['kind'] for s in record['steps']]}) broke: "
        + "; ".join(record["violations"][:10])
    )
