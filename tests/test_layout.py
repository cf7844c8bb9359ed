"""Imports point inward: model <- training, model <- service; torch stays on the training side."""

from __future__ import annotations

import ast
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
