"""Two rebalancers on one real PostgreSQL database, as two router replicas: one leads (the
advisory lock), its decisions are followed by the other, an SRE change made through the
follower reaches the leader, and when the leader's session dies the follower takes over
(router/rebalancer/rebalancer.py, router/store/leader.py). Decisions are stepped by hand in
simulated time; only the leader election's own checks are real, waited for with a generous
deadline."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import psycopg
import pytest

from pools.allocation import plan_moves
from pools.config import Config
from pools.fleet import InstanceState
from pools.testing.config import config_for_test
from router.cli.commands.pools import _format_rebalancer
from router.core import build_core
from router.rebalancer.rebalancer import Rebalancer
from router.rebalancer.store import DecisionLog
from router.store import PostgresStore
from router.store.leader import AdvisoryLockLeader, leadership_for
from tests.postgres import PASSWORD, PostgresServer
from tests.unit.test_rebalance_shell import SHARES, SPECS, Clock, finished

DEADLINE_S = 30.0


def config(url: str, loop_s: float | None = None) -> Config:
    """Ticks driven by the test, or (`loop_s`) the loop running every `loop_s`."""
    return config_for_test(
        pools=SHARES,
        rebalancer={
            "enabled": loop_s is not None,
            "interval_s": loop_s or 10,
            "cooldown_s": 10,
            "smoothing_window_s": 10,
            "drain_timeout_s": 30,
        },
        store={"url": url, "password_env": "GPUPOOL_TEST_STORE_PASSWORD"},
    )


@pytest.fixture(autouse=True)
def _password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUPOOL_TEST_STORE_PASSWORD", PASSWORD)


@asynccontextmanager
async def replica(
    url: str, clock: Clock, name: str, check_s: float, loop_s: float | None = None
) -> AsyncIterator[Rebalancer]:
    """A rebalancer with a connection pool of its own, as a router process has, named `name`,
    its leader election checking every `check_s`; its loop every `loop_s` (None: off)."""
    store = PostgresStore(url, password=PASSWORD, connect_timeout_s=2.0)
    await asyncio.to_thread(store.open)
    try:
        core = build_core(
            config(url, loop_s),
            list(SPECS),
            clock,
            random.Random(0),
            decision_log=DecisionLog(store),
        )
        rb = core.rebalancer
        rb.replica = name
        rb.leadership = leadership_for(store, name, check_s=check_s)
        rb.leadership.on_change = rb._leading_changed
        await rb.start()
        try:
            yield rb
        finally:
            await rb.aclose()
    finally:
        await asyncio.to_thread(store.close)


async def check_now(rb: Rebalancer) -> None:
    """The replica's leader election checks now (PostgreSQL's: an advisory lock)."""
    assert isinstance(rb.leadership, AdvisoryLockLeader)
    await rb.leadership.check()


def _state(rb: Rebalancer, instance_id: str) -> InstanceState:
    state = rb.fleet.get(instance_id)
    assert state is not None, instance_id
    return state


async def until(condition: Callable[[], Awaitable[bool]]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not await condition():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        await asyncio.sleep(0.05)


async def test_one_decides_the_other_follows_and_takes_over(
    postgres_server: PostgresServer,
) -> None:
    url = postgres_server.create_database(f"rebalance{time.monotonic_ns()}")
    clock = Clock()
    # a checks once, at its start, then only when the test says: its process is as good as
    # dead once its session is ended (a live one would campaign again at once)
    async with replica(url, clock, "a", check_s=3600) as a:

        async def a_leads() -> bool:
            return a.leadership.leading

        await until(a_leads)
        async with replica(url, clock, "b", check_s=0.05) as b:
            await check_now(b)
            assert not b.leadership.leading
            assert b.view()["leader"] == {
                "replica": "b",
                "leading": False,
                "leader": "a",
                "election": "advisory_lock",
            }
            assert a.metrics.rebalancer_leader._value.get() == 1
            assert b.metrics.rebalancer_leader._value.get() == 0
            # `gpupool pools show` says which replica answered and who leads
            assert "answered by replica b: leader a" in _format_rebalancer(b.view())
            assert "answered by replica a: it leads" in _format_rebalancer(a.view())

            # the leader decides (agent requests waited twice their target) and publishes
            clock.now_s += 10
            for _ in range(20):
                a.signals.finished(finished("agent", clock.now_s - 1, queue_s=6.0))
                a.signals.finished(finished("normal", clock.now_s - 1, queue_s=0.0))
            assert a.tick().reason == "moved"
            moved = a.placed_shares()["agent"]
            assert moved == pytest.approx(1 / 3 + 0.1)
            await a.sync()
            await b.sync()  # the follower places the leader's ratio
            assert b.loop_state.shares == pytest.approx(a.loop_state.shares)
            assert b.placed_shares()["agent"] == pytest.approx(moved)
            assert b.pool_map.current.fracs == a.pool_map.current.fracs

            # an SRE change through the follower reaches the leader
            await b.pin("sre", {"agent": 0.5})
            assert b.placed_shares()["agent"] == pytest.approx(0.5)
            await a.sync()
            assert a.sre.pinned_shares == {"agent": 0.5, "normal": 0.5}
            assert a.placed_shares()["agent"] == pytest.approx(0.5)
            assert a.loop_state.last_move_at_s == clock.now_s  # its cooldown started

            # the leader's session is ended by the server: the follower takes over
            with psycopg.connect(url, password=PASSWORD, autocommit=True) as admin:
                ended = admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE application_name = 'gpupool a'"
                ).fetchall()
            assert len(ended) == 1

            async def b_leads() -> bool:
                return b.leadership.leading

            await until(b_leads)
            assert b.metrics.rebalancer_leader._value.get() == 1
            await check_now(a)
            assert not a.leadership.leading and a.leadership.leader == "b"
            assert a.metrics.rebalancer_leader._value.get() == 0
            # the new leader decides from the shared ratio, which the old one now follows
            await b.unpin("sre")
            await a.sync()
            assert a.sre.pinned_shares is None


async def test_only_the_leader_decides(postgres_server: PostgresServer) -> None:
    """Both loops run (a decision every 0.2 s); the follower's records none while the leader's
    records several."""
    url = postgres_server.create_database(f"loops{time.monotonic_ns()}")
    clock = Clock()
    async with replica(url, clock, "a", check_s=0.05, loop_s=0.2) as a:

        async def a_leads() -> bool:
            return a.leadership.leading

        await until(a_leads)
        async with replica(url, clock, "b", check_s=0.05, loop_s=0.2) as b:

            async def a_decided_twice_since_b_started() -> bool:
                clock.now_s += 0.2  # the decisions' own clock: each loop's tick is due
                return len(a.recent) >= len(seen) + 2

            seen = list(a.recent)
            await until(a_decided_twice_since_b_started)
            assert not b.leadership.leading
            assert list(b.recent) == []  # b's loop ran as often, deciding nothing


async def test_an_instance_moved_through_either_replica_is_the_one_every_replica_moves(
    postgres_server: PostgresServer,
) -> None:
    """`move_instance` names the instance. The ratio alone would let each replica choose its own
    instance to move (the same shares are reached by moving any of the giver's instances), so
    the ratio is published with its placement and every replica drains that same instance,
    each from its own sequences on it."""
    url = postgres_server.create_database(f"moveinst{time.monotonic_ns()}")
    clock = Clock()
    async with replica(url, clock, "a", check_s=3600) as a:

        async def a_leads() -> bool:
            return a.leadership.leading

        await until(a_leads)
        async with replica(url, clock, "b", check_s=3600) as b:
            await b.sync()
            start = a.pool_map.current
            assert b.pool_map.current.fracs == start.fracs
            capacity = a.fleet.capacity_gpus()
            normal = [i for i, f in start.fracs.items() if dict(f) == {"normal": 1.0}]
            agent = [i for i, f in start.fracs.items() if dict(f) == {"agent": 1.0}]
            assert len(normal) == 2 and len(agent) == 1
            # the normal instance a plan from the shares alone would not move
            planned = plan_moves(start, capacity, {"agent": 2 / 3, "normal": 1 / 3})
            (planned_move,) = planned.draining
            (moved,) = [i for i in normal if i != planned_move]
            for who, by, to_pool in (("follower", b, "agent"), ("leader", a, "normal")):
                from_pool = "normal" if to_pool == "agent" else "agent"
                for r in (a, b):  # a sequence of the old pool runs there on each replica
                    _state(r, moved).running_by_pool[from_pool] = 1
                await by.move_instance("sre", moved, to_pool)
                for r in (a, b):
                    await r.sync()
                    current = r.pool_map.current
                    assert current.fracs == by.pool_map.current.fracs, (who, r.replica)
                    assert dict(current.fracs[moved]) == {to_pool: 1.0}, (who, r.replica)
                    drain = current.draining[moved]
                    assert (drain.from_pool, drain.to_pool) == (from_pool, to_pool)
                for r in (a, b):  # each replica's own sequence ends: its drain ends
                    _state(r, moved).running_by_pool[from_pool] = 0
                    r.check_drains()
                    assert r.pool_map.current.draining == {}
                    assert dict(r.pool_map.current.fracs[moved]) == {to_pool: 1.0}
