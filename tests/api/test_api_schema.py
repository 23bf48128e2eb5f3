"""The served OpenAPI schema, fuzzed with schemathesis against the live loopback server.

Every operation gets bounded examples (positive and negative data), sent with
an admin key, so generated requests get past authentication and reach the
handlers; the one check is that no request is answered with a server error.
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from tests.api.conftest import Live


@pytest.fixture
def api_schema(live: Live) -> Any:
    return schemathesis.openapi.from_url(f"{live.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_schema_fuzz_has_no_server_errors(case: Any, live: Live) -> None:
    case.call_and_validate(
        base_url=live.url,
        headers={"Authorization": f"Bearer {live.seed.keys['admin']}"},
        checks=[not_a_server_error],
    )
