"""Budgets and concurrency slots changed atomically in the store (router/governance/shared.py):
the bucket rules on both backends, and two PostgreSQL clients (each with its own connection
pool, as two router replicas would have) racing from several threads: the budget is spent
exactly once, the slots never exceed their limit."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from router.governance.shared import RunUsageRow, SessionStep, SharedBudgets, Stretch
from router.governance.store import MIGRATIONS
from router.store import PostgresStore, Store, applied_versions, migrate
from tests.postgres import PASSWORD, PostgresServer

T0 = 1_750_000_000.0
CLOCK_S = 0.002  # the resolution of SQLite's clock (julianday('now')), and then some


def _budgets(store: Store) -> SharedBudgets:
    migrate(store, MIGRATIONS)
    return SharedBudgets(store)


def test_a_bucket_reserves_refills_and_settles(any_store: Store) -> None:
    b = _budgets(any_store)
    kw = {"capacity": 100.0, "rate_per_s": 10.0}
    assert b.reserve("t", "tokens", 60, T0, **kw)  # a new bucket starts full
    assert not b.reserve("t", "tokens", 60, T0, **kw)  # 40 left
    assert b.reserve("t", "tokens", 40, T0, **kw)
    assert not b.reserve("t", "tokens", 1, T0 - 5, **kw)  # a clock behind refills nothing
    assert b.reserve("t", "tokens", 20, T0 + 2, **kw)  # 2 s: 20 back
    b.settle("t", "tokens", reserved=20, used=5)  # 15 given back
    assert b.level("t", "tokens") == 15.0
    b.settle("t", "tokens", reserved=0, used=30)  # used more than reserved: a debt
    assert b.level("t", "tokens") == -15.0
    b.settle("t", "tokens", reserved=500, used=0)
    assert b.level("t", "tokens") == 100.0  # never above capacity
    assert b.level("t", "other") is None


def test_levels_are_read_refilled_to_now_for_the_tenants_asked(any_store: Store) -> None:
    """`levels` (GET /v1/budget's read, the sweep's): by each row's own rate, capped, one
    tenant's or several's, a bucket never used absent (it is full)."""
    b = _budgets(any_store)
    assert b.reserve_up_to("t", "tokens", 100, 100, T0, capacity=600, rate_per_s=10) == (100, 500)
    b.reserve_up_to("u", "tokens", 10, 10, T0, capacity=60, rate_per_s=1)
    read = b.levels(["t"], T0 + 3)
    assert set(read) == {("t", "tokens")}
    assert (read[("t", "tokens")].level, read[("t", "tokens")].at_s) == (530, T0 + 3)
    assert read[("t", "tokens")].at(T0 + 4) == 540
    later = b.levels(["u", "t", "nobody"], T0 + 60)
    assert later[("t", "tokens")].level == 600 and later[("u", "tokens")].level == 60
    assert b.levels(["t"], T0 - 5)[("t", "tokens")].level == 500  # a clock behind: no refill
    assert b.levels([], T0) == {}


def test_an_oversized_reservation_only_from_a_full_bucket(any_store: Store) -> None:
    b = _budgets(any_store)
    kw = {"capacity": 100.0, "rate_per_s": 1.0}
    assert b.reserve("t", "tokens", 1, T0, **kw)
    assert not b.reserve("t", "tokens", 150, T0, **kw)  # not full
    assert b.reserve("t", "tokens", 150, T0 + 10, **kw)  # full again: allowed, goes below 0
    assert b.level("t", "tokens") == -50.0


def test_slots_limit_expire_release_and_renew(any_store: Store) -> None:
    b = _budgets(any_store)
    assert b.acquire_slot("t", "r1:a", 2, T0, lease_s=10)
    assert b.acquire_slot("t", "r2:b", 2, T0, lease_s=10)
    assert not b.acquire_slot("t", "r1:c", 2, T0, lease_s=10)
    assert b.acquire_slot("t", "r1:a", 2, T0, lease_s=10)  # its own again: still two
    assert b.acquire_slot("other", "r1:c", 2, T0, lease_s=10)  # per tenant
    b.release_slot("t", "r2:b")
    assert b.acquire_slot("t", "r1:c", 2, T0 + 1, lease_s=10)
    assert b.renew_slots("r1:", T0 + 5, lease_s=10) == 3  # r1's slots, both tenants
    # r2 dies holding nothing; r1's leases now end at T0 + 15: at T0 + 16 they have expired
    assert not b.acquire_slot("t", "r3:x", 2, T0 + 14, lease_s=10)
    assert b.acquire_slot("t", "r3:x", 2, T0 + 16, lease_s=10)


def test_holders_of_one_unit_take_one_slot(any_store: Store) -> None:
    """A run's steps on two replicas: a slot held by each, one of the limit counted."""
    b = _budgets(any_store)

    def run_slot(replica: str, run: str) -> bool:
        return b.acquire_slot("t", f"{replica}:run:{run}", 1, T0, lease_s=10, unit=f"run:{run}")

    assert run_slot("r1", "x")
    assert run_slot("r2", "x")  # the same run on another replica: not a second run
    assert not run_slot("r2", "y")
    b.release_slot("t", "r1:run:x")
    assert not run_slot("r1", "y")  # x still holds its slot on r2
    b.release_slot("t", "r2:run:x")
    assert run_slot("r1", "y")


