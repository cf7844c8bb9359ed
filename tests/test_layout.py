"""Imports point inward: model <- training, model <- service; torch stays on the training side."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("model", "training", "service")
FORBIDDEN = {"model": {"training", "service"}, "training": {"service"}, "service": {"training", "torch"}}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_inward(package: str) -> None:
    files = sorted((REPO / package).rglob("*.py"))
    assert files, package
    for path in files:
        bad = _imports(path) & FORBIDDEN[package]
        assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"


def test_only_network_imports_torch_in_model() -> None:
    users = {p.name for p in (REPO / "model").rglob("*.py") if "torch" in _imports(p)}
    assert users == {"network.py"}


# The AST check above sees only direct imports. These import the real modules in a fresh interpreter and
# look at everything that got loaded, so an indirect path (service -> model.x -> model.network -> torch, or
# an import done at import time of a dependency) is caught too. Modules are discovered with pkgutil, not
# listed, so renames and new modules under model/ and service/ are covered without editing this file.
_LOADED = """
import importlib
import json
import pkgutil
import sys

package, entry_points, skip = sys.argv[1], json.loads(sys.argv[2]), set(json.loads(sys.argv[3]))


def walk(pkg):  # pkgutil.walk_packages, but a skipped package is neither imported nor walked into
    for info in pkgutil.iter_modules(pkg.__path__, prefix=pkg.__name__ + "."):
        if info.name in skip:
            continue
        module = importlib.import_module(info.name)
        yield info.name
        if info.ispkg:
            yield from walk(module)


imported = [package]
for name in entry_points:
    importlib.import_module(name)
    imported.append(name)
imported += walk(importlib.import_module(package))
print(json.dumps({"imported": imported, "loaded": sorted(sys.modules)}))
"""


def _loaded(
    package: str, entry_points: tuple[str, ...] = (), skip: tuple[str, ...] = ()
) -> tuple[list[str], list[str]]:
    """Import `package`, `entry_points` and every module under the package but `skip` in a subprocess;
    returns (the modules imported, sorted(sys.modules) afterwards)."""
    proc = subprocess.run(
        [sys.executable, "-c", _LOADED, package, json.dumps(entry_points), json.dumps(skip)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["imported"], result["loaded"]


def _in(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_service_import_chain_has_no_torch_and_no_training() -> None:
    entry_points = ("service.main", "service.__main__", "service.scoring", "service.settings")
    imported, loaded = _loaded("service", entry_points)
    walked = [n for n in imported if n.startswith("service.")]
    assert len(set(walked)) > len(entry_points), imported  # the walk found the package's modules
    bad = [n for n in loaded if _in(n, "torch", "training")]
    assert not bad, f"importing the service loads {bad}"


def test_model_import_chain_without_network_has_no_torch() -> None:
    imported, loaded = _loaded("model", skip=("model.network",))
    assert len(imported) > 1 and "model.network" not in imported, imported
    bad = [n for n in loaded if _in(n, "torch", "training", "service")]
    assert not bad, f"importing {imported} loads {bad}"
