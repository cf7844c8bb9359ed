"""Read-your-writes on request: POST /ratings answers once a batch is stored in Redis, and each worker
folds the stream in behind it (service/replication.py). A read that must include a write passes the stream
id the write returned as `after`; it waits, at most DCMC_READ_AFTER_TIMEOUT_S, until this worker has
applied that entry (woken by the replica when it has: no polling), and past the bound answers 503 with
Retry-After. Without `after`, a read answers from what this worker has applied (from a cached row: other
users' ratings up to DCMC_ANSWER_STALENESS_S later).
"""

from __future__ import annotations

import asyncio
from typing import Annotated

import redis
from fastapi import HTTPException, Query
from starlette.concurrency import run_in_threadpool

from model.stream import stream_order
from service.errors import invalid
from service.scoring import ServedModel

After = Annotated[
    str | None,
    Query(
        pattern=r"^[0-9]{1,20}(-[0-9]{1,20})?$",
        description="A stream id that POST /ratings returned (`last_id`): answer only once this worker has "
        "folded that rating in (waiting at most DCMC_READ_AFTER_TIMEOUT_S, else 503 with Retry-After). "
        "Without it, the answer is of what this worker has applied, other users' ratings up to "
        "DCMC_ANSWER_STALENESS_S later where it comes from a cached row.",
    ),
]


def applied(scorer: ServedModel, after: str) -> bool:
    """Whether the worker's model includes the stream entry `after` (and all before it)."""
    return scorer.replica is not None and scorer.replica.applied(after)


async def wait_applied(scorer: ServedModel, after: str | None, timeout_s: float) -> None:
    """Return once `after` is applied here (at once without one); 503 past `timeout_s`; 422 when this
    service takes no online ratings, or the stream never had that entry (an id not returned by a write)."""
    if after is None:
        return
    replica = scorer.replica
    if replica is None:
        msg = "this service takes no online ratings (no REDIS_URL): nothing to wait for"
        raise invalid(["query", "after"], "no_online_ratings", msg)
    if replica.applied(after):
        return
    assert scorer.ratings is not None
    try:
        newest = await run_in_threadpool(scorer.ratings.last_generated)
    except redis.RedisError:
        newest = None  # cannot tell: wait for it
    if newest is not None and stream_order(after) > stream_order(newest):
        msg = (
            f"the rating stream has no entry {after} (its newest is {newest}): an id that POST /ratings "
            "of this service did not return"
        )
        raise invalid(["query", "after"], "no_such_rating", msg)
    if not await until_applied(scorer, after, timeout_s):
        raise HTTPException(
            status_code=503,
            detail=f"this worker has not applied rating {after} yet (it has applied up to "
            f"{replica.last}); retry, or read without `after`",
            headers={"Retry-After": "1"},
        )


async def until_applied(scorer: ServedModel, after: str, timeout_s: float) -> bool:
    """Wait at most `timeout_s` until this worker has applied the stream entry `after`, asking its replica
    to fold in what has arrived now (`hurry`); whether it has."""
    replica = scorer.replica
    if replica is None:
        return False
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def wake() -> None:  # from the replica's thread
        def settle() -> None:
            if not done.done():
                done.set_result(None)

        loop.call_soon_threadsafe(settle)

    cancel = replica.notify(after, wake)
    replica.hurry()  # fold in what has arrived now, not at the end of the gathering interval
    try:
        await asyncio.wait_for(done, timeout_s)
    except asyncio.TimeoutError:
        return replica.applied(after)
    finally:
        cancel()
    return True
