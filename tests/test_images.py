"""Every image installs what its code imports: each Dockerfile emulated without an engine
(tests/docker_emulation.py: its COPY lines into a temporary directory, its RUN lines in a fresh venv), then
its command run as docker-compose.yml runs it: the trainer image trains and publishes a tiny artifact, the
API image serves it against a Redis that requires a password, as the compose file deploys them.

These build two venvs from the package index (torch from its wheel on disk): a few minutes. `-m "not
image"` leaves them out of a quick run; CI runs them.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement

from tests.docker_emulation import REPO, Dockerfile, Image, build, compose
from tests.service.conftest import RedisServer, free_port
from training.synthetic import low_rank_ratings, write_csv

PASSWORD = "0penSesame42"
ENV = {"REDIS_PASSWORD": PASSWORD, "DATA_DIR": "/srv/data"}


def _run(
    image: Image, argv: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=image.app, env=image.environ(env), capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def volumes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Host folders standing for the compose file's mounts: the `artifacts` volume and DATA_DIR."""
    root = tmp_path_factory.mktemp("volumes")
    data = root / "data"
    write_csv(data / "ratings.csv", low_rank_ratings())
    (root / "artifacts").mkdir()
    return {"/artifacts": root / "artifacts", "/data": data}


def _mapped(arg: str, image: Image, volumes: dict[str, Path]) -> str:
    """A path of the container as it lies here: a mount's folder, or the emulated WORKDIR."""
    for inside, outside in volumes.items():
        if arg == inside or arg.startswith(inside + "/"):
            return str(outside) + arg[len(inside) :]
    return image.host_path(arg)


@pytest.fixture(scope="module")
def trainer_image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    # TORCH_INDEX_URL empty: pip's own index, where `torch==2.13.0` is the CPU wheel on disk (the image's
    # default, the CPU index, is not reachable from here).
    try:
        return build(
            REPO / "docker/trainer.Dockerfile", tmp_path_factory.mktemp("trainer"), {"TORCH_INDEX_URL": ""}
        )
    except subprocess.CalledProcessError as exc:
        pytest.fail(
            f"the trainer image does not build: RUN {exc.cmd}\n{exc.stdout[-2000:]}\n{exc.stderr[-4000:]}"
        )


@pytest.fixture(scope="module")
def api_image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    try:
        return build(REPO / "docker/api.Dockerfile", tmp_path_factory.mktemp("api"))
    except subprocess.CalledProcessError as exc:
        pytest.fail(
            f"the API image does not build: RUN {exc.cmd}\n{exc.stdout[-2000:]}\n{exc.stderr[-4000:]}"
        )


