"""The router's operations outside `/v1` (admin, health, metrics, the document itself) against
its OpenAPI description, with schemathesis: what `test_openapi.py` does for the `/v1`
operations, split off so that the unit tests' workers share them out (`openapi_rig.py`)."""

from __future__ import annotations

from tests.unit.openapi_rig import (
    OPERATIONS,
    Tally,
    check_enough_cases,
    explicit_test,
    live,
    operation_tests,
    session,
)

__all__ = ["live", "session"]  # the module's fixtures

REST = [(m, p) for m, p in OPERATIONS if not p.startswith("/v1/")]
TALLY = Tally()

globals().update(operation_tests(REST, TALLY))
test_explicit_cases = explicit_test(REST, TALLY)


def test_enough_cases_were_generated() -> None:
    """Runs after the operations above (pytest keeps the order of a module)."""
    check_enough_cases(TALLY, REST, min_cases=500)
