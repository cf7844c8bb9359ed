"""The Redis rating stream as the service writes it and the trainer reads it: its key, its identity, and
how a Redis URL is shown in logs and messages (never with its password)."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

HIDDEN = "***"
"""What a password is shown as."""


def stream_key(prefix: str) -> str:
    """The stream of online ratings under the key prefix `prefix` (DCMC_REDIS_KEY_PREFIX)."""
    return f"{prefix}:ratings"


def identity_key(stream: str) -> str:
    """The key holding the stream's identity: a random id the service sets once (SET NX) when it first
    follows the stream, so that an artifact can tell this stream from another of the same name (another
    Redis, or the same one emptied and begun again)."""
    return f"{stream}:identity"


def redact_url(url: str) -> str:
    """`url` with its password, in the user part or as a `password=` query parameter, shown as ***:
    redis://:s3cret@redis:6379/0 -> redis://:***@redis:6379/0. Whatever cannot be parsed is shown as a
    placeholder, never as itself."""
    try:
        parts = urlsplit(url)
        password = parts.password
        netloc = parts.netloc
        if password is not None:
            user = parts.username or ""
            host = netloc.rpartition("@")[2]
            netloc = f"{user}:{HIDDEN}@{host}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            query = urlencode([(k, HIDDEN if k.lower() == "password" else v) for k, v in pairs], safe="*")
        if "://" not in url:
            return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
        shown = f"{parts.scheme}://{netloc}{parts.path}"
        return shown + (f"?{query}" if query else "") + (f"#{parts.fragment}" if parts.fragment else "")
    except ValueError:
        return "<a Redis URL that cannot be parsed>"
