"""`queue.order: run_las` across router replicas (router/admission/shared_attained.py): each
replica publishes its share of each run's attained GPU-seconds on the admission exchange and
orders its queue by the run's service on every replica. On both store backends (embedded
SQLite, a real PostgreSQL), two or three replicas, each with its own accountant, run table,
admitter and exchange, over one store, in simulated time (one fake clock; `tick()` called by
hand, so nothing depends on sleep timing)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from pools.config import Config
from pools.fleet import Lease
from pools.launchers.base import InstanceSpec
from pools.testing.config import REMOVE, config_for_test, one_pool
from pools.testing.gateway import another_router, gateway_over_fakes
from router.accounting.accountant import Accountant, SequenceToken
from router.admission.decision import Need
from router.admission.picking import RunAffinity
from router.admission.shared_attained import KEEP_S, SharedAttained
from router.admission.shared_reservations import SharedReservations
from router.core import Core, build_core
from router.errors import CapacityExceeded
from router.gateway.app import Gateway
from router.governance.store import MIGRATIONS
from router.request import RequestContext
from router.runtable import RunTable
from router.store import SqliteStore, Store, migrate
from tests.postgres import PASSWORD, PostgresServer
from tests.unit.test_rebalance_borrow import ctx
from tests.unit.test_shared_reservations import Clock

SPEC = InstanceSpec("engine-0", "http://127.0.0.1:9", 1)
NEED = Need(prompt_tokens=8, total_tokens=16, deadline_s=1e9)
DECAY_S = 60.0  # run_las_idle_decay_s
PASSWORD_ENV = "GPUPOOL_TEST_STORE_PASSWORD"

_ids = itertools.count()


@dataclass(eq=False)
class _Waiter:
    ctx: RequestContext
    need: Need = NEED
    exclude: frozenset[str] = frozenset()

    def gone(self) -> bool:
        return False

    def admitted(self, lease: Lease) -> None:
        raise AssertionError("only queued here, never dispatched")

    def refused(self, err: CapacityExceeded) -> None:
        raise AssertionError(err)


def _config(tmp_path: Path, order: str = "run_las") -> Config:
    queue: dict[str, object] = {"order": order}  # a pool's `queue` settings, as YAML gives them
    if order == "run_las":
        queue |= {"run_las_idle_decay_s": DECAY_S, "run_las_max_slowdown": None}
    return config_for_test(
        tmp_path,
        urls=[SPEC.url],
        pools=one_pool(queue=queue),
        rebalancer={"decision_log_path": str(tmp_path / f"d{next(_ids)}.sqlite")},
    )


class Replica:
    """One router's run table, accountant, admitter and exchange."""

    def __init__(
        self, tmp_path: Path, store: Store, name: str, clock: Clock, max_rows_per_tick: int = 1000
    ) -> None:
        self.clock = clock
        self.runs = RunTable()
        self.accountant = Accountant(runs=self.runs)
        self.accountant.add_instance(SPEC.instance_id, 1.0, {"normal": 1.0}, 0.0)
        self.core: Core = build_core(
            _config(tmp_path),
            [SPEC],
            clock,
            random.Random(0),
            affinity=RunAffinity(runs=self.runs),
            run_usage=self.accountant.run_usage,
            wall_clock=clock,
        )
        assert self.core.admitter.attained_runs is self.runs
        self.attained = SharedAttained(
            self.runs, store.dialect, max_rows_per_tick=max_rows_per_tick
        )
        self.shared = SharedReservations(
            store, self.core.fleet, name, clock=clock, attained=self.attained
        )
        self.core.admitter.peers = self.shared

    def serve(self, run: str, start_s: float, end_s: float | None) -> SequenceToken:
        """A step of `run` alone on the engine (1 GPU) from `start_s`: its GPU-seconds are
        its duration; `end_s` None: still in flight."""
        token = self.accountant.begin(SPEC.instance_id, start_s, ("t", run))
        if end_s is not None:
            self.accountant.end(token, end_s)
        return token

    def attained_gpu_s(self, run: str) -> float:
        """What run_las orders a step of `run` queued now by."""
        entry = self.core.admitter.enqueue(_Waiter(_ctx(run)), self.clock())
        self.core.admitter.withdraw(entry)
        return entry.attained_gpu_s

    def order(self, *runs: str) -> list[str]:
        """The runs in the order their steps, queued now in this order, would go."""
        admitter, now = self.core.admitter, self.clock()
        entries = [admitter.enqueue(_Waiter(_ctx(run)), now) for run in runs]
        queue = admitter.queues["normal"]
        went = []
        while (entry := queue.peek(now)) is not None:
            queue.pop(entry, now)
            went.append(entry.payload.ctx.run_id)
        for entry in entries:
            admitter.withdraw(entry)
        return went


