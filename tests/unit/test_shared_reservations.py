"""Admission across router replicas (router/admission/shared_reservations.py), on both store
backends (embedded SQLite, a real PostgreSQL): the `admission_reservations` table's contract
(publish, read the others', age by the database's clock, forget, withdraw), and two admitters
over one engine sharing one store: together they never reserve more than the engine's blocks
or its batch, where each alone would fill it; a replica that stops refreshing stops counting;
a store that stops answering keeps the last reservations for the lease, then drops them.

The engine reports 1000 blocks of 16 tokens: 999 usable less the 5 % margin, 949.05."""

from __future__ import annotations

import itertools
import logging
import random
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from pools.config import Config, ConfigError
from pools.fleet import Lease
from pools.launchers.base import InstanceSpec
from pools.operating_point import OperatingPoint
from pools.telemetry import InstanceReading
from pools.testing.config import config_for_test, one_pool
from router.admission.decision import Need
from router.admission.shared_reservations import ReservationsTable, SharedReservations, snapshot
from router.core import Core, build_core
from router.governance.store import MIGRATIONS
from router.ops.pools_view import PoolsView
from router.store import Store, migrate
from tests.unit.test_rebalance_borrow import ctx

SPEC = InstanceSpec("engine-0", "http://127.0.0.1:9", 1)
BIG = Need(prompt_tokens=1500, total_tokens=1600, deadline_s=1e9)  # 100 blocks
SMALL = Need(prompt_tokens=8, total_tokens=16, deadline_s=1e9)  # 1 block
USABLE_BLOCKS = 999 * 0.95
MAX_NUM_SEQS = 6  # the batch test's engine

_ids = itertools.count()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _config(tmp_path: Path) -> Config:
    return config_for_test(
        tmp_path,
        urls=[SPEC.url],
        pools=one_pool(),
        rebalancer={"decision_log_path": str(tmp_path / f"d{next(_ids)}.sqlite")},
    )


def _core(tmp_path: Path, clock: Clock, max_num_seqs: int = 64) -> Core:
    core = build_core(_config(tmp_path), [SPEC], clock, random.Random(0), wall_clock=clock)
    state = core.fleet.get(SPEC.instance_id)
    assert state is not None
    state.op = OperatingPoint(max_num_seqs=max_num_seqs)  # the engine's --max-num-seqs
    core.fleet.record_reading(
        SPEC.instance_id, InstanceReading(0.0, 0.0, 0, 0, 1000, 16, 0, 0, 0, 0, 0, 0, 0)
    )
    return core


def _pools_view(tmp_path: Path, core: Core, clock: Clock) -> dict[str, Any]:
    """`GET /admin/pools` of the replica `core` is."""
    c = core
    view = PoolsView(
        _config(tmp_path), c.fleet, c.pool_map, c.admitter, c.rebalancer, c.metrics, clock=clock
    )
    return view.view()


def _replica(store: Store, core: Core, name: str, clock: Clock) -> SharedReservations:
    shared = SharedReservations(store, core.fleet, name, clock=clock)
    core.admitter.peers = shared
    return shared


def _admit(core: Core, need: Need) -> Lease | None:
    return core.admitter.admit_now(ctx("normal", next(_ids)), need, 0.0)


def _reserved(*cores: Core) -> tuple[int, int]:
    """KV blocks and sequences the replicas hold on the engine together."""
    states = [c.fleet.get(SPEC.instance_id) for c in cores]
    return sum(s.reserved_blocks for s in states if s), sum(s.inflight for s in states if s)


@pytest.fixture
def store(any_store: Store) -> Store:
    migrate(any_store, MIGRATIONS)
    return any_store


def test_the_table_publishes_reads_the_others_and_ages_by_the_database(store: Store) -> None:
    table = ReservationsTable(store)
    a = {"engine-0": {"normal": (100, 2, 60)}}
    assert table.exchange("a", a, 3.0) == {}  # nobody else yet; never itself
    b = {"engine-0": {"normal": (7, 1, 7), "agent": (3, 1, 0)}, "engine-1": {"agent": (1, 1, 1)}}
    assert table.exchange("b", b, 3.0) == {"a": a}
    assert table.exchange("a", None, 3.0) == {"b": b}  # None: read only
    a2 = {"engine-1": {"normal": (5, 1, 5)}}
    assert table.exchange("a", a2, 3.0) == {"b": b}
    assert table.exchange("c", None, 3.0) == {"a": a2, "b": b}  # replaced, not added
    with store.connection() as conn:  # b last wrote 10 s ago by the database's clock
        conn.execute(
            "UPDATE admission_reservations SET updated_at_s = updated_at_s - 10 WHERE replica = ?",
            ("b",),
        )
    assert table.exchange("c", None, 3.0) == {"a": a2}
    assert table.exchange("c", None, 30.0) == {"a": a2, "b": b}
    assert table.forget(5.0) == 1  # b's row is gone
    assert table.exchange("c", None, 30.0) == {"a": a2}
    table.withdraw("a")
    assert table.exchange("c", None, 30.0) == {}


