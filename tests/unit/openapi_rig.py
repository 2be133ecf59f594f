"""The schemathesis rig of `test_openapi.py` and `test_openapi_admin.py`: the router's own
OpenAPI document, the checks every answer must pass, one test per operation (under
pytest-xdist, schemathesis runs only the first operation of a test parametrized over the whole
schema), and a tally of what was sent and answered. The operations are split over two files so
that the unit tests' workers share them out."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
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
SHORT_DEADLINE_MS = 1000

OPERATIONS = [
    (method.upper(), path)
    for path, ops in DOCUMENT["paths"].items()
    for method in ops
    if method != "parameters"
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
    case: schemathesis.Case, live: LiveRouter, session: requests.Session, tally: Tally
) -> None:
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
    def test(case: schemathesis.Case, live: LiveRouter, session: requests.Session) -> None:
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
