"""Two governors on one real PostgreSQL database, as two router replicas (store.url set): a
tenant's token budget and concurrency slots are shared (router/governance/replica.py).

Clocks are fake and frozen unless a test moves them (the buckets refill by the wall clock, so
nothing refills behind a test's back); the database calls are real and race in threads."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager

import psycopg
import pytest
from prometheus_client import CollectorRegistry

from pools.config import Config, ConfigError
from pools.testing.config import config_for_test, one_pool
from router.admission.estimate import Estimate
from router.admission.picking import RunAffinity
from router.errors import RateLimited, RunStopped, StoreUnavailable
from router.governance import GovernanceMetrics, Governor
from router.governance import governor as governor_module
from router.governance.governor import StepSignals
from router.governance.store import GovernanceStore
from router.request import RequestContext, RequestOutcome
from router.store import PostgresStore, StoreError
from router.store.loop_connection import LoopConnection
from tests.postgres import PASSWORD, PostgresServer, start_postgres

T0 = 1_750_000_000.0
PASSWORD_ENV = "GPUPOOL_TEST_STORE_PASSWORD"
TOKENS_PER_MINUTE = 600
ESTIMATE = Estimate(prompt_tokens=6, output_tokens=4, source="heuristic")  # 10 tokens
HOLDER_PREFIX = "gpupool-test"
REGISTRIES: dict[int, CollectorRegistry] = {}  # each governor's metrics


class Clock:
    def __init__(self, now_s: float) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def shared_config(url: str, **store: object) -> Config:
    return config_for_test(
        pools=one_pool(queue={"max_wait_s": 0}),  # a refusal is at once (no refill wait)
        tenants=[
            {"name": "t", "api_key_sha256": "0" * 64, "tokens_per_minute": TOKENS_PER_MINUTE},
            # free: 2 requests in flight, 1 run active
            {"name": "s", "api_key_sha256": "1" * 64, "tier": "free"},
            {"name": "c", "api_key_sha256": "2" * 64, "cost_cap_gpu_seconds_per_hour": 10},
            # a tier and a budget: refused by its own bucket before its slot is awaited
            {
                "name": "st",
                "api_key_sha256": "3" * 64,
                "tier": "free",
                "tokens_per_minute": TOKENS_PER_MINUTE,
            },
        ],
        store={"url": url, "password_env": PASSWORD_ENV, **store},
    )


@pytest.fixture(autouse=True)
def _password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)


@asynccontextmanager
async def replica(
    config: Config, url: str, wall: Callable[[], float], name: str
) -> AsyncIterator[Governor]:
    """A governor with a connection pool of its own (as a router process would have)."""
    store = PostgresStore(url, password=PASSWORD, connect_timeout_s=0.5)
    await asyncio.to_thread(store.open)
    gstore = GovernanceStore(store)
    await asyncio.to_thread(gstore.open)  # the migrations
    registry = CollectorRegistry()
    gov = Governor(
        config,
        GovernanceMetrics(registry),
        clock=Clock(1000.0),
        store=gstore,
        wall_clock=wall,
        replica_id=f"{HOLDER_PREFIX}-{name}",
    )
    REGISTRIES[id(gov)] = registry
    failed = False
    try:
        yield gov
    except BaseException:
        failed = True
        raise
    finally:
        try:
            await gov.aclose()
        except StoreError:
            if not failed:  # else the test's own failure (its server stopped) is what to see
                raise
        finally:
            await asyncio.to_thread(store.close)


_seq = iter(range(10**9))


def ctx(tenant: str, run_id: str | None = None) -> RequestContext:
    return RequestContext(
        request_id=f"r{next(_seq)}",
        tenant=tenant,
        class_name="normal",
        pool="normal",
        priority=0,
        deadline_s=1000.0 + 60,
        run_id=run_id,
        model="tiny",
        stream=False,
        client_wants_usage=False,
        received_at_s=1000.0,
    )


def tenant_of(gov: Governor, name: str) -> StepSignals:
    return StepSignals(tenant=next(t for t in gov.config.tenants if t.name == name))


async def enter(gov: Governor, tenant: str, run_id: str | None = None) -> RequestOutcome:
    c = ctx(tenant, run_id)
    await gov.enter(c, ESTIMATE, tenant_of(gov, tenant))
    return RequestOutcome(ctx=c, estimate=ESTIMATE)


async def finish(gov: Governor, outcome: RequestOutcome, used: int = 10) -> None:
    outcome.dispatched_at_s = 1000.0
    outcome.ended_at_s = 1000.0
    outcome.status = 200
    outcome.prompt_tokens, outcome.completion_tokens = used, 0
    gov.finished(outcome)
    replica = gov._replica
    assert replica is not None
    replica.release_parked()  # as when no request takes the slot within HANDOVER_S
    await asyncio.gather(*replica._pending)  # the slot's release, in the background


def lease(gov: Governor, tenant: str, bucket: str = "tokens") -> float:
    assert gov._replica is not None
    return gov._replica.leases.get((tenant, bucket), 0.0)


async def shared_level(gov: Governor, tenant: str) -> float | None:
    assert gov._replica is not None
    return await asyncio.to_thread(gov._replica.db.level, tenant, "tokens")


def sample(gov: Governor, name: str, **labels: str) -> float:
    return REGISTRIES[id(gov)].get_sample_value(name, labels) or 0.0


# ------------------------------------------------------------------------------ budgets


async def test_two_replicas_racing_spend_the_budget_once(postgres_server: PostgresServer) -> None:
    url = postgres_server.create_database("replicas_budget")
    config = shared_config(url)
    wall = Clock(T0)  # frozen: the shared bucket does not refill during the race
    async with replica(config, url, wall, "a") as a, replica(config, url, wall, "b") as b:

        async def attempt(gov: Governor) -> RequestOutcome | None:
            try:
                return await enter(gov, "t")
            except RateLimited:
                return None

        # 2 x 40 requests of 10 tokens for a 600-token minute, all at once
        results = await asyncio.gather(*(attempt(g) for g in (a, b) for _ in range(40)))
        admitted = [r for r in results if r is not None]
        granted = 10 * len(admitted)
        held = lease(a, "t") + lease(b, "t")
        level = await shared_level(a, "t")
        assert level is not None
        # nothing spent twice: granted + what the replicas hold + what is left = the bucket
        assert granted + held + level == TOKENS_PER_MINUTE
        # at most one chunk (5 % of 600 = 30) idle per replica
        chunk = config.store.budget_chunk_frac * TOKENS_PER_MINUTE
        assert granted >= TOKENS_PER_MINUTE - 2 * chunk
        assert 0 <= held <= 2 * chunk
        # the sweep gives the leases back; settling to less than reserved gives back the rest
        for gov in (a, b):
            await gov.sync_replicas()
        assert await shared_level(a, "t") == TOKENS_PER_MINUTE - granted
        by_a = [r for r in results[:40] if r is not None]
        by_b = [r for r in results[40:] if r is not None]
        for gov, outcomes in ((a, by_a[:5]), (b, by_b[:5])):
            for outcome in outcomes:
                await finish(gov, outcome, used=4)
            await gov.sync_replicas()
        given_back = 6 * (len(by_a[:5]) + len(by_b[:5]))
        assert await shared_level(a, "t") == TOKENS_PER_MINUTE - granted + given_back


async def test_concurrency_slots_across_replicas_and_a_dead_replicas_expire(
    postgres_server: PostgresServer,
) -> None:
    url = postgres_server.create_database("replicas_slots")
    config = shared_config(url, slot_lease_s=5)
    wall = Clock(T0)
    async with replica(config, url, wall, "b") as b:
        async with replica(config, url, wall, "a") as a:
            await enter(a, "s")
            held_by_b = await enter(b, "s")  # the tier's two slots
            with pytest.raises(RateLimited) as refused:
                await enter(a, "s")
            assert refused.value.code == "tenant_concurrency"
            assert "across the router replicas" in refused.value.message
            await finish(b, held_by_b)
            await enter(a, "s")  # b's slot came back at once
            wall.now_s = T0 + 4
            await a.sync_replicas()  # renews a's two slots: they end at T0 + 9
            a._replica = None  # a dies: no release, no sweep, no leaving (its pool closes)
            wall.now_s = T0 + 8
            with pytest.raises(RateLimited):
                await enter(b, "s")
        wall.now_s = T0 + 9.5  # past a's last renewal + slot_lease_s: its slots expired
        await enter(b, "s")
        await enter(b, "s")
        with pytest.raises(RateLimited):
            await enter(b, "s")


async def loop_ready(gov: Governor) -> int:
    """Wait until the replica's connection on the event loop is up; its statements so far."""
    assert gov._replica is not None and gov._replica._loop is not None
    return await _ready(gov._replica._loop)


