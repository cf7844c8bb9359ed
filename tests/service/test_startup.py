"""Start-up: a bad artifact stops `dcmc serve` with a clear message and a non-zero exit."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from service.__main__ import main as serve_main
from tests.service.conftest import DCMC, free_port


def _serve(artifacts: Path) -> subprocess.CompletedProcess[str]:
    argv = [DCMC, "serve", "--artifacts", str(artifacts), "--port", str(free_port())]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_tampered_artifact_prevents_start_up(artifact_copy: Path) -> None:
    with open(artifact_copy / "item_embeddings.npy", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x00\x00\x80\x7f")
    done = _serve(artifact_copy)
    assert done.returncode != 0
    assert "item_embeddings.npy fails its checksum" in done.stderr
    assert "Traceback" not in done.stderr


def test_missing_artifact_prevents_start_up(tmp_path: Path) -> None:
    done = _serve(tmp_path / "nothing-here")
    assert done.returncode != 0
    assert "does not exist" in done.stderr


def test_a_misspelt_inference_variable_prevents_start_up(
    tiny_artifact: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DCMC_INFERENCE__CRF__GAMA", "1")
    assert serve_main(["--artifacts", str(tiny_artifact)]) == 2
    err = capsys.readouterr().err
    assert "unknown inference setting 'crf.gama'; valid: mode, crf.gamma" in err and "Traceback" not in err