async def test_two_admitters_on_one_store_never_overfill_the_engines_blocks(
    tmp_path: Path, store: Store
) -> None:
    clock = Clock()
    cores = [_core(tmp_path, clock), _core(tmp_path, clock)]
    # alone, each fills the engine's blocks: 9 sequences of 100 blocks (900 <= 949.05)
    alone = [lease for lease in iter(lambda: _admit(cores[0], BIG), None)]
    assert len(alone) == 9
    for lease in alone:
        lease.release()
    replicas = [_replica(store, c, name, clock) for c, name in zip(cores, "ab", strict=True)]
    admitted = 0
    for turn in range(20):  # turns alternate; each exchanges before the other admits
        core, shared = cores[turn % 2], replicas[turn % 2]
        await shared.tick()
        if _admit(core, BIG) is not None:
            admitted += 1
        await shared.tick()
        blocks, _ = _reserved(*cores)
        assert blocks <= USABLE_BLOCKS
    assert admitted == 9 and _reserved(*cores) == (900, 9)
    assert all(r.replicas_seen == 1 for r in replicas)


async def test_two_admitters_on_one_store_keep_the_engines_batch(
    tmp_path: Path, store: Store
) -> None:
    clock = Clock()
    cores = [_core(tmp_path, clock, MAX_NUM_SEQS), _core(tmp_path, clock, MAX_NUM_SEQS)]
    replicas = [_replica(store, c, name, clock) for c, name in zip(cores, "ab", strict=True)]
    held = []
    for turn in range(4 * MAX_NUM_SEQS):
        await replicas[turn % 2].tick()
        lease = _admit(cores[turn % 2], SMALL)
        if lease is not None:
            held.append(lease)
        await replicas[turn % 2].tick()
    assert _reserved(*cores)[1] == MAX_NUM_SEQS
    # one of a's sequences ends: once a publishes and b reads, b may take the place
    a_lease = next(le for le in held if le.state is cores[0].fleet.get(SPEC.instance_id))
    a_lease.release()
    assert _admit(cores[1], SMALL) is None  # b has not read it yet
    await replicas[0].tick()
    await replicas[1].tick()
    assert _admit(cores[1], SMALL) is not None


def test_without_the_exchange_each_fills_the_engine_alone(tmp_path: Path) -> None:
    """The bound's other side: what both admit between two exchanges is not seen by the
    other (here: no exchange at all), so together they promise the engine twice over."""
    clock = Clock()
    cores = [_core(tmp_path, clock), _core(tmp_path, clock)]
    for core in cores:
        while _admit(core, BIG) is not None:
            pass
    assert _reserved(*cores) == (1800, 18)


async def test_a_replica_that_stops_refreshing_stops_counting(tmp_path: Path, store: Store) -> None:
    clock = Clock()
    cores = [_core(tmp_path, clock), _core(tmp_path, clock)]
    a, b = (_replica(store, c, name, clock) for c, name in zip(cores, "ab", strict=True))
    while _admit(cores[0], BIG) is not None:
        pass
    await a.tick()
    await b.tick()
    assert _admit(cores[1], BIG) is None  # a holds the engine
    with store.connection() as conn:  # a died: its row was last written a lease ago
        conn.execute(
            "UPDATE admission_reservations SET updated_at_s = updated_at_s - ?", (a.lease_s,)
        )
    await b.tick()
    assert b.replicas_seen == 0 and b.peers == {}
    assert _admit(cores[1], BIG) is not None


async def test_a_stopped_replica_withdraws_its_reservations(tmp_path: Path, store: Store) -> None:
    clock = Clock()
    cores = [_core(tmp_path, clock), _core(tmp_path, clock)]
    a = _replica(store, cores[0], "a", clock)
    registry = CollectorRegistry()
    b = SharedReservations(store, cores[1].fleet, "b", clock=clock, registry=registry)
    assert _admit(cores[0], BIG) is not None
    await a.tick()
    await b.tick()
    assert b.peers[SPEC.instance_id].blocks == 100
    labels = {"instance": SPEC.instance_id}
    assert registry.get_sample_value("gpupool_admission_peer_replicas") == 1
    assert registry.get_sample_value("gpupool_admission_peer_reserved_blocks", labels) == 100
    assert registry.get_sample_value("gpupool_admission_peer_pending_blocks", labels) == 100
    assert registry.get_sample_value("gpupool_admission_peer_running_requests", labels) == 1
    await a.aclose()
    await b.tick()
    assert b.peers == {}
    assert registry.get_sample_value("gpupool_admission_peer_replicas") == 0
    assert registry.get_sample_value("gpupool_admission_peer_reserved_blocks", labels) is None


