"""run_las orders by a run's attained GPU-seconds; the accountant that counts them starts from
zero when the router restarts. The governance store keeps each run's settled GPU-seconds, so
after a restart a run's attained service is what it had before plus what it has had since."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from pools.config import parse_config
from pools.launchers.base import InstanceSpec
from pools.testing.config import config_data, one_pool
from pools.testing.fake_engine import FakeEngineState, make_fake_engine
from pools.testing.serve import serve_asgi
from router.accounting.accountant import with_restored
from router.admission.queueing import RunUsage
from router.gateway.app import create_app


def test_restored_service_adds_to_what_the_accountant_saw_since() -> None:
    assert with_restored(None, None) is None
    live = RunUsage(gpu_seconds=0.5, in_flight=1, last_active_s=90.0)
    assert with_restored(live, None) == live
    # not seen since the restart: idle since it was last seen before it
    assert with_restored(None, (2.0, 40.0)) == RunUsage(2.0, 0, 40.0)
    # seen since: 2.0 before + 0.5 since, in flight and active as the accountant says
    assert with_restored(live, (2.0, 40.0)) == RunUsage(2.5, 1, 90.0)


def _config(tmp_path: Path) -> dict[str, Any]:
    return config_data(
        tmp_path,
        pools=one_pool(queue={"order": "run_las"}),
        tenants=[{"name": "t", "api_key": "k-t"}],
    )


async def test_a_runs_attained_service_survives_a_router_restart(tmp_path: Path) -> None:
    """Three steps on a 1-GPU fake engine (0.1 s each, more on a loaded machine). The second
    router (the first never closed, as after `kill -9`) orders the run by the GPU-seconds the
    ledger recorded for it (`GET /v1/runs/r`); a run it has never seen has none; after one more
    step, by the ledger's total of all four."""
    engine = FakeEngineState(ttft_s=0.1)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    headers = {"authorization": "Bearer k-t", "x-gpupool-run-id": "r"}
    data = _config(tmp_path)

    async def ledger_gpu_s(client: httpx.AsyncClient) -> float:
        r = await client.get("/v1/runs/r", headers={"authorization": "Bearer k-t"})
        assert r.status_code == 200, r.text
        return float(r.json()["totals"]["gpu_seconds"])

    async with serve_asgi(make_fake_engine(engine)) as url:
        spec = [InstanceSpec("engine-0", url, 1)]
        first = create_app(parse_config(data), spec)
        await first.start()
        transport = httpx.ASGITransport(app=first)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            for _ in range(3):
                r = await client.post("/v1/chat/completions", json=body, headers=headers)
                assert r.status_code == 200
            before_s = await ledger_gpu_s(client)
            await asyncio.sleep(1.5)  # the governor saves once a second
        assert before_s >= 0.3 - 0.01
        second = create_app(parse_config(data), spec)
        await second.start()
        try:
            attained = second.admitter._attained["normal"]
            now = second.clock()
            assert attained.attained_gpu_s(("t", "r"), now) == pytest.approx(before_s, rel=1e-6)
            assert attained.attained_gpu_s(("t", "never-seen"), now) == 0.0
            transport = httpx.ASGITransport(app=second)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
                r = await client.post("/v1/chat/completions", json=body, headers=headers)
                assert r.status_code == 200
                total_s = await ledger_gpu_s(client)
            assert total_s > before_s
            after = attained.attained_gpu_s(("t", "r"), second.clock())
            assert after == pytest.approx(total_s, rel=1e-6)
        finally:
            await second.aclose()
            await first.aclose()
