"""The router against its own OpenAPI description (`GET /openapi.json`), with schemathesis.

Every operation gets schemathesis's coverage cases (boundaries, missing and mistyped fields and
headers, methods the path does not take), 20 hypothesis-generated cases, valid and invalid, and
the rig's explicit cases (answers the generated ones reach only now and then), sent over real
HTTP to the router in front of vLLM-like fake engines. Each answer is checked: no 5xx, a
documented status code, a documented content type, a body and headers that match the
documented schema, invalid input refused, a method the path does not take answered 405 with
`Allow`, a protected operation refusing a request without its key. Deterministic (derandomized
hypothesis, no example database); at least 1,400 cases in all (the `/v1` operations here, the
rest in `test_openapi_admin.py`; the rig is `openapi_rig.py`; 2,700 until s47: tests/README.md).
"""

from __future__ import annotations

from typing import Any

import httpx
from fastapi.routing import APIRoute

from tests.unit.openapi_rig import (
    DOCUMENT,
    OPERATIONS,
    Tally,
    check_enough_cases,
    explicit_test,
    live,
    operation_tests,
    session,
)
from tests.unit.test_hostile_rig import LiveRouter

__all__ = ["live", "session"]  # the module's fixtures

V1 = [(m, p) for m, p in OPERATIONS if p.startswith("/v1/")]
TALLY = Tally()


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
    assert hot["responses"]["200"]["headers"]["x-gpupool-replica"]["required"] is True
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


globals().update(operation_tests(V1, TALLY))
test_explicit_cases = explicit_test(V1, TALLY)


def test_enough_cases_were_generated() -> None:
    """Runs after the operations above (pytest keeps the order of a module)."""
    check_enough_cases(TALLY, V1, min_cases=900)
