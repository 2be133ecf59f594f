"""`queue.order: run_las` on the request path, through the gateway over fake engines: the
accountant's per-run GPU-seconds reach the queue, so a fresh run's step overtakes a step of a
run that has already been served, where `fifo` keeps arrival order."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from pools.config import ConfigError
from pools.launchers.base import InstanceSpec
from pools.testing.config import config_for_test, even_pools
from pools.testing.fake_engine import FakeEngineState
from pools.testing.gateway import gateway_over_fakes
from router.gateway.app import Gateway, create_app
from tests.unit.test_admitter import asgi_post

# ~0.4 s on the fake engine; the agent engine's 12 KV blocks hold one such step at a time
STEP = {"model": "tiny", "messages": [{"role": "user", "content": "next step"}], "max_tokens": 100}


def _config(tmp_path: Path, queue: dict[str, Any], **extra: Any) -> Any:
    return config_for_test(
        tmp_path,
        pools=even_pools(agent={"queue": queue}),
        router={"scrape_interval_s": 0.05},
        **extra,
    )


@pytest.fixture
def states() -> list[FakeEngineState]:
    return [FakeEngineState(num_gpu_blocks=12, itl_s=0.004) for _ in range(2)]


@pytest.fixture
async def gateway(
    tmp_path: Path, request: pytest.FixtureRequest, states: list[FakeEngineState]
) -> AsyncIterator[Gateway]:
    queue = dict(request.param)
    governance = queue.pop("governance", None)
    extra = {} if governance is None else {"governance": governance}
    async with gateway_over_fakes(_config(tmp_path, queue, **extra), states) as rig:
        yield rig.gateway


async def _step(gw: Gateway, run: str, done: list[str]) -> None:
    reply = await asgi_post(gw, STEP, headers={"x-gpupool-run-id": run})
    assert reply.status == 200, reply.body
    done.append(run)


async def _until(cond: Any) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


async def _served_order(gw: Gateway, states: list[FakeEngineState]) -> list[str]:
    done: list[str] = []
    for _ in range(3):  # the long run has three steps behind it
        await _step(gw, "long", done)
    queue = gw.admitter.queues["agent"]
    # the blocker holds the agent engine's KV until both later steps queue behind it (a gate,
    # not its ~0.4 s: on a loaded machine it ended before the second one queued)
    gate = asyncio.Event()
    for state in states:
        state.gate = gate
    blocker = asyncio.ensure_future(_step(gw, "blocker", done))
    await _until(lambda: gw.accountant.run_usage(("default", "blocker"), 0.0) is not None)
    later = [asyncio.ensure_future(_step(gw, "long", done))]
    await _until(lambda: len(queue) == 1)
    later.append(asyncio.ensure_future(_step(gw, "fresh", done)))
    await _until(lambda: len(queue) == 2)
    gate.set()
    await asyncio.gather(blocker, *later)
    return done[3:]


@pytest.mark.parametrize(
    "gateway", [{"order": "run_las", "run_las_aging_s": 4, "max_wait_s": 10}], indirect=True
)
async def test_run_las_serves_the_fresh_run_before_the_served_one(
    gateway: Gateway, states: list[FakeEngineState]
) -> None:
    usage = gateway.accountant.run_usage(("default", "long"), 0.0)
    assert usage is None
    assert await _served_order(gateway, states) == ["blocker", "fresh", "long"]
    long_usage = gateway.accountant.run_usage(("default", "long"), 1e12)
    assert long_usage is not None and long_usage.gpu_seconds > 0.4 * 4 * 0.5


@pytest.mark.parametrize("gateway", [{"order": "fifo"}], indirect=True)
async def test_fifo_keeps_arrival_order(gateway: Gateway, states: list[FakeEngineState]) -> None:
    assert await _served_order(gateway, states) == ["blocker", "long", "fresh"]


def test_run_las_fields_are_refused_where_they_take_no_effect(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="only apply with order: run_las"):
        _config(tmp_path, {"order": "wfq", "run_las_aging_s": 3})
    with pytest.raises(ConfigError, match="must be below max_wait_s"):
        _config(tmp_path, {"order": "run_las", "run_las_aging_s": 30, "max_wait_s": 10})
    with pytest.raises(ConfigError, match="only apply with order: run_las"):
        _config(tmp_path, {"order": "fifo", "run_las_max_attained_gpu_s": 2})
    cfg = _config(
        tmp_path,
        {
            "order": "run_las",
            "run_las_aging_s": 3,
            "run_las_idle_decay_s": 9,
            "run_las_max_attained_gpu_s": 2.5,
        },
    )
    agent = next(p for p in cfg.pools if p.name == "agent")
    assert (agent.queue.order, agent.queue.run_las_aging_s) == ("run_las", 3.0)
    assert agent.queue.run_las_idle_decay_s == 9.0
    assert agent.queue.run_las_max_attained_gpu_s == 2.5


def test_the_bound_relative_to_fifo_is_configured_and_refused_where_it_does_nothing(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match="only apply with order: run_las"):
        _config(tmp_path, {"order": "wfq", "run_las_max_slowdown": 1.5})
    with pytest.raises(ConfigError, match="run_las_max_slowdown"):
        _config(tmp_path, {"order": "run_las", "run_las_max_slowdown": 0.5})
    queue = {"order": "run_las", "run_las_max_slowdown": 1.7}
    agent = next(p for p in _config(tmp_path, queue).pools if p.name == "agent")
    assert agent.queue.run_las_max_slowdown == 1.7
    off = {"order": "run_las", "run_las_max_slowdown": None}
    agent = next(p for p in _config(tmp_path, off).pools if p.name == "agent")
    assert agent.queue.run_las_max_slowdown is None
    gw = create_app(_config(tmp_path, queue), [InstanceSpec("engine-0", "http://x", 1)])
    assert gw.admitter.queues["agent"].max_slowdown == 1.7


@pytest.mark.parametrize("gateway", [{"order": "run_las"}], indirect=True)
async def test_a_run_that_ends_is_counted_in_the_completion_histogram(gateway: Gateway) -> None:
    started = asyncio.get_running_loop().time()
    done: list[str] = []
    await _step(gateway, "r1", done)
    await asyncio.sleep(0.3)  # a tool call
    last = await asgi_post(
        gateway, STEP, headers={"x-gpupool-run-id": "r1", "x-gpupool-run-end": "1"}
    )
    assert last.status == 200
    took_s = asyncio.get_running_loop().time() - started
    registry = gateway.metrics.registry
    labels = {"class": "agent"}
    assert registry.get_sample_value("gpupool_run_completion_seconds_count", labels) == 1.0
    observed = registry.get_sample_value("gpupool_run_completion_seconds_sum", labels)
    assert observed is not None and 0.3 < observed <= took_s
    # the run ended: ending it again observes nothing more
    assert gateway.accounting_observer.run_completed("default", "r1") is None


@pytest.mark.parametrize(
    "gateway", [{"order": "run_las", "governance": {"run_idle_timeout_s": 0.5}}], indirect=True
)
async def test_a_run_that_goes_idle_is_counted_when_governance_times_it_out(
    gateway: Gateway,
) -> None:
    """No explicit end: the run's completion is observed when it has been idle past
    `governance.run_idle_timeout_s` (the sweep ends it), from its first arrival to its last
    step's last byte, not to the timeout."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    done: list[str] = []
    await _step(gateway, "r2", done)
    await asyncio.sleep(0.2)  # a tool call
    await _step(gateway, "r2", done)
    took_s = loop.time() - started
    registry = gateway.metrics.registry
    labels = {"class": "agent"}
    gateway.governor.sweep()  # idle 0 s: still active
    assert registry.get_sample_value("gpupool_run_completion_seconds_count", labels) in (None, 0.0)
    await asyncio.sleep(0.6)
    gateway.governor.sweep()
    assert registry.get_sample_value("gpupool_run_completion_seconds_count", labels) == 1.0
    observed = registry.get_sample_value("gpupool_run_completion_seconds_sum", labels)
    assert observed is not None and 0.2 < observed <= took_s
