"""Hot reload: each worker swaps in a new verified artifact without dropping a request.

The service serves `DCMC_ARTIFACTS`, typically a symlink such as `ARTIFACTS/current` that a trainer
repoints atomically at a newly written artifact (`dcmc train --publish ARTIFACTS`). Every
`DCMC_RELOAD_POLL_S` seconds a thread of each worker reads the manifest behind that path; when its model
version differs from the one served, the worker

1. resolves the link once and reads every file of the new artifact from that one directory (a publish
   that repoints the link meanwhile cannot mix two runs' files), verifies and loads it beside the old one.
   Files that cannot be verified (missing, failing a checksum: a directory being written or replaced)
   are tried again at the next poll, with one log line per version; an artifact that verified and still
   failed to load is refused for good (one log line; the old model keeps serving),
2. replays onto it the online ratings it does not include (those after its snapshot of the rating
   stream), follows the stream, and warms it with one prediction,
3. swaps it in: one reference assignment (`app.state.scorer`). Every request reads that reference once,
   so each answer comes from one model or the other, never a mixture (`model_version` says which). The
   old model stops following the stream a few seconds later, once requests that hold it are done.

While a new model loads, /health reports its version as `loading_model_version`, and after a failure
`reload_error` says which version and why in a few words (never where the files are: that is in the log).
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


def manifest_version(directory: Path) -> str | None:
    """The model version in the manifest behind `directory`, or None while there is none to read (a
    trainer may be replacing it right now)."""
    try:
        version = json.loads((directory / MANIFEST).read_text())["model_version"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return str(version)


class Reloader:
    """Polls the served artifact path and swaps in a new model (module docstring). `load(path)` builds
    and starts a ServedModel (replayed, following the stream); `state` is the app's state."""

    def __init__(self, state: Any, path: Path, poll_s: float, load: Callable[[Path], ServedModel]) -> None:
        self.state, self.path, self.poll_s, self.load = state, Path(path), poll_s, load
        self.refused: set[str] = set()
        self._unavailable: set[str] = set()  # versions whose files could not be verified (logged once)
        self.loading: str | None = None
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one reload at a time

    def start(self) -> None:
        """Poll in a daemon thread (not when poll_s is 0)."""
        if self.poll_s > 0:
            self._thread = threading.Thread(target=self._run, name="dcmc-reload", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check()
            except Exception:  # a bug must not stop the polling silently
                log.exception("checking %s for a new artifact failed", self.path)

    def check(self) -> bool:
        """Reload when the artifact behind the path has a new model version; True when a new model now
        serves."""
        with self._lock:
            current: ServedModel | None = getattr(self.state, "scorer", None)
            resolved = Path(os.path.realpath(self.path))  # once: every file is read from this directory
            version = manifest_version(resolved)
            if version is None or current is None or version == current.version or version in self.refused:
                return False
            self.loading = version
            try:
                started = time.perf_counter()
                new = self.load(resolved)
                if not new.replayed:  # Redis is down: the online ratings are not in it yet
                    new.close()
                    log.warning("model %s loaded, but the online ratings cannot be replayed yet", version)
                    return False
                _warm(new)
                self.state.scorer = new  # the swap
                log.info(
                    "now serving model %s (was %s), loaded and replayed in %.1fs",
                    new.version,
                    current.version,
                    time.perf_counter() - started,
                )
                timer = threading.Timer(RETIRE_AFTER_S, current.close)
                timer.daemon = True
                timer.start()
                self.last_error = None
                self._unavailable.clear()
                return True
            except ArtifactUnavailable as exc:  # perhaps a publish in progress: tried again next poll
                self.last_error = f"model {version} not loaded yet: {exc.reason}; retrying"
                if version not in self._unavailable:
                    self._unavailable.add(version)
                    log.warning(
                        "cannot load model %s yet (%s); retrying every %.1fs", version, exc, self.poll_s
                    )
                return False
            except Exception as exc:  # verified, and still it fails: that model does not serve
                self.refused.add(version)
                reason = exc.reason if isinstance(exc, ArtifactError) else type(exc).__name__
                self.last_error = f"model {version} refused: {reason}"
                expected = isinstance(exc, ArtifactError | ConfigError)
                log.error(
                    "refusing the artifact at %s (model %s): %s; still serving model %s",
                    resolved,
                    version,
                    exc,
                    current.version,
                    exc_info=not expected,
                )
                return False
            finally:
                self.loading = None


def _warm(scorer: ServedModel) -> None:
    """One prediction through the new model (first calls into ONNX Runtime and numpy are slower)."""
    if scorer.n_items > 0 and scorer.fold.n_users > 0:
        scorer.predict(0, np.arange(min(10, scorer.n_items), dtype=np.int64))
