"""Borrowing between tenants with a shared store (router replicas on one PostgreSQL): a tenant
short of its shared budget borrows the shortfall from an idle tenant's shared bucket, out of a
shared allowance, and a lender is idle only when no replica has demand of it
(router/governance/borrowing.py, shared.py `gpupool_borrow`, docs/replicas.md).

Two governors on one real PostgreSQL database, as two router processes; clocks are fake and
frozen unless a test moves them (tests/unit/test_governance_replicas.py's rig)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from pools.config import Config, contract_problems
from pools.testing.config import config_for_test, one_pool
from router.admission.estimate import Estimate
from router.errors import RateLimited, StoreUnavailable
from router.governance import GovernanceMetrics, Governor
from router.governance.borrowing import IDLE_AFTER_SWEEPS, Split, Terms, idle, split
from router.governance.shared import SharedBudgets
from router.governance.store import MIGRATIONS
from router.request import RequestOutcome
from router.store import Store, migrate
from tests.postgres import PostgresServer, start_postgres
from tests.unit.test_budget_replicas import counted
from tests.unit.test_governance_replicas import (
    PASSWORD_ENV,
    REGISTRIES,
    T0,
    Clock,
    ctx,
    replica,
    sample,
    tenant_of,
)
from tests.unit.test_governance_replicas import _password as _password

IDLE_AFTER_S = IDLE_AFTER_SWEEPS * 1.0  # the governors' sweep interval is 1 s


def borrow_config(
    url: str | None,
    *,
    frac: float = 0.5,
    lender_tpm: int = 600,
    q_tpm: int | None = None,
    x_rpm: int | None = None,
    **store: object,
) -> Config:
    """x borrows (60 tokens a minute, `frac` of it a minute borrowed at most; with `x_rpm`, a
    requests-per-minute budget); l lends; q never borrows (with `q_tpm`, a budget of its own:
    a lender too). `url` None: one router (no store)."""
    shared: dict[str, Any] = {}
    if url is not None:
        shared["store"] = {"url": url, "password_env": PASSWORD_ENV, **store}
    return config_for_test(
        pools=one_pool(queue={"max_wait_s": 0}),  # a refusal is at once (no refill wait)
        tenants=[
            {
                "name": "x",
                "api_key_sha256": "0" * 64,
                "tokens_per_minute": 60,
                "requests_per_minute": x_rpm,
                "borrow_max_frac": frac,
            },
            {"name": "l", "api_key_sha256": "1" * 64, "tokens_per_minute": lender_tpm},
            {"name": "q", "api_key_sha256": "2" * 64, "tokens_per_minute": q_tpm},
        ],
        **shared,
    )


@asynccontextmanager
async def replicas(
    server: PostgresServer, database: str, wall: Clock, **config: Any
) -> AsyncIterator[tuple[Governor, Governor]]:
    """Two governors, a and b, on a fresh database of `server` (`config`: `borrow_config`'s)."""
    url = server.create_database(database)
    config_ = borrow_config(url, **config)
    async with replica(config_, url, wall, "a") as a, replica(config_, url, wall, "b") as b:
        yield a, b


async def enter(gov: Governor, tenant: str, tokens: int) -> RequestOutcome:
    c = ctx(tenant)
    estimate = Estimate(prompt_tokens=tokens, output_tokens=0, source="heuristic")
    await gov.enter(c, estimate, tenant_of(gov, tenant))
    return RequestOutcome(ctx=c, estimate=estimate)


async def finish(gov: Governor, outcome: RequestOutcome, used: int | None = None) -> None:
    """`used`: its tokens (default: as estimated, nothing given back)."""
    outcome.dispatched_at_s = outcome.ended_at_s = 1000.0
    outcome.status = 200
    assert outcome.estimate is not None
    outcome.prompt_tokens = outcome.estimate.prompt_tokens if used is None else used
    outcome.completion_tokens = 0
    gov.finished(outcome)


async def refused(gov: Governor, tenant: str, tokens: int) -> str:
    with pytest.raises(RateLimited) as err:
        await enter(gov, tenant, tokens)
    return err.value.code


def borrowed(gov: Governor, tenant: str = "x") -> float:
    return sample(gov, "gpupool_tenant_tokens_borrowed_total", tenant=tenant)


def lent(gov: Governor, tenant: str = "l") -> float:
    return sample(gov, "gpupool_tenant_tokens_lent_total", tenant=tenant)


async def level(gov: Governor, tenant: str, bucket: str = "tokens") -> float | None:
    assert gov._replica is not None
    return await asyncio.to_thread(gov._replica.db.level, tenant, bucket)


# ------------------------------------------------------------------------------ pure parts


def test_split_takes_the_lease_then_the_own_bucket_and_borrows_the_rest() -> None:
    assert split(30, lease=5, own_level=10, allowance_level=60, allowance_capacity=60) == Split(
        5, 10, 15
    )
    # a debt is paid off by the loan, as one router's loan pays its bucket's: a negative
    # lease or level is a negative part, the loan the need plus the debt
    assert split(30, lease=-5, own_level=-10, allowance_level=60, allowance_capacity=60) == (
        Split(-5, -10, 45)
    )
    assert split(30, lease=5, own_level=-10, allowance_level=60, allowance_capacity=60) == (
        Split(5, -10, 35)
    )
    # the debt counts toward the allowance: 45 short of an allowance holding 40, no loan
    assert split(30, lease=-5, own_level=-10, allowance_level=40, allowance_capacity=60) is None
    assert split(30, lease=0, own_level=30, allowance_level=60, allowance_capacity=60) is None
    assert split(30, lease=20, own_level=40, allowance_level=60, allowance_capacity=60) is None
    # the allowance holds the shortfall now, and it is not above its capacity
    assert split(30, lease=0, own_level=0, allowance_level=29, allowance_capacity=60) is None
    assert split(30, lease=0, own_level=0, allowance_level=30, allowance_capacity=30) == Split(
        0, 0, 30
    )


def test_idle_means_no_mark_within_the_bound() -> None:
    assert idle(None, T0, 3.0)  # never marked
    assert idle(T0 - 3.5, T0, 3.0)
    assert not idle(T0 - 3.0, T0, 3.0)  # exactly the bound: still busy
    assert not idle(T0 + 1.0, T0, 3.0)  # a replica whose clock is ahead


# ------------------------------------------------------------------------------ the statement


LENDERS = [("big", 1000.0, 1000 / 60), ("small", 100, 100 / 60), ("tie", 1000.0, 1000 / 60)]


def test_the_borrow_statement_follows_the_rules_on_both_backends(any_store: Store) -> None:
    """SQLite (the rules in Python) and PostgreSQL (`gpupool_borrow`) answer alike."""
    migrate(any_store, MIGRATIONS)
    db = SharedBudgets(any_store)

    def borrow(
        need: float, lease: float = 0.0, now_s: float = T0
    ) -> tuple[str, float, float] | None:
        terms = Terms(60, 1.0, 700, 700 / 60, (("x", 60.0, 1.0), *LENDERS), idle_after_s=3.0)
        loan = db.borrow("x", need, lease, now_s, terms)
        return None if loan is None else (loan.lender, loan.short, loan.own)

    db.reserve("x", "tokens", 50, T0, capacity=60, rate_per_s=1.0)  # x holds 10 of its 60
    # 10 own + 5 of the lease, 15 short; "big" and "tie" lend 500 each: the first name
    assert borrow(30, lease=5) == ("big", 15, 10)
    assert db.level("x", "tokens") == 0 and db.level("big", "tokens") == 985
    assert db.level("x", "allowance") == 700 - 15
    assert db.active_at("x") == T0  # the borrower has demand: it is no lender
    assert borrow(486) == ("tie", 486, 0)  # "big" has 485 above its reserve now
    assert db.level("tie", "tokens") == 514
    assert borrow(486) is None  # nobody lends that much: nothing taken
    assert db.level("x", "allowance") == 700 - 15 - 486
    # a lender marked active within the bound does not lend
    db.settle_many([], active=["big"], now_s=T0)
    assert borrow(20) == ("small", 20, 0)  # 50 above its reserve; "tie" 14
    # after the bound "big" lends again (x's own bucket refilled 3.5 tokens meanwhile)
    assert borrow(20, now_s=T0 + 3.5) == ("big", 16.5, 3.5)
    # the allowance (700 - 537.5 taken, refilled 3.5 s at 700/60: 203.3) bounds a loan
    assert borrow(210, now_s=T0 + 3.5) is None
    assert borrow(200, now_s=T0 + 3.5) == ("big", 200, 0)


def test_the_borrow_statement_pays_a_debt_off_on_both_backends(any_store: Store) -> None:
    """A borrower in debt (its own shared bucket, its replica's lease) borrows the need plus
    the debt and its bucket ends at 0, as one router's loan leaves its bucket (s48: before,
    both backends borrowed the need alone and left the debt)."""
    migrate(any_store, MIGRATIONS)
    db = SharedBudgets(any_store)
    terms = Terms(60, 1.0, 700, 700 / 60, tuple(LENDERS), idle_after_s=3.0)
    db.reserve("x", "tokens", 60, T0, capacity=60, rate_per_s=1.0)
    db.settle_many([("x", "tokens", -20.0)])  # a sweep charged 20 more than it held
    assert db.level("x", "tokens") == -20
    loan = db.borrow("x", 30, 0.0, T0, terms)
    assert loan is not None and (loan.lender, loan.short, loan.own, loan.from_lease) == (
        "big",
        50,
        -20,
        0,
    )
    assert db.level("x", "tokens") == 0 and db.level("big", "tokens") == 950
    assert db.level("x", "allowance") == 700 - 50
    # the lease's debt (what this replica settled above its take since its last sweep) too
    loan = db.borrow("x", 30, -5.0, T0, terms)
    assert loan is not None and (loan.short, loan.own, loan.from_lease) == (35, 0, -5)
    assert db.level("tie", "tokens") == 1000 - 35  # big holds 450 above its reserve now
    # a never-used lender's row is made when it lends, not before
    assert db.level("small", "tokens") is None


# ------------------------------------------------------------------------------ two replicas


async def test_an_exhausted_tenant_borrows_from_an_idle_one_on_either_replica(
    postgres_server: PostgresServer,
) -> None:
    wall = Clock(T0)  # x may borrow 60 a minute
    async with replicas(postgres_server, "borrow_idle", wall, frac=1.0) as (a, b):
        for _ in range(2):  # x's own 60 tokens, on a
            await finish(a, await enter(a, "x", 30))
        await a.sync_replicas()
        assert await level(a, "x") == 0
        outcome = await enter(b, "x", 30)  # short by 30 on b: borrowed from l (never used)
        assert borrowed(b) == 30 and lent(b) == 30
        assert borrowed(a) == 0 and lent(a) == 0  # counted on the replica that did it
        assert await level(a, "l") == 600 - 30
        assert await level(a, "x", "allowance") == 60 - 30
        await finish(b, outcome)  # the give-back of a settle goes to x's own budget
        wall.now_s = T0 + 10  # x's own bucket refills 10 tokens
        await enter(a, "x", 30)  # on a too (its own local bucket is spent: the shared decide)
        assert borrowed(a) == 20 and lent(a) == 20
        assert await level(a, "l") == 600 - 20  # refilled 10 s at 10/s: full, then the loan


async def test_a_tenant_busy_on_the_other_replica_does_not_lend(
    postgres_server: PostgresServer,
) -> None:
    wall = Clock(T0)
    async with replicas(postgres_server, "borrow_busy", wall, frac=1.0) as (a, b):
        for _ in range(2):
            await enter(a, "x", 30)
        in_flight = await enter(b, "l", 10)  # l works on b (its top-up marked it)
        assert await refused(a, "x", 30) == "token_rate"
        assert borrowed(a) == 0 and await level(a, "l") == 600 - 30  # b's chunk (5 %: 30)
        # past the bound, still in flight on b: b's sweep marks it again
        wall.now_s = T0 + IDLE_AFTER_S + 2
        await b.sync_replicas()
        assert await refused(a, "x", 30) == "token_rate"
        assert borrowed(a) == 0
        # it ends on b; once no replica marked it for the bound, it lends
        await finish(b, in_flight)
        await b.sync_replicas()
        wall.now_s = T0 + 2 * IDLE_AFTER_S + 3
        await a.sync_replicas()
        await b.sync_replicas()
        await enter(a, "x", 30)
        assert borrowed(a) > 0 and lent(a) == borrowed(a)


async def test_the_allowance_is_shared_by_the_replicas(postgres_server: PostgresServer) -> None:
    """Two replicas racing borrow no more than one allowance together."""
    wall = Clock(T0)  # x may borrow 30 a minute
    async with replicas(postgres_server, "borrow_allowance", wall, frac=0.5) as (a, b):
        for _ in range(2):
            await enter(a, "x", 30)

        async def attempt(gov: Governor) -> bool:
            try:
                await enter(gov, "x", 10)
            except RateLimited:
                return False
            return True

        results = await asyncio.gather(*(attempt(g) for g in (a, b) for _ in range(4)))
        assert sum(results) == 3  # 30 borrowed in loans of 10, of 8 attempts
        assert borrowed(a) + borrowed(b) == 30
        assert lent(a) + lent(b) == 30
        assert await level(a, "x", "allowance") == 0
        assert await level(a, "l") == 600 - 30


async def test_the_lender_keeps_its_reserve(postgres_server: PostgresServer) -> None:
    wall = Clock(T0)  # l: 100, keeps 50
    async with replicas(postgres_server, "borrow_reserve", wall, frac=1.0, lender_tpm=100) as (
        a,
        b,
    ):
        for _ in range(2):
            await enter(a, "x", 30)
        assert await refused(b, "x", 51) == "token_rate"  # l lends 50 at most
        await enter(b, "x", 50)
        assert await level(a, "l") == 50
        assert await refused(a, "x", 1) == "token_rate"  # l is at its reserve
        assert borrowed(a) + borrowed(b) == 50


async def test_a_borrowed_request_refused_afterwards_gives_the_loan_back_to_the_lender(
    postgres_server: PostgresServer,
) -> None:
    """x borrows on a, then its requests-per-minute bucket (spent on b) refuses it: the loan
    goes back to l's shared bucket and x's allowance with a's next sweep (its give-back
    statement), the rest to x's own; no loan is counted (s48: before, all of it went to x's
    own budget, l stayed 30 short and x's allowance spent)."""
    wall = Clock(T0)
    async with replicas(postgres_server, "borrow_refused", wall, frac=1.0, x_rpm=1) as (a, b):
        await enter(b, "x", 60)  # x's own 60 tokens and its one request a minute, on b
        assert await refused(a, "x", 30) == "request_rate"  # after the loan
        assert await level(a, "l") == 600 - 30  # lent, until a's sweep
        await a.sync_replicas()
        assert await level(a, "l") == 600
        assert await level(a, "x", "allowance") == 60
        assert await level(a, "x") == 0  # none of the loan in x's own budget
        assert borrowed(a) == 0 and lent(a) == 0


async def test_one_routers_refused_loan_goes_back_to_the_lender() -> None:
    """The reference, one router (no store): x waits for its bucket, borrows from l once l's
    request ends, and is refused by its hourly cost cap (crossed by its request that ended
    meanwhile): l's bucket and x's allowance get the loan back, x's own bucket its part
    (s48: before, x's own bucket got all of it)."""
    config = config_for_test(
        pools=one_pool(queue={"max_wait_s": 60}),
        tenants=[
            {
                "name": "x",
                "api_key_sha256": "0" * 64,
                "tokens_per_minute": 60,
                "borrow_max_frac": 1.0,
                "cost_cap_gpu_seconds_per_hour": 1.0,
            },
            {"name": "l", "api_key_sha256": "1" * 64, "tokens_per_minute": 600},
        ],
    )
    registry = CollectorRegistry()
    gov = Governor(config, GovernanceMetrics(registry), clock=Clock(1000.0))
    REGISTRIES[id(gov)] = registry
    first = await enter(gov, "x", 50)  # x holds 10 of its 60
    busy = await enter(gov, "l", 10)  # l is not idle: no loan yet
    waiting = asyncio.create_task(enter(gov, "x", 30))
    for _ in range(100):
        await asyncio.sleep(0)
        if gov._tenants["x"].lock.locked():
            break
    assert gov._tenants["x"].lock.locked() and not waiting.done()  # waits for its bucket
    await finish(gov, busy)  # l idle: it may lend
    first.gpu_seconds = 2.0  # over x's cap of 1 GPU-second an hour
    await finish(gov, first)  # wakes x's waiter: 20 borrowed, then the cap refuses it
    with pytest.raises(RateLimited) as err:
        await waiting
    assert err.value.code == "cost_cap"
    x, lender = gov._tenants["x"], gov._tenants["l"]
    assert x.tokens is not None and x.allowance is not None and lender.tokens is not None
    assert lender.tokens.level(1000.0) == 600 - 10
    assert x.allowance.level(1000.0) == 60
    assert x.tokens.level(1000.0) == 10
    assert borrowed(gov) == 0 and lent(gov) == 0


async def debt_then_borrow(gov: Governor) -> None:
    """x spends its 60 and settles 20 more (a debt), then asks for 30: one router's loan
    pays the debt off (50 borrowed, x's bucket at 0)."""
    await finish(gov, await enter(gov, "x", 60), used=80)
    if gov._replica is not None:
        await gov.sync_replicas()  # the lease's debt charged to x's shared bucket
    await enter(gov, "x", 30)


async def test_a_loan_pays_a_debt_off_on_replicas_as_on_one_router(
    postgres_server: PostgresServer,
) -> None:
    """One router (the reference) and replicas borrow alike for a borrower in debt: the need
    plus the debt, its budget at 0 after (s48: before, the replicas borrowed 30 and left x's
    shared bucket at -20)."""
    registry = CollectorRegistry()
    one = Governor(
        borrow_config(None, frac=1.0),
        GovernanceMetrics(registry),
        clock=Clock(1000.0),
    )
    REGISTRIES[id(one)] = registry
    await debt_then_borrow(one)
    x, lender = one._tenants["x"], one._tenants["l"]
    assert x.tokens is not None and lender.tokens is not None
    assert (borrowed(one), lender.tokens.level(1000.0), x.tokens.level(1000.0)) == (50, 550, 0)
    wall = Clock(T0)
    async with replicas(postgres_server, "borrow_debt", wall, frac=1.0) as (a, _):
        await debt_then_borrow(a)
        await a.sync_replicas()
        assert (borrowed(a), await level(a, "l"), await level(a, "x")) == (50, 550, 0)
        assert await level(a, "x", "allowance") == 60 - 50


@pytest.fixture
def own_server() -> Iterator[PostgresServer]:
    with start_postgres() as server:
        yield server


async def test_no_borrowing_while_the_store_is_down(own_server: PostgresServer) -> None:
    """open: the replica's own buckets decide (refused when spent, no loan); closed: 503 as
    for any budget; both borrow again once the store answers."""
    url = own_server.create_database("borrow_outage")
    wall = Clock(T0)
    opened = borrow_config(url, frac=1.0, budgets_on_outage="open")
    closed = borrow_config(url, frac=1.0, budgets_on_outage="closed")
    async with replica(opened, url, wall, "o") as o, replica(closed, url, wall, "c") as c:
        for _ in range(2):
            await enter(o, "x", 30)
        own_server.stop()
        # the request that finds the store down (its top-up fails) is no loan either: its
        # own bucket, spent, decides, and nothing is left in debt for it
        assert await refused(o, "x", 30) == "token_rate"
        assert sample(o, "gpupool_governance_store_up") == 0
        assert o._replica is not None and o._replica.leases.get(("x", "tokens"), 0.0) == 0.0
        await o.sync_replicas()  # the sweep finds the store down too
        assert await refused(o, "x", 30) == "token_rate"  # its own bucket is spent: no loan
        # refused on its own bucket, not admitted on debt: no outage decision counted
        outage = "gpupool_governance_outage_requests_total"
        assert sample(o, outage, tenant="x", policy="open") == 0
        with pytest.raises(StoreUnavailable):
            await enter(c, "x", 30)
        assert borrowed(o) == borrowed(c) == 0
        assert lent(o) == lent(c) == 0
        own_server.start()
        await o.sync_replicas()
        await c.sync_replicas()
        await enter(c, "x", 30)  # the store answers: borrowed again
        assert borrowed(c) == 30


# ------------------------------------------------------------------------------ cost, config


async def test_a_request_that_does_not_borrow_sends_nothing_new(
    postgres_server: PostgresServer,
) -> None:
    """With a borrower configured, requests that fit their own budgets (the borrower's
    included) cost one store call per lease top-up, as before; a borrow is one statement
    (after the top-up that found the budget short)."""
    url = postgres_server.create_database("borrow_statements")
    config = borrow_config(url, frac=1.0, q_tpm=6000)
    wall = Clock(T0)
    async with replica(config, url, wall, "a") as a:
        assert a._replica is not None and a._replica._loop is not None
        loop_before = a._replica._loop.statements
        for tenant, tokens, requests in (("q", 30, 12), ("x", 3, 12)):
            topups = a.metrics.shared_reservations.labels(tenant, "tokens")
            before = topups._value.get()
            with counted(a) as count:
                for _ in range(requests):
                    await finish(a, await enter(a, tenant, tokens))
            assert count[0] == topups._value.get() - before > 0
        await enter(a, "x", 24)  # the rest of its own 60: no loan
        assert borrowed(a) == 0
        with counted(a) as count:
            await enter(a, "x", 30)  # short: a top-up refused, then the borrow
        assert borrowed(a) == 30
        assert count[0] == 2
        assert a._replica._loop.statements == loop_before  # nothing on the loop's connection


def test_the_config_check_accepts_borrowing_with_a_shared_store() -> None:
    config = borrow_config("postgresql://u@db:5432/g")
    assert not [p for p in contract_problems(config) if "borrow_max_frac" in p]
