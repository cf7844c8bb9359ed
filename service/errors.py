"""The service's 422 bodies, shaped like FastAPI's own (`detail`: a list of {loc, type, msg})."""

from __future__ import annotations

from fastapi import HTTPException

from model.ids import UnknownIdError
from service.settings import Settings


def unknown_ids(*errors: UnknownIdError) -> HTTPException:
    """The one 404 for ids the model does not know: `msg` names them all, `unknown_users` and
    `unknown_items` list them (in request order), one per error given."""
    detail: dict[str, object] = {"msg": "; ".join(str(e) for e in errors)}
    for error in errors:
        detail[f"unknown_{error.kind}s"] = error.missing
    return HTTPException(status_code=404, detail=detail)


def invalid(loc: list[str | int], kind: str, msg: str) -> HTTPException:
    """A 422 naming the input at `loc`."""
    return HTTPException(status_code=422, detail=[{"loc": loc, "type": kind, "msg": msg}])


def too_long(field: str, count: int, limit: int, setting: str, unit: str) -> HTTPException:
    """A 422 for a body list over its limit."""
    msg = f"{field} has {count} {unit}; at most {limit} are allowed (setting {setting})"
    return invalid(["body", field], "too_long", msg)


def check_k(k: int, settings: Settings) -> None:
    """422 unless 1 <= k <= settings.max_k (/recommend, /similar-users and /similar-items)."""
    if not 1 <= k <= settings.max_k:
        msg = f"k must lie in 1..{settings.max_k} (setting DCMC_MAX_K), got {k}"
        raise invalid(["query", "k"], "out_of_range", msg)
