"""A run's numbering under a lease (store.run_lease, docs/replicas.md s48): two governors on
one real PostgreSQL database as two router replicas. The replica that numbers a run's step
in the store holds the run and numbers its next steps from memory (no statement per step);
its sweep (`write_leases`, called here where the sweep loop would) writes the run's row once
and renews the lease, hands the run over when another replica asked for it, and reads a stop
written elsewhere.

The governors run on the real monotonic clock (the database's lease expiry is on its own
real clock) with a short sweep interval. Every expected number comes from the scenario:
which replica took which of the run's steps, in order."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry

from pools.config import Config
from pools.testing.config import config_for_test, one_pool
from router.accounting.ledger import MIGRATIONS as LEDGER_MIGRATIONS
from router.admission.estimate import Estimate
from router.errors import RunStopped
from router.governance import GovernanceMetrics, Governor
from router.governance.governor import StepSignals
from router.governance.shared import HELD_ELSEWHERE, HeldRun, SharedBudgets, Stretch
from router.governance.store import MIGRATIONS as GOVERNANCE_MIGRATIONS
from router.governance.store import GovernanceStore
from router.request import RequestContext, RequestOutcome
from router.store import PostgresStore, Store, migrate
from tests.postgres import PASSWORD, PostgresServer
from tests.unit.test_governance_replicas import ctx as replica_ctx

PASSWORD_ENV = "GPUPOOL_TEST_STORE_PASSWORD"
ESTIMATE = Estimate(prompt_tokens=6, output_tokens=4, source="heuristic")
# the lease: 2 sweeps (1 s); a step waiting for another replica's run answers run_held after
# 2.25 sweeps, so every wait here ends a sweep before that (0.2 s was too short on a loaded
# machine, s49)
SWEEP_S = 0.5
MAX_STEPS = 6
_seq = itertools.count()
_databases = itertools.count()


def config(**store: object) -> Config:
    return config_for_test(
        pools=one_pool(queue={"max_wait_s": 0}),
        tenants=[
            {"name": "g", "api_key_sha256": "0" * 64, "run_guards": {"max_steps": MAX_STEPS}},
            # free: 2 requests in flight, 1 run active (a slot statement for every request)
            {"name": "s", "api_key_sha256": "1" * 64, "tier": "free"},
        ],
        store={
            "url": "postgresql://gpupool@localhost/unused",
            "password_env": PASSWORD_ENV,
            **store,
        },
    )


@pytest.fixture(autouse=True)
def _password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)


@pytest.fixture
def two_stores(postgres_server: PostgresServer) -> Iterator[tuple[Store, Store]]:
    """Two store objects (two connection pools) on one database, as two replicas have; the
    ledger's tables there too (the lease is on only where the ledger shares the database)."""
    url = postgres_server.create_database(f"run_lease_{next(_databases)}")
    a, b = (PostgresStore(url, password=PASSWORD, connect_timeout_s=0.5) for _ in range(2))
    with contextlib.closing(a), contextlib.closing(b):
        a.open()
        b.open()
        migrate(a, LEDGER_MIGRATIONS)
        yield a, b


@dataclass
class Replica:
    gov: Governor
    registry: CollectorRegistry
    db: SharedBudgets

    def counted(self, name: str) -> float:
        return self.registry.get_sample_value(f"gpupool_governance_{name}_total") or 0.0


@asynccontextmanager
async def replicas(
    stores: tuple[Store, Store], *, lease: bool = True
) -> AsyncIterator[tuple[Replica, Replica]]:
    made = []
    for i, store in enumerate(stores):
        gstore = GovernanceStore(store)
        await asyncio.to_thread(gstore.open)  # the migrations
        registry = CollectorRegistry()
        gov = Governor(
            config(run_lease=lease),
            GovernanceMetrics(registry),
            store=gstore,
            sweep_interval_s=SWEEP_S,
            replica_id=f"lease-{i}",
        )
        gov.fold_steps = True  # as router/settlement.py sets it with a PostgreSQL ledger
        made.append(Replica(gov, registry, SharedBudgets(store)))
    try:
        yield made[0], made[1]
    finally:
        for r in made:
            await r.gov.aclose()


def ctx(run_id: str, tenant: str = "g") -> RequestContext:
    """A step's context on the real monotonic clock (the replicas' tests' `ctx` is on a
    fake one)."""
    now = time.monotonic()
    c = replica_ctx(tenant, run_id)
    return dataclasses.replace(c, deadline_s=now + 30.0, received_at_s=now)


def signals(gov: Governor, tenant: str = "g") -> StepSignals:
    return StepSignals(tenant=next(t for t in gov.config.tenants if t.name == tenant))


