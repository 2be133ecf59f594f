"""Admission and estimation of one short chat request, timed in process (issue 28, s41).

    .venv/bin/python benchmarks/results/hot-path-2026-12-03-s41/admission_micro.py CHECKOUT

run from the main checkout (the tiny model's tokenizer is under ./.gpupool). CHECKOUT's code
is imported first. The router is the overhead benchmark's (one fake engine split half and half
between the agent and normal pools, admission on), its engine served over real HTTP; after one
request through it, `adm_once` is `Admitter.admit_now` (views, decide, pick, acquire) and the
lease's release, `est_once` the body's parse and `TokenEstimator.estimate_input_now`. Each is
timed 15 times over 3,000 calls, with the loop let run between them (the engine's scrapes keep
its telemetry fresh); printed: the fastest and the median, µs a call.
"""

import asyncio
import sys
import tempfile
import time
import timeit
from pathlib import Path

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else ".")

import orjson

from pools.testing.config import config_for_test, even_pools
from pools.testing.fake_engine import FakeEngineState
from pools.testing.gateway import gateway_over_fakes
from router.gateway.protocols import ChatAdapter
from router.request import RequestContext

BODY = orjson.dumps(
    {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello there, how are you"}],
        "max_tokens": 16,
    }
)


async def main() -> None:
    config = config_for_test(Path(tempfile.mkdtemp()), pools=even_pools())
    async with gateway_over_fakes(config, [FakeEngineState()]) as rig:
        gateway = rig.gateway
        await rig.client.post("/v1/chat/completions", content=BODY)
        await asyncio.sleep(0.5)
        admitter, estimator, adapter = gateway.admitter, gateway.estimator, ChatAdapter()
        now = time.monotonic()
        ctx = RequestContext(
            "r1", "default", "normal", "normal", 0, now + 60, None, "tiny", False, False, now
        )
        estimate = estimator.estimate_input_now(
            adapter.estimate_input(orjson.loads(BODY)), class_name="normal"
        )
        assert estimate is not None

        def adm_once() -> None:
            lease = admitter.admit_now(ctx, admitter.need(ctx, estimate), time.monotonic())
            assert lease is not None
            lease.release()

        def est_once() -> None:
            parsed = adapter.estimate_input(orjson.loads(BODY))
            estimator.estimate_input_now(parsed, class_name="normal")

        for f in (adm_once, est_once):
            times = []
            for _ in range(15):
                times.append(timeit.timeit(f, number=3000) / 3000 * 1e6)
                await asyncio.sleep(0.05)
            times.sort()
            print(f"{f.__name__} {times[0]:.2f} us  median {times[7]:.2f}")


asyncio.run(main())
