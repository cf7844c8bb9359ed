"""The docker-compose wiring, parsed and interpolated as compose would (no Docker engine here: see
tests/docker_emulation.py, and tests/test_images.py for the images built and run), the deployment's
hardening, and a service that runs without torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.docker_emulation import ComposeError, Dockerfile, compose, raw_compose
from tests.service.conftest import serve_argv

REPO = Path(__file__).resolve().parents[2]
ENV = {"DATA_DIR": "/srv/data", "REDIS_PASSWORD": "pw0rd"}
URL = "redis://:pw0rd@redis:6379/0"


def _compose() -> dict[str, Any]:
    return compose(ENV)


def _strings(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [x for v in node for x in _strings(v)]
    if isinstance(node, dict):
        return [x for v in node.values() for x in _strings(v)]
    return []


def test_compose_services_health_checks_and_volumes() -> None:
    services = _compose()["services"]
    assert set(services) == {"redis", "trainer", "api", "retrainer"}
    assert services["redis"]["image"].startswith("redis:7")
    assert "redis-cli ping" in " ".join(services["redis"]["healthcheck"]["test"])
    assert services["trainer"]["restart"] == "no"
    assert "artifacts:/artifacts" in services["trainer"]["volumes"]
    assert "/srv/data:/data:ro" in services["trainer"]["volumes"]
    api = services["api"]
    assert api["depends_on"] == {
        "redis": {"condition": "service_healthy"},
        "trainer": {"condition": "service_completed_successfully"},
    }
    assert "/ready" in " ".join(api["healthcheck"]["test"])
    assert "artifacts:/artifacts:ro" in api["volumes"]
    assert api["environment"]["REDIS_URL"] == URL
    assert "artifacts" in _compose()["volumes"]
    # Online ratings are acknowledged only once fsynced: the append-only file on a volume, fsync always
    # (the flags the durability tests give their redis-server: tests/service/conftest.py RedisServer).
    command = services["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "always"
    assert "redis-data:/data" in services["redis"]["volumes"] and "redis-data" in _compose()["volumes"]
    assert api["environment"]["DCMC_WRITE_TOKEN"] == ""  # unset: writes off
    assert api["environment"]["DCMC_READ_TOKEN"] == ""  # unset: reads open
    assert (
        compose({**ENV, "DCMC_READ_TOKEN": "r"})["services"]["api"]["environment"]["DCMC_READ_TOKEN"] == "r"
    )
    assert api["environment"]["DCMC_REQUIRE_DURABLE"] == "true"  # and on, only while Redis is durable
    assert (
        compose({**ENV, "DCMC_WRITE_TOKEN": "t"})["services"]["api"]["environment"]["DCMC_WRITE_TOKEN"] == "t"
    )
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
    bind, ports, container = published.split(":")
    low, high = (int(x) for x in ports.split("-"))
    assert container == "8000" and high - low + 1 >= 4 and bind == "127.0.0.1"
    assert api["environment"]["REDIS_URL"] == URL  # every replica: the same Redis


def test_api_image_has_no_training_code_and_runs_the_service_entry_point() -> None:
    image = Dockerfile.parse(REPO / "docker/api.Dockerfile")
    steps = image.steps
    copied = image.copied()
    assert copied == {"pyproject.toml", "README.md", "model", "service"}, copied  # no training/, no `.`
    runs = " && ".join(args for word, args in steps if word == "RUN")
    assert "find_spec('torch') is None" in runs and "find_spec('training') is None" in runs
    cmd = json.loads(next(args for word, args in steps if word == "CMD"))
    assert cmd[:3] == ["python", "-m", "service"]
    assert cmd == _compose()["services"]["api"]["command"]


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

    parsed = build_parser().parse_args(trainer[1:])
    assert parsed.dataset == "ml-100k" and parsed.epochs == 100 and parsed.publish == "/artifacts/current"
    # The retrainer's loop runs `dcmc train <its command> --out RUN --publish /artifacts/current`.
    retrainer = services["retrainer"]
    assert retrainer["entrypoint"] == ["/app/docker/retrain-loop.sh"]
    loop = (REPO / "docker/retrain-loop.sh").read_text()
    assert 'dcmc train "$@" --out "/artifacts/runs/$stamp" --publish /artifacts/current' in loop
    parsed = build_parser().parse_args(["train", *retrainer["command"], "--out", "/x", "--publish", "/y"])
    assert parsed.dataset == "ml-100k" and parsed.out == "/x"
    # trains on the stream, at the URL in its environment (the password stays off the command line)
    from training.cli import FROM_ENV

    assert parsed.online_ratings == FROM_ENV
    # then compacts the stream up to what the published artifact read, reading REDIS_URL like the training
    assert "dcmc compact --artifacts /artifacts/current" in loop
    compact = build_parser().parse_args(["compact", "--artifacts", "/artifacts/current"])
    assert compact.online_ratings == FROM_ENV
    assert retrainer["environment"]["REDIS_URL"] == services["api"]["environment"]["REDIS_URL"] == URL
    assert "artifacts:/artifacts" in retrainer["volumes"] and retrainer["restart"] == "unless-stopped"
    assert services["api"]["environment"]["DCMC_RELOAD_POLL_S"] == "5"
    from service.__main__ import build_parser as service_parser

    parsed = service_parser().parse_args(api[3:])
    assert parsed.workers == 2 and parsed.host == "0.0.0.0" and parsed.port == 8000
    # `dcmc serve` (which execs `python -m service`) takes the same flags.
    parsed = build_parser().parse_args(["serve", *api[3:]])
    assert parsed.workers == 2 and parsed.host == "0.0.0.0"


def test_compose_refuses_to_start_without_a_redis_password() -> None:
    with pytest.raises(ComposeError, match="REDIS_PASSWORD"):
        compose({"DATA_DIR": "/srv/data"})
    with pytest.raises(ComposeError, match="REDIS_PASSWORD"):
        compose({"DATA_DIR": "/srv/data", "REDIS_PASSWORD": ""})
    with pytest.raises(ComposeError, match="DATA_DIR"):
        compose({"REDIS_PASSWORD": "pw0rd"})


def test_redis_requires_the_password_and_every_url_carries_it() -> None:
    services = _compose()["services"]
    command = services["redis"]["command"]
    assert command[command.index("--requirepass") + 1] == "pw0rd"
    # The health check authenticates (REDISCLI_AUTH) and reads the PONG: redis-cli exits 0 on NOAUTH too.
    assert services["redis"]["environment"]["REDISCLI_AUTH"] == "pw0rd"
    (kind, check) = services["redis"]["healthcheck"]["test"]
    assert kind == "CMD-SHELL" and check == "redis-cli ping | grep -q PONG"
    urls = [s for s in _strings(raw_compose()) if "redis://" in s]
    assert len(urls) == 2 and all(url.startswith("redis://:${REDIS_PASSWORD:?") for url in urls), urls
    for name in ("api", "retrainer"):
        assert services[name]["environment"]["REDIS_URL"] == URL
    # No URL (and so no password) on a command line, where `ps` shows it.
    assert not [
        s for name in services for s in _strings(services[name].get("command", [])) if "redis://" in s
    ]


def test_the_api_port_binds_loopback_unless_api_bind_says_otherwise() -> None:
    assert _compose()["services"]["api"]["ports"] == ["127.0.0.1:8000-8009:8000"]
    public = compose({**ENV, "API_BIND": "0.0.0.0", "API_PORTS": "9000-9003"})["services"]["api"]["ports"]
    assert public == ["0.0.0.0:9000-9003:8000"]


@pytest.mark.parametrize(
    ("service", "dockerfile"), [("trainer", "trainer"), ("retrainer", "trainer"), ("api", "api")]
)
def test_every_image_runs_as_an_unprivileged_user(service: str, dockerfile: str) -> None:
    image = Dockerfile.parse(REPO / f"docker/{dockerfile}.Dockerfile")
    user = image.user()
    assert user not in (None, "root", "0") and not str(user).startswith(("0:", "root:")), user
    runs = image.args("RUN")
    assert any(r.startswith(f"useradd --create-home --uid 10001 {user}") for r in runs), runs
    assert str(_compose()["services"][service].get("user", user)) not in ("root", "0")
    if dockerfile == "trainer":  # it writes the artifacts volume: a new volume takes /artifacts' owner
        assert f"chown {user}:{user} /artifacts" in " ".join(runs)
        steps = [word for word, _ in image.steps]
        assert steps.index("USER") > max(i for i, w in enumerate(steps) if w in ("RUN", "COPY"))


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


def test_the_readme_deployment_section_names_every_variable_of_the_compose_file() -> None:
    text = (REPO / "docker-compose.yml").read_text()
    variables = set(re.findall(r"\$\{([A-Z_]+)", text))
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Deployment") :]
    section = section[: section.index("\n## ", 1)]
    assert {"REDIS_PASSWORD", "DATA_DIR", "API_BIND"} <= variables
    missing = {v for v in variables if v not in section}
    assert not missing, f"README's deployment section does not mention {sorted(missing)}"