async def background_ready(gov: Governor) -> int:
    """The same for the connection of the statements nobody waits for (releases)."""
    assert gov._replica is not None and gov._replica._loop_background is not None
    return await _ready(gov._replica._loop_background)


async def _ready(loop_conn: LoopConnection) -> int:
    for _ in range(500):
        if loop_conn.ready():
            return loop_conn.statements
        await asyncio.sleep(0.01)
    raise AssertionError("no connection on the loop")


async def test_slots_and_step_numbers_on_the_loops_connection(
    postgres_server: PostgresServer,
) -> None:
    """The calls a request waits for go on the event loop's connection when it is idle (no
    worker thread), with the same results: the tier's two slots across replicas, the third
    refused, a release (on the background connection, so the next slot never finds it in
    flight) freeing one; a run's steps numbered across replicas."""
    url = postgres_server.create_database("replicas_loop")
    wall = Clock(T0)
    config = shared_config(url)
    async with replica(config, url, wall, "a") as a, replica(config, url, wall, "b") as b:
        before = {gov: await loop_ready(gov) for gov in (a, b)}
        released_before = await background_ready(a)
        first = await enter(a, "s")
        await enter(b, "s")
        with pytest.raises(RateLimited):
            await enter(a, "s")
        await finish(a, first)  # released on a's loop connection
        await enter(b, "s")
        steps = []
        for gov in (a, b, a):
            outcome = await enter(gov, "t", run_id="run-loop")
            gov.dispatched(outcome)
            steps.append(outcome.step_index)
        assert steps == [0, 1, 2]
        used = {gov: await loop_ready(gov) - before[gov] for gov in (a, b)}
        assert used == {a: 4, b: 3}  # a: 2 acquires (one refused), 2 steps
        assert a._replica is not None
        await asyncio.gather(*a._replica._pending)  # the release, in the background
        assert await background_ready(a) - released_before == 1


