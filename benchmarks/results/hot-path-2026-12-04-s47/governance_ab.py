"""In-process A/B of governance's per-request calls for a tenant without limits (issue 28,
s47): the governor module of two checkouts loaded side by side in one process, each driven
through the calls the request path makes (as router/gateway/proxy.py and router/settlement.py
of that checkout make them), alternated; the minimum per request over many rounds.

    PYTHONPATH=/work/main .venv/bin/python governance_ab.py BEFORE.py AFTER.py
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
from collections.abc import Callable, Coroutine
from types import ModuleType
from typing import Any

from prometheus_client import CollectorRegistry

from pools.testing.config import config_for_test
from router.admission.estimate import Estimate
from router.governance.metrics import GovernanceMetrics
from router.request import RequestContext, RequestOutcome

ROUNDS, N = 150, 400
ESTIMATE = Estimate(prompt_tokens=20, output_tokens=1, source="heuristic")


def load(path: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


Run = Callable[[int], Coroutine[Any, Any, None]]


def driver(module: ModuleType) -> Run:
    config = config_for_test(tenants=[{"name": "t", "api_key_sha256": "0" * 64}])
    gov = module.Governor(config, GovernanceMetrics(CollectorRegistry()))
    tenant = config.tenants[0]
    headers: dict[str, str] = {}
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}
    fast = hasattr(gov, "enter_now")

    async def run(n: int) -> None:
        for i in range(n):
            c = RequestContext(
                request_id=f"r{i}",
                tenant="t",
                class_name="normal",
                pool="normal",
                priority=0,
                deadline_s=1e12,
                run_id=None,
                model="tiny",
                stream=False,
                client_wants_usage=False,
                received_at_s=0.0,
            )
            c, signals = gov.prepare(c, tenant, headers, body)
            if not (fast and gov.enter_now(c, signals)):
                await gov.enter(c, ESTIMATE, signals, speculate=True)
                gov.rate_headers(c.tenant)
                gov.speculation(c.request_id)
            outcome = RequestOutcome(ctx=c, estimate=ESTIMATE)
            outcome.dispatched_at_s = 1.0
            gov.dispatched(outcome)
            gov.deferred_step(outcome)
            outcome.prompt_tokens, outcome.completion_tokens, outcome.gpu_seconds = 20, 1, 1e-4
            gov.finished(outcome)

    return run


async def base(n: int) -> None:  # the context and outcome alone, taken off both
    for i in range(n):
        c = RequestContext(
            request_id=f"r{i}",
            tenant="t",
            class_name="normal",
            pool="normal",
            priority=0,
            deadline_s=1e12,
            run_id=None,
            model="tiny",
            stream=False,
            client_wants_usage=False,
            received_at_s=0.0,
        )
        outcome = RequestOutcome(ctx=c, estimate=ESTIMATE)
        outcome.dispatched_at_s = 1.0


def main() -> None:
    runs: dict[str, Run] = {
        "before": driver(load(sys.argv[1], "gov_before")),
        "after": driver(load(sys.argv[2], "gov_after")),
        "base": base,
    }
    loop = asyncio.new_event_loop()
    best = dict.fromkeys(runs, 1e9)
    for _ in range(ROUNDS):
        for tag, run in runs.items():
            t0 = time.perf_counter()
            loop.run_until_complete(run(N))
            best[tag] = min(best[tag], (time.perf_counter() - t0) / N * 1e6)
    b = best["base"]
    print(
        f"governance per request, min of {ROUNDS} x {N} (interleaved), the context and"
        f" outcome's {b:.2f} us taken off: before {best['before'] - b:.2f} us,"
        f" after {best['after'] - b:.2f} us"
    )


if __name__ == "__main__":
    main()
