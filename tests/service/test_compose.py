"""The docker-compose wiring, parsed (no Docker engine here), and a service that runs without torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.service.conftest import serve_argv

REPO = Path(__file__).resolve().parents[2]


def _compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_compose_services_health_checks_and_volumes() -> None:
    services = _compose()["services"]
    assert set(services) == {"redis", "trainer", "api", "retrainer"}
    assert services["redis"]["image"].startswith("redis:7")
    assert "redis-cli" in services["redis"]["healthcheck"]["test"]
    assert services["trainer"]["restart"] == "no"
    assert "artifacts:/artifacts" in services["trainer"]["volumes"]
    assert any(v.startswith("${DATA_DIR:?") for v in services["trainer"]["volumes"])
    api = services["api"]
    assert api["depends_on"] == {
        "redis": {"condition": "service_healthy"},
        "trainer": {"condition": "service_completed_successfully"},
    }
    assert "/ready" in " ".join(api["healthcheck"]["test"])
    assert "artifacts:/artifacts:ro" in api["volumes"]
    assert api["environment"]["REDIS_URL"] == "redis://redis:6379/0"
    assert "artifacts" in _compose()["volumes"]
    # Online ratings are acknowledged only once fsynced: the append-only file on a volume, fsync always
    # (the flags the durability tests give their redis-server: tests/service/conftest.py RedisServer).
    command = services["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "always"
    assert "redis-data:/data" in services["redis"]["volumes"] and "redis-data" in _compose()["volumes"]
    assert api["environment"]["DCMC_WRITE_TOKEN"] == "${DCMC_WRITE_TOKEN:-}"  # unset: writes off
    for name, dockerfile in (("api", "docker/api.Dockerfile"), ("trainer", "docker/trainer.Dockerfile")):
        assert services[name]["build"]["dockerfile"] == dockerfile
        assert (REPO / dockerfile).is_file()
    api_image = (REPO / "docker/api.Dockerfile").read_text()
    installs = [line for line in api_image.splitlines() if "pip install" in line]
    assert installs and all('".[serve]"' in line and "torch" not in line.split("&&")[0] for line in installs)


def test_compose_can_scale_the_api_on_one_redis() -> None:
    # `--scale api=N` needs no container_name and a host port range with room for N replicas.
    api = _compose()["services"]["api"]
    assert "container_name" not in api
    (published,) = api["ports"]
    host, _, container = published.rpartition(":")
    low, high = (int(x) for x in re.fullmatch(r"\$\{API_PORTS:-(\d+)-(\d+)\}", host).groups())  # type: ignore[union-attr]
    assert container == "8000" and high - low + 1 >= 4
    assert api["environment"]["REDIS_URL"] == "redis://redis:6379/0"  # every replica: the same Redis


def _instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per Dockerfile instruction, with comments dropped and continuations joined."""
    lines = [line for line in dockerfile.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_api_image_has_no_training_code_and_runs_the_service_entry_point() -> None:
    steps = _instructions((REPO / "docker/api.Dockerfile").read_text())
    copied = {  # the sources of every COPY/ADD (all arguments but the destination, flags dropped)
        src.rstrip("/")
        for word, args in steps
        if word in ("COPY", "ADD")
        for src in [a for a in args.split() if not a.startswith("--")][:-1]
    }
    assert copied == {"pyproject.toml", "README.md", "model", "service"}, copied  # no training/, no `.`
    runs = " && ".join(args for word, args in steps if word == "RUN")
    assert "find_spec('torch') is None" in runs and "find_spec('training') is None" in runs
    cmd = json.loads(next(args for word, args in steps if word == "CMD"))
    assert cmd[:3] == ["python", "-m", "service"]
    api = _compose()["services"]["api"]["command"]
    assert cmd == [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", a) for a in api]


def _flags(argv: list[str]) -> list[str]:
    return [a for a in argv if a.startswith("--")]


def test_containers_run_the_commands_the_tests_run() -> None:
    services = _compose()["services"]
    api = services["api"]["command"]
    assert api[:3] == ["python", "-m", "service"]  # the service's own entry point: no training code needed
    assert _flags(api) == _flags(serve_argv("X", 0, 2))
    trainer = services["trainer"]["command"]
    assert trainer[:2] == ["dcmc", "train"]
    assert {"--dataset", "--data-dir", "--out", "--epochs", "--threads"} <= set(_flags(trainer))
    # the trainer publishes its artifact as the link the api serves (and polls: hot reload)
    assert (
        trainer[trainer.index("--publish") + 1] == api[api.index("--artifacts") + 1] == "/artifacts/current"
    )
    assert trainer[trainer.index("--out") + 1].startswith("/artifacts/runs/")
    from training.cli import build_parser  # the flags exist in the real CLI

    def with_defaults(args: list[str]) -> list[str]:  # compose's ${VAR:-default} with VAR unset
        return [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", a) for a in args]

    parsed = build_parser().parse_args(with_defaults(trainer[1:]))
    assert parsed.dataset == "ml-100k" and parsed.epochs == 100 and parsed.publish == "/artifacts/current"
    # The retrainer's loop runs `dcmc train <its command> --out RUN --publish /artifacts/current`.
    retrainer = services["retrainer"]
    assert retrainer["entrypoint"] == ["/app/docker/retrain-loop.sh"]
    loop = (REPO / "docker/retrain-loop.sh").read_text()
    assert 'dcmc train "$@" --out "/artifacts/runs/$stamp" --publish /artifacts/current' in loop
    parsed = build_parser().parse_args(
        ["train", *with_defaults(retrainer["command"]), "--out", "/x", "--publish", "/y"]
    )
    assert parsed.dataset == "ml-100k" and parsed.out == "/x"
    assert parsed.online_ratings == services["api"]["environment"]["REDIS_URL"]  # trains on the stream
    assert "artifacts:/artifacts" in retrainer["volumes"] and retrainer["restart"] == "unless-stopped"
    assert services["api"]["environment"]["DCMC_RELOAD_POLL_S"] == "${DCMC_RELOAD_POLL_S:-5}"
    from service.__main__ import build_parser as service_parser

    parsed = service_parser().parse_args(with_defaults(api[3:]))
    assert parsed.workers == 2 and parsed.host == "0.0.0.0" and parsed.port == 8000
    # `dcmc serve` (which execs `python -m service`) takes the same flags.
    parsed = build_parser().parse_args(["serve", *with_defaults(api[3:])])
    assert parsed.workers == 2 and parsed.host == "0.0.0.0"


_NO_TORCH = """
import sys

class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")

sys.meta_path.insert(0, _Blocker())
from fastapi.testclient import TestClient
from service.main import create_app
from service.settings import Settings

with TestClient(create_app(Settings(artifacts=sys.argv[1]))) as client:
    response = client.post("/predict", json={"user": "u0", "items": ["i1", "i2"]})
    assert response.status_code == 200, response.text
    assert len(response.json()["predictions"]) == 2
assert "torch" not in sys.modules
print("ok")
"""


def test_service_runs_without_torch(tiny_artifact: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, str(tiny_artifact)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_an_empty_write_token_turns_writes_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.settings import Settings

    monkeypatch.setenv("DCMC_WRITE_TOKEN", "")
    assert Settings().write_token is None
    monkeypatch.setenv("DCMC_WRITE_TOKEN", "t0ken")
    token = Settings().write_token
    assert token is not None and token.get_secret_value() == "t0ken" and "t0ken" not in repr(Settings())