async def test_a_step_counted_later_goes_on_the_background_connection(
    postgres_server: PostgresServer,
) -> None:
    """A step sent on with no statement whose record was not committed with its number is
    counted in the store afterwards (`number_later`): nobody waits for that answer, so it
    goes on the background connection, not polled, and the loop's connection stays free for
    the next request's statement; the run's next step is numbered after it."""
    url = postgres_server.create_database("replicas_number_later")
    async with replica(shared_config(url), url, Clock(T0), "a") as a:
        on_loop = await loop_ready(a)
        in_background = await background_ready(a)
        assert a._replica is not None
        a._replica.number_later("t", "run-later")
        await asyncio.gather(*a._replica._pending)
        assert await loop_ready(a) == on_loop
        assert await background_ready(a) == in_background + 1
        outcome = await enter(a, "t", run_id="run-later")
        a.dispatched(outcome)
        assert outcome.step_index == 1


async def test_a_statement_unanswered_on_the_loop_is_an_outage_at_once(
    postgres_server: PostgresServer,
) -> None:
    """The slots' table locked by another session (a hung server, as the router sees it): the
    slot call on the loop waits its bound (connect_timeout_s, 0.5 s here), then the store is
    down (not asked again in a thread) and budgets fail open: the request is admitted."""
    url = postgres_server.create_database("replicas_loop_hang")
    async with replica(shared_config(url), url, Clock(T0), "a") as a:
        await loop_ready(a)
        locker = await psycopg.AsyncConnection.connect(url, password=PASSWORD)
        try:
            await locker.execute("LOCK TABLE concurrency_slots IN ACCESS EXCLUSIVE MODE")
            started = asyncio.get_running_loop().time()
            await enter(a, "s")
            waited_s = asyncio.get_running_loop().time() - started
        finally:
            await locker.close()
        assert 0.5 <= waited_s < 5.0  # the bound, not a second wait in a thread (10 s)
        assert sample(a, "gpupool_governance_store_up") == 0.0


def prepare(gov: Governor, tenant: str, run_id: str | None = None) -> RequestContext:
    """What the gateway does at a request's arrival: `prepare`, which asks the store for the
    request's slot and its run's step number (awaited at `enter`)."""
    signals = tenant_of(gov, tenant)
    c, _ = gov.prepare(ctx(tenant, run_id), signals.tenant, {}, {"messages": []})
    return c


def busy(gov: Governor) -> bool:
    """The loop's connection has a statement in flight."""
    assert gov._replica is not None and gov._replica._loop is not None
    return gov._replica._loop._busy


