"""A tenant's own budget must not move capacity (issue 23): governance refusals (`token_rate`,
`tenant_concurrency`, `cost_cap`, ...) and the time a request waits for its tenant's bucket
used to count as pool pressure in the rebalancer's signal window (one capped tenant on idle
engines read as rejections pressure 18). Pool pressure counts only admission's capacity
refusals and the waits in the pool's queue. Through the router, against a fake engine over
real HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pools.testing.config import config_for_test, one_pool
from pools.testing.fake_engine import FakeEngineState
from pools.testing.gateway import gateway_over_fakes
from router.gateway.app import Gateway

TENANTS: list[dict[str, Any]] = [
    # a request over the whole bucket spends it (it goes through once the bucket is full);
    # after one, "capped" waits minutes for its next and "rate" about a second
    {"name": "capped", "api_key": "k-capped", "tokens_per_minute": 30},
    {"name": "rate", "api_key": "k-rate", "tokens_per_minute": 1200},  # 20 a second
    {"name": "one", "api_key": "k-one", "tier": "one"},  # one request in flight
    {"name": "open", "api_key": "k-open"},
]


@dataclass
class Rig:
    gateway: Gateway
    client: httpx.AsyncClient
    engine: FakeEngineState

    async def post(self, tenant: str, max_tokens: int = 3) -> httpx.Response:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": max_tokens,
        }
        headers = {"authorization": f"Bearer k-{tenant}"}
        return await self.client.post("/v1/chat/completions", json=body, headers=headers)

    def pressure(self) -> dict[str, Any]:
        signals = self.gateway.rebalancer.gather(self.gateway.clock(), since_s=0.0)
        return {
            "rejected_frac": signals["normal"].rejected_frac,
            "queue_wait_s": signals["normal"].queue_wait_s,
        }


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition did not come true within 5 s")


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    engine = FakeEngineState()  # answers at once unless a test sets itl_s
    config = config_for_test(
        tmp_path,
        # a queue of one: a second request is refused for capacity at once
        pools=one_pool(queue={"max_wait_s": 5.0, "max_depth": 1}),
        engines={"local": {"vllm_args": ["--max-num-seqs", "1"]}},
        tenants=TENANTS,
        governance={
            "tiers": {
                "one": {"max_concurrent_runs": 1, "max_concurrent_requests": 1, "queue_weight": 1.0}
            }
        },
        rebalancer={"enabled": False},
    )
    async with gateway_over_fakes(config, [engine], client_timeout_s=30) as r:
        yield Rig(r.gateway, r.client, engine)


async def test_token_rate_refusals_are_not_pool_pressure(rig: Rig) -> None:
    assert (await rig.post("capped", max_tokens=30)).status_code == 200
    # the bucket is spent: each of these would wait longer than the pool's max_wait_s
    codes = [(await rig.post("capped")).json()["error"]["code"] for _ in range(4)]
    assert codes == ["token_rate"] * 4
    pressure = rig.pressure()
    assert pressure["rejected_frac"] == 0.0 and pressure["queue_wait_s"] < 0.05


async def test_tenant_concurrency_refusals_are_not_pool_pressure(rig: Rig) -> None:
    rig.engine.itl_s = 0.02
    first = asyncio.ensure_future(rig.post("one", max_tokens=50))  # ~1 s on the engine
    await _until(lambda: rig.engine.running > 0)
    refused = await rig.post("one")
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "tenant_concurrency"
    assert (await first).status_code == 200
    assert rig.pressure()["rejected_frac"] == 0.0


async def test_a_wait_for_the_tenants_bucket_is_not_a_queue_wait(rig: Rig) -> None:
    assert (await rig.post("rate", max_tokens=1200)).status_code == 200
    # the bucket is ~10 tokens short: this one (~11) waits about a second for it, then is
    # admitted at once (the engine is idle)
    started = rig.gateway.clock()
    assert (await rig.post("rate", max_tokens=1)).status_code == 200
    assert rig.gateway.clock() - started > 0.3
    assert rig.pressure()["queue_wait_s"] < 0.1


async def test_capacity_refusals_and_queue_waits_still_count(rig: Rig) -> None:
    """The other side: a full queue (429 queue_full) is pressure, and so is a wait in it."""
    rig.engine.itl_s = 0.02
    running = asyncio.ensure_future(rig.post("open", max_tokens=50))  # ~1 s on the engine
    await _until(lambda: rig.engine.running > 0)
    queued = asyncio.ensure_future(rig.post("open"))  # waits for the one running
    await _until(lambda: len(rig.gateway.admitter.queues["normal"]) > 0)
    full = await rig.post("open")
    assert full.json()["error"]["code"] == "queue_full"
    assert [(await running).status_code, (await queued).status_code] == [200, 200]
    pressure = rig.pressure()
    assert pressure["rejected_frac"] == pytest.approx(1 / 3)
    assert pressure["queue_wait_s"] > 0.1
