"""A known run's step sent on before the shared store's answer (router/governance/
speculation.py): two governors on one store as two router replicas (the real store classes,
over SQLite and over a real PostgreSQL server), each step entered with `speculate=True` as
the request path enters it, its answer awaited as the request path awaits it before the
response's first byte.

Every expected number comes from the scenario: which replica took which of the run's steps,
in order; the store numbers a run's steps 0, 1, 2, ... as they arrive at any replica."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from pools.config import Config
from pools.testing.config import config_for_test, one_pool
from router.admission.estimate import Estimate
from router.errors import RateLimited, RunStopped
from router.governance import GovernanceMetrics, Governor
from router.governance.governor import StepSignals
from router.governance.speculation import SPECULATE_WITHIN_S, Speculation
from router.governance.store import GovernanceStore
from router.request import RequestOutcome
from router.store import PostgresStore, SqliteStore, Store
from tests.postgres import PASSWORD, PostgresServer
from tests.unit.test_governance_replicas import Clock, ctx

PASSWORD_ENV = "GPUPOOL_TEST_STORE_PASSWORD"
ESTIMATE = Estimate(prompt_tokens=6, output_tokens=4, source="heuristic")
T0 = 1_750_000_000.0


def config() -> Config:
    # store.url only switches the shared half on: the governors get their store objects
    return config_for_test(
        pools=one_pool(queue={"max_wait_s": 0}),
        tenants=[
            {"name": "g", "api_key_sha256": "0" * 64, "run_guards": {"max_steps": 5}},
            # free: 2 requests in flight, 1 run active
            {"name": "s", "api_key_sha256": "1" * 64, "tier": "free"},
        ],
        store={"url": "postgresql://gpupool@localhost/unused", "password_env": PASSWORD_ENV},
    )


@pytest.fixture(autouse=True)
def _password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)


@pytest.fixture(params=["sqlite", "postgresql"])
def two_stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Store, Store]]:
    """Two store objects (two connection pools) on one database, as two replicas have."""
    stores: tuple[Store, Store]
    if request.param == "sqlite":
        path = tmp_path / "shared.sqlite"
        stores = (SqliteStore(path), SqliteStore(path))
    else:
        server: PostgresServer = request.getfixturevalue("postgres_server")
        url = server.create_database(f"speculation_{next(_databases)}")
        stores = (
            PostgresStore(url, password=PASSWORD, connect_timeout_s=0.5),
            PostgresStore(url, password=PASSWORD, connect_timeout_s=0.5),
        )
    for store in stores:
        store.open()
    yield stores
    for store in stores:
        store.close()


class Replica:
    def __init__(self, gov: Governor, registry: CollectorRegistry, clock: Clock) -> None:
        self.gov = gov
        self.registry = registry
        self.clock = clock

    def speculated(self, outcome: str) -> float:
        name = "gpupool_governance_step_speculated_total"
        return self.registry.get_sample_value(name, {"outcome": outcome}) or 0.0


@asynccontextmanager
async def replicas(stores: tuple[Store, Store]) -> AsyncIterator[tuple[Replica, Replica]]:
    made = []
    for i, store in enumerate(stores):
        gstore = GovernanceStore(store)
        await asyncio.to_thread(gstore.open)  # the migrations
        registry, clock = CollectorRegistry(), Clock(1000.0)
        gov = Governor(
            config(),
            GovernanceMetrics(registry),
            clock=clock,
            store=gstore,
            wall_clock=Clock(T0),
            replica_id=f"spec-{i}",
        )
        made.append(Replica(gov, registry, clock))
    try:
        yield made[0], made[1]
    finally:
        for r in made:
            await r.gov.aclose()


_databases = iter(range(10**9))


def signals(gov: Governor, tenant: str, messages: list[object] | None = None) -> StepSignals:
    return StepSignals(
        tenant=next(t for t in gov.config.tenants if t.name == tenant), messages=messages
    )


async def begin(
    r: Replica, run_id: str, tenant: str = "g", *, speculate: bool = True
) -> tuple[RequestOutcome, Speculation | None]:
    """A step entered and dispatched (to engine-0) as the request path does: its outcome,
    and its speculation (None: it waited for the store at `enter`)."""
    c = ctx(tenant, run_id)
    await r.gov.enter(c, ESTIMATE, signals(r.gov, tenant), speculate=speculate)
    outcome = RequestOutcome(ctx=c, estimate=ESTIMATE, instance_id="engine-0")
    outcome.dispatched_at_s = 1000.0
    r.gov.dispatched(outcome)
    return outcome, r.gov.speculation(c.request_id)


async def served(r: Replica, outcome: RequestOutcome) -> None:
    """The step's response went out (status 200): settled."""
    outcome.ended_at_s = 1000.0
    outcome.status = 200
    outcome.prompt_tokens, outcome.completion_tokens = 6, 4
    r.gov.finished(outcome)
    replica = r.gov._replica
    assert replica is not None
    replica.release_parked()  # as when no request takes the slot within HANDOVER_S
    await asyncio.gather(*replica._pending)


async def refused(r: Replica, outcome: RequestOutcome, status: int) -> None:
    """The request path answered the step's refusal (`status`), as it does for one refused
    at `enter`: not dispatched after all."""
    outcome.dispatched_at_s = outcome.step_index = outcome.instance_id = None
    outcome.ended_at_s, outcome.status = 1000.0, status
    outcome.outcome = "rejected" if status == 429 else "client_error"
    r.gov.finished(outcome)
    replica = r.gov._replica
    assert replica is not None
    await asyncio.gather(*replica._pending)