async def test_the_slot_and_step_are_asked_for_at_prepare_and_awaited_at_enter(
    postgres_server: PostgresServer,
) -> None:
    """`prepare` sends the slot's statement (or the step number's) before it returns, so its
    round trip overlaps the request's preparation; `enter` awaits it: the same slots, the
    same refusal, the same step numbers, one statement each."""
    url = postgres_server.create_database("replicas_early")
    wall = Clock(T0)
    config = shared_config(url)
    async with replica(config, url, wall, "a") as a, replica(config, url, wall, "b") as b:
        await loop_ready(a)
        await finish(a, await enter(a, "s"))  # the statements prepared on the connection
        await finish(a, await enter(a, "t", run_id="run-early"))
        before = await loop_ready(a)
        first = prepare(a, "s")
        assert busy(a)  # sent, nothing awaited yet
        await a.enter(first, ESTIMATE, tenant_of(a, "s"))
        await enter(b, "s")  # the tier's second slot
        third = prepare(a, "s")
        assert busy(a)
        with pytest.raises(RateLimited) as refused:
            await a.enter(third, ESTIMATE, tenant_of(a, "s"))
        assert refused.value.code == "tenant_concurrency"
        assert "2 requests in flight across the router replicas" in refused.value.message
        step = prepare(a, "t", run_id="run-early")
        assert busy(a)
        await a.enter(step, ESTIMATE, tenant_of(a, "t"))
        outcome = RequestOutcome(ctx=step, estimate=ESTIMATE)
        a.dispatched(outcome)
        assert outcome.step_index == 1
        assert await loop_ready(a) - before == 3  # one statement per request, not two
        assert not a._early


async def test_a_slot_asked_for_at_prepare_is_given_back_when_the_request_ends_before_enter(
    postgres_server: PostgresServer,
) -> None:
    """A request refused or failed between `prepare` and `enter` (the gateway's `abandon`,
    settlement's `finished` without a ticket, a cancelled `enter`, or nobody at all: the
    sweep after EARLY_TTL_S; a refusal by its own bucket inside `enter`) holds no slot: the
    tier's two stay free."""
    url = postgres_server.create_database("replicas_early_leak")
    wall = Clock(T0)
    config = shared_config(url)
    async with replica(config, url, wall, "a") as a:
        await loop_ready(a)
        assert a._replica is not None

        asked: list[asyncio.Task[object]] = []  # the store calls `prepare` started

        def prepared(tier: str) -> RequestContext:
            ctx = prepare(a, tier)
            asked.append(a._early[ctx.request_id].task)
            return ctx

        async def released() -> None:
            """Every answer has come and every release it started has run: waited for, not
            slept on (a loaded machine answers late). A request's slot is parked first
            (`HANDOVER_S`, 10 ms) and released by a timer: released here at once, else a
            timer that fires during the `enter`s below sends its release while the next
            slot is asked for, and the slot it frees is still counted (s45's failure under
            load)."""
            await asyncio.gather(*asked, return_exceptions=True)
            await asyncio.sleep(0)  # the answers' callbacks have started the releases
            assert a._replica is not None
            a._replica.release_parked()
            while a._replica._pending:
                await asyncio.gather(*a._replica._pending, return_exceptions=True)

        big = Estimate(prompt_tokens=400, output_tokens=100, source="heuristic")
        spent = prepared("st")
        await a.enter(spent, big, tenant_of(a, "st"))
        await finish(a, RequestOutcome(ctx=spent, estimate=big), used=500)  # 100 left
        refused = prepared("st")
        with pytest.raises(RateLimited) as over:
            await a.enter(refused, big, tenant_of(a, "st"))
        assert over.value.code == "token_rate"  # before `enter` awaited the slot
        a.abandon(prepared("s").request_id)
        a.finished(RequestOutcome(ctx=prepared("s"), estimate=ESTIMATE))
        cancelled = prepared("s")
        entering = asyncio.create_task(a.enter(cancelled, ESTIMATE, tenant_of(a, "s")))
        entering.cancel()
        with pytest.raises(asyncio.CancelledError):
            await entering
        forgotten = prepared("s")
        await released()
        gov_clock = a.clock
        assert isinstance(gov_clock, Clock)
        gov_clock.now_s += governor_module.EARLY_TTL_S + 1
        a.sweep()
        assert forgotten.request_id not in a._early
        await released()
        held = [await enter(a, "s"), await enter(a, "s")]  # both slots free
        with pytest.raises(RateLimited):
            await enter(a, "s")
        for outcome in held:
            await finish(a, outcome)
        held = [await enter(a, "st"), await enter(a, "st")]  # and "st"'s
        with pytest.raises(RateLimited):
            await enter(a, "st")
        assert not a._early


async def slot_holders(url: str, tenant: str) -> list[str]:
    """The holders of `tenant`'s request slots in the database, sorted."""
    async with await psycopg.AsyncConnection.connect(url, password=PASSWORD) as conn:
        cur = await conn.execute(
            "SELECT holder FROM concurrency_slots WHERE tenant = %s ORDER BY holder",
            (f"{tenant}/requests",),
        )
        return [str(row[0]) for row in await cur.fetchall()]


def parked(gov: Governor) -> int:
    assert gov._replica is not None
    return gov._replica.parked()


