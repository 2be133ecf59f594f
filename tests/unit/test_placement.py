"""`pools.<pool>.placement` takes effect on the request path: where a run's next step goes when
its home instance is full (wait for it, or go elsewhere), a step waiting for its home does not
hold up the steps queued behind it, and a run's home is keyed by (tenant, run id).

Two engines, one pool; KV capacity is the limit: each engine holds two of the `BIG` steps."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from pools.config import ConfigError, parse_config
from pools.fleet import Lease
from pools.launchers.base import InstanceSpec
from pools.testing.config import config_data
from router.admission.estimate import Estimate
from router.gateway.app import Gateway, create_app
from router.request import RequestContext
from tests.unit.test_rebalance_borrow import ctx as borrow_ctx
from tests.unit.test_rebalance_shell import Clock, reading

SPECS = [InstanceSpec(f"engine-{i}", f"http://127.0.0.1:{9 + i}", 1) for i in range(2)]
# 400 blocks each: an engine's 1000 blocks (950 past the margin) hold two
BIG = Estimate(prompt_tokens=6000, output_tokens=400, source="heuristic")


def _data(tmp_path: Path, pool: dict[str, Any]) -> dict[str, Any]:
    pools = {"agent": {"classes": ["agent", "normal"], "share": {"initial_frac": 1.0}, **pool}}
    return config_data(tmp_path, pools=pools, router={"kv_margin_frac": 0.05})


@pytest.fixture
async def make_gw(tmp_path: Path) -> AsyncIterator[Callable[[str], Any]]:
    made: list[Gateway] = []

    async def make(placement: str) -> Gateway:
        (tmp_path / placement).mkdir()
        config = parse_config(_data(tmp_path / placement, {"placement": placement}))
        clock = Clock()
        gw = create_app(config, list(SPECS), scrape=False, clock=clock)
        await gw.start()
        made.append(gw)
        for spec in SPECS:
            gw.fleet.record_reading(spec.instance_id, reading(clock()))
        return gw

    yield make
    for gw in made:
        await gw.aclose()


def _ctx(n: int, run_id: str | None, tenant: str = "t") -> RequestContext:
    return dataclasses.replace(borrow_ctx("agent", n), run_id=run_id, tenant=tenant)


async def _fill(gw: Gateway) -> dict[str, list[Lease]]:
    """Both engines full (two BIG steps each, no run)."""
    leases: dict[str, list[Lease]] = {"engine-0": [], "engine-1": []}
    for i in range(4):
        lease = await gw.admitter.admit(_ctx(100 + i, None), BIG)
        leases[lease.instance_id].append(lease)
    assert [len(v) for v in leases.values()] == [2, 2]
    return leases


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.mark.parametrize(
    ("placement", "a_goes_to", "b_waits"),
    [
        # no prefill rate measured yet: nothing to weigh, so the step keeps its cache
        ("affinity_or_move", None, False),
        ("always_affinity", None, False),
        ("least_loaded", "engine-1", True),
    ],
)
async def test_the_pools_placement_decides_where_a_homeless_slot_goes(
    make_gw: Any, placement: str, a_goes_to: str | None, b_waits: bool
) -> None:
    """Run A's home is engine-0, both engines are full, A queues first, then B (no run).
    A slot frees on engine-1: the affinity rules keep A for engine-0 and B, behind it, goes
    (A does not block the queue); least_loaded sends A to engine-1 and B waits."""
    gw = await make_gw(placement)
    leases = await _fill(gw)
    gw.affinity.record(("t", "A"), "engine-0", context_tokens=6000)
    a = asyncio.ensure_future(gw.admitter.admit(_ctx(1, "A"), BIG))
    await _settle()
    b = asyncio.ensure_future(gw.admitter.admit(_ctx(2, "B"), BIG))
    await _settle()
    assert len(gw.admitter.queues["agent"]) == 2
    leases["engine-1"].pop().release()
    await _settle()
    if a_goes_to is None:
        assert not a.done()
        assert b.done() and b.result().instance_id == "engine-1"
        leases["engine-0"].pop().release()  # its home frees: A goes there
        await _settle()
        assert a.done() and a.result().instance_id == "engine-0"
    else:
        assert a.done() and a.result().instance_id == a_goes_to
        assert b.done() is not b_waits
        b.cancel()
    await _settle()


async def test_affinity_or_move_moves_once_the_wait_has_cost_as_much_as_the_move(
    make_gw: Any,
) -> None:
    """Run A (6,000 tokens cached on engine-0) waits; a slot frees on engine-1, which prefills
    3,000 uncached tokens/s (6,000 measured at a 50 % hit rate) and runs one sequence: the
    move costs 2 s x (1 + 1) = 4 s. No TPOT is measured, so there is no estimate of the wait
    at home: A waits until it has waited 4 s (ski rental), then moves."""
    gw = await make_gw("affinity_or_move")
    leases = await _fill(gw)
    for state in gw.fleet:
        state.prefill_tokens_per_s, state.prefix_hit_frac = 6000.0, 0.5
    gw.affinity.record(("t", "A"), "engine-0", context_tokens=6000)
    clock = gw.admitter.clock
    start_s = clock()
    a = asyncio.ensure_future(gw.admitter.admit(_ctx(1, "A"), BIG))
    await _settle()
    assert gw.admitter.homebound("agent") == {"engine-0": 1}
    clock.now_s = start_s + 3.9
    leases["engine-1"].pop().release()
    await _settle()
    assert not a.done()  # waited 3.9 s < 4 s
    clock.now_s = start_s + 4.0
    gw.admitter.pump()
    await _settle()
    assert a.done() and a.result().instance_id == "engine-1"
    assert gw.admitter.homebound("agent") == {}


async def test_affinity_or_move_never_takes_an_instances_last_free_slot(
    tmp_path: Path,
) -> None:
    """Engines of two sequences each (`--max-num-seqs 2`: the operating point's ceiling),
    both full. Run A (home engine-0) waits. One slot frees on engine-1: the last one there,
    no spare room, so A keeps waiting however long it has waited. The second frees: one is
    spare, and A, having waited far past the move's cost, moves."""
    data = _data(tmp_path, {"placement": "affinity_or_move"})
    data["engines"]["local"]["vllm_args"] = ["--max-num-seqs", "2"]
    clock = Clock()
    gw = create_app(parse_config(data), list(SPECS), scrape=False, clock=clock)
    await gw.start()
    try:
        for spec in SPECS:
            gw.fleet.record_reading(spec.instance_id, reading(clock()))
        leases = await _fill(gw)
        for state in gw.fleet:
            state.prefill_tokens_per_s, state.prefix_hit_frac = 6000.0, 0.5  # a 2 s move
        gw.affinity.record(("t", "A"), "engine-0", context_tokens=6000)
        a = asyncio.ensure_future(gw.admitter.admit(_ctx(1, "A"), BIG))
        await _settle()
        clock.now_s += 100.0
        for spec in SPECS:  # fresh telemetry
            gw.fleet.record_reading(spec.instance_id, reading(clock()))
        leases["engine-1"].pop().release()
        await _settle()
        assert not a.done()
        leases["engine-1"].pop().release()
        await _settle()
        assert a.done() and a.result().instance_id == "engine-1"
    finally:
        await gw.aclose()


async def test_steps_waiting_for_each_home_are_counted_until_they_leave(make_gw: Any) -> None:
    gw = await make_gw("always_affinity")
    leases = await _fill(gw)
    homes = {"A": "engine-0", "C": "engine-0", "D": "engine-1"}
    steps = {}
    for i, (run, home) in enumerate(homes.items()):
        gw.affinity.record(("t", run), home, context_tokens=6000)
        steps[run] = asyncio.ensure_future(gw.admitter.admit(_ctx(i, run), BIG))
        await _settle()
    steps["E"] = asyncio.ensure_future(gw.admitter.admit(_ctx(9, None), BIG))  # no run
    await _settle()
    assert gw.admitter.homebound("agent") == {"engine-0": 2, "engine-1": 1}
    steps["C"].cancel()  # its client left
    await _settle()
    assert gw.admitter.homebound("agent") == {"engine-0": 1, "engine-1": 1}
    leases["engine-0"].pop().release()  # A goes home
    await _settle()
    assert steps["A"].done() and steps["A"].result().instance_id == "engine-0"
    assert gw.admitter.homebound("agent") == {"engine-1": 1}
    leases["engine-1"].pop().release()
    await _settle()
    assert steps["D"].done() and steps["D"].result().instance_id == "engine-1"
    assert gw.admitter.homebound("agent") == {}
    steps["E"].cancel()
    await _settle()


async def test_a_runs_home_is_its_tenants(make_gw: Any) -> None:
    """Tenant u's run "A" has no home although tenant t's run "A" has one: under
    always_affinity u's step takes the free slot on engine-1, t's waits for engine-0."""
    gw = await make_gw("always_affinity")
    leases = await _fill(gw)
    gw.affinity.record(("t", "A"), "engine-0", context_tokens=6000)
    t_step = asyncio.ensure_future(gw.admitter.admit(_ctx(1, "A", tenant="t"), BIG))
    await _settle()
    u_step = asyncio.ensure_future(gw.admitter.admit(_ctx(2, "A", tenant="u"), BIG))
    await _settle()
    leases["engine-1"].pop().release()
    await _settle()
    assert u_step.done() and u_step.result().instance_id == "engine-1"
    assert not t_step.done()
    t_step.cancel()
    await _settle()


def test_check_config_refuses_an_unknown_placement(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="placement"):
        parse_config(_data(tmp_path, {"placement": "sticky"}))
    config = parse_config(_data(tmp_path, {}))
    assert config.pools[0].placement == "always_affinity"  # the default
