"""What a Docker engine would do with our files, done without one (this machine and CI have none).

- `compose(env)`: docker-compose.yml as `docker compose config` reads it: YAML, then every `${VAR}`,
  `${VAR:-default}`, `${VAR-default}`, `${VAR:?error}`, `${VAR?error}` and `$$` interpolated from `env`
  (a required variable that is unset raises `ComposeError` with its message, as compose refuses to start).
- `Dockerfile.parse(path)` and `build(dockerfile, ...)`: an image emulated in a directory: its `COPY`
  lines copy from the build context into the directory standing for `WORKDIR`, and its `RUN` lines run
  there with `sh -c`, in order, in a fresh venv standing for the base image's Python, with its `ENV`
  and `ARG` values in the environment. `RUN` lines that set up the image's user (useradd, mkdir and chown of
  root's directories) cannot run on a host and are skipped, and listed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


class ComposeError(Exception):
    """What `docker compose` would refuse with."""


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's variable interpolation of one string."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(4)
        op, arg = match.group(2), match.group(3)
        value = env.get(name)
        unset_or_empty = value is None or (value == "" and op is not None and op.startswith(":"))
        if op in (":-", "-"):
            return arg if unset_or_empty else str(value)
        if op in (":?", "?"):
            if unset_or_empty:
                raise ComposeError(f"required variable {name} is missing a value: {arg}")
            return str(value)
        return value or ""

    return _VAR.sub(one, value)


def _walk(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_walk(x, env) for x in node]
    if isinstance(node, dict):
        return {k: _walk(v, env) for k, v in node.items()}
    return node


def raw_compose() -> dict[str, Any]:
    """docker-compose.yml as YAML, not interpolated."""
    out: dict[str, Any] = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    return out


def compose(env: dict[str, str]) -> dict[str, Any]:
    """docker-compose.yml interpolated from `env` (ComposeError where compose would refuse)."""
    out: dict[str, Any] = _walk(raw_compose(), env)
    return out


@dataclass
class Dockerfile:
    """The instructions of a Dockerfile, in order: (INSTRUCTION, arguments), comments dropped and line
    continuations joined."""

    path: Path
    steps: list[tuple[str, str]]

    @classmethod
    def parse(cls, path: Path) -> Dockerfile:
        lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
        joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
        steps = []
        for line in joined.splitlines():
            if line.strip():
                word, _, rest = line.strip().partition(" ")
                steps.append((word.upper(), rest.strip()))
        return cls(Path(path), steps)

    def args(self, word: str) -> list[str]:
        """The arguments of every `word` instruction."""
        return [rest for w, rest in self.steps if w == word]

    def exec_form(self, word: str) -> list[str] | None:
        """The last CMD or ENTRYPOINT, in its JSON (exec) form."""
        found = self.args(word)
        return json.loads(found[-1]) if found else None

    def copied(self) -> set[str]:
        """The sources of every COPY/ADD (flags dropped)."""
        return {
            src.rstrip("/")
            for args in self.args("COPY") + self.args("ADD")
            for src in [a for a in shlex.split(args) if not a.startswith("--")][:-1]
        }

    def user(self) -> str | None:
        """The user the image's command runs as (the last USER), None for root by default."""
        users = self.args("USER")
        return users[-1] if users else None


SYSTEM_SETUP = re.compile(r"^(useradd|groupadd|adduser|addgroup)\b")
"""RUN lines that create the image's user (and the directories it owns): not run on a host."""


@dataclass
class Image:
    """An emulated image: `app` stands for WORKDIR, `venv` for the base image's Python."""

    root: Path
    app: Path
    venv: Path
    workdir: str
    env: dict[str, str]
    skipped: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    def environ(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a process in the image: the host's, less anything of the test's own
        Python, the venv first on PATH, the image's ENV and ARG values, then `extra`."""
        base = {
            k: v
            for k, v in os.environ.items()
            if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")
            and not k.startswith(("DCMC_", "PYTEST_"))
            and k != "REDIS_URL"
        }
        base["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{base.get('PATH', '')}"
        base["VIRTUAL_ENV"] = str(self.venv)
        return {**base, **self.env, **(extra or {})}

    def host_path(self, path: str) -> str:
        """A path inside the image as it lies here (WORKDIR -> `app`, other absolute paths under `root`)."""
        if path == self.workdir or path.startswith(self.workdir.rstrip("/") + "/"):
            return str(self.app) + path[len(self.workdir.rstrip("/")) :]
        return path


def _dockerignore(context: Path) -> Any:
    """A copytree `ignore` for the context's .dockerignore (its `**/NAME` and `**/*.EXT` patterns, the
    ones that reach into copied folders)."""
    path = context / ".dockerignore"
    lines = path.read_text().splitlines() if path.is_file() else []
    names = [line[3:] for line in lines if line.startswith("**/")]
    return shutil.ignore_patterns(*names)


def build(
    dockerfile: Path,
    root: Path,
    build_args: dict[str, str] | None = None,
    context: Path = REPO,
    timeout_s: float = 1500,
) -> Image:
    """Emulate `docker build -f dockerfile context` into `root` (module docstring). Raises
    subprocess.CalledProcessError (with the step's output) when a RUN line fails."""
    parsed = Dockerfile.parse(dockerfile)
    build_args = build_args or {}
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    image = Image(root=root, app=root / "app", venv=venv, workdir="/", env={})
    image.app.mkdir(parents=True)
    for word, args in parsed.steps:
        if word == "FROM":
            assert args.startswith("python:3.11"), (
                f"{dockerfile}: the emulation stands for python:3.11, not {args}"
            )
        elif word == "ENV":
            for pair in shlex.split(args):
                key, _, value = pair.partition("=")
                image.env[key] = value
        elif word == "ARG":
            key, _, default = args.partition("=")
            image.env[key] = build_args.get(key, default)
        elif word == "WORKDIR":
            image.workdir = args
        elif word in ("COPY", "ADD"):
            parts = [a for a in shlex.split(args) if not a.startswith("--")]
            *sources, dest = parts
            target = image.app / dest if not dest.startswith("/") else Path(image.host_path(dest))
            for source in sources:
                src = context / source
                if src.is_dir():  # its contents, as Docker copies a directory
                    shutil.copytree(src, target, dirs_exist_ok=True, ignore=_dockerignore(context))
                elif dest.endswith("/") or len(sources) > 1:
                    target.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, target / src.name)
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, target)
        elif word == "RUN":
            if SYSTEM_SETUP.match(args):
                image.skipped.append(args)
                continue
            done = subprocess.run(
                ["sh", "-c", args],
                cwd=image.app,
                env=image.environ(),
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
            image.log.append(f"RUN {args}\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
            if done.returncode != 0:
                raise subprocess.CalledProcessError(done.returncode, args, done.stdout, done.stderr)
        elif word not in ("USER", "EXPOSE", "CMD", "ENTRYPOINT", "LABEL", "HEALTHCHECK"):
            raise AssertionError(f"{dockerfile}: the emulation does not know {word}")
    return image