async def test_a_finished_requests_slot_is_handed_to_the_tenants_next_request(
    postgres_server: PostgresServer,
) -> None:
    """A request's slot, when it ends, waits for the tenant's next request on its replica
    (HANDOVER_S), which takes it without a statement: the database keeps counting it, so the
    tier's limit (2) holds across replicas exactly as before; another replica sees it free
    once nobody took it within the window (released by its timer)."""
    url = postgres_server.create_database("replicas_handover")
    wall = Clock(T0)
    config = shared_config(url)
    async with replica(config, url, wall, "a") as a, replica(config, url, wall, "b") as b:
        assert a._replica is not None
        a._replica.handover_s = 60.0  # parked slots wait for the test, not a timer
        await loop_ready(a)
        first = await enter(a, "s")
        before = await loop_ready(a)
        outcome = first
        for _ in range(5):  # one request after another on a: the same slot, no statement
            outcome.dispatched_at_s = outcome.ended_at_s = 1000.0
            outcome.status = 200
            a.finished(outcome)
            assert parked(a) == 1
            assert await slot_holders(url, "s") == [f"{HOLDER_PREFIX}-a:{first.ctx.request_id}"]
            outcome = await enter(a, "s")
            assert parked(a) == 0
        assert a._replica.handovers == 5
        assert await loop_ready(a) == before  # no acquire, no release sent
        assert not a._replica._pending
        second = await enter(b, "s")  # the tier's other slot
        with pytest.raises(RateLimited):
            await enter(b, "s")  # a's slot is held: 2 of 2
        a.finished(outcome)  # parked on a: still counted, b is still refused
        with pytest.raises(RateLimited):
            await enter(b, "s")
        a._replica.handover_s = 0.02  # the next park's window, short for the test
        await finish(b, second)  # b's own slot, released at once by the helper
        third = await enter(a, "s")  # takes a's parked slot
        third.dispatched_at_s = third.ended_at_s = 1000.0
        third.status = 200
        a.finished(third)
        assert a._replica.handovers == 6
        for _ in range(1000):  # nobody came: its timer releases it (waited for, not slept on)
            if not (parked(a) or a._replica._pending):
                break
            await asyncio.sleep(0.01)
        assert await slot_holders(url, "s") == []
        await enter(b, "s")
        await enter(b, "s")  # both slots on b now


async def test_a_handed_over_slot_still_numbers_the_runs_step(
    postgres_server: PostgresServer,
) -> None:
    """A governed run's step that takes a parked slot asks the store for its step number
    only: one statement, the numbering across replicas unchanged."""
    url = postgres_server.create_database("replicas_handover_step")
    wall = Clock(T0)
    config = shared_config(url)
    async with replica(config, url, wall, "a") as a, replica(config, url, wall, "b") as b:
        for gov in (a, b):
            assert gov._replica is not None
            gov._replica.handover_s = 60.0  # parked slots wait for the test, not a timer
        steps: list[tuple[int | None, int]] = []
        for gov in (a, a, b, a):
            before = await loop_ready(gov)
            outcome = await enter(gov, "s", run_id="run-handover")
            gov.dispatched(outcome)
            steps.append((outcome.step_index, await loop_ready(gov) - before))
            outcome.dispatched_at_s = outcome.ended_at_s = 1000.0
            outcome.status = 200
            gov.finished(outcome)  # its slot parked on `gov`
        assert [n for n, _ in steps] == [0, 1, 2, 3]
        # a: the request slot and the step in one statement, the run's slot (tier "free":
        # one run); a again: the parked slot, the step; b: as a's first; a: the slot parked
        # two steps ago, the step
        assert [sent for _, sent in steps] == [2, 1, 2, 1]
        assert a._replica is not None and a._replica.handovers == 2


async def test_a_governed_steps_slot_and_number_are_one_statement(
    postgres_server: PostgresServer,
) -> None:
    """A run's step that needs a request slot asks for the slot and its step number in one
    statement (sent at `prepare` once prepared on the connection); refused, it numbers no
    step, so the run's next granted step takes the next number."""
    url = postgres_server.create_database("replicas_slot_and_step")
    wall = Clock(T0)
    config = shared_config(url)
    async with replica(config, url, wall, "a") as a, replica(config, url, wall, "b") as b:
        assert a._replica is not None
        a._replica.handover_s = 0.0  # every slot asked for: no hand-over here
        await loop_ready(a)
        numbers: list[int | None] = []
        sent: list[int] = []
        for n in range(3):
            before = await loop_ready(a)
            step = prepare(a, "s", run_id="run-both")
            assert busy(a) == (n > 0)  # sent at `prepare` once the statement is prepared
            await a.enter(step, ESTIMATE, tenant_of(a, "s"))
            outcome = RequestOutcome(ctx=step, estimate=ESTIMATE)
            a.dispatched(outcome)
            numbers.append(outcome.step_index)
            sent.append(await loop_ready(a) - before)
            await finish(a, outcome)
        assert numbers == [0, 1, 2]
        assert sent == [2, 1, 1]  # the first also takes the run's slot (tier "free")
        held = [await enter(b, "s"), await enter(b, "s")]  # the tier's two slots, on b
        with pytest.raises(RateLimited) as refused:
            await a.enter(prepare(a, "s", run_id="run-both"), ESTIMATE, tenant_of(a, "s"))
        assert refused.value.code == "tenant_concurrency"
        for outcome in held:
            await finish(b, outcome)
        outcome = await enter(a, "s", run_id="run-both")
        a.dispatched(outcome)
        assert outcome.step_index == 3  # the refused step took no number


