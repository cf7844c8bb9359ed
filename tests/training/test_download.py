"""Tests for training.download against a local http.server (no internet needed)."""

from __future__ import annotations

import bz2
import functools
import hashlib
import http.server
import io
import socket
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from training.data import DataError, load_dataset
from training.download import SOURCES, Source, download, sha256_of

UDATA = b"".join(
    f"{u}\t{i}\t{(u + i) % 5 + 1}\t88000{u}{i}\n".encode() for u in range(1, 6) for i in range(1, 5)
)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """An http.server on 127.0.0.1 (port 0) serving a tmp directory; yields (base_url, directory)."""
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    root = tmp_path / "served"
    root.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", root
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leftovers(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())


def test_sources_table() -> None:
    assert set(SOURCES) == {"ml-100k", "douban", "flixster", "yahoo_music", "epinions"}
    (ml,) = SOURCES["ml-100k"]
    assert ml.url == "https://files.grouplens.org/datasets/movielens/ml-100k.zip"
    assert ml.path_in_dir == "ml-100k/u.data"
    assert ml.sha256 == "06416e597f82b7342361e41163890c81036900f418ad91315590814211dca490"
    assert SOURCES["douban"][0].url == (
        "https://raw.githubusercontent.com/fmonti/mgcnn/master/Data/douban/training_test_dataset.mat"
    )
    for name in ("douban", "flixster", "yahoo_music"):
        (src,) = SOURCES[name]
        assert src.path_in_dir.startswith(f"monti/{name}/") and len(src.sha256 or "") == 64
    assert SOURCES["epinions"][0].sha256 is None
    assert SOURCES["epinions"][0].path_in_dir == "epinions/ratings_data.txt"


def test_plain_file_success_and_skip(server: tuple[str, Path], tmp_path: Path) -> None:
    base, root = server
    data = b"\x89HDF fake mat payload" * 1000
    (root / "training_test_dataset.mat").write_bytes(data)
    sources = {"douban": [Source(f"{base}/training_test_dataset.mat", "monti/douban/x.mat", sha(data))]}
    out = tmp_path / "data"
    path = download("douban", out, sources=sources, progress=True)
    assert path == out / "monti/douban/x.mat" and path.read_bytes() == data
    assert leftovers(out) == ["monti/douban/x.mat"]
    # present with the right hash: skipped (server gone would otherwise fail)
    (root / "training_test_dataset.mat").unlink()
    assert download("douban", out, sources=sources, progress=False) == path


def test_zip_archive_extracts_and_loads(server: tuple[str, Path], tmp_path: Path) -> None:
    base, root = server
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("ml-100k/u.data", UDATA)
        zf.writestr("ml-100k/README", "readme")
        zf.writestr("../evil.txt", "no")
    (root / "ml-100k.zip").write_bytes(buf.getvalue())
    sources = {"ml-100k": [Source(f"{base}/ml-100k.zip", "ml-100k/u.data", sha(UDATA), "ml-100k/u.data")]}
    out = tmp_path / "data"
    path = download("ml-100k", out, sources=sources, progress=False)
    assert path.read_bytes() == UDATA
    assert leftovers(out) == ["ml-100k/README", "ml-100k/u.data"]
    assert not (tmp_path / "evil.txt").exists()
    s = load_dataset("ml-100k", out, split="random")
    assert len(s.train) + len(s.val) + len(s.test) == 20


def test_base_url_override_uses_file_name(server: tuple[str, Path], tmp_path: Path) -> None:
    base, root = server
    data = b"payload"
    (root / "training_test_dataset_10_NNs.mat").write_bytes(data)
    src = Source("https://example.invalid/a/b/training_test_dataset_10_NNs.mat", "monti/f/t.mat", sha(data))
    path = download("flixster", tmp_path / "d", sources={"flixster": [src]}, base_url_override=base + "/")
    assert path.read_bytes() == data


def test_bz2_unpinned_logs_hash(
    server: tuple[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    base, root = server
    text = b"1 10 5\n2 10 4\n3 11 1\n4 12 2\n"
    (root / "ratings_data.txt.bz2").write_bytes(bz2.compress(text))
    sources = {"epinions": [Source(f"{base}/ratings_data.txt.bz2", "epinions/ratings_data.txt", None)]}
    with caplog.at_level("WARNING", logger="training.download"):
        path = download("epinions", tmp_path / "d", sources=sources, progress=False)
    assert path.read_bytes() == text
    assert sha(text) in caplog.text and "not verified" in caplog.text
    assert leftovers(tmp_path / "d") == ["epinions/ratings_data.txt"]


def test_checksum_mismatch_leaves_nothing(server: tuple[str, Path], tmp_path: Path) -> None:
    base, root = server
    (root / "f.mat").write_bytes(b"tampered")
    pinned = sha(b"original")
    sources = {"douban": [Source(f"{base}/f.mat", "monti/douban/f.mat", pinned)]}
    out = tmp_path / "d"
    with pytest.raises(DataError) as info:
        download("douban", out, sources=sources, progress=False)
    msg = str(info.value)
    assert "f.mat" in msg and pinned in msg and sha(b"tampered") in msg
    assert leftovers(out) == []


def test_zip_checksum_mismatch_extracts_nothing(server: tuple[str, Path], tmp_path: Path) -> None:
    base, root = server
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("ml-100k/u.data", UDATA)
        zf.writestr("ml-100k/u.item", "x")
    (root / "ml-100k.zip").write_bytes(buf.getvalue())
    sources = {"ml-100k": [Source(f"{base}/ml-100k.zip", "ml-100k/u.data", "0" * 64, "ml-100k/u.data")]}
    with pytest.raises(DataError, match="sha256 mismatch"):
        download("ml-100k", tmp_path / "d", sources=sources, progress=False)
    assert leftovers(tmp_path / "d") == []


def test_wrong_hash_on_disk_is_replaced(server: tuple[str, Path], tmp_path: Path) -> None:
    base, root = server
    (root / "g.mat").write_bytes(b"good")
    dest = tmp_path / "d" / "g.mat"
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"stale")
    path = download("x", tmp_path / "d", sources={"x": [Source(f"{base}/g.mat", "g.mat", sha(b"good"))]})
    assert path.read_bytes() == b"good" and sha256_of(path) == sha(b"good")


def test_unreachable_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    url = f"http://127.0.0.1:{closed_port()}/f.mat"
    with pytest.raises(
        DataError, match=r"could not reach .*f\.mat.*offline\? point --data-dir at a local copy"
    ):
        download("x", tmp_path / "d", sources={"x": [Source(url, "f.mat", None)]}, progress=False)
    assert leftovers(tmp_path / "d") == []


def test_http_404(server: tuple[str, Path], tmp_path: Path) -> None:
    base, _ = server
    with pytest.raises(DataError, match=r"HTTP 404"):
        download("x", tmp_path / "d", sources={"x": [Source(f"{base}/missing.mat", "m.mat", None)]})
    assert leftovers(tmp_path / "d") == []


def test_unknown_name(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"no download source for 'netflix'.*ml-100k"):
        download("netflix", tmp_path)