async def test_a_store_that_does_not_answer_keeps_the_last_reservations_for_the_lease(
    tmp_path: Path, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="router.admission.shared_reservations")
    clock = Clock()
    cores = [_core(tmp_path, clock), _core(tmp_path, clock)]
    a, b = (_replica(store, c, name, clock) for c, name in zip(cores, "ab", strict=True))
    pumps: list[int] = []
    b.on_change = lambda: pumps.append(1)
    assert _admit(cores[0], BIG) is not None
    await a.tick()
    await b.tick()
    assert b.peers[SPEC.instance_id].blocks == 100 and pumps == [1]
    store.close()
    clock.now += b.lease_s - 0.1
    await b.tick()
    assert b.peers[SPEC.instance_id].blocks == 100  # the last read still counts
    assert "does not answer" in caplog.text
    clock.now += 0.1
    await b.tick()
    assert b.peers == {} and pumps == [1, 1]
    store.open()
    await a.tick()  # a's snapshot is rewritten (unchanged, but a refresh is due)
    await b.tick()
    assert b.peers[SPEC.instance_id].blocks == 100 and pumps == [1, 1, 1]
    assert "answers again" in caplog.text


async def test_admin_pools_shows_the_other_replicas_reservations_beside_its_own(
    tmp_path: Path, store: Store
) -> None:
    clock = Clock()
    cores = [_core(tmp_path, clock) for _ in range(3)]
    a, b, c = (_replica(store, co, name, clock) for co, name in zip(cores, "abc", strict=True))

    def view() -> dict[str, Any]:
        return _pools_view(tmp_path, cores[2], clock)

    assert _admit(cores[0], BIG) is not None and _admit(cores[0], SMALL) is not None
    assert _admit(cores[1], SMALL) is not None
    assert _admit(cores[2], SMALL) is not None  # c's own
    await a.tick()
    await b.tick()
    clock.now += 0.25
    await c.tick()
    clock.now += 0.05
    answer = view()
    assert answer["replica"] == {
        "id": "c",
        "shared_admission": True,
        "interval_s": 0.1,
        "peers_counted": 2,
        "peers_read_age_s": 0.05,
        "store_answers": True,
    }
    engine = answer["instances"][SPEC.instance_id]
    assert (engine["kv_reserved_blocks"], engine["running_by_pool"]) == (1, {"normal": 1})
    assert engine["peer_reservations"] == {
        "kv_reserved_blocks": 102,
        "kv_pending_blocks": 102,
        "running": 3,
        "kv_reserved_blocks_by_pool": {"normal": 102},
        "running_by_pool": {"normal": 3},
        "by_replica": {
            "a": {"normal": {"kv_reserved_blocks": 101, "running": 2, "kv_pending_blocks": 101}},
            "b": {"normal": {"kv_reserved_blocks": 1, "running": 1, "kv_pending_blocks": 1}},
        },
    }
    peer = c.peers[SPEC.instance_id]  # what admission adds to c's own (`adjust`)
    assert (peer.blocks, peer.pending_blocks, peer.sequences) == (102, 102, 3)
    await b.aclose()
    await c.tick()
    assert view()["instances"][SPEC.instance_id]["peer_reservations"]["by_replica"].keys() == {"a"}
    store.close()  # past the lease without an answer: nothing of the others counts
    clock.now += c.lease_s
    await c.tick()
    answer = view()
    assert answer["replica"]["peers_counted"] == 0
    assert answer["replica"]["peers_read_age_s"] is None
    assert answer["replica"]["store_answers"] is False
    assert answer["instances"][SPEC.instance_id]["peer_reservations"]["running"] == 0
    store.open()
    # without a shared store: the replica's id alone, no peers
    alone = _core(tmp_path, clock)
    lone = _pools_view(tmp_path, alone, clock)
    assert lone["replica"] == {"id": alone.rebalancer.replica, "shared_admission": False}
    assert lone["instances"][SPEC.instance_id]["peer_reservations"] is None


def test_the_snapshot_is_what_the_replica_holds(tmp_path: Path) -> None:
    core = _core(tmp_path, Clock())
    assert snapshot(core.fleet) == {}
    first, second = _admit(core, BIG), _admit(core, SMALL)
    assert first is not None and second is not None
    # no first token yet: each may still add its whole reservation to the engine's count
    assert snapshot(core.fleet) == {SPEC.instance_id: {"normal": (101, 2, 101)}}
    first.first_token(1.0)  # before the next scrape is requested: its prompt is counted there
    core.fleet.record_reading(
        SPEC.instance_id,
        InstanceReading(2.0, 0.2, 1, 0, 1000, 16, 0, 0, 0, 0, 0, 0, 0, requested_at_s=1.5),
    )
    # 1600 tokens in 100 blocks, 1500 of them the prompt's: 93 whole prompt blocks are in the
    # engine's count, 7 may still be filled
    assert snapshot(core.fleet) == {SPEC.instance_id: {"normal": (101, 2, 8)}}
    first.release()
    second.release()
    assert snapshot(core.fleet) == {}


def test_only_a_shared_store_with_an_interval_shares_reservations(
    tmp_path: Path, any_store: Store
) -> None:
    core = _core(tmp_path, Clock())
    shared = SharedReservations.for_store(any_store, core.fleet, "a", core.admitter.schedule_pump)
    assert (shared is not None) == (any_store.dialect == "postgresql")
    off = SharedReservations.for_store(
        any_store, core.fleet, "a", core.admitter.schedule_pump, interval_s=0
    )
    assert off is None
    with pytest.raises(ConfigError, match="admission_interval_s"):  # embedded: one router
        config_for_test(tmp_path, store={"admission_interval_s": 0.2})
