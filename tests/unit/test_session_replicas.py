"""A session's runs numbered across router replicas (store.url set): two governors on one real
PostgreSQL database, as two router processes behind a load balancer. A Claude Code / Codex /
x-session-id session's steps map to its runs in the store (router/governance/shared.py:
`gpupool_session_step`), so every replica gives a task the same `<session>:<n>` run and
numbers its steps in it.

Every expected run and step number comes from the scenario: which task (user message) each
step belongs to and the order the steps arrive in, on whichever replica."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterator

import pytest

from router.errors import RateLimited
from router.governance import Governor
from router.governance.governor import StepSignals
from router.governance.runtable import MAX_ANCHORS
from router.governance.shared import SESSION_FRESH_S
from router.governance.speculation import SPECULATE_WITHIN_S
from router.request import RequestContext, RequestOutcome
from tests.postgres import PASSWORD, PostgresServer, start_postgres
from tests.unit.test_governance_replicas import (
    ESTIMATE,
    PASSWORD_ENV,
    T0,
    Clock,
    ctx,
    finish,
    replica,
    shared_config,
    tenant_of,
)

SESSION = "claude-session-1"


def session_step(gov: Governor, tenant: str, task: str | None) -> RequestContext:
    """What the gateway does at a session step's arrival: classify names the session and the
    task anchor (the user message), `prepare` gives it a run (and asks the store)."""
    c = dataclasses.replace(ctx(tenant), session_id=SESSION, session_turn=task)
    prepared, _ = gov.prepare(c, tenant_of(gov, tenant).tenant, {}, {"messages": []})
    return prepared


async def step(
    gov: Governor,
    task: str | None,
    *,
    tenant: str = "t",
    run_end: bool = False,
    speculate: bool = False,
) -> RequestOutcome:
    """One whole step on `gov`: prepared, entered, dispatched (the outcome then carries its
    run and its step number, as settlement hands them to the ledger), finished.
    `speculate`: entered as the request path enters it (a known run's step goes on before
    the store's answer, awaited before the response's first byte)."""
    c = session_step(gov, tenant, task)
    signals = StepSignals(tenant=tenant_of(gov, tenant).tenant, run_end=run_end)
    await gov.enter(c, ESTIMATE, signals, speculate=speculate)
    outcome = RequestOutcome(ctx=c, estimate=ESTIMATE)
    gov.dispatched(outcome)
    if (spec := gov.speculation(c.request_id)) is not None:
        SPECULATED.append(c.request_id)
        await spec.wait()
        assert spec.error is None
        outcome.step_index = spec.step  # as the request path's `_confirmed` does
    await finish(gov, outcome)
    return outcome


SPECULATED: list[str] = []


async def settled(*govs: Governor) -> None:
    """The background statements (a run's end forgotten in the store) done."""
    for gov in govs:
        assert gov._replica is not None
        await asyncio.gather(*gov._replica._pending)


@pytest.fixture(autouse=True)
def _password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)


@pytest.fixture
async def two(postgres_server: PostgresServer) -> AsyncIterator[tuple[Governor, Governor]]:
    url = postgres_server.create_database(f"sessions_{next(_databases)}")
    config = shared_config(url)
    wall = Clock(T0)
    async with replica(config, url, wall, "a") as a, replica(config, url, wall, "b") as b:
        yield a, b


_databases = iter(range(10**6))


def runs_and_steps(outcomes: list[RequestOutcome]) -> list[tuple[str | None, int | None]]:
    return [(o.ctx.run_id, o.step_index) for o in outcomes]


async def test_a_sessions_steps_alternating_between_replicas_land_in_one_run(
    two: tuple[Governor, Governor],
) -> None:
    a, b = two
    assert (await step(a, "read the repo")).ctx.run_id == f"{SESSION}:1"  # a's alone
    outcomes = [await step(gov, "fix the bug") for gov in (b, a, b, a, b, a)]
    run = f"{SESSION}:2"
    assert runs_and_steps(outcomes) == [(run, n) for n in range(6)]
    # a step with no anchor (a tool result only) joins the current run, on either
    assert runs_and_steps([await step(b, None), await step(a, None)]) == [(run, 6), (run, 7)]
    # the next task (a new user message) is the session's third run, on either replica
    nxt = [await step(gov, "now add a test") for gov in (b, a, b)]
    assert runs_and_steps(nxt) == [(f"{SESSION}:3", n) for n in range(3)]


