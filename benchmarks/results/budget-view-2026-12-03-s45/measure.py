"""GET /v1/budget's shared read and the shared x-ratelimit-* headers, timed on a real
PostgreSQL (README.md beside this file). Run from a checkout's root with PYTHONPATH set to it."""

from __future__ import annotations

import asyncio
import importlib
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

# the tests' helpers (a real PostgreSQL, a replica's governor), imported by name so the
# type check of benchmarks/ does not walk into tests/
pg: Any = importlib.import_module("tests.postgres")
rig: Any = importlib.import_module("tests.unit.test_governance_replicas")


def _p50_p95(samples: list[float]) -> tuple[float, float]:
    samples.sort()
    return samples[len(samples) // 2], samples[len(samples) * 95 // 100]


async def _timed_async(fn: Callable[[], Awaitable[object]], n: int, scale: float) -> str:
    rounds = []
    for _round in range(3):
        xs = []
        for _ in range(n):
            start = time.perf_counter()
            await fn()
            xs.append((time.perf_counter() - start) * scale)
        rounds.append("p50 {:.4f} p95 {:.4f}".format(*_p50_p95(xs)))
    return ", ".join(rounds)


def _timed(fn: Callable[[], object], n: int, scale: float) -> str:
    rounds = []
    for _round in range(3):
        xs = []
        for _ in range(n):
            start = time.perf_counter()
            fn()
            xs.append((time.perf_counter() - start) * scale)
        rounds.append("p50 {:.4f} p95 {:.4f}".format(*_p50_p95(xs)))
    return ", ".join(rounds)


async def main(server: Any) -> None:
    url = server.create_database("measure")
    async with rig.replica(rig.shared_config(url), url, rig.Clock(rig.T0), "a") as a:
        await rig.enter(a, "t")
        tenant = rig.tenant_of(a, "t").tenant
        print("budget_now ms:", await _timed_async(lambda: a.budget_now(tenant), 300, 1e3))
        print("budget (learned) ms:", _timed(lambda: a.budget(tenant), 3000, 1e3))
        print("rate_headers us:", _timed(lambda: a.rate_headers("t"), 3000, 1e6))


if __name__ == "__main__":
    os.environ[rig.PASSWORD_ENV] = pg.PASSWORD
    with pg.start_postgres() as server:
        asyncio.run(main(server))
