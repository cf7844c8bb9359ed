"""Static checks: import directions, no torch in the serving path, and the docker-compose wiring."""

from __future__ import annotations

import ast
from pathlib import Path

import yaml

from tests.service.conftest import serve_argv

REPO = Path(__file__).resolve().parents[2]


def _imports(package: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path in (REPO / package).rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        out[str(path.relative_to(REPO))] = names
    return out


def test_service_imports_neither_torch_nor_training() -> None:
    bad = {f: n & {"torch", "training"} for f, n in _imports("service").items() if n & {"torch", "training"}}
    assert bad == {}


def test_model_does_not_import_service() -> None:
    assert {f for f, n in _imports("model").items() if "service" in n} == set()


def _compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_compose_services_health_checks_and_volumes() -> None:
    services = _compose()["services"]
    assert set(services) == {"redis", "trainer", "api"}
    assert services["redis"]["image"].startswith("redis:7")
    assert "redis-cli" in services["redis"]["healthcheck"]["test"]
    assert services["trainer"]["restart"] == "no"
    assert "artifacts:/artifacts" in services["trainer"]["volumes"]
    assert any(v.startswith("${DATA_DIR:?") for v in services["trainer"]["volumes"])
    api = services["api"]
    assert api["depends_on"] == {"redis": {"condition": "service_healthy"},
                                 "trainer": {"condition": "service_completed_successfully"}}
    assert "/ready" in " ".join(api["healthcheck"]["test"])
    assert "artifacts:/artifacts:ro" in api["volumes"]
    assert api["environment"]["REDIS_URL"] == "redis://redis:6379/0"
    assert "artifacts" in _compose()["volumes"]
    for name, dockerfile in (("api", "docker/api.Dockerfile"), ("trainer", "docker/trainer.Dockerfile")):
        assert services[name]["build"]["dockerfile"] == dockerfile
        assert (REPO / dockerfile).is_file()
    api_image = (REPO / "docker/api.Dockerfile").read_text()
    installs = [line for line in api_image.splitlines() if "pip install" in line]
    assert installs and all('".[serve]"' in line and "torch" not in line.split("&&")[0] for line in installs)


def _flags(argv: list[str]) -> list[str]:
    return [a for a in argv if a.startswith("--")]


def test_containers_run_the_commands_the_tests_run() -> None:
    services = _compose()["services"]
    api = services["api"]["command"]
    assert api[:2] == ["dcmc", "serve"]
    assert _flags(api) == _flags(serve_argv("X", 0, 2))
    trainer = services["trainer"]["command"]
    assert trainer[:2] == ["dcmc", "train"]
    assert {"--dataset", "--data-dir", "--out", "--epochs", "--threads"} <= set(_flags(trainer))
    assert trainer[trainer.index("--out") + 1] == api[api.index("--artifacts") + 1] == "/artifacts/current"
    from training.cli import build_parser  # the flags exist in the real CLI

    defaults = {"${TRAIN_EPOCHS:-20}": "20", "${TRAIN_THREADS:-2}": "2"}
    parsed = build_parser().parse_args([defaults.get(a, a) for a in trainer[1:]])
    assert parsed.dataset == "ml-100k"
    parsed = build_parser().parse_args([a.replace("${API_WORKERS:-2}", "2") for a in api[1:]])
    assert parsed.workers == 2 and parsed.host == "0.0.0.0"
