"""How a Redis URL is shown (model/stream.py): never with its password."""

from __future__ import annotations

import pytest

from model.stream import redact_url, stream_key


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@redis:6379/0", "redis://:***@redis:6379/0"),
        ("redis://alice:p%40ss@h/0", "redis://alice:***@h/0"),
        (
            "rediss://h:6380/1?password=s3cret&ssl_cert_reqs=none",
            "rediss://h:6380/1?password=***&ssl_cert_reqs=none",
        ),
        ("unix:///run/redis.sock?db=0&password=s3cret", "unix:///run/redis.sock?db=0&password=***"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://[::1/0", "<a Redis URL that cannot be parsed>"),
    ],
)
def test_a_url_is_shown_without_its_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "s3cret" not in redact_url(url) and "p%40ss" not in redact_url(url)


def test_the_stream_key() -> None:
    assert stream_key("dcmc") == "dcmc:ratings"
