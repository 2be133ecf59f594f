"""The test rig in `pools.testing`: the config tests start from, a router over fake engines, and
`gpupool serve` as a child process that never outlives its block."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from pools.config import DEFAULT_CPU_CONFIG
from pools.testing.config import (
    REMOVE,
    config_data,
    config_for_test,
    deep_merge,
    even_pools,
    one_pool,
)
from pools.testing.fake_engine import FakeEngineState, make_fake_engine
from pools.testing.gateway import gateway_over_fakes
from pools.testing.router_process import async_router_process, start_router_process
from pools.testing.serve import serve_asgi

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_deep_merge_merges_mappings_replaces_the_rest_and_remove_removes() -> None:
    base = {"a": {"x": 1, "y": [1]}, "b": 2}
    assert deep_merge(base, {"a": {"y": [2], "z": None}, "b": REMOVE}) == {
        "a": {"x": 1, "y": [2], "z": None}
    }
    assert base == {"a": {"x": 1, "y": [1]}, "b": 2}  # untouched


def test_config_for_test_is_the_default_with_files_under_the_folder(tmp_path: Path) -> None:
    config = config_for_test(tmp_path, router={"scrape_interval_s": 0.05})
    assert config.router.ledger_path == tmp_path / "l.sqlite"
    assert config.router.state_path == tmp_path / "s.json"
    assert config.router.scrape_interval_s == 0.05
    assert config.model.name == "tiny" and {p.name for p in config.pools} == {"agent", "normal"}
    assert config_data() == DEFAULT_CPU_CONFIG and config_data() is not DEFAULT_CPU_CONFIG


def test_pools_replace_the_default_pools_whole() -> None:
    even = config_for_test(pools=even_pools(normal={"queue": {"max_depth": 4}}))
    agent, normal = sorted(even.pools, key=lambda p: p.name)
    assert agent.share.initial_frac == normal.share.initial_frac == 0.5
    assert normal.queue.max_depth == 4 and agent.slo == normal.slo  # no default SLOs merged in
    (only,) = config_for_test(pools=one_pool(queue={"order": "run_las"})).pools
    assert only.classes == ("normal", "agent") and only.queue.order == "run_las"


def test_urls_make_the_engines_static() -> None:
    config = config_for_test(urls=["http://127.0.0.1:9"])
    assert config.engines.launcher == "static"
    assert list(config.engines.static.urls) == ["http://127.0.0.1:9"]


async def test_a_gateway_over_fakes_serves_and_closes(tmp_path: Path) -> None:
    async with gateway_over_fakes(config_for_test(tmp_path, pools=even_pools()), 2) as rig:
        resp = await rig.client.post("/v1/chat/completions", json=BODY)
        assert resp.status_code == 200, resp.text
        assert [s.instance_id for s in rig.specs] == ["engine-0", "engine-1"]
        assert rig.state_of(resp.headers["x-gpupool-instance"]).requests_seen
    assert not rig.gateway.started


async def test_a_router_process_serves_and_is_stopped(tmp_path: Path) -> None:
    engine = FakeEngineState()
    async with serve_asgi(make_fake_engine(engine)) as url:
        data = config_data(tmp_path, urls=[url], pools=one_pool())
        async with async_router_process(data, tmp_path / "router") as router:
            async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
                resp = await client.post("/v1/chat/completions", json=BODY)
            assert resp.status_code == 200, resp.text
        assert router.proc.returncode is not None  # nothing outlives the block


def test_a_router_that_exits_fails_with_its_log(tmp_path: Path) -> None:
    bad = config_data(tmp_path, urls=["http://127.0.0.1:9"], router={"no_such_setting": 1})
    with (
        pytest.raises(AssertionError, match="no_such_setting"),
        start_router_process(bad, tmp_path / "router", ready_timeout_s=30),
    ):
        pass
