"""An engine whose `/metrics` has no `vllm:cache_config_info` (an older vLLM, a proxy in front
of one, another OpenAI server behind `launcher: static`) reports no KV capacity. It used to be
shown healthy while admission counted it as stale: every request waited `max_wait_s` and got
429 `queue_timeout`. Now it is admitted by its operating point and at most
`router.unknown_kv_max_concurrency` sequences at once, and `/admin/pools` says
`kv_capacity: unknown` (issue 23)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from rich.console import Console

from pools.config import ConfigError, parse_config
from pools.fleet import Fleet
from pools.launchers.base import InstanceSpec
from pools.telemetry import parse_vllm_metrics
from pools.testing.config import config_data, one_pool
from pools.testing.fake_engine import FakeEngineState, make_fake_engine
from pools.testing.serve import serve_asgi
from router.admission.decision import InstanceView, Need, fit_reason
from router.cli import main
from router.cli.commands.top import Snapshot, render
from router.gateway.app import create_app


def _config(tmp_path: Path, **router: Any) -> dict[str, Any]:
    pools = one_pool(queue={"max_wait_s": 5.0})
    return config_data(tmp_path, pools=pools, router=router)


def _body(max_tokens: int = 3) -> dict[str, object]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
    }


def test_the_fake_engine_can_leave_out_cache_config_info() -> None:
    reading = parse_vllm_metrics(FakeEngineState(cache_config_info=False).metrics_text(), 0.0)
    assert reading.num_gpu_blocks is None and reading.block_size is None
    assert parse_vllm_metrics(FakeEngineState().metrics_text(), 0.0).num_gpu_blocks == 1024


async def test_an_engine_without_cache_config_info_serves_its_first_request_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Through the router over real HTTP, with the real scraper: the first request is served
    in well under 1 s (it waited the pool's `max_wait_s`, 5 s here, then got 429)."""
    engine = FakeEngineState(cache_config_info=False)
    caplog.set_level(logging.WARNING, logger="pools.fleet")
    async with serve_asgi(make_fake_engine(engine)) as url:
        gateway = create_app(parse_config(_config(tmp_path)), [InstanceSpec("old", url, 1)])
        await gateway.start()
        try:
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=gateway), base_url="http://gw", timeout=30
            ) as client:
                started = time.monotonic()
                resp = await client.post("/v1/chat/completions", json=_body())
                elapsed_s = time.monotonic() - started
                assert resp.status_code == 200, resp.text
                assert elapsed_s < 1.0  # the bound (it takes milliseconds here)
                view = (await client.get("/admin/pools")).json()
        finally:
            await gateway.aclose()
    old = view["instances"]["old"]
    assert old["kv_capacity"] == "unknown"
    assert old["num_gpu_blocks"] is None
    # the operating point is capped by router.unknown_kv_max_concurrency (default 16)
    assert old["operating_point"]["limit"] == 16
    warnings = [r for r in caplog.records if "cache_config_info" in r.getMessage()]
    assert len(warnings) == 1  # once, not at every scrape


async def test_the_bound_on_an_engine_of_unknown_capacity_holds(tmp_path: Path) -> None:
    """With `unknown_kv_max_concurrency: 2`, a third concurrent request waits for one of the
    first two to finish (the engine is slow enough that all three overlap)."""
    engine = FakeEngineState(cache_config_info=False, itl_s=0.05)
    async with serve_asgi(make_fake_engine(engine)) as url:
        config = parse_config(_config(tmp_path, unknown_kv_max_concurrency=2))
        gateway = create_app(config, [InstanceSpec("old", url, 1)])
        await gateway.start()
        state = gateway.fleet.get("old")
        assert state is not None
        try:
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=gateway), base_url="http://gw", timeout=30
            ) as client:
                calls = [
                    asyncio.ensure_future(
                        client.post("/v1/chat/completions", json=_body(max_tokens=10))
                    )
                    for _ in range(3)
                ]
                for _ in range(500):
                    if state.inflight == 2 and len(gateway.admitter.queues["normal"]) == 1:
                        break
                    await asyncio.sleep(0.01)
                assert state.inflight == 2
                assert len(gateway.admitter.queues["normal"]) == 1
                assert [r.status_code for r in await asyncio.gather(*calls)] == [200] * 3
        finally:
            await gateway.aclose()
    assert engine.peak_running == 2