async def test_a_reload_releases_the_parked_slots(postgres_server: PostgresServer) -> None:
    """A parked slot skips the limit's check, so a reload (which may lower a tier's limit)
    releases them."""
    url = postgres_server.create_database("replicas_handover_reload")
    config = shared_config(url)
    async with replica(config, url, Clock(T0), "a") as a:
        assert a._replica is not None
        a._replica.handover_s = 60.0
        done = await enter(a, "s")
        done.dispatched_at_s = done.ended_at_s = 1000.0
        done.status = 200
        a.finished(done)
        assert parked(a) == 1
        a.reload(config)
        assert parked(a) == 0
        await asyncio.gather(*a._replica._pending)
        assert await slot_holders(url, "s") == []


async def test_run_slots_and_cost_caps_across_replicas(postgres_server: PostgresServer) -> None:
    url = postgres_server.create_database("replicas_runs")
    config = shared_config(url)
    wall = Clock(T0)
    async with replica(config, url, wall, "a") as a, replica(config, url, wall, "b") as b:
        await finish(a, await enter(a, "s", run_id="r1"))  # r1 stays active (not idle yet)
        with pytest.raises(RateLimited) as refused:
            await enter(b, "s", run_id="r2")  # the tier's one run slot is r1's, on a
        assert "agent runs active across the router replicas" in refused.value.message
        await finish(a, await enter(a, "s", run_id="r1"))  # r1's next step: its own slot
        # r1's next step on b: the run's slot, counted once (a slot held on a and on b)
        await finish(b, await enter(b, "s", run_id="r1"))
        assert a.end_run("s", "r1") is not None
        assert a._replica is not None
        await asyncio.gather(*a._replica._pending)
        with pytest.raises(RateLimited):
            await enter(a, "s", run_id="r2")  # r1 is still active on b
        assert b.end_run("s", "r1") is not None
        assert b._replica is not None
        await asyncio.gather(*b._replica._pending)
        await finish(b, await enter(b, "s", run_id="r2"))
        # cost caps: a's request used 12 of c's 10 GPU-seconds an hour; b sees it after a
        # sweep on each (a publishes, b reads)
        spent = await enter(a, "c")
        spent.gpu_seconds = 12.0
        await finish(a, spent)
        await enter(b, "c")
        await a.sync_replicas()
        await b.sync_replicas()
        with pytest.raises(RateLimited) as capped:
            await enter(b, "c")
        assert capped.value.code == "cost_cap"
        assert b.budget(tenant_of(b, "c").tenant)["cost"]["hourly"]["used_gpu_seconds"] == 12


async def test_a_runs_steps_are_numbered_across_replicas(postgres_server: PostgresServer) -> None:
    url = postgres_server.create_database("replicas_steps")
    config = shared_config(url)
    wall = Clock(T0)
    async with replica(config, url, wall, "a") as a, replica(config, url, wall, "b") as b:
        numbers = []
        for gov in (a, b, a, b, b):
            outcome = await enter(gov, "t", run_id="run-1")
            gov.dispatched(outcome)  # what settlement calls first at dispatch
            numbers.append(outcome.step_index)
            await finish(gov, outcome)
        assert numbers == [0, 1, 2, 3, 4]
        other = await enter(b, "t", run_id="run-2")
        b.dispatched(other)
        assert other.step_index == 0  # per run