async def step(r: Replica, run_id: str, tenant: str = "g") -> int:
    """A whole step (entered, dispatched, served): the number the ledger records, with its
    record committed there (as the ledger commits it before the response's final bytes)."""
    c = ctx(run_id, tenant)
    await r.gov.enter(c, ESTIMATE, signals(r.gov, tenant))
    outcome = RequestOutcome(ctx=c, estimate=ESTIMATE, instance_id="engine-0")
    outcome.dispatched_at_s = time.monotonic()
    r.gov.dispatched(outcome)
    outcome.ended_at_s = time.monotonic()
    outcome.status = 200
    outcome.prompt_tokens, outcome.completion_tokens = 6, 4
    r.gov.finished(outcome)
    replica = r.gov._replica
    assert replica is not None
    replica.release_parked()  # as when no request takes its slot within HANDOVER_S
    await asyncio.gather(*replica._pending)
    assert outcome.step_index is not None
    await asyncio.to_thread(record, r.db.store, run_id, outcome.step_index)
    return outcome.step_index


def row(store: Store, run_id: str, tenant: str = "g") -> tuple[int, str | None]:
    """The run's row: (next_step, holder)."""
    with store.connection() as conn:
        got = conn.execute(
            "SELECT next_step, holder FROM run_steps WHERE tenant = ? AND run_id = ?",
            (tenant, run_id),
        ).fetchone()
    assert got is not None
    return int(got[0]), got[1]


def slots(store: Store, tenant: str) -> int:
    """The tenant's request slots held now on any replica."""
    with store.connection() as conn:
        got = conn.execute(
            "SELECT COUNT(*) FROM concurrency_slots WHERE tenant = ?", (f"{tenant}/requests",)
        ).fetchone()
    assert got is not None
    return int(got[0])


def home(store: Store, run_id: str) -> tuple[str | None, int | None]:
    """The run's home as stored: (instance, the step it answered)."""
    with store.connection() as conn:
        got = conn.execute(
            "SELECT home, home_step FROM run_steps WHERE tenant = 'g' AND run_id = ?", (run_id,)
        ).fetchone()
    assert got is not None
    return got[0], None if got[1] is None else int(got[1])


def record(store: Store, run_id: str, step_index: int) -> None:
    """The ledger's record of a step (what the holder's ledger commits with its number)."""
    with store.connection() as conn:
        conn.execute(
            "INSERT INTO requests (request_id, run_id, step_index, tenant, class_name, pool,"
            " instance, model, started_at_s, ended_at_s, queue_s, prompt_tokens,"
            " completion_tokens, gpu_seconds, outcome, status_code) VALUES (?, ?, ?, 'g',"
            " 'normal', 'normal', 'engine-0', 'tiny', 0, 0, 0, 6, 4, 0, 'ok', 200)",
            (f"rec-{next(_seq)}", run_id, step_index),
        )


# ------------------------------------------------------------------------------ tests


async def test_a_run_that_stays_is_numbered_from_memory(two_stores: tuple[Store, Store]) -> None:
    async with replicas(two_stores) as (a, _):
        assert [await step(a, "run-1") for _ in range(5)] == [0, 1, 2, 3, 4]
        # only the first step was numbered in the store; the others from a's memory, their
        # homes kept for the sweep (the first's written as without the lease)
        assert row(two_stores[0], "run-1") == (1, "lease-0")
        assert home(two_stores[0], "run-1") == ("engine-0", 0)
        assert a.counted("run_lease_steps") == 4
        await a.gov.write_leases()  # the sweep: the row written once
        assert row(two_stores[0], "run-1") == (5, "lease-0")
        assert home(two_stores[0], "run-1") == ("engine-0", 4)
        assert await step(a, "run-1") == 5


async def test_without_the_lease_every_step_is_numbered_in_the_store(
    two_stores: tuple[Store, Store],
) -> None:
    async with replicas(two_stores, lease=False) as (a, _):
        assert [await step(a, "run-1") for _ in range(3)] == [0, 1, 2]
        assert row(two_stores[0], "run-1") == (3, None)
        assert a.counted("run_lease_steps") == 0


async def test_a_run_moving_waits_for_the_holders_sweep_and_goes_on(
    two_stores: tuple[Store, Store],
) -> None:
    async with replicas(two_stores) as (a, b):
        assert [await step(a, "run-1") for _ in range(3)] == [0, 1, 2]
        moved = asyncio.ensure_future(step(b, "run-1"))
        await asyncio.sleep(SWEEP_S)  # b asks again every quarter sweep: a holds it still
        assert not moved.done()
        await a.gov.write_leases()  # a's sweep: b asked, a writes 3 and lets the run go
        assert await moved == 3
        assert b.counted("run_lease_moves") == 1  # one step waited (asking 4 times a sweep)
        assert row(two_stores[0], "run-1")[1] == "lease-1"
        assert await step(b, "run-1") == 4  # b holds it now: from its memory
        back = asyncio.ensure_future(step(a, "run-1"))
        await asyncio.sleep(SWEEP_S)
        await b.gov.write_leases()
        assert await back == 5
        assert row(two_stores[0], "run-1") == (6, "lease-0")


async def test_max_steps_is_exact_under_the_lease_and_after_a_move(
    two_stores: tuple[Store, Store],
) -> None:
    async with replicas(two_stores) as (a, b):
        assert [await step(a, "run-1") for _ in range(MAX_STEPS)] == list(range(MAX_STEPS))
        with pytest.raises(RunStopped) as stop:
            await step(a, "run-1")
        assert stop.value.code == "run_steps"
        other = asyncio.ensure_future(step(b, "run-1"))
        await asyncio.sleep(SWEEP_S)
        await a.gov.write_leases()  # a's stop ends the run here: written and let go
        with pytest.raises(RunStopped) as stop:
            await other
        assert stop.value.code == "run_steps"  # the row's count: 6 steps taken