def _two(
    tmp_path: Path, store: Store, b_rows_per_tick: int = 1000
) -> tuple[Clock, Replica, Replica]:
    """Replicas a and b on one clock (b publishing at most `b_rows_per_tick` a tick)."""
    clock = Clock()
    return (
        clock,
        Replica(tmp_path, store, "a", clock),
        Replica(tmp_path, store, "b", clock, b_rows_per_tick),
    )


async def _exchange(*replicas: Replica) -> None:
    """One exchange of each, in this order."""
    for replica in replicas:
        await replica.shared.tick()


def _ctx(run: str) -> RequestContext:
    return _ctx_of("t", run)


def _ctx_of(tenant: str, run: str) -> RequestContext:
    return dataclasses.replace(ctx("normal", next(_ids)), tenant=tenant, run_id=run)


@pytest.fixture
def store(any_store: Store) -> Store:
    migrate(any_store, MIGRATIONS)  # governance's (admission_reservations); the exchange
    return any_store  # applies admission's own migration at its first tick


async def test_a_run_served_on_two_replicas_is_ordered_by_its_total_on_both(
    tmp_path: Path, store: Store
) -> None:
    clock, a, b = _two(tmp_path, store)
    a.serve("x", 0.0, 30.0)  # 30 GPU-s on a
    b.serve("x", 0.0, 30.0)  # and 30 on b: 60 in all
    b.serve("y", 30.0, 70.0)  # 40 on b alone
    clock.now = 71.0
    # each replica alone: b puts x (30 here) before y (40 here)
    assert b.order("x", "y") == ["x", "y"]
    assert (a.attained_gpu_s("x"), a.attained_gpu_s("y")) == (30.0, 0.0)
    await _exchange(a, b, a)  # one publication each, and a reads b's
    assert a.attained_gpu_s("x") == pytest.approx(60.0)
    assert b.attained_gpu_s("x") == pytest.approx(60.0)
    assert a.attained_gpu_s("y") == b.attained_gpu_s("y") == pytest.approx(40.0)
    assert a.order("x", "y") == ["y", "x"]
    assert b.order("x", "y") == ["y", "x"]
    # a replica's own rows are never read back as another's
    assert a.attained.peer_runs() == 2 and b.attained.peer_runs() == 1
    # nothing changed: nothing is written again
    assert a.attained.changes(clock.now)[1] == []


async def test_idle_forgiveness_goes_by_the_runs_idle_time_on_every_replica(
    tmp_path: Path, store: Store
) -> None:
    clock, a, b = _two(tmp_path, store)
    a.serve("x", 0.0, 30.0)  # on a until t=30
    b.serve("x", 170.0, 200.0)  # then on b until t=200
    clock.now = 201.0
    await _exchange(a, b, a)
    clock.now = 220.0  # idle 190 s on a, 20 s in all: nothing forgiven
    assert a.attained_gpu_s("x") == pytest.approx(60.0, abs=0.01)
    assert b.attained_gpu_s("x") == pytest.approx(60.0, abs=0.01)
    clock.now = 320.0  # idle 120 s in all: one halving past the first 60 s, on both
    assert a.attained_gpu_s("x") == pytest.approx(30.0, abs=0.01)
    assert b.attained_gpu_s("x") == pytest.approx(30.0, abs=0.01)
    # a step in flight on b: the run is not idle anywhere, its forgiveness stays as it was
    b.serve("x", 330.0, None)
    clock.now = 331.0
    await _exchange(b, a)
    clock.now = 500.0
    assert a.attained_gpu_s("x") == pytest.approx(30.0, abs=0.01)


async def test_past_the_cap_the_rest_wait_for_the_next_ticks(tmp_path: Path, store: Store) -> None:
    clock, a, b = _two(tmp_path, store, b_rows_per_tick=2)
    for i in range(5):
        b.serve(f"r{i}", float(i), float(i) + 1.0)
    clock.now = 10.0
    seen = []
    for _ in range(3):
        await _exchange(b, a)
        seen.append(a.attained.peer_runs())
    assert seen == [2, 4, 5]
    assert [a.attained_gpu_s(f"r{i}") for i in range(5)] == pytest.approx([1.0] * 5)
    assert b.attained.changes(clock.now)[1] == []