async def test_a_runs_home_follows_its_steps_across_replicas(
    postgres_server: PostgresServer,
) -> None:
    """Each replica keeps its own run table; a step's home comes from the store when another
    replica answered the run's latest step, and stays this replica's own when its own is
    later."""
    url = postgres_server.create_database("replicas_homes")
    config = shared_config(url)
    wall = Clock(T0)
    async with replica(config, url, wall, "a") as a, replica(config, url, wall, "b") as b:
        homes = {a: RunAffinity(), b: RunAffinity()}
        for gov in (a, b):
            gov.on_home = homes[gov].adopt
        key = ("t", "run-1")

        async def step(gov: Governor, answered_by: str, used: int) -> RequestOutcome:
            outcome = await enter(gov, "t", run_id="run-1")
            gov.dispatched(outcome)
            outcome.instance_id = answered_by
            homes[gov].record(key, answered_by, used, step=outcome.step_index)  # settlement
            await finish(gov, outcome, used)
            return outcome

        await step(a, "engine-1", 40)
        assert homes[b].get(key) is None
        second = await step(b, "engine-2", 90)  # b learns step 0's home as step 1 arrives
        assert second.step_index == 1
        await enter(a, "t", run_id="run-1")  # step 2 arrives at a: b answered step 1
        assert (homes[a].get(key), homes[a].context_tokens(key)) == ("engine-2", 90)
        # a's own later answer is not replaced by an older one in the store
        homes[b].record(key, "engine-3", 120, step=7)
        await enter(b, "t", run_id="run-1")
        assert (homes[b].get(key), homes[b].context_tokens(key)) == ("engine-3", 120)
        # the store keeps the latest step's home whatever order replicas record in
        db = a._replica.db if a._replica is not None else None
        assert db is not None
        assert await asyncio.to_thread(db.record_home, "t", "run-1", "engine-5", 5, 1) is True
        assert await asyncio.to_thread(db.record_home, "t", "run-1", "engine-4", 4, 1) is False
        stored = await asyncio.to_thread(db.next_step, "t", "run-1", T0)
        assert (stored.home, stored.home_step) == ("engine-5", 5)
        # a run's steps in a session are homed by the session: nothing recorded for them
        in_session = dataclasses.replace(ctx("t", "sess:1"), session_id="sess")
        await a.enter(in_session, ESTIMATE, tenant_of(a, "t"))
        outcome = RequestOutcome(ctx=in_session, estimate=ESTIMATE, instance_id="engine-6")
        a.dispatched(outcome)
        await finish(a, outcome)
        stored = await asyncio.to_thread(db.next_step, "t", "sess:1", T0)
        assert stored.home is None and stored.step == 1


async def test_an_unchanged_home_is_not_written_again(postgres_server: PostgresServer) -> None:
    """A step answered by the home the store gave it writes nothing; a new home is written."""
    url = postgres_server.create_database("replicas_home_unchanged")
    wall = Clock(T0)
    async with replica(shared_config(url), url, wall, "a") as a:
        db = a._replica.db if a._replica is not None else None
        assert db is not None
        for answered_by in ("engine-1", "engine-1", "engine-1", "engine-2"):
            outcome = await enter(a, "t", run_id="run-1")
            a.dispatched(outcome)
            outcome.instance_id = answered_by
            await finish(a, outcome, used=10 * (outcome.step_index or 0) + 5)
            stored = await asyncio.to_thread(db.next_step, "t", "run-1", T0)
            # the next_step above took a number too: steps are 0, 2, 4, 6
            if answered_by == "engine-1":  # step 0's record stays: the later ones matched it
                assert (stored.home, stored.home_step, stored.context_tokens) == ("engine-1", 0, 5)
        assert (stored.home, stored.home_step, stored.context_tokens) == ("engine-2", 6, 65)


async def test_max_steps_counts_the_steps_every_replica_served(
    postgres_server: PostgresServer,
) -> None:
    url = postgres_server.create_database("replicas_max_steps")
    config = config_for_test(
        pools=one_pool(queue={"max_wait_s": 0}),
        tenants=[{"name": "g", "api_key_sha256": "3" * 64, "run_guards": {"max_steps": 3}}],
        store={"url": url, "password_env": PASSWORD_ENV},
    )
    wall = Clock(T0)
    async with replica(config, url, wall, "a") as a, replica(config, url, wall, "b") as b:
        for gov in (a, b, a):  # three steps, none more than two on one replica
            outcome = await enter(gov, "g", run_id="run-1")
            gov.dispatched(outcome)
            await finish(gov, outcome)
        for gov in (b, a):  # b served one of them, a two: both refuse the fourth
            with pytest.raises(RunStopped) as err:
                await enter(gov, "g", run_id="run-1")
            assert err.value.code == "run_steps"
            assert "max_steps" in str(err.value)


