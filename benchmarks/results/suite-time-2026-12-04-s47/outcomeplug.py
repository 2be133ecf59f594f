"""Throwaway pytest plugin (`-p outcomeplug`, this folder on PYTHONPATH) for the OpenAPI
property tests' case counts: sets the rig's generated cases per operation from
`OPENAPI_EXAMPLES` (unset: the rig's own) and writes one JSON line per case sent to
`OUTCOMES` (operation, schemathesis phase, status, the error's code/type): what a case count
finds, compared across counts by `outcomes.py`."""

from __future__ import annotations

import importlib
import json
import os
from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # imported by name: the rig is test code, outside the typed packages this folder is in
    schemathesis: Any = importlib.import_module("schemathesis")
    openapi_rig: Any = importlib.import_module("tests.unit.openapi_rig")

    if "OPENAPI_EXAMPLES" in os.environ:
        openapi_rig.EXAMPLES_PER_OPERATION = int(os.environ["OPENAPI_EXAMPLES"])
    sink = open(os.environ["OUTCOMES"], "a")  # noqa: SIM115 (closed at exit)
    config.add_cleanup(sink.close)
    inner = openapi_rig._check
    real_call = schemathesis.Case.call
    seen: dict[int, Any] = {}

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        response = real_call(self, *args, **kwargs)
        seen[id(self)] = response
        return response

    def check(case: Any, live: Any, session: Any, tally: Any) -> Any:
        failure = None
        try:
            return inner(case, live, session, tally)
        except BaseException as err:  # a failing case is an outcome too; re-raised
            failure = type(err).__name__
            raise
        finally:
            response = seen.pop(id(case), None)
            code = None
            if response is not None:
                try:
                    body = response.json()
                    error = body.get("error") if isinstance(body, dict) else None
                    if isinstance(error, dict):
                        code = error.get("code") or error.get("type")
                except ValueError:
                    pass
            meta = case.meta
            sink.write(
                json.dumps(
                    {
                        "op": case.operation.label,
                        "phase": meta.phase.name.value if meta is not None else None,
                        "status": None if response is None else response.status_code,
                        "code": code,
                        "failure": failure,
                    }
                )
                + "\n"
            )

    schemathesis.Case.call = call
    openapi_rig._check = check