async def step(r: Replica, run_id: str, tenant: str = "g") -> RequestOutcome:
    """A whole step, answered: its outcome (step_index: the number the ledger records)."""
    outcome, spec = await begin(r, run_id, tenant)
    if spec is not None:
        await spec.wait()
        assert spec.error is None
    await served(r, outcome)
    return outcome


# ------------------------------------------------------------------------------ tests


async def test_a_known_runs_step_goes_on_and_is_confirmed(two_stores: tuple[Store, Store]) -> None:
    async with replicas(two_stores) as (a, _):
        first, spec = await begin(a, "run-1")
        assert spec is None  # a run this replica has not seen: the store's answer first
        assert first.step_index == 0
        await served(a, first)
        second, spec = await begin(a, "run-1")
        assert spec is not None  # a took step 0: step 1 goes on before the answer
        assert (spec.resolved, second.step_index) == (False, 1)
        await spec.wait()
        assert (spec.error, spec.step, spec.label) == (None, 1, "confirmed")
        await served(a, second)
        assert second.step_index == 1
        assert (a.speculated("confirmed"), a.speculated("renumbered")) == (1, 0)
        # without speculate (a caller that cannot hold the response), it waits as before
        third, spec = await begin(a, "run-1", speculate=False)
        assert spec is None and third.step_index == 2


async def test_a_step_is_renumbered_when_another_replica_took_steps(
    two_stores: tuple[Store, Store],
) -> None:
    async with replicas(two_stores) as (a, b):
        assert [(await step(a, "run-1")).step_index for _ in range(2)] == [0, 1]
        b_step = await step(b, "run-1")  # b has not seen the run: it waits, gets 2
        assert b_step.step_index == 2
        outcome, spec = await begin(a, "run-1")  # a knows 1: goes on as 2
        assert spec is not None and outcome.step_index == 2
        await spec.wait()
        assert (spec.error, spec.step, spec.label) == (None, 3, "renumbered")
        await served(a, outcome)
        assert outcome.step_index == 3  # the store's, in the ledger's record
        assert (await step(a, "run-1")).step_index == 4  # a knows 3 now: confirmed as 4
        assert (a.speculated("confirmed"), a.speculated("renumbered")) == (1, 1)


async def test_a_run_stopped_on_another_replica_refuses_the_step(
    two_stores: tuple[Store, Store],
) -> None:
    async with replicas(two_stores) as (a, b):
        for r in (a, a, b):  # steps 0 and 1 on a, 2 on b
            await step(r, "run-1")
        # b's loop detection stops the run: the same tool call three times in a row
        call = {
            "role": "assistant",
            "tool_calls": [{"function": {"name": "ls", "arguments": "{}"}}],
        }
        looping = [{"role": "user", "content": "go"}, call, call, call]
        with pytest.raises(RunStopped) as stop:
            await b.gov.enter(ctx("g", "run-1"), ESTIMATE, signals(b.gov, "g", looping))
        assert stop.value.code == "run_loop"
        assert b.gov._replica is not None
        await asyncio.gather(*b.gov._replica._pending)  # the stop written to the store
        outcome, spec = await begin(a, "run-1")  # a's own state: not stopped, 2 of 5 steps
        assert spec is not None
        await spec.wait()
        assert isinstance(spec.error, RunStopped)
        assert spec.error.code == "run_loop"
        assert "another router replica" in spec.error.message
        assert spec.label == "refused" and a.speculated("refused") == 1
        await refused(a, outcome, 403)
        run = a.gov._tenants["g"].runs["run-1"]
        assert (run.steps, run.inflight) == (3, 0)  # the refused step does not count
        with pytest.raises(RunStopped):  # stopped on a now: refused at `enter`
            await begin(a, "run-1")


async def test_max_steps_reached_on_another_replica_refuses_the_step(
    two_stores: tuple[Store, Store],
) -> None:
    async with replicas(two_stores) as (a, b):
        for r in (a, a, b, b, b):  # 5 steps, max_steps 5: a served 2, b 3
            await step(r, "run-1")
        outcome, spec = await begin(a, "run-1")  # a counts 2 of 5: goes on
        assert spec is not None
        await spec.wait()
        assert isinstance(spec.error, RunStopped)
        assert spec.error.code == "run_steps"
        await refused(a, outcome, 403)


async def test_the_last_allowed_step_and_an_idle_run_wait_for_the_store(
    two_stores: tuple[Store, Store],
) -> None:
    async with replicas(two_stores) as (a, _):
        for _ in range(3):
            await step(a, "run-1")
        outcome, spec = await begin(a, "run-1")  # step 3 of 5: its next would be the last
        assert spec is not None
        await spec.wait()
        await served(a, outcome)
        last, spec = await begin(a, "run-1")  # step 4, the last allowed: waited for
        assert spec is None and last.step_index == 4
        await served(a, last)
        await step(a, "run-2")
        a.clock.now_s += SPECULATE_WITHIN_S + 1  # run-2 not seen for longer: waited for
        outcome, spec = await begin(a, "run-2")
        assert spec is None and outcome.step_index == 1


async def test_a_refused_slot_refuses_the_step(two_stores: tuple[Store, Store]) -> None:
    async with replicas(two_stores) as (a, b):
        await step(a, "run-1", tenant="s")
        # b holds the tenant's two request slots (requests in flight, no run)
        for _ in range(2):
            await b.gov.enter(ctx("s", None), ESTIMATE, signals(b.gov, "s"))
        outcome, spec = await begin(a, "run-1", tenant="s")  # a has none in flight: goes on
        assert spec is not None
        await spec.wait()
        assert isinstance(spec.error, RateLimited)
        assert spec.error.code == "tenant_concurrency"
        await refused(a, outcome, 429)
        assert a.speculated("refused") == 1