async def test_a_replica_that_did_not_see_a_sessions_runs_takes_the_stores_numbers(
    two: tuple[Governor, Governor],
) -> None:
    """b takes tasks 2 and 3; a, which saw only task 1, gets task 4 as run 4 (its own
    count would say 2), and task 2's later step on a lands in b's run 2."""
    a, b = two
    assert (await step(a, "task 1")).ctx.run_id == f"{SESSION}:1"
    assert (await step(b, "task 2")).ctx.run_id == f"{SESSION}:2"
    assert (await step(b, "task 3")).ctx.run_id == f"{SESSION}:3"
    fourth = await step(a, "task 4")
    assert (fourth.ctx.run_id, fourth.step_index) == (f"{SESSION}:4", 0)
    back = await step(a, "task 2")
    assert (back.ctx.run_id, back.step_index) == (f"{SESSION}:2", 1)
    # the governor's own run state follows the store's run (guards, GET /v1/budget)
    active = {r["run_id"]: r["steps"] for r in a.budget(tenant_of(a, "t").tenant)["active_runs"]}
    assert active[f"{SESSION}:2"] == 2  # step 0 on b, step 1 here: the store's count
    session = a.session("t", SESSION)
    assert session is not None and f"{SESSION}:2" in session["runs"]


async def test_new_tasks_on_two_replicas_at_once_get_distinct_runs_and_one_task_one_run(
    two: tuple[Governor, Governor],
) -> None:
    a, b = two
    # two new tasks at once: both statements in flight before either is awaited
    first = await asyncio.gather(step(a, "task x"), step(b, "task y"))
    assert sorted(o.ctx.run_id or "" for o in first) == [f"{SESSION}:1", f"{SESSION}:2"]
    # one new task on both at once: one run, numbered once (the next task is run 4, no gap)
    same = await asyncio.gather(step(a, "task z"), step(b, "task z"))
    assert [o.ctx.run_id for o in same] == [f"{SESSION}:3"] * 2
    assert sorted(o.step_index or 0 for o in same) == [0, 1]
    assert (await step(b, "task w")).ctx.run_id == f"{SESSION}:4"


async def test_a_run_ended_on_one_replica_starts_a_new_run_on_the_other(
    two: tuple[Governor, Governor],
) -> None:
    a, b = two
    clock_b = b.clock
    assert isinstance(clock_b, Clock)
    assert (await step(b, "task 1")).ctx.run_id == f"{SESSION}:1"
    clock_b.now_s += SPECULATE_WITHIN_S + 1  # b no longer knows the run well
    assert (await step(a, "task 1")).ctx.run_id == f"{SESSION}:1"
    ended = await step(a, "task 1", run_end=True)  # the client ends the run on a
    assert ended.ctx.run_id == f"{SESSION}:1"
    await settled(a)
    again = await step(b, "task 1")  # b still maps the task to run 1 itself
    assert (again.ctx.run_id, again.step_index) == (f"{SESSION}:2", 0)
    assert (await step(a, "task 1")).ctx.run_id == f"{SESSION}:2"


async def test_the_stores_anchors_stay_bounded(two: tuple[Governor, Governor]) -> None:
    a, b = two
    wall = a._wall_clock  # both replicas' (the store keeps the anchors last seen)
    assert isinstance(wall, Clock)
    for n in range(MAX_ANCHORS + 8):
        wall.now_s += 1
        await step(a if n % 2 else b, f"task {n}")
    assert a._replica is not None
    kept = await asyncio.to_thread(a._replica.db.session_anchors, "t", SESSION)
    assert len(kept) == MAX_ANCHORS
    # the newest kept, with their runs
    assert kept == {f"task {n}": n + 1 for n in range(8, MAX_ANCHORS + 8)}
    # a forgotten task's next step is a new run (as on one replica)
    assert (await step(a, "task 0")).ctx.run_id == f"{SESSION}:{MAX_ANCHORS + 9}"