async def test_a_tick_compares_the_runs_touched_since_the_last_at_most_the_scan_cap(
    tmp_path: Path, store: Store
) -> None:
    clock, _, b = _two(tmp_path, store)
    b.attained.max_scan_runs = 3
    await _exchange(b)
    assert b.attained.changes(clock.now)[1] == []  # nothing touched: nothing compared
    for i in range(4):  # four runs touched (each step's begin) in one interval
        b.serve(f"r{i}", 0.0, 1.0)
    clock.now = 2.0
    shares = b.attained.changes(clock.now)[1]  # the 3 most recently touched compared
    assert sorted(run for _, run, *_ in shares) == ["r1", "r2", "r3"]  # r0 missed
    b.attained.published(shares)
    b.runs.touch(("t", "r0"))  # r0's next touch (its next step, or its end's settlement)
    assert [run for _, run, *_ in b.attained.changes(clock.now)[1]] == ["r0"]


async def test_a_dead_replicas_share_counts_and_its_step_in_flight_stops(
    tmp_path: Path, store: Store
) -> None:
    clock, a, b = _two(tmp_path, store)
    b.serve("x", 0.0, 30.0)
    b.serve("x", 40.0, None)  # b dies with this step in flight
    clock.now = 41.0
    await _exchange(b, a)
    clock.now = 200.0
    await a.shared.tick()  # b's reservations are still live (its row is < 3 s old in the db)
    assert a.attained_gpu_s("x") == pytest.approx(30.0)  # in flight on b: not idle
    with store.connection() as conn:  # b last wrote 10 s ago by the database's clock
        conn.execute(
            "UPDATE admission_reservations SET updated_at_s = updated_at_s - 10 WHERE replica = ?",
            ("b",),
        )
    clock.now = 210.0
    await a.shared.tick()  # b is gone, last seen at t=200
    assert a.shared.view()["peers_counted"] == 0
    assert a.attained_gpu_s("x") == pytest.approx(30.0)  # its service still counts
    clock.now = 200.0 + 2 * DECAY_S  # idle since b was last seen: one halving
    assert a.attained_gpu_s("x") == pytest.approx(15.0, abs=0.01)
    # a replica that starts after b died finds b's rows too
    c = Replica(tmp_path, store, "c", clock)
    await c.shared.tick()
    assert c.attained.peer_runs() == 1
    assert c.attained_gpu_s("x") > 0.0


async def test_rows_past_retention_are_deleted_and_forgotten(tmp_path: Path, store: Store) -> None:
    clock, a, b = _two(tmp_path, store)
    b.serve("x", 0.0, 30.0)
    clock.now = 31.0
    await _exchange(b, a)
    assert a.attained_gpu_s("x") == pytest.approx(30.0)
    with store.connection() as conn:  # written two hours ago by the database's clock
        conn.execute("UPDATE admission_attained SET updated_at_s = updated_at_s - 7200")
    c = Replica(tmp_path, store, "c", clock)
    await c.shared.tick()  # its first exchange deletes the rows past retention, then reads
    with store.connection() as conn:
        assert conn.execute("SELECT COUNT(*) FROM admission_attained").fetchone()[0] == 0
    assert c.attained.peer_runs() == 0 and c.attained_gpu_s("x") == 0.0
    # a forgets what it read once the database's clock is past the retention
    a.attained.forget(time.time() + KEEP_S - 60.0)
    assert a.attained.peer_runs() == 1
    a.attained.forget(time.time() + KEEP_S + 60.0)
    assert a.attained.peer_runs() == 0
    assert a.attained_gpu_s("x") == 0.0


async def test_only_a_shared_store_with_a_run_las_pool_shares_attained_service(
    tmp_path: Path, store: Store
) -> None:
    clock = Clock()
    wfq = build_core(_config(tmp_path, "wfq"), [SPEC], clock, random.Random(0), wall_clock=clock)
    assert wfq.admitter.attained_runs is None  # no run_las pool: nothing to share
    las = Replica(tmp_path, store, "a", clock).core
    shared = SharedReservations.for_store(
        store, las.fleet, "a", lambda: None, attained_runs=las.admitter.attained_runs
    )
    if isinstance(store, SqliteStore):  # the embedded store: one router, nothing built
        assert shared is None
    else:
        assert shared is not None and shared.attained is not None
    plain = SharedReservations.for_store(store, las.fleet, "a", lambda: None)
    assert plain is None or plain.attained is None


