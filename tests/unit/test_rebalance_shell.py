"""The rebalancer in the router, in simulated time (no engines are contacted: telemetry is fed
to the fleet directly): signals from the request path move the ratio, a whole-instance move
drains, SRE settings persist and are audited, the admin API and its errors, the metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from pools.launchers.base import InstanceSpec
from pools.telemetry import InstanceReading
from pools.testing.config import config_for_test, deep_merge, default_pools
from router.gateway.app import Gateway, create_app
from router.request import RequestContext, RequestOutcome


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


SHARES = default_pools(
    agent={"share": {"initial_frac": 1 / 3, "floor_frac": 0.2, "ceiling_frac": 0.7}},
    normal={"share": {"initial_frac": 2 / 3, "floor_frac": 0.3, "ceiling_frac": 0.8}},
)


def config(tmp_path: Path, **rebalancer: Any) -> Any:
    rebalancer = {
        "enabled": False,  # ticks are driven by the tests
        "interval_s": 10,
        "cooldown_s": 10,
        "smoothing_window_s": 10,
        "drain_timeout_s": 30,
        **rebalancer,
    }
    return config_for_test(tmp_path, pools=SHARES, rebalancer=rebalancer)


SPECS = [InstanceSpec(f"engine-{i}", f"http://127.0.0.1:{9 + i}", 1) for i in range(3)]


def reading(now_s: float) -> InstanceReading:
    return InstanceReading(
        taken_at_s=now_s,
        kv_usage_frac=0.1,
        running=0,
        waiting=0,
        num_gpu_blocks=1000,
        block_size=16,
        preemptions_total=0,
        prefix_cache_hits_total=0,
        prefix_cache_queries_total=0,
        ttft_sum_s=0,
        ttft_count=0,
        itl_sum_s=0,
        itl_count=0,
    )


@pytest.fixture
async def make_gateway() -> AsyncIterator[Callable[..., Any]]:
    made: list[Gateway] = []

    async def make(cfg: Any, clock: Clock) -> Gateway:
        gateway = create_app(cfg, list(SPECS), scrape=False, clock=clock)
        await gateway.start()
        for spec in SPECS:
            gateway.fleet.record_reading(spec.instance_id, reading(clock()))
        made.append(gateway)
        return gateway

    yield make
    for gateway in made:
        if gateway.started:  # a test may have closed it already (a restart)
            await gateway.aclose()


def finished(pool: str, ended_at_s: float, *, queue_s: float, status: int = 200) -> RequestOutcome:
    ctx = RequestContext(
        request_id="r",
        tenant="t",
        class_name=pool,
        pool=pool,
        priority=0,
        deadline_s=ended_at_s + 100,
        run_id=None,
        model="tiny",
        stream=True,
        client_wants_usage=False,
        received_at_s=ended_at_s - queue_s - 1.0,
    )
    out = RequestOutcome(ctx=ctx, status=status, ended_at_s=ended_at_s)
    out.admission_started_at_s = ctx.received_at_s  # governance let it through at once
    out.admitted_at_s = ctx.received_at_s + queue_s
    if status == 429:
        out.outcome, out.error_type = "rejected", "capacity_exceeded"
        out.admitted_at_s = None
    return out


def client(gateway: Gateway) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://gw")


async def test_agent_queue_pressure_moves_share_to_agent_and_is_logged(
    tmp_path: Path, make_gateway: Callable[..., Any]
) -> None:
    clock = Clock()
    gw: Gateway = await make_gateway(config(tmp_path), clock)
    rb = gw.rebalancer
    assert rb.placed_shares()["agent"] == pytest.approx(1 / 3)
    clock.now_s += 10
    # agent requests waited 6 s in the queue (target: its TTFT 3 s -> pressure 2); chat 0
    for _ in range(20):
        rb.signals.finished(finished("agent", clock.now_s - 1, queue_s=6.0))
        rb.signals.finished(finished("normal", clock.now_s - 1, queue_s=0.0))
    decision = rb.tick()
    assert decision.reason == "moved"
    assert decision.pressure["agent"]["queue_wait"] == pytest.approx(2.0)
    assert decision.shares["agent"] == pytest.approx(1 / 3 + 0.1)
    # placed at once by resizing one instance (no drain: an instance becomes split)
    assert rb.placed_shares()["agent"] == pytest.approx(1 / 3 + 0.1)
    assert not gw.pool_map.current.draining
    split = [i for i, p in gw.pool_map.current.fracs.items() if len(p) > 1]
    assert len(split) == 1
    async with client(gw) as c:
        await _settle(gw)
        body = (await c.get("/admin/decisions")).json()
        assert body["data"][0]["reason"] == "moved"
        assert body["data"][0]["move"]["to_pool"] == "agent"
        assert body["data"][0]["signals"]["agent"]["queue_wait_s"] == pytest.approx(6.0)
        metrics = (await c.get("/metrics")).text
        assert (
            'gpupool_rebalance_moves_total{from_pool="normal",kind="auto",to_pool="agent"} 1.0'
            in metrics
        )
        assert 'gpupool_pool_pressure{pool="agent",signal="queue_wait"} 2.0' in metrics
        pools = (await c.get("/admin/pools")).json()
        assert pools["rebalancer"]["target_shares"]["agent"] == pytest.approx(0.4333, abs=1e-3)


async def _settle(gw: Gateway) -> None:
    if gw.rebalancer._writes:
        await asyncio.gather(*gw.rebalancer._writes)


async def test_whole_instance_move_drains_then_joins(
    tmp_path: Path, make_gateway: Callable[..., Any]
) -> None:
    clock = Clock()
    gw: Gateway = await make_gateway(config(tmp_path), clock)
    rb = gw.rebalancer
    normal = gw.pool_map.current.instances_for("normal")
    moving = normal[0]
    lease = gw.fleet.acquire(moving, "normal", blocks=10)  # a chat sequence in flight there
    await rb.move_instance("sre-1", moving, "agent")
    alloc = gw.pool_map.current
    assert moving in alloc.draining
    assert moving not in alloc.instances_for("normal")  # no new chat work at once
    assert moving not in alloc.instances_for("agent")  # not yet agent's
    assert rb.placed_shares()["agent"] == pytest.approx(2 / 3)
    lease.release()  # the chat sequence finishes: the instance joins the agent pool
    alloc = gw.pool_map.current
    assert not alloc.draining and moving in alloc.instances_for("agent")
    await _settle(gw)
    rows = await rb.decision_log.decisions(limit=5)
    assert rows[0]["reason"] == "drain_done" and rows[0]["ended_by"] == "finished"
    audit = await rb.decision_log.audit()
    assert audit[0]["who"] == "sre-1" and audit[0]["action"] == "move_instance"


async def test_drain_ends_at_its_deadline_without_cutting_anything(
    tmp_path: Path, make_gateway: Callable[..., Any]
) -> None:
    clock = Clock()
    gw: Gateway = await make_gateway(config(tmp_path), clock)
    rb = gw.rebalancer
    moving = gw.pool_map.current.instances_for("normal")[0]
    lease = gw.fleet.acquire(moving, "normal", blocks=10)
    await rb.move_instance("sre", moving, "agent")
    clock.now_s += 29
    rb.check_drains()
    assert moving in gw.pool_map.current.draining
    clock.now_s += 2
    rb.check_drains()
    assert moving in gw.pool_map.current.instances_for("agent")
    assert not lease.released  # the old sequence still runs where it is
    lease.release()


async def test_move_outside_bounds_is_refused_with_openai_shape(
    tmp_path: Path, make_gateway: Callable[..., Any]
) -> None:
    clock = Clock()
    gw: Gateway = await make_gateway(config(tmp_path), clock)
    async with client(gw) as c:
        # agent 1/3 + 0.5 > its ceiling 0.7
        r = await c.post(
            "/admin/pools/move", json={"from_pool": "normal", "to_pool": "agent", "share_frac": 0.5}
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "outside_bounds"
        r = await c.post("/admin/pools/bounds", json={"pool": "agent", "floor_frac": 0.9})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_bounds"
        r = await c.post("/admin/pools/bounds", json={"pool": "nope", "floor_frac": 0.1})
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_pool"
        r = await c.post("/admin/pools/pin", json={"shares": {"agent": 0.5, "normal": 0.6}})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_shares"
        r = await c.post("/admin/pools/freeze", json={"bogus": 1})
        assert r.status_code == 400
        r = await c.get("/admin/decisions?limit=0")
        assert r.status_code == 400 and r.json()["error"]["param"] == "limit"


async def test_sre_settings_survive_a_restart_and_are_audited(
    tmp_path: Path, make_gateway: Callable[..., Any]
) -> None:
    clock = Clock()
    cfg = config(tmp_path)
    gw: Gateway = await make_gateway(cfg, clock)
    async with client(gw) as c:
        r = await c.post(
            "/admin/pools/bounds", json={"pool": "agent", "floor_frac": 0.3, "ceiling_frac": 0.6}
        )
        assert r.status_code == 200, r.text
        r = await c.post("/admin/pools/pin", json={"shares": {"agent": 0.5}})
        assert r.status_code == 200, r.text
        assert r.json()["target_shares"] == {"agent": 0.5, "normal": 0.5}
        r = await c.post("/admin/pools/pin", json={"instance": "engine-2", "pool": "normal"})
        assert r.status_code == 200, r.text
        assert (await c.post("/admin/pools/freeze", json={})).status_code == 200
    assert gw.rebalancer.placed_shares()["agent"] == pytest.approx(0.5)
    await gw.aclose()

    again: Gateway = await make_gateway(cfg, clock)
    view = again.rebalancer.view()
    assert view["frozen"] is True
    assert view["pinned_shares"] == {"agent": 0.5, "normal": 0.5}
    assert view["bounds_overrides"] == {"agent": [0.3, 0.6]}
    assert view["pinned_instances"] == {"engine-2": "normal"}
    assert again.rebalancer.placed_shares()["agent"] == pytest.approx(0.5)
    assert dict(again.pool_map.current.pools_of("engine-2")) == {"normal": 1.0}
    async with client(again) as c:
        audit = (await c.get("/admin/pools/audit")).json()["data"]
    assert [a["action"] for a in audit] == ["freeze", "pin_instance", "pin", "set_bounds"]
    assert all(a["who"] == "local" for a in audit)  # the open loopback router's operator
    assert audit[3]["after"] == [0.3, 0.6] and audit[3]["before"] is None


async def test_frozen_loop_does_not_move_and_schedule_bounds_apply(
    tmp_path: Path, make_gateway: Callable[..., Any]
) -> None:
    clock = Clock()
    data_cfg = config(tmp_path)
    gw: Gateway = await make_gateway(data_cfg, clock)
    rb = gw.rebalancer
    await rb.freeze("sre", True)
    clock.now_s += 10
    for _ in range(5):
        rb.signals.finished(finished("agent", clock.now_s - 1, queue_s=30.0))
    assert rb.tick().reason == "frozen"
    assert rb.placed_shares()["agent"] == pytest.approx(1 / 3)


async def test_schedule_window_bounds_move_the_ratio(
    tmp_path: Path, make_gateway: Callable[..., Any]
) -> None:
    night = {"start": "00:00", "end": "24:00", "floor_frac": 0.5, "ceiling_frac": 0.7}
    pools = deep_merge(SHARES, {"agent": {"share": {"schedule": [night]}}})
    rebalancer = {"enabled": False, "interval_s": 10}
    cfg = config_for_test(tmp_path, pools=pools, rebalancer=rebalancer)
    clock = Clock()
    gw: Gateway = await make_gateway(cfg, clock)
    # restoring at start already applies the schedule's floor 0.5
    assert gw.rebalancer.placed_shares()["agent"] == pytest.approx(0.5)


async def test_the_recall_check_between_decisions_brings_lent_share_back(
    tmp_path: Path, make_gateway: Callable[..., Any]
) -> None:
    """Share lent to the agent pool at one decision; 11 s later (past the interval and the
    cooldown, before the next decision) chat requests waited 2.4 s in the queue (pressure
    2.4 / 0.8 = 3) and the agent pool is calm: the check between decisions recalls the loan,
    places it and logs it. Before that, with chat calm, the check changes nothing."""
    clock = Clock()
    gw: Gateway = await make_gateway(config(tmp_path), clock)
    rb = gw.rebalancer
    clock.now_s += 10
    for _ in range(20):
        rb.signals.finished(finished("agent", clock.now_s - 1, queue_s=6.0))
        rb.signals.finished(finished("normal", clock.now_s - 1, queue_s=0.0))
    assert rb.tick().reason == "moved"
    lent = rb.placed_shares()["agent"]
    assert lent > 1 / 3 + 0.05
    clock.now_s += 5
    before = rb.loop_state
    assert rb.check_recall() is None  # within the interval and cooldown, and chat is calm
    assert rb.loop_state is before
    clock.now_s += 6
    for _ in range(20):
        rb.signals.finished(finished("agent", clock.now_s - 1, queue_s=0.0))
        rb.signals.finished(finished("normal", clock.now_s - 1, queue_s=2.4))
    decision = rb.check_recall()
    assert decision is not None and decision.reason == "recalled"
    assert decision.pressure["normal"]["queue_wait"] == pytest.approx(3.0)
    assert rb.placed_shares()["agent"] == pytest.approx(1 / 3)  # back home, not past it
    assert rb.tick().reason == "not_due"  # one step per interval
    async with client(gw) as c:
        await _settle(gw)
        body = (await c.get("/admin/decisions")).json()
        assert [d["reason"] for d in body["data"][:2]] == ["recalled", "moved"]