async def test_a_killed_holder_frees_the_run_after_the_lease(
    two_stores: tuple[Store, Store],
) -> None:
    async with replicas(two_stores) as (a, b):
        assert [await step(a, "run-1") for _ in range(4)] == [0, 1, 2, 3]  # 1-3 from memory
        assert row(two_stores[0], "run-1") == (1, "lease-0")
        a.gov._leases.clear()  # a dies: no sweep writes the row or lets the run go
        started = time.monotonic()
        # b waits for the lease to run out (2 sweeps), then goes on past a's records
        assert await step(b, "run-1") == 4
        waited_s = time.monotonic() - started
        assert 2 * SWEEP_S * 0.5 < waited_s < 2 * SWEEP_S + 1.0
        assert row(two_stores[0], "run-1") == (5, "lease-1")


async def test_a_stop_from_the_other_replica_reaches_the_holder_at_its_sweep(
    two_stores: tuple[Store, Store],
) -> None:
    async with replicas(two_stores) as (a, b):
        assert [await step(a, "run-1") for _ in range(2)] == [0, 1]
        b.db.mark_run("g", "run-1", "run_loop")  # an operator's stop, written through b
        assert await step(a, "run-1") == 2  # a holds the run: it has not read the stop yet
        await a.gov.write_leases()  # its sweep reads it
        with pytest.raises(RunStopped) as stop:
            await step(a, "run-1")
        assert stop.value.code == "run_loop"
        assert "another router replica" in stop.value.message


def test_the_lease_statements_on_a_real_server(two_stores: tuple[Store, Store]) -> None:
    """The statements' contract: a live lease numbers nothing for another holder; a release
    hands the exact count over; an expired lease is taken past the ledger's records."""
    migrate(two_stores[0], GOVERNANCE_MIGRATIONS)
    a, b = SharedBudgets(two_stores[0]), SharedBudgets(two_stores[1])
    now = time.time()
    assert a.lease_step("g", "r", now, "A", 5.0, Stretch()).step == 0
    assert a.lease_step("g", "r", now, "A", 5.0, Stretch()) == HELD_ELSEWHERE  # its own too
    assert b.lease_step("g", "r", now, "B", 5.0, Stretch()) == HELD_ELSEWHERE
    b.want_held("g", "r")
    assert a.write_held("A", 5.0, [HeldRun("g", "r", 7)]) == [(None, True)]  # renewed, wanted
    assert b.write_held("B", 5.0, [HeldRun("g", "r", 9)]) == [None]  # not b's
    # let go: holder and wanted cleared
    assert a.write_held("A", 5.0, [HeldRun("g", "r", 7, release=True)]) == [(None, False)]
    assert b.lease_step("g", "r", now, "B", 0.05, Stretch()).step == 7
    record(two_stores[0], "r", 8)
    record(two_stores[0], "r", 9)  # b's steps from memory, committed by its ledger
    time.sleep(0.2)  # b's lease runs out (b died)
    assert a.lease_step("g", "r", now, "A", 5.0, Stretch()).step == 10
    assert row(two_stores[0], "r") == (11, "A")


async def test_a_tiers_held_run_takes_only_its_slot_and_gives_it_back_while_it_waits(
    two_stores: tuple[Store, Store],
) -> None:
    async with replicas(two_stores) as (a, b):
        assert [await step(a, "run-s", "s") for _ in range(3)] == [0, 1, 2]
        assert row(two_stores[0], "run-s", "s") == (1, "lease-0")  # slots only after step 0
        moved = asyncio.ensure_future(step(b, "run-s", "s"))
        await asyncio.sleep(SWEEP_S / 4)  # b asked for the run and waits
        waited = time.monotonic() + SWEEP_S / 2  # well before run_held
        # b's request slot given back while it waits
        while await asyncio.to_thread(slots, two_stores[0], "s") != 0:
            assert time.monotonic() < waited, "b kept its request slot while it waited"
            assert not moved.done()
            await asyncio.sleep(0.02)
        assert not moved.done()
        await a.gov.write_leases()
        assert await moved == 3


async def test_a_holder_that_listens_hands_the_run_over_at_once(
    two_stores: tuple[Store, Store],
) -> None:
    async with replicas(two_stores) as (a, b):
        a.gov.listen()  # as `start` does
        await asyncio.sleep(0.1)  # its LISTEN in place
        assert [await step(a, "run-1") for _ in range(3)] == [0, 1, 2]
        started = time.monotonic()
        assert await step(b, "run-1") == 3  # no sweep of a's: its listener handed it over
        assert time.monotonic() - started < SWEEP_S  # before a's sweep would have
        assert a.counted("run_lease_handovers") == 1
        assert b.counted("run_lease_moves") == 1
        assert row(two_stores[0], "run-1")[1] == "lease-1"
        assert await step(b, "run-1") == 4  # held by b now: from its memory