def test_the_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_rows_per_tick"):
        SharedAttained(RunTable(), "postgresql", max_rows_per_tick=0)


@pytest.mark.parametrize(("order", "shared"), [("run_las", True), ("wfq", False)])
def test_the_gateway_shares_attained_service_on_a_shared_store_with_a_run_las_pool(
    monkeypatch: pytest.MonkeyPatch, order: str, shared: bool
) -> None:
    monkeypatch.setenv(PASSWORD_ENV, "x")  # nothing connects: the gateway is not started
    config = config_for_test(
        urls=[SPEC.url],
        pools=one_pool(queue={"order": order}),
        store={"url": "postgresql://u@127.0.0.1:1/db", "password_env": PASSWORD_ENV},
    )
    gw = Gateway(config, [SPEC])
    peers = gw.admitter.peers
    assert peers is not None  # the reservations are shared in any case
    assert (peers.attained is not None) is shared
    if peers.attained is not None:
        assert peers.attained.runs is gw.runs  # the accountant's run table


async def test_a_run_that_changes_while_its_row_is_written_is_written_again(
    tmp_path: Path, store: Store
) -> None:
    clock, a, b = _two(tmp_path, store)
    b.serve("x", 0.0, 10.0)
    clock.now = 11.0
    shares = b.attained.changes(clock.now)[1]  # x: 10 GPU-s, being written...
    b.serve("x", 11.0, 15.0)  # ...while its next step begins and ends
    b.attained.published(shares)
    await _exchange(b, a)  # the next tick writes 14
    assert a.attained_gpu_s("x") == pytest.approx(14.0)


async def test_a_failed_admission_migration_skips_the_attained_rows_not_the_reservations(
    tmp_path: Path, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    with store.connection() as conn:  # a newer gpupool's admission tables: refused
        conn.execute(
            "INSERT INTO gpupool_schema (component, version, applied_at_s) VALUES (?, ?, ?)",
            ("admission", 99, 0.0),
        )
    clock, a, b = _two(tmp_path, store)
    b.serve("x", 0.0, 10.0)
    clock.now = 11.0
    for _ in range(2):
        await _exchange(b, a)
    assert a.shared.view()["peers_counted"] == 1  # the reservations are exchanged
    assert a.attained_gpu_s("x") == 0.0  # the attained rows are not
    assert caplog.text.count("admission migration failed") == 2  # once per replica


async def test_two_started_routers_order_a_run_by_its_steps_on_both(
    postgres_server: PostgresServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two routers over fake engines on one PostgreSQL database, each exchanging every 0.1 s
    as `start()` starts it: a run's steps on a and on b, and each orders the run by both."""
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    config = config_for_test(
        tmp_path,
        pools=one_pool(queue={"order": "run_las"}),
        router={"ledger_path": REMOVE},
        store={"url": postgres_server.create_database("run_las_two"), "password_env": PASSWORD_ENV},
    )
    key = ("default", "run-1")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with gateway_over_fakes(config) as a, another_router(a, config) as (b, b_client):
        for client in (a.client, a.client, b_client):
            answer = await client.post(
                "/v1/chat/completions", json=body, headers={"x-gpupool-run-id": "run-1"}
            )
            assert answer.status_code == 200
        routers = (a.gateway, b)

        def own(gw: Gateway) -> float:
            usage = gw.accountant.run_usage(key, gw.clock())
            assert usage is not None and usage.in_flight == 0
            return usage.gpu_seconds

        total = own(a.gateway) + own(b)
        assert own(a.gateway) > 0 and own(b) > 0

        def seen(gw: Gateway) -> float:
            assert gw.admitter.peers is not None and gw.admitter.peers.attained is not None
            usage = gw.admitter.peers.attained.with_peers(key, gw.accountant.run_usage(key, 0))
            return 0.0 if usage is None else usage.gpu_seconds

        async with asyncio.timeout(5):  # two exchanges: 0.2 s, on a loaded machine more
            while any(seen(gw) != pytest.approx(total) for gw in routers):  # noqa: ASYNC110
                await asyncio.sleep(0.02)  # the exchange's ticks have no event to wait on
        for gw in routers:  # what a step of the run queued now is ordered by
            entry = gw.admitter.enqueue(_Waiter(_ctx_of("default", "run-1")), gw.clock())
            gw.admitter.withdraw(entry)
            assert entry.attained_gpu_s == pytest.approx(total)
            assert gw.admitter.peers is not None
            assert gw.admitter.peers.view()["attained_peer_runs"] == 1
