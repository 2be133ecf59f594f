"""Borrowing: a pool's overflow uses another pool's idle capacity up to borrow_max_frac, the
owner's queue wins the next free slot, and the borrowed sequence is the borrower's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from pools.fleet import Lease
from pools.launchers.base import InstanceSpec
from pools.testing.config import REMOVE, config_for_test, default_pools
from router.admission.estimate import Estimate
from router.gateway.app import Gateway, create_app
from router.request import RequestContext
from tests.unit.test_rebalance_shell import Clock, reading

SPECS = [InstanceSpec(f"engine-{i}", f"http://127.0.0.1:{9 + i}", 1) for i in range(2)]


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[Gateway]:
    half = {"share": {"initial_frac": 0.5, "floor_frac": REMOVE, "ceiling_frac": REMOVE}}
    config = config_for_test(
        tmp_path,
        pools=default_pools(agent=half, normal=half),
        router={"kv_margin_frac": 0.05},
        rebalancer={"borrow_max_frac": 0.5},
    )
    clock = Clock()
    gateway = create_app(config, list(SPECS), scrape=False, clock=clock)
    await gateway.start()
    for spec in SPECS:
        r = reading(clock())
        gateway.fleet.record_reading(spec.instance_id, r)  # 1000 blocks of 16 tokens
    yield gateway
    await gateway.aclose()


def ctx(pool: str, n: int) -> RequestContext:
    return RequestContext(
        request_id=f"{pool}-{n}",
        tenant="t",
        class_name=pool,
        pool=pool,
        priority=0,
        deadline_s=1e9,
        run_id=None,
        model="tiny",
        stream=True,
        client_wants_usage=False,
        received_at_s=1000.0,
    )


# 400 blocks each: the agent engine (950 usable) holds two, the third overflows
BIG = Estimate(prompt_tokens=6000, output_tokens=400, source="heuristic")


async def test_overflow_borrows_up_to_the_limit_and_is_the_borrowers(gw: Gateway) -> None:
    (agent_i,) = gw.pool_map.current.instances_for("agent")
    (normal_i,) = gw.pool_map.current.instances_for("normal")
    a = gw.admitter
    own = [await a.admit(ctx("agent", i), BIG) for i in range(2)]
    assert {lease.instance_id for lease in own} == {agent_i}
    borrowed = await a.admit(ctx("agent", 2), BIG)
    assert borrowed.instance_id == normal_i and borrowed.pool == "agent"
    # a second borrowed one would pass 0.5 x normal's part (475 blocks): it waits
    fourth = asyncio.ensure_future(a.admit(ctx("agent", 3), BIG))
    await asyncio.sleep(0.05)
    assert not fourth.done() and len(a.queues["agent"]) == 1
    view = gw.rebalancer.view()
    assert view["borrowed_frac"]["agent"] == pytest.approx(0.5 * 400 / 999, abs=1e-4)
    # the owner still has its part: a chat request fits on its engine at once
    chat = await a.admit(ctx("normal", 0), Estimate(100, 100, "heuristic"))
    assert chat.instance_id == normal_i
    for lease in [*own, borrowed, chat]:
        lease.release()
    got: Lease = await asyncio.wait_for(fourth, 2)
    got.release()


async def test_the_owners_queue_wins_the_next_free_slot(gw: Gateway) -> None:
    (normal_i,) = gw.pool_map.current.instances_for("normal")
    a = gw.admitter
    own = [await a.admit(ctx("agent", i), BIG) for i in range(2)]  # the agent engine is full
    chat_big = await a.admit(ctx("normal", 0), Estimate(9000, 2200, "heuristic"))  # 700 blocks
    order: list[str] = []
    chat = asyncio.ensure_future(a.admit(ctx("normal", 1), Estimate(4000, 800, "heuristic")))
    chat.add_done_callback(lambda _f: order.append("normal"))
    await asyncio.sleep(0.05)
    assert not chat.done() and len(a.queues["normal"]) == 1  # 100 + 700 + 300 > 950
    overflow = asyncio.ensure_future(a.admit(ctx("agent", 2), BIG))
    overflow.add_done_callback(lambda _f: order.append("agent"))
    await asyncio.sleep(0.05)
    assert not overflow.done(), "borrowed while the owner had a request waiting"
    chat_big.release()  # the slot frees
    lease = await asyncio.wait_for(chat, 2)
    assert lease.instance_id == normal_i and lease.pool == "normal"
    borrowed = await asyncio.wait_for(overflow, 2)  # then the borrower, beside it
    assert borrowed.instance_id == normal_i and borrowed.pool == "agent"
    assert order == ["normal", "agent"]
    for held in [*own, lease, borrowed]:
        held.release()