async def test_run_tokens_and_stops_count_across_replicas(postgres_server: PostgresServer) -> None:
    """A run's settled tokens reach the other replicas with each one's sweep (one sweep late),
    and a guard's stop on one replica stops the run on the others."""
    url = postgres_server.create_database("replicas_run_guards")
    config = config_for_test(
        pools=one_pool(queue={"max_wait_s": 0}),
        tenants=[{"name": "g", "api_key_sha256": "3" * 64, "run_guards": {"max_tokens": 100}}],
        store={"url": url, "password_env": PASSWORD_ENV},
    )
    wall = Clock(T0)
    async with replica(config, url, wall, "a") as a, replica(config, url, wall, "b") as b:

        async def step(gov: Governor, run_id: str, used: int) -> None:
            outcome = await enter(gov, "g", run_id=run_id)
            gov.dispatched(outcome)
            await finish(gov, outcome, used)

        await step(a, "run-1", 60)
        await a.sync_replicas()  # a's 60 tokens are in the store
        await step(b, "run-1", 50)  # b counts 60: under 100
        await step(a, "run-1", 0)  # b's 50 not swept yet: a counts 60 (one sweep late)
        await b.sync_replicas()
        with pytest.raises(RunStopped) as err:  # 110 of 100, although a served 60
            await enter(a, "g", run_id="run-1")
        assert err.value.code == "run_tokens"
        # a guard only one replica can see (here: loop detection on a) stops it on b too
        await step(a, "run-2", 1)
        assert a._replica is not None
        a._replica.mark_run("g", "run-2", "run_loop")
        await asyncio.gather(*a._replica._pending)
        with pytest.raises(RunStopped) as err:
            await enter(b, "g", run_id="run-2")
        assert err.value.code == "run_loop"
        assert "another router replica" in err.value.message


# ------------------------------------------------------------------------------ outage


@pytest.fixture
def own_server() -> Iterator[PostgresServer]:
    with start_postgres() as server:
        yield server


async def test_an_outage_fails_open_or_closed_and_reconciles(
    own_server: PostgresServer, caplog: pytest.LogCaptureFixture
) -> None:
    url = own_server.create_database("replicas_outage")
    wall = Clock(T0)
    opened = shared_config(url, budgets_on_outage="open")
    closed = shared_config(url, budgets_on_outage="closed")
    async with replica(opened, url, wall, "open") as o, replica(closed, url, wall, "closed") as c:
        for gov in (o, c):
            await enter(gov, "t")  # each takes a chunk of 30: 20 left in its lease
            await gov.sync_replicas()  # and gives it back (10 tokens spent each)
        assert await shared_level(o, "t") == TOKENS_PER_MINUTE - 20
        assert o._replica is not None
        o._replica.handover_s = 60.0
        tier = await enter(o, "s")
        tier.dispatched_at_s = tier.ended_at_s = 1000.0
        tier.status = 200
        o.finished(tier)  # its slot parked on o when the store goes away
        assert parked(o) == 1
        own_server.stop()
        # fail closed: nothing in the lease, no decision without the database
        with pytest.raises(StoreUnavailable) as refused:
            await enter(c, "t")
        assert refused.value.status == 503 and refused.value.code == "store_unavailable"
        assert sample(c, "gpupool_governance_outage_requests_total", tenant="t", policy="closed")
        assert sample(c, "gpupool_governance_store_up") == 0
        # fail open: admitted on the replica's own bucket, the lease runs into debt
        spent = [await enter(o, "t") for _ in range(5)]
        assert lease(o, "t") == -50
        assert parked(o) == 0  # not handed over while the store is down: left to the sweep
        assert sample(o, "gpupool_governance_outage_requests_total", tenant="t", policy="open")
        assert "budgets fail OPEN" in caplog.text and "budgets fail CLOSED" in caplog.text
        await o.sync_replicas()  # still down: the debt is kept
        assert lease(o, "t") == -50
        for outcome in spent:
            await finish(o, outcome, used=8)  # 2 back each: the debt is 40
        own_server.start()
        await o.sync_replicas()  # reconnect: the debt is charged to the shared bucket
        await c.sync_replicas()
        assert await shared_level(o, "t") == TOKENS_PER_MINUTE - 20 - 40
        assert lease(o, "t") == 0
        assert sample(o, "gpupool_governance_store_up") == 1
        assert sample(c, "gpupool_governance_store_up") == 1
        assert "answers again" in caplog.text
        assert await slot_holders(url, "s") == []  # the parked slot released by the sweep
        await enter(c, "t")  # closed: served again once the store answers


# ------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    ("store", "words"),
    [
        ({"budgets_on_outage": "maybe"}, "budgets_on_outage"),
        ({"slot_lease_s": 1}, "slot_lease_s"),
        ({"budget_chunk_frac": 0.9}, "budget_chunk_frac"),
    ],
)
def test_the_config_refuses_bad_shared_budget_settings(
    store: dict[str, object], words: str
) -> None:
    with pytest.raises(ConfigError, match=words):
        shared_config("postgresql://gpupool@db:5432/gpupool", **store)


def test_the_config_refuses_shared_budget_settings_without_a_url() -> None:
    with pytest.raises(ConfigError, match=r"budgets_on_outage set without store\.url"):
        config_for_test(store={"budgets_on_outage": "closed"})