def _view(**overrides: Any) -> InstanceView:
    fields: dict[str, Any] = {
        "instance_id": "i",
        "frac": 1.0,
        "healthy": True,
        "fresh": True,
        "capacity_blocks": 0,
        "block_size": 16,
        "used_blocks": 0.0,
        "pool_reserved_blocks": 0,
        "pool_running": 0,
        "running": 0,
        "pool_limit": 8,
        "instance_limit": 8,
        "pending_prefill_tokens": 0,
        "prefill_tokens_per_s": None,
        "ttft_target_s": 1.0,
        "margin_frac": 0.05,
    }
    return InstanceView(**(fields | overrides))


def test_unknown_capacity_is_decided_by_the_operating_point_alone() -> None:
    need = Need(prompt_tokens=100, total_tokens=100_000, deadline_s=10.0)
    assert fit_reason(_view(kv_known=False), need) is None
    full = _view(kv_known=False, running=8, pool_running=8)
    assert fit_reason(full, need) == "operating_point"
    # known capacity of 0 blocks (nothing reported yet) still counts as stale
    assert fit_reason(_view(), need) == "stale"
    assert fit_reason(_view(kv_known=False, fresh=False), need) == "stale"


def test_the_fleet_says_whether_capacity_is_known() -> None:
    fleet = Fleet([InstanceSpec("a", "http://a", 1), InstanceSpec("b", "http://b", 1)])
    a, b = fleet.get("a"), fleet.get("b")
    assert a is not None and b is not None
    assert a.kv_capacity is None  # nothing reported yet
    fleet.record_reading("a", parse_vllm_metrics(FakeEngineState().metrics_text(), 0.0))
    text = FakeEngineState(cache_config_info=False).metrics_text()
    fleet.record_reading("b", parse_vllm_metrics(text, 0.0))
    # read again (mypy keeps `a.kv_capacity` narrowed to None from the assert above)
    assert [s.kv_capacity for s in (a, b)] == ["known", "unknown"]


def test_gpupool_top_shows_unknown_capacity() -> None:
    instance = {
        "healthy": True,
        "pools": {"normal": 1.0},
        "kv_usage_frac": 0.0,
        "kv_capacity": "unknown",
        "num_gpu_blocks": None,
        "kv_reserved_blocks": 3,
        "operating_point": {"limit": 16, "source": "seed"},
    }
    pools = {
        "allocation_version": 1,
        "admission": "on",
        "pools": {},
        "instances": {"old": instance},
    }
    console = Console(record=True, width=200)
    console.print(render(Snapshot("http://r", 0.0, 5, pools, None, None, None)))
    old = next(line for line in console.export_text().splitlines() if "old" in line)
    assert "kv_capacity: unknown" in old and "0.0 %" not in old


def test_check_config_warns_about_static_engines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    static = tmp_path / "static.yaml"
    data = {
        **_config(tmp_path, unknown_kv_max_concurrency=4),
        "engines": {"launcher": "static", "static": {"urls": ["http://127.0.0.1:8301"]}},
    }
    static.write_text(yaml.safe_dump(data))
    assert main(["check-config", str(static)]) == 0
    out = capsys.readouterr().out
    assert "warning: engines.static:" in out and "unknown_kv_max_concurrency (4)" in out
    local = tmp_path / "local.yaml"
    local.write_text(yaml.safe_dump(_config(tmp_path)))
    assert main(["check-config", str(local)]) == 0
    assert "warning" not in capsys.readouterr().out


def test_the_bound_is_validated() -> None:
    with pytest.raises(ConfigError, match="unknown_kv_max_concurrency"):
        parse_config(_config(Path("/tmp"), unknown_kv_max_concurrency=0))
