"""The router against its own OpenAPI description (`GET /openapi.json`), with schemathesis.

Every operation gets schemathesis's coverage cases (boundaries, missing and mistyped fields and
headers, methods the path does not take) and hypothesis-generated cases, valid and invalid,
sent over real HTTP to the router in front of vLLM-like fake engines. Each answer is checked:
no 5xx, a documented status code, a documented content type, a body and headers that match the
documented schema, invalid input refused, a method the path does not take answered 405 with
`Allow`, a protected operation refusing a request without its key. Deterministic (derandomized
hypothesis, no example database); at least 1,000 cases in all.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from fastapi.routing import APIRoute
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from router.identity import OperatorAccess, Tenants
from router.ops.openapi import openapi_document
from tests.unit.test_hostile_rig import ADMIN_KEY, LiveRouter, hostile_config, live_router

MIN_CASES = 1000
EXAMPLES_PER_OPERATION = 120  # generated cases; the coverage phase adds its own on top

CONFIG = hostile_config(Path("/nonexistent"))  # the document does not depend on the paths
DOCUMENT = openapi_document(
    CONFIG, OperatorAccess.from_config(Tenants.from_config(CONFIG.tenants), CONFIG.router)
)
schema = schemathesis.openapi.from_dict(DOCUMENT)
# HTTP takes headers and query parameters nobody described: an unknown one is not invalid input
schema.config.generation.update(allow_extra_parameters=False, with_security_parameters=False)

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
    unsupported_method,
    ignored_auth,
]
CASES: Counter[str] = Counter()  # operation -> cases sent
STATUSES: Counter[int] = Counter()
SHORT_DEADLINE_MS = 1000
SHORT_DEADLINE_504S: Counter[str] = Counter()  # operation -> 504s to a deadline that short


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRouter]:
    config = hostile_config(tmp_path_factory.mktemp("openapi"))
    with live_router(config) as router:
        yield router


@pytest.fixture(scope="module")
def session(live: LiveRouter) -> Iterator[requests.Session]:
    with requests.Session() as s:
        yield s


def test_the_router_serves_this_document(live: LiveRouter) -> None:
    resp = httpx.get(f"{live.url}/openapi.json")
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    served: dict[str, Any] = resp.json()
    assert served == DOCUMENT
    hot = served["paths"]["/v1/chat/completions"]["post"]
    assert {"400", "401", "403", "404", "408", "413", "429", "502", "503", "504"} <= set(
        hot["responses"]
    )
    assert {p["name"] for p in hot["parameters"]} >= {
        "x-gpupool-class",
        "x-gpupool-priority",
        "x-gpupool-deadline-ms",
        "x-gpupool-run-id",
        "x-gpupool-usage",
    }
    body = served["components"]["schemas"]["ChatCompletionRequest"]
    assert body["additionalProperties"] is True and body["required"] == ["model", "messages"]
    assert "Error405" in served["components"]["responses"]


# served but not described: HTML and static files for browsers (GET /ui, docs/status_page.md)
UNDOCUMENTED = {("GET", "/ui"), ("GET", "/ui/{asset}")}


def test_every_route_the_router_serves_is_described(live: LiveRouter) -> None:
    """A route added without its description would escape the schemathesis run below."""
    served = {
        (method, route.path)
        for route in live.gateway.api.routes
        if isinstance(route, APIRoute)
        for method in route.methods
    }
    described = {
        (m.upper(), path)
        for path, ops in DOCUMENT["paths"].items()
        for m in ops
        if m != "parameters"  # the path's own parameters, not a method
    }
    assert served - UNDOCUMENTED == described


def _check(case: schemathesis.Case, live: LiveRouter, session: requests.Session) -> None:
    # the admin tenant's key opens every operation; ignored_auth retries without it
    response = case.call(
        base_url=live.url,
        session=session,
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=30,
    )
    CASES[case.operation.label] += 1
    STATUSES[response.status_code] += 1
    checks = CHECKS
    if _own_deadline_passed(case, response):
        SHORT_DEADLINE_504S[case.operation.label] += 1
        checks = [c for c in CHECKS if c is not not_a_server_error]
    case.validate_response(response, checks=checks)


def _operation_test(method: str, path: str) -> Any:
    """One test per operation: under pytest-xdist schemathesis runs only the first operation of
    a test parametrized over the whole schema, so each gets its own test function."""

    @schema.include(method=method, path=path).parametrize()
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    def test(case: schemathesis.Case, live: LiveRouter, session: requests.Session) -> None:
        _check(case, live, session)

    return test


OPERATIONS = [
    (method.upper(), path)
    for path, ops in DOCUMENT["paths"].items()
    for method in ops
    if method != "parameters"
]
for _method, _path in OPERATIONS:
    _name = "test_router_matches_its_openapi_" + "".join(
        c if c.isalnum() else "_" for c in f"{_method}_{_path}"
    ).strip("_")
    globals()[_name] = _operation_test(_method, _path)


def _own_deadline_passed(case: schemathesis.Case, response: requests.Response) -> bool:
    """A 504 deadline_exceeded to a request that gave itself at most SHORT_DEADLINE_MS: the
    documented answer to the client's own deadline, not a failure of the router."""
    raw = (case.headers or {}).get("x-gpupool-deadline-ms")
    try:
        deadline_ms = int(raw) if raw is not None else None
    except ValueError:
        return False
    if response.status_code != 504 or deadline_ms is None or deadline_ms > SHORT_DEADLINE_MS:
        return False
    code: str = response.json()["error"]["code"]
    return code == "deadline_exceeded"


def test_enough_cases_were_generated() -> None:
    """Runs after the operations above (pytest keeps the order of a module)."""
    if not CASES:
        pytest.skip("run together with test_router_matches_its_openapi")
    total = sum(CASES.values())
    print(
        f"schemathesis: {total} cases over {len(CASES)} operations; statuses "
        f"{dict(sorted(STATUSES.items()))}; 504s to a deadline <= {SHORT_DEADLINE_MS} ms: "
        f"{sum(SHORT_DEADLINE_504S.values())}; per operation {dict(CASES)}"
    )
    assert len(CASES) == sum(
        m in ("get", "post") for ops in DOCUMENT["paths"].values() for m in ops
    )
    assert total >= MIN_CASES, dict(CASES)
    server_errors = sum(n for s, n in STATUSES.items() if s >= 500)
    assert server_errors == sum(SHORT_DEADLINE_504S.values()), dict(STATUSES)
    assert STATUSES[200] > 0
