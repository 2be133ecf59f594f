"""A pytest plugin: run every collected test REPEAT times (as pytest-repeat does), to run a
test that failed once under load many times in one session.

    REPEAT=80 PYTHONPATH=.:benchmarks/results/unit-suite-time-2026-12-04-s46 \
        .venv/bin/pytest -p repeatplug tests/unit/test_x.py::test_y
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def _repeat_step(request: pytest.FixtureRequest) -> int:
    step: int = request.param
    return step


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    n = int(os.environ.get("REPEAT", "1"))
    if n > 1:
        metafunc.fixturenames.append("_repeat_step")
        metafunc.parametrize("_repeat_step", range(n), indirect=True)
