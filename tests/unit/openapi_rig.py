"""The schemathesis rig of `test_openapi.py` and `test_openapi_admin.py`: the router's own
OpenAPI document, the checks every answer must pass, one test per operation (under
pytest-xdist, schemathesis runs only the first operation of a test parametrized over the whole
schema), the explicit cases (EXPLICIT), and a tally of what was sent and answered. The
operations are split over two files so that the unit tests' workers share them out."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.core.transport import Response
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

if TYPE_CHECKING:  # schemathesis declares its OpenAPI case type for type checkers only
    from schemathesis.specs.openapi.schemas import OpenApiCase

# Generated (hypothesis) cases per operation, on top of schemathesis's coverage phase, which
# runs whole: its explicit cases (boundaries, missing and mistyped fields and headers, methods
# the path does not take: 1,194 in all). 120 until s47; at a fixed seed 20 reached as many
# lines and branches of the router (11,102 against 11,060, each missing ~120 the other
# reached) and all but 6 of its 126 (operation, status, error code) answers; the ones found
# only now and then that do not change the router's state are sent explicitly (EXPLICIT).
# tests/README.md "s47", benchmarks/results/suite-time-2026-12-04-s47.
EXAMPLES_PER_OPERATION = 20

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
SHORT_DEADLINE_MS = 1000

OPERATIONS = [
    (method.upper(), path)
    for path, ops in DOCUMENT["paths"].items()
    for method in ops
    if method != "parameters"
]


@dataclass(frozen=True)
class Explicit:
    """A case sent as written, checked as the generated ones are, and answered as expected."""

    method: str
    path: str
    body: dict[str, Any]
    status: int
    code: str | int  # the error's code
    headers: dict[str, str] = field(default_factory=dict)


EXPLICIT = [
    Explicit(
        "POST",
        "/admin/pools/pin",
        {"instance": "no-such-engine", "pool": "agent"},
        404,
        "unknown_instance",
    ),
    Explicit(
        "POST",
        "/admin/pools/move",
        {"instance": "no-such-engine", "to_pool": "agent"},
        404,
        "unknown_instance",
    ),
    Explicit(
        "POST",
        "/v1/responses",
        {"model": "tiny", "input": "hi", "previous_response_id": "resp_not_made_here"},
        400,
        "previous_response_not_found",
    ),
    # the engine's own 400 (the fake engine's limit, vLLM's), passed through in OpenAI's shape:
    # an integer limit over the context is lowered to it by the router, a float one is not
    Explicit(
        "POST",
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e5},
        400,
        400,
    ),
]


@dataclass
class Tally:
    cases: Counter[str] = field(default_factory=Counter)  # operation -> cases sent
    statuses: Counter[int] = field(default_factory=Counter)
    short_deadline_504s: Counter[str] = field(default_factory=Counter)  # to a deadline that short


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRouter]:
    config = hostile_config(tmp_path_factory.mktemp("openapi"))
    with live_router(config) as router:
        yield router


@pytest.fixture(scope="module")
def session(live: LiveRouter) -> Iterator[requests.Session]:
    with requests.Session() as s:
        yield s


def _check(
    case: OpenApiCase, live: LiveRouter, session: requests.Session, tally: Tally
) -> Response:
    # the admin tenant's key opens every operation; ignored_auth retries without it
    response = case.call(
        base_url=live.url,
        session=session,
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=30,
    )
    tally.cases[case.operation.label] += 1
    tally.statuses[response.status_code] += 1
    checks = CHECKS
    if _own_deadline_passed(case, response):
        tally.short_deadline_504s[case.operation.label] += 1
        checks = [c for c in CHECKS if c is not not_a_server_error]
    case.validate_response(response, checks=checks)
    return response


def _operation_test(method: str, path: str, tally: Tally) -> Callable[..., None]:
    @schema.include(method=method, path=path).parametrize()
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    def test(case: OpenApiCase, live: LiveRouter, session: requests.Session) -> None:
        _check(case, live, session, tally)

    return test  # type: ignore[no-any-return]


def operation_tests(operations: list[tuple[str, str]], tally: Tally) -> dict[str, Any]:
    """`test_router_matches_its_openapi_<METHOD>_<path>` for each operation, to put in a test
    module's globals."""
    tests = {}
    for method, path in operations:
        name = "test_router_matches_its_openapi_" + "".join(
            c if c.isalnum() else "_" for c in f"{method}_{path}"
        ).strip("_")
        tests[name] = _operation_test(method, path, tally)
    return tests


def explicit_test(operations: list[tuple[str, str]], tally: Tally) -> Callable[..., None]:
    """`test_explicit_cases` for the EXPLICIT cases of the module's `operations`."""
    chosen = [e for e in EXPLICIT if (e.method, e.path) in operations]

    def test_explicit_cases(live: LiveRouter, session: requests.Session) -> None:
        assert chosen, "no explicit case for these operations"
        for explicit in chosen:
            case = schema[explicit.path][explicit.method].Case(
                body=explicit.body,
                headers={"Content-Type": "application/json", **explicit.headers},
            )
            response = _check(case, live, session, tally)
            error = response.json()["error"]
            assert (response.status_code, error["code"]) == (explicit.status, explicit.code), (
                explicit,
                response.text,
            )

    return test_explicit_cases


def _own_deadline_passed(case: OpenApiCase, response: Response) -> bool:
    """A 504 deadline_exceeded to a request that gave itself at most SHORT_DEADLINE_MS: the
    documented answer to the client's own deadline, not a failure of the router."""
    raw = case.headers.get("x-gpupool-deadline-ms")
    try:
        deadline_ms = int(raw) if raw is not None else None
    except ValueError:
        return False
    if response.status_code != 504 or deadline_ms is None or deadline_ms > SHORT_DEADLINE_MS:
        return False
    code: str = response.json()["error"]["code"]
    return code == "deadline_exceeded"


def check_enough_cases(tally: Tally, operations: list[tuple[str, str]], min_cases: int) -> None:
    """Every operation of the module was sent cases, at least `min_cases` in all; the only 5xx
    were 504s to a client's own short deadline; something succeeded."""
    if not tally.cases:
        pytest.skip("run together with the module's operation tests")
    total = sum(tally.cases.values())
    print(
        f"schemathesis: {total} cases over {len(tally.cases)} operations; statuses "
        f"{dict(sorted(tally.statuses.items()))}; 504s to a deadline <= {SHORT_DEADLINE_MS} ms:"
        f" {sum(tally.short_deadline_504s.values())}; per operation {dict(tally.cases)}"
    )
    assert len(tally.cases) == len(operations), sorted(tally.cases)
    assert total >= min_cases, dict(tally.cases)
    server_errors = sum(n for s, n in tally.statuses.items() if s >= 500)
    assert server_errors == sum(tally.short_deadline_504s.values()), dict(tally.statuses)
    assert tally.statuses[200] > 0
