"""Hot reload, and the supervisor of the served model: each worker swaps in a new verified artifact, or a
fresh model where its own can no longer follow the stream, without dropping a request.

The service serves `DCMC_ARTIFACTS`, typically a symlink such as `ARTIFACTS/current` that a trainer
repoints atomically at a newly written artifact (`dcmc train --publish ARTIFACTS`). Every
`DCMC_RELOAD_POLL_S` seconds a thread of each worker reads the manifest behind that path; when its model
version differs from the one served, the worker

1. resolves the link once and reads every file of the new artifact from that one directory (a publish
   that repoints the link meanwhile cannot mix two runs' files), verifies and loads it beside the old one.
   Files that cannot be verified (missing, failing a checksum: a directory being written or replaced),
   and failures that may pass (memory, the disk), are tried again at the next poll, with one log line per
   version; an artifact that verified and still cannot serve (a bad setting, an inconsistent file) is
   refused for good (one log line; the old model keeps serving),
2. places the new model in the rating stream and catches it up (service/replication.py): it is the
   candidate until it is ready (while Redis is down, it keeps trying on its own, and the files are not
   read again),
3. swaps it in once ready: one reference assignment (`app.state.scorer`). Every request reads that
   reference once, so each answer comes from one model or the other, never a mixture (`model_version`
   says which). The old model stops following the stream a few seconds later, once requests that hold it
   are done.

The same candidate path replaces the served model by a fresh one of the same artifact when its replica
says it can no longer follow the stream (`ServedModel.needs_rebuild`: the stream was begun again).

While a new model loads or catches up, /health reports its version as `loading_model_version`, and after a
failure `reload_error` says which version and why in a few words (never where the files are: that is in
the log).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from model.artifact import MANIFEST, ArtifactError, ArtifactUnavailable
from model.config import ConfigError
from service.scoring import ServedModel

log = logging.getLogger(__name__)

RETIRE_AFTER_S = 5.0
"""How long an old model keeps following the stream after a swap (requests that took it finish first)."""

TICK_S = 0.2
"""How often the supervisor looks at a candidate's progress and at the served model's replica."""


def manifest_version(directory: Path) -> str | None:
    """The model version in the manifest behind `directory`, or None while there is none to read (a
    trainer may be replacing it right now)."""
    try:
        version = json.loads((directory / MANIFEST).read_text())["model_version"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return str(version)


class Reloader:
    """Polls the served artifact path and swaps in a new model, or a rebuilt one (module docstring).
    `load(path)` builds and starts a ServedModel of the artifact at `path`, `rebuild(model)` one of the
    artifact `model` serves; `state` is the app's state."""

    def __init__(
        self,
        state: Any,
        path: Path,
        poll_s: float,
        load: Callable[[Path], ServedModel],
        rebuild: Callable[[ServedModel], ServedModel] | None = None,
    ) -> None:
        self.state, self.path, self.poll_s, self.load = state, Path(path), poll_s, load
        self.rebuild = rebuild
        self.refused: set[str] = set()
        self._unavailable: set[str] = set()  # versions whose files could not be verified (logged once)
        self.candidate: ServedModel | None = None
        """A model loaded and catching up with the stream, swapped in once ready."""
        self._candidate_since = 0.0
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one reload at a time
        self._polled = 0.0

    @property
    def loading(self) -> str | None:
        """The version of the candidate being loaded or caught up, if any."""
        candidate = self.candidate
        return candidate.version if candidate is not None else None

    def start(self) -> None:
        """Supervise in a daemon thread: a candidate's progress and the served replica every TICK_S, the
        artifact path every poll_s (never when it is 0)."""
        self._thread = threading.Thread(target=self._run, name="dcmc-reload", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._lock:
            if self.candidate is not None:
                self.candidate.close()
                self.candidate = None

    def _run(self) -> None:
        while not self._stop.wait(TICK_S):
            try:
                self.tick()
            except Exception:  # a bug must not stop the supervision silently
                log.exception("checking %s for a new artifact failed", self.path)

    def tick(self) -> bool:
        """One look: promote a ready candidate, poll the artifact path when due, rebuild a model that can
        no longer follow the stream. True when a new model now serves."""
        if self.poll_s > 0 and time.monotonic() - self._polled >= self.poll_s:
            return self.check()
        with self._lock:
            if self.candidate is not None:
                return self._promote()
            current: ServedModel | None = getattr(self.state, "scorer", None)
            if current is not None and current.needs_rebuild and self.rebuild is not None:
                log.warning("rebuilding model %s: %s", current.version, current.needs_rebuild)
                self._propose(self.rebuild(current))
                return self._promote()
            return False

    def check(self) -> bool:
        """Poll now: load the artifact behind the path when it has a new model version (as the candidate),
        and swap in the candidate once it is ready; True when a new model now serves."""
        with self._lock:
            self._polled = time.monotonic()
            current: ServedModel | None = getattr(self.state, "scorer", None)
            resolved = Path(os.path.realpath(self.path))  # once: every file is read from this directory
            version = manifest_version(resolved)
            wanted = (
                version is not None
                and current is not None
                and version != current.version
                and version not in self.refused
            )
            # A candidate of another version than the one now published is not wanted any more (a
            # rebuild of the served model's own version is).
            if (
                self.candidate is not None
                and version is not None
                and current is not None
                and self.candidate.version != (version if wanted else current.version)
            ):
                self._drop_candidate()
            if wanted and self.candidate is None:
                assert version is not None and current is not None
                self._load(resolved, version, current)
            return self._promote() if self.candidate is not None else False

    def _load(self, resolved: Path, version: str, current: ServedModel) -> None:
        try:
            self._propose(self.load(resolved))
            self._unavailable.clear()
        except ArtifactUnavailable as exc:  # perhaps a publish in progress: tried again next poll
            self.last_error = f"model {version} not loaded yet: {exc.reason}; retrying"
            if version not in self._unavailable:
                self._unavailable.add(version)
                log.warning("cannot load model %s yet (%s); retrying every %.1fs", version, exc, self.poll_s)
        except (ArtifactError, ConfigError) as exc:  # verified, and still it cannot serve
            self.refused.add(version)
            reason = exc.reason if isinstance(exc, ArtifactError) else type(exc).__name__
            self.last_error = f"model {version} refused: {reason}"
            log.error(
                "refusing the artifact at %s (model %s): %s; still serving model %s",
                resolved,
                version,
                exc,
                current.version,
            )
        except Exception as exc:  # memory, the disk, a bug: it may pass, tried again at the next poll
            self.last_error = f"model {version} not loaded yet: {type(exc).__name__}; retrying"
            log.error(
                "loading model %s from %s failed (%s); retrying at the next poll, still serving model %s",
                version,
                resolved,
                exc,
                current.version,
                exc_info=True,
            )

    def _propose(self, model: ServedModel) -> None:
        self.candidate = model
        self._candidate_since = time.perf_counter()

    def _drop_candidate(self) -> None:
        if self.candidate is not None:
            self.candidate.close()
            self.candidate = None

    def _promote(self) -> bool:
        """Swap the candidate in if it is ready (the caller holds the lock)."""
        new = self.candidate
        current: ServedModel | None = getattr(self.state, "scorer", None)
        if new is None or current is None or not new.ready:
            return False
        self.candidate = None
        _warm(new)
        self.state.scorer = new  # the swap
        log.info(
            "now serving model %s (was %s), loaded and caught up in %.1fs",
            new.version,
            current.version,
            time.perf_counter() - self._candidate_since,
        )
        timer = threading.Timer(RETIRE_AFTER_S, current.close)
        timer.daemon = True
        timer.start()
        self.last_error = None
        return True


def _warm(scorer: ServedModel) -> None:
    """One prediction through the new model (first calls into ONNX Runtime and numpy are slower)."""
    if scorer.n_items > 0 and scorer.fold.n_users > 0:
        scorer.predict(0, np.arange(min(10, scorer.n_items), dtype=np.int64))