async def test_a_tier_tenants_session_steps_take_their_slot_and_run_in_one_statement(
    two: tuple[Governor, Governor],
) -> None:
    a, b = two
    assert (await step(b, "task 1", tenant="s")).ctx.run_id == f"{SESSION}:1"
    outcomes = [await step(gov, "task 2", tenant="s") for gov in (a, b, a)]
    assert runs_and_steps(outcomes) == [(f"{SESSION}:2", n) for n in range(3)]
    # the tier's 2 requests in flight on a: a step on b is refused its slot, and maps nothing
    held = [session_step(a, "s", "task 2") for _ in range(2)]
    for c in held:
        await a.enter(c, ESTIMATE, tenant_of(a, "s"))
    refused = session_step(b, "s", "task 3")
    with pytest.raises(RateLimited) as err:
        await b.enter(refused, ESTIMATE, tenant_of(b, "s"))
    assert err.value.code == "tenant_concurrency"
    assert b._replica is not None
    kept = await asyncio.to_thread(b._replica.db.session_anchors, "s", SESSION)
    assert sorted(kept) == ["task 1", "task 2"]


async def test_a_known_runs_session_step_goes_on_before_the_answer_in_its_run(
    two: tuple[Governor, Governor],
) -> None:
    """A step of a run this replica took the previous step of goes on before the store's
    answer (s41), numbered in that run; another replica's step in between renumbers it."""
    a, b = two
    SPECULATED.clear()
    outcomes = [await step(a, "task 1", speculate=True)]  # its first here: waits
    outcomes.append(await step(a, "task 1", speculate=True))  # known: goes on
    outcomes.append(await step(b, "task 1", speculate=True))
    outcomes.append(await step(a, "task 1", speculate=True))  # known: renumbered 2 -> 3
    assert runs_and_steps(outcomes) == [(f"{SESSION}:1", n) for n in range(4)]
    assert len(SPECULATED) == 2


async def test_a_tasks_later_steps_rewrite_the_sessions_rows_only_when_stale(
    two: tuple[Governor, Governor],
) -> None:
    """A later step of the current task reads the session's rows and writes only its step
    while both were written within SESSION_FRESH_S; past that it refreshes them (the day's
    sweep and the anchors' bound go by them)."""
    a, b = two
    wall = a._wall_clock
    assert isinstance(wall, Clock) and a._replica is not None
    db = a._replica.db

    def seen() -> tuple[float, float]:
        with db.store.connection() as conn:
            (anchor,) = conn.execute("SELECT seen_at_s FROM session_anchors").fetchone()
            (session,) = conn.execute("SELECT updated_at_s FROM session_runs").fetchone()
        return float(anchor), float(session)

    clocks = [wall, a.clock, b.clock]

    def later(s: float) -> None:
        for clock in clocks:
            assert isinstance(clock, Clock)
            clock.now_s += s

    await step(a, "task 1")
    first = await asyncio.to_thread(seen)
    later(SESSION_FRESH_S / 2)
    assert (await step(b, "task 1")).step_index == 1  # mapped: the rows are fresh
    assert (await step(a, "task 1")).step_index == 2  # a knows the run: its own statement
    assert await asyncio.to_thread(seen) == first
    later(SESSION_FRESH_S)
    assert (await step(a, "task 1")).step_index == 3
    assert await asyncio.to_thread(seen) == (wall.now_s, wall.now_s)


@pytest.fixture
def own_server() -> Iterator[PostgresServer]:
    with start_postgres() as server:
        yield server


async def test_an_outage_numbers_locally_and_reconnecting_hands_the_numbers_to_the_store(
    own_server: PostgresServer,
) -> None:
    """While the store is down each replica numbers a session's runs from what it knows; the
    sweep that reconnects hands the store what it numbered, so a task numbered during the
    outage keeps its run on the other replica and the session's next new task goes past it."""
    url = own_server.create_database("sessions_outage")
    config = shared_config(url)
    wall = Clock(T0)
    async with replica(config, url, wall, "a") as a, replica(config, url, wall, "b") as b:
        assert (await step(a, "task 1")).ctx.run_id == f"{SESSION}:1"
        own_server.stop()
        assert (await step(a, "task 2")).ctx.run_id == f"{SESSION}:2"  # a's own count
        assert (await step(a, "task 3")).ctx.run_id == f"{SESSION}:3"
        assert a._replica is not None and a._replica.down_since_s is not None
        own_server.start()
        await a.sync_replicas()  # reconnects, and hands over tasks 2 and 3
        assert a._replica.down_since_s is None
        on_b = await step(b, "task 2")  # b never saw it: the store maps it to a's run
        assert (on_b.ctx.run_id, on_b.step_index) == (f"{SESSION}:2", 0)
        assert (await step(b, "task 4")).ctx.run_id == f"{SESSION}:4"  # past a's numbers
        assert (await step(a, "task 5")).ctx.run_id == f"{SESSION}:5"
