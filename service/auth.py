"""Who may do what: the write token (`DCMC_WRITE_TOKEN`: writes, and reading other people's ratings) and the
optional read token (`DCMC_READ_TOKEN`: every read route). Tokens are compared in constant time and never
logged.

    no token                     reads (unless DCMC_READ_TOKEN is set); explanations name only the asking
                                 user's own ratings, others' as counts
    Bearer DCMC_READ_TOKEN       reads
    Bearer DCMC_WRITE_TOKEN      reads, writes, a user's ratings (GET /users/{id}/ratings), explanations
                                 that name every rating's user

/health, /ready, /metrics and the OpenAPI pages stay open: they hold no one's ratings, and orchestrators
poll them without credentials.
"""

from __future__ import annotations

import hmac

from fastapi import HTTPException

from service.settings import Settings


def _bearer(authorization: str | None) -> str | None:
    scheme, _, given = (authorization or "").partition(" ")
    return given.strip() if scheme.lower() == "bearer" else None


def _matches(given: str | None, token: str | None) -> bool:
    return given is not None and token is not None and hmac.compare_digest(given.encode(), token.encode())


def holds_write_token(settings: Settings, authorization: str | None) -> bool:
    """Whether the request carries the write token (never true while writes are off)."""
    token = settings.write_token.get_secret_value() if settings.write_token is not None else None
    return _matches(_bearer(authorization), token)


def require_write(settings: Settings, authorization: str | None, what: str = "this route") -> None:
    """403 while writes are off, 401 without the write token (every route that writes, or that shows a
    person's ratings)."""
    if settings.write_token is None:
        raise HTTPException(
            status_code=403,
            detail=f"writes are off: set DCMC_WRITE_TOKEN on the service to turn {what} on",
        )
    if not holds_write_token(settings, authorization):
        raise HTTPException(
            status_code=401,
            detail=f"{what} needs the header `Authorization: Bearer <DCMC_WRITE_TOKEN>`",
            headers={"WWW-Authenticate": "Bearer"},
        )


def require_read(settings: Settings, authorization: str | None) -> None:
    """401 without the read token (or the write token) where DCMC_READ_TOKEN is set; nothing otherwise."""
    if settings.read_token is None:
        return
    given = _bearer(authorization)
    if _matches(given, settings.read_token.get_secret_value()) or holds_write_token(settings, authorization):
        return
    raise HTTPException(
        status_code=401,
        detail="reads need the header `Authorization: Bearer <DCMC_READ_TOKEN>` (DCMC_READ_TOKEN is set)",
        headers={"WWW-Authenticate": "Bearer"},
    )