def _race(
    clients: list[SharedBudgets], threads_each: int, attempt: Callable[[SharedBudgets, int], bool]
) -> int:
    """Every thread calls `attempt` until it is refused; returns how many were granted."""
    granted = [0]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def run(client: SharedBudgets, n: int) -> None:
        try:
            i = 0
            while attempt(client, n * 1000 + i):
                i += 1
                with lock:
                    granted[0] += 1
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [
        threading.Thread(target=run, args=(c, k * threads_each + j))
        for k, c in enumerate(clients)
        for j in range(threads_each)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    return granted[0]


def test_two_replicas_racing_never_overspend(postgres_server: PostgresServer) -> None:
    url = postgres_server.create_database("race")
    stores = [PostgresStore(url, password=PASSWORD, max_connections=3) for _ in range(2)]
    for store in stores:
        store.open()
    try:
        clients = [_budgets(store) for store in stores]
        spent = _race(
            clients,
            3,
            lambda c, _: c.reserve("t", "tokens", 1.0, T0, capacity=200.0, rate_per_s=1e-9),
        )
        assert spent == 200  # the whole budget, once
        assert clients[0].level("t", "tokens") == 0.0
        held = _race(clients, 3, lambda c, n: c.acquire_slot("t", f"holder-{n}", 7, T0, lease_s=60))
        assert held == 7
    finally:
        for store in stores:
            store.close()


def test_a_runs_counters_and_stop_are_kept_for_every_replica(any_store: Store) -> None:
    """Usage added by any replica's sweep and a guard's stop come back with the next step's
    number; an end clears them (the id starts afresh), its step numbers go on."""
    b = _budgets(any_store)
    first = b.next_step("t", "run-1", T0)
    assert (first.step, first.tokens, first.gpu_seconds, first.stop_code) == (0, 0, 0.0, None)
    b.add_run_usage(
        [RunUsageRow("t", "run-1", 100, 1.5), RunUsageRow("t", "never-numbered", 5, 0.1)]
    )
    b.add_run_usage([RunUsageRow("t", "run-1", 20, 0.25)])  # another replica's sweep
    second = b.next_step("t", "run-1", T0)
    assert (second.step, second.tokens, second.gpu_seconds) == (1, 120, 1.75)
    b.mark_run("t", "run-1", "run_loop")
    assert b.next_step("t", "run-1", T0).stop_code == "run_loop"
    b.mark_run("t", "run-1", None)  # ended by its client
    again = b.next_step("t", "run-1", T0)
    assert (again.step, again.tokens, again.gpu_seconds, again.stop_code) == (3, 0, 0.0, None)
    assert b.next_step("t", "never-numbered", T0).tokens == 0  # no row was made for it


def test_a_sessions_runs_map_its_tasks_on_both_backends(any_store: Store) -> None:
    """`session_step`'s contract (PostgreSQL: one call of `gpupool_session_step`; SQLite:
    the same steps in one transaction): a task keeps its run, a new task takes the session's
    next number, a step without a task joins the current run, a pinned step is numbered in
    its run, the anchors stay bounded, an ended run's task starts a new run, and what a
    replica numbered during an outage is adopted."""
    b = _budgets(any_store)
    clock = iter(range(1, 1000))  # a step a second: the anchors' order is their last step's

    def step(anchor: str | None, run: int | None = None, floor: int = 0) -> tuple[int, int]:
        at = float(next(clock))
        got = b.session_step("t", SessionStep("S", anchor, run, floor), at, max_anchors=4)
        assert got.run is not None
        return got.run, got.step

    assert [step("x"), step("x"), step("y"), step(None), step("x")] == [
        (1, 0), (1, 1), (2, 0), (2, 1), (1, 2)
    ]  # fmt: skip
    assert step("y", run=1) == (2, 3)  # numbered in run 1, whose step 3 it is: y maps to 2
    assert step("z", floor=7) == (8, 0)  # past the replica's outage numbers
    for task in ("p", "q", "r"):
        step(task)
    assert sorted(b.session_anchors("t", "S")) == ["p", "q", "r", "z"]  # the newest 4
    b.forget_session_run("t", "S", 8)
    assert step("z") == (12, 0)  # its task's next step: a new run (9..11 are p, q, r)
    b.adopt_session_runs([("t", "S", 20, [("w", 20), ("z", 5)])], 100.0)
    assert step("w") == (20, 0)  # adopted (its steps during the outage were numbered alone)
    assert step("z") == (12, 1)  # mapped by the store already: kept
    assert step("v") == (21, 0)


def test_a_runs_active_time_is_counted_on_the_databases_clock(any_store: Store) -> None:
    """The step's upsert and the sweep's update count a run's active time (migration 11):
    a gap within the idle timeout counts, a longer one (a pause) does not unless the
    replica's stretch reaches back over it, an event older than the latest adds nothing,
    and an end clears it. The database's clock is real: each figure is bounded by the real
    time around it (SQLite's to the millisecond: `CLOCK_S`)."""
    b = _budgets(any_store)
    started = time.monotonic()
    assert b.next_step("t", "r", T0, Stretch(0.0, 60)).active_s == 0.0  # its first event
    time.sleep(0.2)
    counted = b.next_step("t", "r", T0, Stretch(0.0, 60)).active_s  # the gap counts
    assert 0.2 - 0.01 <= counted <= time.monotonic() - started + CLOCK_S
    time.sleep(0.2)
    mark = time.monotonic()
    assert b.next_step("t", "r", T0, Stretch(0.0, 0.05)).active_s == counted  # a pause
    time.sleep(0.2)
    bridged = b.next_step("t", "r", T0, Stretch(100.0, 0.05)).active_s  # in flight
    assert counted + 0.2 - 0.01 <= bridged <= counted + time.monotonic() - mark + CLOCK_S
    b.add_run_usage([RunUsageRow("t", "r", 5, 0.5, age_s=1000.0, span_s=5.0, idle_s=60)])
    assert b.active_s("t", "r") == bridged  # an end before the latest event: nothing
    b.mark_run("t", "r", None)  # ended by its client: a fresh run's time
    assert b.active_s("t", "r") == 0.0
    assert b.next_step("t", "r", T0, Stretch(2.5, 60)).active_s == 2.5  # its stretch


def test_rows_numbered_before_the_active_time_migration_start_at_their_next_stretch(
    any_store: Store,
) -> None:
    """`gpupool store migrate` from governance 10 to 11: a run numbered before it keeps its
    number and counters, has no active time yet, and its next event starts it at that
    event's stretch."""
    migrate(any_store, MIGRATIONS[:10])
    with any_store.connection() as conn:
        conn.execute(
            "INSERT INTO run_steps (tenant, run_id, next_step, updated_at_s, tokens)"
            " VALUES ('t', 'old', 4, ?, 70)",
            (T0,),
        )
    b = _budgets(any_store)  # the rest of the migrations: 11
    assert applied_versions(any_store)["governance"] == len(MIGRATIONS) >= 11
    assert b.active_s("t", "old") == 0.0
    got = b.next_step("t", "old", T0, Stretch(3.0, 60))
    assert (got.step, got.tokens, got.active_s) == (4, 70, 3.0)
