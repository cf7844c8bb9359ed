"""Download the public originals of the benchmark datasets, with sha256 verification.

Files land under a data directory in the layout that :func:`training.data.load_dataset` reads:
``DIR/ml-100k/u.data``, ``DIR/monti/<name>/<file>.mat`` and ``DIR/epinions/ratings_data.txt``.
Each file is streamed to a temporary file next to its destination, verified, and only then moved
into place, so a failed or mismatching download leaves nothing behind.
"""

from __future__ import annotations

import bz2
import hashlib
import http.client
import logging
import os
import shutil
import sys
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any
from urllib.parse import urlsplit

from training.data import DataError

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20
_TIMEOUT_S = 60.0
_MGCNN = "https://raw.githubusercontent.com/fmonti/mgcnn/master/Data"


@dataclass(frozen=True)
class Source:
    """One downloadable file: where it comes from, where it goes and its pinned sha256."""

    url: str
    path_in_dir: str  # destination relative to the data directory (the file whose hash is checked)
    sha256: str | None  # of the final (extracted / decompressed) file; None = not pinned
    archive_member: str | None = None  # for a .zip URL: the member that becomes `path_in_dir`


SOURCES: dict[str, list[Source]] = {
    "ml-100k": [
        Source(
            "https://files.grouplens.org/datasets/movielens/ml-100k.zip",
            "ml-100k/u.data",
            "06416e597f82b7342361e41163890c81036900f418ad91315590814211dca490",
            archive_member="ml-100k/u.data",
        )
    ],
    "douban": [
        Source(
            f"{_MGCNN}/douban/training_test_dataset.mat",
            "monti/douban/training_test_dataset.mat",
            "1f4476321cbfe0f606e7e35d0695ca15447a1b0b2c811df130109b6cb9a067ae",
        )
    ],
    "flixster": [
        Source(
            f"{_MGCNN}/flixster/training_test_dataset_10_NNs.mat",
            "monti/flixster/training_test_dataset_10_NNs.mat",
            "8b07e0387edfe7ffdccead2826bb3844ddbd9e6a8ccba264ce81a3b59b273197",
        )
    ],
    "yahoo_music": [
        Source(
            f"{_MGCNN}/yahoo_music/training_test_dataset_10_NNs.mat",
            "monti/yahoo_music/training_test_dataset_10_NNs.mat",
            "56a80de836537544d0d6ba36fc59937dfe87f738ac5e2a701cc8226faf4f31ec",
        )
    ],
    "epinions": [
        Source(
            "http://www.trustlet.org/datasets/downloaded_epinions/ratings_data.txt.bz2",
            "epinions/ratings_data.txt",
            None,
        )
    ],
}


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _url_for(source: Source, base_url_override: str | None) -> str:
    """The source URL, or `base_url_override` + '/' + the URL's file name."""
    if base_url_override is None:
        return source.url
    name = PurePosixPath(urlsplit(source.url).path).name
    return f"{base_url_override.rstrip('/')}/{name}"


@contextmanager
def _temp_file(directory: Path, stem: str) -> Iterator[Path]:
    """A temporary file path in `directory` that is removed on exit unless it was moved away."""
    fd, name = tempfile.mkstemp(prefix=f".{stem}.", suffix=".part", dir=directory)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
    finally:
        with suppress(FileNotFoundError):
            tmp.unlink()


def _progress_bar(total: int | None, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a training dependency
        return None
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)


def _fetch(url: str, dest: Path, *, progress: bool) -> None:
    """Stream `url` into `dest`; network trouble raises DataError."""
    offline = "offline? point --data-dir at a local copy"
    try:
        with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as resp, open(dest, "wb") as out:
            length = resp.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
            bar = _progress_bar(total, PurePosixPath(urlsplit(url).path).name, progress)
            try:
                for chunk in iter(lambda: resp.read(_CHUNK), b""):
                    out.write(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
            finally:
                if bar is not None:
                    bar.close()
    except urllib.error.HTTPError as exc:
        raise DataError(f"could not download {url}: server answered HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", exc)
        raise DataError(f"could not reach {url} ({reason}); {offline}") from None
    except OSError as exc:
        raise DataError(f"could not download {url} to {dest.parent}: {exc}") from None


def _copy_stream(src: IO[bytes], dest: Path) -> None:
    with open(dest, "wb") as out:
        shutil.copyfileobj(src, out, _CHUNK)


def _unpack(source: Source, url: str, downloaded: Path, dest_tmp: Path) -> None:
    """Write the final file content of `source` from the downloaded payload into `dest_tmp`."""
    name = PurePosixPath(urlsplit(url).path).name
    try:
        if source.archive_member is not None:
            with zipfile.ZipFile(downloaded) as zf:
                try:
                    member = zf.open(source.archive_member)
                except KeyError:
                    raise DataError(f"{name}: archive has no member {source.archive_member!r}") from None
                with member:
                    _copy_stream(member, dest_tmp)
        elif name.endswith(".bz2"):
            with bz2.open(downloaded, "rb") as src:
                _copy_stream(src, dest_tmp)
        else:
            os.replace(downloaded, dest_tmp)
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise DataError(f"{name} from {url}: cannot unpack the download: {exc}") from None


def _extract_rest(source: Source, archive: Path, to: Path) -> None:
    """Extract the other members of a zip archive next to the verified one (no path escapes)."""
    root = to.resolve()
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            if info.is_dir() or info.filename == source.archive_member:
                continue
            target = (to / info.filename).resolve()
            if root not in target.parents:
                logger.warning("skipping archive member outside the data directory: %r", info.filename)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with _temp_file(target.parent, target.name) as tmp:
                with zf.open(info) as src:
                    _copy_stream(src, tmp)
                os.replace(tmp, target)


def _download_one(source: Source, to: Path, base_url_override: str | None, progress: bool) -> Path:
    dest = to / source.path_in_dir
    if dest.is_file():
        have = sha256_of(dest)
        if source.sha256 is None or have == source.sha256:
            logger.info("%s already present (sha256 %s); skipping", dest, have)
            return dest
        logger.warning("%s has sha256 %s, expected %s; downloading again", dest, have, source.sha256)
    url = _url_for(source, base_url_override)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create {dest.parent}: {exc}") from None
    logger.info("downloading %s -> %s", url, dest)
    with _temp_file(dest.parent, dest.name) as payload, _temp_file(dest.parent, dest.name) as final:
        _fetch(url, payload, progress=progress)
        _unpack(source, url, payload, final)
        got = sha256_of(final)
        if source.sha256 is not None and got != source.sha256:
            raise DataError(
                f"{dest.name} from {url}: sha256 mismatch: expected {source.sha256}, got {got}; "
                "the file was not saved"
            )
        if source.archive_member is not None:
            _extract_rest(source, payload, to)
        os.replace(final, dest)
    if source.sha256 is None:
        logger.warning("%s: sha256 %s (no pinned checksum for this source; not verified)", dest, got)
    else:
        logger.info("%s: sha256 verified", dest)
    return dest


def download(
    name: str,
    to: Path,
    *,
    base_url_override: str | None = None,
    progress: bool = True,
    sources: Mapping[str, list[Source]] | None = None,
) -> Path:
    """Download dataset `name` into data directory `to` (verified); returns the path of its main file."""
    table = SOURCES if sources is None else sources
    if name not in table:
        raise DataError(f"no download source for {name!r}; downloadable datasets: {', '.join(table)}")
    to = Path(to).expanduser()
    result: Path | None = None
    for source in table[name]:
        result = _download_one(source, to, base_url_override, progress)
    if result is None:
        raise DataError(f"no download source for {name!r}")
    return result
