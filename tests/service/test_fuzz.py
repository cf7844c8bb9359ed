"""A fuzz run of the whole OpenAPI surface (schemathesis): generated requests to a real `dcmc serve`
(exact inference, online writes on, a private redis-server) get no 5xx."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.service.conftest import RedisServer, Service

TOKEN = "fuzz-token"


@pytest.fixture(scope="module")
def fuzzed(tiny_artifact: Path) -> Iterator[Any]:
    redis_server = RedisServer().start()
    env = {
        "REDIS_URL": redis_server.url,
        "DCMC_WRITE_TOKEN": TOKEN,
        "DCMC_INFERENCE__MODE": "exact",
        "DCMC_INFERENCE__KERNEL__CO_RATING": "50",
    }
    svc = Service(tiny_artifact, env)
    try:
        svc.wait_ready()
        yield schemathesis.openapi.from_url(f"{svc.url}/openapi.json")
    finally:
        svc.stop()
        redis_server.kill()


def test_no_request_gets_a_server_error(fuzzed: Any) -> None:
    operations = [result.ok() for result in fuzzed.get_all_operations()]
    assert len(operations) >= 8  # every route of the API
    for operation in operations:

        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy())
        def fuzz(case: Any) -> None:
            case.call_and_validate(headers={"Authorization": f"Bearer {TOKEN}"}, checks=[not_a_server_error])

        fuzz()