@pytest.fixture(scope="module")
def trained(trainer_image: Image, volumes: dict[str, Path]) -> Path:
    """The trainer image's command (its entrypoint and compose's `--out`/`--publish`), on a tiny data set
    with the tiny preset instead of ML-100K: the published link."""
    service = compose(ENV)["services"]["trainer"]
    command = service["command"]
    out, link = command[command.index("--out") + 1], command[command.index("--publish") + 1]
    entrypoint = Dockerfile.parse(REPO / "docker/trainer.Dockerfile").exec_form("ENTRYPOINT")
    assert entrypoint is not None
    argv = [
        *entrypoint,
        "dcmc",
        "train",
        *("--dataset", "csv", "--data-dir", "/data/ratings.csv", "--split", "random", "--preset", "tiny"),
        *("--no-tune", "--out", out, "--publish", link, "--no-progress", "--threads", "1"),
    ]
    done = _run(trainer_image, [_mapped(a, trainer_image, volumes) for a in argv], {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return Path(_mapped(link, trainer_image, volumes))


@pytest.mark.image
def test_the_trainer_image_trains_publishes_and_then_keeps_its_artifact(
    trainer_image: Image, trained: Path, volumes: dict[str, Path]
) -> None:
    assert trainer_image.skipped == [  # the image's user, which a host cannot create
        "useradd --create-home --uid 10001 dcmc && mkdir -p /artifacts && chown dcmc:dcmc /artifacts"
    ]
    assert trained.is_symlink() and (trained / "manifest.json").is_file()
    assert trained.resolve() == (volumes["/artifacts"] / "runs" / "initial").resolve()
    version = json.loads((trained / "manifest.json").read_text())["model_version"]
    # A second `up`: the verified artifact is kept (train-if-missing.sh), the link republished if missing.
    trained.unlink()
    entrypoint = Dockerfile.parse(REPO / "docker/trainer.Dockerfile").exec_form("ENTRYPOINT")
    assert entrypoint is not None
    argv = [*entrypoint, "dcmc", "train", "--dataset", "csv", "--data-dir", "/data/ratings.csv"]
    argv += ["--out", "/artifacts/runs/initial", "--publish", "/artifacts/current"]
    done = _run(trainer_image, [_mapped(a, trainer_image, volumes) for a in argv])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "present and verified; not retraining" in done.stdout
    assert json.loads((trained / "manifest.json").read_text())["model_version"] == version
    # torch is the CPU build the image asked for.
    done = _run(trainer_image, ["python", "-c", "import torch; print(torch.__version__)"])
    assert done.returncode == 0 and done.stdout.startswith("2.13.0"), done.stderr[-2000:]


@pytest.mark.image
def test_the_api_image_serves_the_published_artifact_on_a_password_redis(
    api_image: Image, trained: Path, volumes: dict[str, Path], tmp_path: Path
) -> None:
    redis_server = RedisServer(directory=tmp_path, password=PASSWORD).start()
    port = free_port()
    service = compose({**ENV, "DCMC_WRITE_TOKEN": "t0ken"})["services"]["api"]
    argv = [_mapped(a, api_image, volumes) for a in service["command"]]
    argv[argv.index("--host") + 1] = "127.0.0.1"
    argv[argv.index("--port") + 1] = str(port)
    env = {
        k: str(v).replace("@redis:6379/", f"@127.0.0.1:{redis_server.port}/")
        for k, v in service["environment"].items()
    }
    assert env["REDIS_URL"] == redis_server.url  # the compose file's URL, password included, reaches it
    proc = subprocess.Popen(
        argv,
        cwd=api_image.app,
        env=api_image.environ(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, f"the API image's command exited:\n{proc.stdout.read()[-4000:]}"  # type: ignore[union-attr]
                try:
                    if client.get("/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "not ready after 120 s"
                time.sleep(0.2)
            r = client.post("/predict", json={"user": "u1", "items": ["i1", "i2", "i3"]})
            assert r.status_code == 200, r.text
            assert len(r.json()["predictions"]) == 3
            health = client.get("/health").json()
            assert health["redis"] == "ok" and health["durable"] is True and health["writes"] == "enabled"
            rating = {"ratings": [{"user": "newcomer", "item": "i1", "rating": 5}]}
            r = client.post("/ratings", json=rating, headers={"Authorization": "Bearer t0ken"})
            assert r.status_code == 200, r.text
            after = {"after": r.json()["last_id"]}
            r = client.post("/predict", json={"user": "newcomer", "items": ["i2"]}, params=after)
            assert r.status_code == 200, r.text
    finally:
        proc.terminate()
        output, _ = proc.communicate(timeout=30)
        redis_server.kill()
    assert PASSWORD not in output  # nothing the service logged shows the password
    # The service's image holds neither torch nor the training code.
    done = _run(
        api_image,
        ["python", "-c", "import importlib.util as u; print(u.find_spec('torch'), u.find_spec('training'))"],
    )
    assert done.stdout.split() == ["None", "None"], done.stderr


# -- the serve extra, read from pyproject.toml, against what the service imports (no venv needed) --------

_ONLY_SERVE = """
import importlib, json, pkgutil, sys
blocked = set(json.loads(sys.argv[2]))

class OnlyServe:  # what the serve extra does not install cannot be imported
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in blocked:
            raise ModuleNotFoundError(f"{top} is not installed by the serve extra", name=top)

sys.meta_path.insert(0, OnlyServe())
import service
for info in pkgutil.walk_packages(service.__path__, prefix="service."):
    importlib.import_module(info.name)
import numpy as np
from model.artifact import load_artifact
from service.metrics import Metrics
from service.scoring import ServedModel
from service.settings import Settings

for mode in ("exact", "paper", "none"):
    settings = Settings(artifacts=sys.argv[1], inference={"mode": mode})
    scorer = ServedModel(load_artifact(sys.argv[1]), settings, Metrics())
    scorer.start()
    ratings, _, _ = scorer.predict(0, np.arange(5))
    assert np.isfinite(ratings).all()
    scorer.similar_users(0, 3)
    scorer.close()
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
"""


def _extra(name: str) -> list[Requirement]:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"].get(name, [])]


def _closure(requirements: list[Requirement]) -> set[str]:
    """The installed distributions these requirements bring in (their extras followed), normalised names."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(r, frozenset(r.extras)) for r in requirements]
    while todo:
        req, extras = todo.pop()
        if (_norm(req.name), extras) in seen:
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            continue
        seen.add((_norm(req.name), extras))
        for raw in dist.requires or []:
            sub = Requirement(raw)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in {"", *extras}):
                todo.append((sub, frozenset(sub.extras)))
    return {name for name, _ in seen}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_module_the_service_imports_is_installed_by_the_serve_extra(tiny_artifact: Path) -> None:
    # The service in an interpreter that can import only what the serve extra installs (and the standard
    # library): every module walked, an artifact loaded and scored in each inference mode.
    serve = _closure(_extra("serve"))
    installed = md.packages_distributions()  # top-level module -> the distributions that install it
    blocked = sorted(
        top
        for top, dists in installed.items()
        if not {_norm(d) for d in dists} & serve and top not in ("model", "service")
    )
    assert {"torch", "training"} <= set(blocked) and "numpy" not in blocked
    proc = subprocess.run(
        [sys.executable, "-c", _ONLY_SERVE, str(tiny_artifact), json.dumps(blocked)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"the service needs more than the serve extra:\n{proc.stderr[-3000:]}"
    loaded = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert {"scipy", "onnxruntime", "fastapi", "redis", "orjson"} <= loaded  # the walk reached them
    assert "torch" not in loaded and "training" not in loaded


def test_the_serve_extra_installs_no_training_dependency() -> None:
    serve = {_norm(r.name) for r in _extra("serve")}
    assert not serve & {"torch", "optuna", "h5py", "onnx", "tqdm"}, serve
