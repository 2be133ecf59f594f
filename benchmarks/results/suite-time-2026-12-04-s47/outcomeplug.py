"""Throwaway pytest plugin (`-p outcomeplug`, this folder on PYTHONPATH) for the OpenAPI
property tests' case counts: sets the rig's generated cases per operation from
`OPENAPI_EXAMPLES` (unset: the rig's own) and writes one JSON line per case sent to
`OUTCOMES` (operation, schemathesis phase, status, the error's code/type): what a case count
finds, compared across counts by `outcomes.py`."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    import requests
    import schemathesis

    from tests.unit import openapi_rig

    if "OPENAPI_EXAMPLES" in os.environ:
        openapi_rig.EXAMPLES_PER_OPERATION = int(os.environ["OPENAPI_EXAMPLES"])
    sink = open(os.environ["OUTCOMES"], "a")  # noqa: SIM115 (closed at exit)
    config.add_cleanup(sink.close)
    inner = openapi_rig._check
    real_call = schemathesis.Case.call
    seen: dict[int, requests.Response] = {}

    def call(self: schemathesis.Case, *args: Any, **kwargs: Any) -> requests.Response:
        response: requests.Response = real_call(self, *args, **kwargs)
        seen[id(self)] = response
        return response

    def check(case: schemathesis.Case, live: Any, session: Any, tally: Any) -> None:
        failure = None
        try:
            inner(case, live, session, tally)
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

    schemathesis.Case.call = call  # type: ignore[method-assign]
    openapi_rig._check = check
