"""A run's active time (`max_duration_s`) counted across router replicas (store.url set): two
governors on one real PostgreSQL database, as two router processes behind a load balancer.

The store counts a run's active time on the database's clock, in the statement that numbers
each step and in the sweep's update of the run's counters (a step's end): gaps between the
run's events on any replica count unless longer than `governance.run_idle_timeout_s` with no
step in flight (router/governance/shared.py: `RUN_ACTIVE`). The database's clock is real, so
these tests use real time with a tiny idle timeout; every assertion holds whatever the
machine's scheduling adds to a gap: a refusal is asserted only where the time the store can
have counted (at least the sleeps) passes the limit, an admission only where the real time
elapsed (an upper bound of anything counted) stays under it, and what a pause adds is bounded
by the time around it."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from pools.config import Config, RunGuardsConfig
from pools.testing.config import config_for_test, one_pool
from router.admission.estimate import Estimate
from router.errors import RunStopped
from router.governance import GovernanceMetrics, Governor
from router.governance.governor import StepSignals
from router.governance.guards import RunState, check_step
from router.governance.store import GovernanceStore
from router.request import RequestOutcome
from router.store import PostgresStore
from tests.postgres import PASSWORD, PostgresServer
from tests.unit.test_governance_replicas import ctx
from tests.unit.test_session_replicas import own_server

__all__ = ["own_server"]  # the outage test's server, a fixture of its own

PASSWORD_ENV = "GPUPOOL_TEST_STORE_PASSWORD"
ESTIMATE = Estimate(prompt_tokens=6, output_tokens=4, source="heuristic")
SESSION = "codex-thread-1"
SETTING = "tenants[d].run_guards.max_duration_s"  # the limit's setting, named in a refusal


class FakeClock:
    """A monotonic clock a test moves (frozen unless moved)."""

    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def duration_config(url: str, *, limit_s: float, idle_s: float) -> Config:
    return config_for_test(
        pools=one_pool(queue={"max_wait_s": 0}),
        tenants=[
            {"name": "d", "api_key_sha256": "0" * 64, "run_guards": {"max_duration_s": limit_s}}
        ],
        governance={"run_idle_timeout_s": idle_s},
        store={"url": url, "password_env": PASSWORD_ENV, "connect_timeout_s": 0.5},
    )


@pytest.fixture(autouse=True)
def _password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)


@asynccontextmanager
async def router(
    config: Config, url: str, name: str, clock: Callable[[], float] = time.monotonic
) -> AsyncIterator[Governor]:
    """One replica's governor, with a connection pool of its own; `clock`: its monotonic
    clock (real unless a test moves it), its wall clock real."""
    store = PostgresStore(url, password=PASSWORD, connect_timeout_s=0.5)
    await asyncio.to_thread(store.open)
    gstore = GovernanceStore(store)
    await asyncio.to_thread(gstore.open)
    gov = Governor(
        config,
        GovernanceMetrics(CollectorRegistry()),
        clock=clock,
        store=gstore,
        replica_id=f"duration-test-{name}",
    )
    try:
        yield gov
    finally:
        await gov.aclose()
        await asyncio.to_thread(store.close)


_requests = iter(range(10**9))


async def step(
    gov: Governor,
    run_id: str | None,
    *,
    session: str | None = None,
    task: str | None = None,
    between: Callable[[], None] | None = None,
    in_flight_s: float = 0.0,
) -> RequestOutcome:
    """One step on `gov` as the request path takes it: prepared (its statement sent),
    entered (refused there: `RunStopped`), dispatched, `in_flight_s` at the engine, finished.
    `between`: called while it is in flight (a test moving a fake clock)."""
    now = gov.clock()
    c = dataclasses.replace(
        ctx("d", run_id),
        session_id=session,
        session_turn=task,
        deadline_s=now + 60,
        received_at_s=now,
    )
    tenant = gov.config.tenants[0]
    c, _ = gov.prepare(c, tenant, {}, {"messages": []})
    await gov.enter(c, ESTIMATE, StepSignals(tenant=tenant))
    outcome = RequestOutcome(ctx=c, estimate=ESTIMATE)
    gov.dispatched(outcome)
    outcome.dispatched_at_s = gov.clock()
    if in_flight_s:
        await asyncio.sleep(in_flight_s)
    if between is not None:
        between()
    outcome.ended_at_s = gov.clock()
    outcome.status = 200
    outcome.prompt_tokens, outcome.completion_tokens = 6, 4
    gov.finished(outcome)
    return outcome


def shared_active_s(gov: Governor, run_id: str) -> float:
    replica = gov._replica
    assert replica is not None
    got = replica.db.active_s("d", run_id)
    assert got is not None
    return got


def one_router_refusal(run_id: str, limit_s: float, message: str) -> str:
    """The refusal one router gives the run at the active time `message` states (check_step's
    own words), to compare a refusal across replicas with."""
    found = re.search(r"active (\d+) s", message)
    assert found is not None, message
    shown = float(found.group(1))
    limits = RunGuardsConfig(max_steps=None, max_duration_s=limit_s)
    state = RunState(run_id, 0.0, 0.0, limits, active_s=max(shown, limit_s))
    state.settings["max_duration_s"] = SETTING
    stop = check_step(state, 0.0, None)
    assert stop is not None and stop.code == "run_duration"
    return stop.message.replace(f"active {max(shown, limit_s):.0f} s", f"active {shown:.0f} s")


@pytest.fixture
def pair(postgres_server: PostgresServer) -> Callable[..., Any]:
    """`async with pair(limit_s=, idle_s=) as (a, b)`: two replicas on a fresh database,
    real clocks."""

    @asynccontextmanager
    async def open_pair(*, limit_s: float, idle_s: float) -> AsyncIterator[tuple[Governor, ...]]:
        url = postgres_server.create_database(f"duration_{next(_databases)}")
        config = duration_config(url, limit_s=limit_s, idle_s=idle_s)
        async with router(config, url, "a") as a, router(config, url, "b") as b:
            yield a, b

    return open_pair


_databases = iter(range(10**6))


async def alternate_until_refused(
    a: Governor, b: Governor, run_id: str | None, *, gap_s: float, steps: int, **kw: Any
) -> tuple[int, RunStopped, list[float]]:
    """Steps of one run on a, b, a, b, ... `gap_s` apart, until one is refused: its index,
    the refusal, and the real time from the first step's start to each step's end."""
    started = time.monotonic()
    elapsed: list[float] = []
    for i in range(steps):
        gov = (a, b)[i % 2]
        try:
            await step(gov, run_id, **kw)
        except RunStopped as stop:
            elapsed.append(time.monotonic() - started)
            return i, stop, elapsed
        elapsed.append(time.monotonic() - started)
        await asyncio.sleep(gap_s)
    raise AssertionError(f"{steps} steps alternating over two replicas, none refused: {elapsed}")


@pytest.mark.parametrize("kind", ["run", "session"])
async def test_a_run_alternating_over_replicas_is_refused_on_its_shared_active_time(
    pair: Callable[..., Any], kind: str
) -> None:
    """Steps 0.3 s apart alternate a, b, a, b with a 0.5 s idle timeout: each replica sees
    the run every 0.6 s (longer than the timeout: a pause to it, so on its own it counts
    nothing and never refuses), the store sees it every 0.3 s and counts the gaps. Refused
    (403 `run_duration`, one router's message) once the shared time passes 0.8 s, on the
    other replica too; a session's run (`<session>:<n>`) the same."""
    limit_s = 0.8
    async with pair(limit_s=limit_s, idle_s=0.5) as (a, b):
        kw: dict[str, Any] = {}
        if kind == "session":
            kw = {"session": SESSION, "task": "fix the bug"}
        run_id = None if kind == "session" else "agent-run"
        refused_at, stop, elapsed = await alternate_until_refused(
            a, b, run_id, gap_s=0.3, steps=14, **kw
        )
        run = f"{SESSION}:1" if kind == "session" else "agent-run"
        assert stop.code == "run_duration"
        assert stop.param == SETTING
        # the store counts at most the real time from the first step to the refused one
        assert elapsed[refused_at] >= limit_s
        # admitted while the real time since the first step (all the store can have
        # counted) was under the limit
        assert all(elapsed[i] >= limit_s for i in range(refused_at, len(elapsed)))
        assert stop.message == one_router_refusal(run, limit_s, stop.message)
        other = (a, b)[(refused_at + 1) % 2]
        await asyncio.sleep(0.05)  # the stop written in the background
        replica = (a, b)[refused_at % 2]._replica
        assert replica is not None
        await asyncio.gather(*replica._pending)
        with pytest.raises(RunStopped) as again:
            await step(other, run_id, **kw)
        assert again.value.code == "run_duration"


async def test_pauses_longer_than_the_idle_timeout_still_do_not_count(
    pair: Callable[..., Any],
) -> None:
    """Three steps 0.1 s apart on a, b, a, a 1.2 s pause (over the 0.5 s timeout), three more
    on b, a, b: the store counts the bursts, not the pause (at most the real time less the
    pause), and a 0.9 s limit is not reached by them."""
    async with pair(limit_s=0.9, idle_s=0.5) as (a, b):
        started = time.monotonic()
        for gov in (a, b, a):
            await step(gov, "paused")
            await asyncio.sleep(0.1)
        burst_s = time.monotonic() - started
        await asyncio.sleep(1.2)
        resumed = time.monotonic()
        for gov in (b, a, b):
            await step(gov, "paused")
            await asyncio.sleep(0.1)
        total_s = time.monotonic() - started
        second_s = time.monotonic() - resumed
        counted = shared_active_s(a, "paused")
        assert counted <= total_s - 1.2  # the pause left out
        assert counted <= burst_s + second_s
        assert counted >= 0.0


async def test_a_step_in_flight_across_a_pause_counts_when_it_ends(
    pair: Callable[..., Any],
) -> None:
    """A step on a is at the engine for 0.6 s, longer than the 0.3 s idle timeout: its end,
    told to the store by a's sweep, counts the whole time (the stretch it was in flight),
    so b, which never saw the run, refuses its next step against a 0.5 s limit. Counted
    from the step's arrival and end alone, 0.6 s would be a pause."""
    async with pair(limit_s=0.5, idle_s=0.3) as (a, b):
        await step(a, "long", in_flight_s=0.6)
        await a.sync_replicas()  # the sweep: the step's usage and its end
        with pytest.raises(RunStopped) as refused:
            await step(b, "long")
        assert refused.value.code == "run_duration"
        assert shared_active_s(a, "long") >= 0.6


async def test_concurrent_steps_on_two_replicas_count_the_same_time_once(
    pair: Callable[..., Any],
) -> None:
    """Steps of one run in flight at once on a and b for 0.4 s: the store counts the time
    once (the latest event time, not a sum of each replica's gaps): at most the real time
    from the first statement to the last sweep."""
    async with pair(limit_s=60.0, idle_s=30.0) as (a, b):
        started = time.monotonic()
        await step(a, "together")  # the row, then both at once
        await asyncio.gather(
            step(a, "together", in_flight_s=0.4), step(b, "together", in_flight_s=0.4)
        )
        await a.sync_replicas()
        await b.sync_replicas()
        whole_s = time.monotonic() - started
        counted = shared_active_s(a, "together")
        assert 0.4 <= counted <= whole_s


async def test_an_outage_counts_per_replica_and_reconciles_on_reconnect(
    own_server: PostgresServer,
) -> None:
    """While the store is down a counts the run's time on its own (as before); its first
    sweep that gets through hands the store its steps' ends with the stretch behind them, so
    the time spent during the outage counts on b too (refused), and a's own figure, merged
    with the store's at its next step, never goes back."""
    url = own_server.create_database("duration_outage")
    config = duration_config(url, limit_s=0.45, idle_s=30.0)
    clock = FakeClock()
    async with router(config, url, "a", clock) as a, router(config, url, "b") as b:
        await step(a, "through")
        await a.sync_replicas()
        own_server.stop()

        def engine_time() -> None:  # a's own clock: the step took 0.3 s
            clock.now_s += 0.3

        await step(a, "through", in_flight_s=0.5, between=engine_time)  # numbered alone
        replica = a._replica
        assert replica is not None and replica.down_since_s is not None
        before = a._tenants["d"].runs["through"].active_s
        assert 0.29 < before < 0.45  # a's own count: under the limit
        await a.sync_replicas()  # still down: the end is kept
        own_server.start()
        await a.sync_replicas()  # reconnects: the step's end and its stretch
        assert replica.down_since_s is None
        with pytest.raises(RunStopped) as on_b:
            await step(b, "through")
        assert on_b.value.code == "run_duration"
        assert shared_active_s(a, "through") >= 0.5  # the real time it spans
        with pytest.raises(RunStopped):
            await step(a, "through")
        assert a._tenants["d"].runs["through"].active_s >= before  # never backwards
