"""Admission across router replicas: each replica's KV and batch reservations on each engine,
published in the shared store and subtracted from the engine's headroom by the others.

Only with a PostgreSQL store (several routers); the embedded store's one router never builds
this, and its admission is unchanged. docs/replicas.md, "Admission across replicas".

- **Publish and read, one exchange per tick** (`interval_s`, 0.1 s): the replica writes one
  row (`admission_reservations`: its id, `{instance: {pool: [blocks, sequences, pending]}}`
  as JSON, the database's clock) and reads the other replicas' rows written within `lease_s`
  (3 s) of the database's clock, on the same connection. An unchanged snapshot is
  rewritten only every `refresh_s` (1 s), so an idle replica writes once a second.
- **What admission sees** (`adjust`, the admitter's hook in `Admitter._view`): on each engine,
  the other replicas' sequences join this replica's (`running`, and the pool's
  `pool_running`), their reserved blocks join the pool's (the pool's share is checked against
  every replica's reservations), and the engine's used blocks grow by the others' **pending**
  blocks: what their sequences may still add beyond the engine's last scrape, counted as the
  engine-tracked bound counts this replica's own (router/admission/engine_kv.py): a sequence
  whose first token came before its replica's last scrape request, its blocks past the
  prompt's whole blocks (its output still to grow); any other, its whole reservation. What
  the others hold already is in the measured use every replica scrapes.
- **A dead replica** (its row not rewritten within `lease_s`) counts for nothing: its
  connections closed with it, so vLLM aborted its sequences. Rows older than an hour are
  deleted by whichever replica sees them.
- **The store does not answer**: the last rows read count until `lease_s` after they were read,
  then admission goes by this replica's own reservations and the measured use alone (one
  warning; one info line when the store answers again).

Over-admission bound: another replica's reservation is seen by this one at most `interval_s`
(its next publish) + `interval_s` (this one's next read) + two round trips after it was made.
In that window each of the N replicas admits against headroom the others may already have
taken, so an engine may be promised up to what the other N - 1 replicas admitted there in
the last ~2 x `interval_s` beyond its blocks (until the next scrape shows it, the measured use
does not catch it either). Second, the replicas scrape the engine at different moments: a
sequence of another replica whose first token came between this replica's last scrape and
its own is counted by its output alone while this replica's older scrape lacks its prompt
blocks: at most the prompts of the sequences another replica started within one
`router.scrape_interval_s`, until this replica's next scrape. Nothing is preempted by the
router; vLLM preempts only if the sequences actually grow into the excess.

With a pool ordered by `run_las`, the same exchange (same tick, same connection) also writes
this replica's share of each changed run's attained GPU-seconds and reads the others' new ones
(router/admission/shared_attained.py; the admitter adds them to the run's own: no round trip
on the request path).

Every database call runs in a worker thread, one exchange at a time; the snapshot and the
adjustment run on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Gauge

from pools.fleet import Fleet, InstanceState, Lease
from pools.periodic import Periodic
from router.admission.decision import InstanceView
from router.admission.shared_attained import KEEP_S, AttainedRow, Share, SharedAttained
from router.admission.shared_attained import MIGRATIONS as ATTAINED_MIGRATIONS
from router.runtable import RunTable
from router.store import Store, StoreError, migrate
from router.store.base import Conn

__all__ = ["PeerLoad", "ReservationsTable", "SharedReservations", "snapshot"]

log = logging.getLogger(__name__)

INTERVAL_S = 0.1  # publish + read, per replica (store.admission_interval_s)
LEASE_S = 3.0  # a replica's row counts while it was rewritten this recently
REFRESH_S = 1.0  # an unchanged snapshot is rewritten this often
FORGET_S = 3600.0  # rows this old are deleted

# {instance: {pool: (reserved blocks, sequences, pending blocks)}}
Snapshot = dict[str, dict[str, tuple[int, int, int]]]

_NOW = {
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
    "postgresql": "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)",
}


class ReservationsTable:
    """The `admission_reservations` rows (governance migration 5, router/governance/shared.py).
    Sync, thread-safe (each call takes its own connection); call it off the event loop. Ages
    are the database's clock, so replicas' clocks need not agree."""

    def __init__(self, store: Store) -> None:
        self.store = store
        now = _NOW[store.dialect]
        self._publish = (
            "INSERT INTO admission_reservations (replica, reservations, updated_at_s)"
            f" VALUES (?, ?, {now}) ON CONFLICT (replica) DO UPDATE SET"
            " reservations = excluded.reservations, updated_at_s = excluded.updated_at_s"
        )
        self._read = (
            "SELECT replica, reservations FROM admission_reservations"
            f" WHERE replica <> ? AND updated_at_s > {now} - ?"
        )
        self._forget = f"DELETE FROM admission_reservations WHERE updated_at_s < {now} - ?"
        self._withdraw = "DELETE FROM admission_reservations WHERE replica = ?"

    def exchange(self, replica: str, mine: Snapshot | None, lease_s: float) -> dict[str, Snapshot]:
        """Write this replica's snapshot (None: write nothing), then read every other replica's
        written within `lease_s`: {replica: snapshot}."""
        with self.store.connection() as conn:
            return self.exchange_on(conn, replica, mine, lease_s)

    def exchange_on(
        self, conn: Conn, replica: str, mine: Snapshot | None, lease_s: float
    ) -> dict[str, Snapshot]:
        """`exchange` on a connection the caller holds."""
        if mine is not None:
            conn.execute(self._publish, (replica, orjson.dumps(mine).decode()))
        rows = conn.execute(self._read, (replica, lease_s)).fetchall()
        return {str(r): _parse(text) for r, text in rows}

    def forget(self, older_than_s: float) -> int:
        """Delete the rows not rewritten for `older_than_s`; how many."""
        with self.store.connection() as conn:
            return conn.execute(self._forget, (older_than_s,)).rowcount

    def withdraw(self, replica: str) -> None:
        """Delete the replica's row (it stops: its reservations end with it)."""
        with self.store.connection() as conn:
            conn.execute(self._withdraw, (replica,))


def _parse(text: Any) -> Snapshot:
    raw = orjson.loads(text)
    return {
        str(iid): {str(pool): (int(v[0]), int(v[1]), int(v[2])) for pool, v in by_pool.items()}
        for iid, by_pool in raw.items()
    }


def snapshot(fleet: Fleet) -> Snapshot:
    """This replica's reservations: per instance and pool, (KV blocks reserved, sequences,
    pending blocks: what they may still add beyond the engine's last scrape, as
    `_pending_blocks` counts)."""
    out: Snapshot = {}
    for state in fleet:
        if not state.leases:
            continue
        pending: dict[str, int] = {}
        for lease in state.leases:
            pending[lease.pool] = pending.get(lease.pool, 0) + _pending_blocks(state, lease)
        out[state.spec.instance_id] = {
            pool: (state.reserved_by_pool.get(pool, 0), running, pending.get(pool, 0))
            for pool, running in state.running_by_pool.items()
            if running > 0
        }
    return out


def _pending_blocks(state: InstanceState, lease: Lease) -> int:
    """Blocks the lease's sequence may add to the engine's count after the last scrape: its
    blocks past the prompt's whole blocks (what its output may still fill, and the prompt's
    partial block) when its first token came before that scrape was requested (its prompt is
    in the count); else its whole reservation."""
    reading = state.reading
    asked = reading.requested_at_s if reading is not None else None
    first = lease.first_token_at_s
    if asked is None or first is None or first > asked or reading is None:
        return lease.blocks
    block_size = reading.block_size or 1
    return max(0, lease.blocks - lease.prompt_tokens // block_size)


@dataclass(frozen=True, slots=True)
class PeerLoad:
    """The other replicas' reservations on one instance."""

    blocks: int = 0
    sequences: int = 0
    pending_blocks: int = 0
    blocks_by_pool: Mapping[str, int] = field(default_factory=dict)
    sequences_by_pool: Mapping[str, int] = field(default_factory=dict)


def combine(snapshots: Mapping[str, Snapshot]) -> dict[str, PeerLoad]:
    """The replicas' snapshots summed per instance."""
    blocks: dict[str, dict[str, int]] = {}
    seqs: dict[str, dict[str, int]] = {}
    pending: dict[str, int] = {}
    for snap in snapshots.values():
        for iid, by_pool in snap.items():
            b, s = blocks.setdefault(iid, {}), seqs.setdefault(iid, {})
            for pool, (n_blocks, n_seqs, n_pending) in by_pool.items():
                b[pool] = b.get(pool, 0) + n_blocks
                s[pool] = s.get(pool, 0) + n_seqs
                pending[iid] = pending.get(iid, 0) + n_pending
    return {
        iid: PeerLoad(
            sum(blocks[iid].values()),
            sum(seqs[iid].values()),
            pending.get(iid, 0),
            blocks[iid],
            seqs[iid],
        )
        for iid in blocks
    }


class SharedReservations:
    """This replica's side: publish its reservations, read the others', adjust the admitter's
    views. `start()` / `aclose()`; `on_change()` (the admitter's `schedule_pump`) is called on
    the event loop when the others' reservations changed (a release elsewhere may let a queued
    request in here). `clock`: monotonic seconds."""

    def __init__(
        self,
        store: Store,
        fleet: Fleet,
        replica: str,
        *,
        interval_s: float = INTERVAL_S,
        lease_s: float = LEASE_S,
        refresh_s: float = REFRESH_S,
        on_change: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        registry: CollectorRegistry | None = None,
        attained: SharedAttained | None = None,
    ) -> None:
        """`registry`: where the `gpupool_admission_peer_*` gauges go (none: no gauges).
        `attained`: run_las's attained service, exchanged on the same tick (none: not shared;
        router/admission/shared_attained.py); `clock` must then be the accountant's."""
        self.table = ReservationsTable(store)
        self.attained = attained
        self._discovered_at_s = -float("inf")
        self.fleet = fleet
        self.replica = replica
        self.interval_s, self.lease_s, self.refresh_s = interval_s, lease_s, refresh_s
        self.on_change = on_change
        self._clock = clock
        self._errors: tuple[type[Exception], ...] = (StoreError, *store.errors)
        self.peers: dict[str, PeerLoad] = {}  # instance -> the others' reservations
        self.by_replica: dict[str, Snapshot] = {}  # what `peers` sums: {replica: snapshot}
        self.replicas_seen = 0
        self._read_at_s: float | None = None
        self._published: Snapshot | None = None
        self._published_at_s = -float("inf")
        self._forgot_at_s = -float("inf")
        self._failing = False
        self._gauges = _PeerGauges(registry) if registry is not None else None
        self._loop = Periodic(
            "gpupool-shared-reservations", self.tick, interval_s, clock=clock, first_delay_s=0
        )

    @classmethod
    def for_store(
        cls,
        store: Store,
        fleet: Fleet,
        replica: str,
        on_change: Callable[[], None],
        *,
        interval_s: float = INTERVAL_S,
        registry: CollectorRegistry | None = None,
        attained_runs: RunTable | None = None,
    ) -> SharedReservations | None:
        """A PostgreSQL store's (several routers may share it), exchanging every `interval_s`
        (`store.admission_interval_s`); None on the embedded store, whose one router has no
        other replicas, or with `interval_s` 0 (not shared): nothing runs, admission is
        unchanged. `attained_runs`: the router's `RunTable` when a pool orders its queue by
        run_las (their attained service is then exchanged too); None: it is not."""
        if store.dialect != "postgresql" or interval_s <= 0:
            return None
        attained = None if attained_runs is None else SharedAttained(attained_runs, store.dialect)
        return cls(
            store,
            fleet,
            replica,
            interval_s=interval_s,
            on_change=on_change,
            registry=registry,
            attained=attained,
        )

    async def start(self) -> None:
        self._loop.start()

    async def aclose(self) -> None:
        await self._loop.aclose()
        try:  # the others stop counting this replica's sequences at once, not after the lease
            await asyncio.to_thread(self.table.withdraw, self.replica)
        except self._errors as err:
            log.info("admission reservations of %s left in the store (%s)", self.replica, err)

    async def tick(self) -> None:
        """One exchange: publish this replica's reservations (when changed, or every
        `refresh_s`), read the others'."""
        now = self._clock()
        mine: Snapshot | None = snapshot(self.fleet)
        if mine == self._published and now - self._published_at_s < self.refresh_s:
            mine = None
        attained = self.attained
        version, shares = attained.changes(now) if attained is not None else (0, [])
        discover = attained is not None and now - self._discovered_at_s >= FORGET_S / 60
        try:
            others, read = await asyncio.to_thread(self._exchange, mine, version, shares, discover)
            if now - self._forgot_at_s >= FORGET_S / 60:
                self._forgot_at_s = now
                await asyncio.to_thread(self.table.forget, FORGET_S)
        except self._errors as err:
            self._failed(now, err)
            return
        if self._failing:
            log.info("admission reservations: the store answers again; other replicas count")
            self._failing = False
        if mine is not None:
            self._published, self._published_at_s = mine, now
        self._read_at_s = now
        self._set(others)
        if attained is not None and read is not None:
            rows, db_now_s = read
            if shares:
                attained.published(shares)
            attained.absorb(rows, others, now)
            if discover:
                self._discovered_at_s = now
                attained.forget(db_now_s)

    def _exchange(
        self, mine: Snapshot | None, version: int, shares: list[Share], discover: bool
    ) -> tuple[dict[str, Snapshot], tuple[list[AttainedRow], float] | None]:
        """One exchange on one connection (in a worker thread): the reservations; with run_las
        shared, this replica's changed shares written and the others' new ones read (on a
        `discover` tick also every replica with rows found, and rows past retention deleted)."""
        attained = self.attained
        if attained is not None and not attained.migrated:
            try:  # a failure skips the attained rows this tick, not the reservations
                migrate(self.table.store, ATTAINED_MIGRATIONS)
                attained.migrated = True  # a flag only this thread writes, once
            except self._errors as err:
                if not attained.migrate_warned:  # once; retried every tick
                    log.warning("run_las across replicas: admission migration failed: %s", err)
                    attained.migrate_warned = True
                attained = None
        with self.table.store.connection() as conn:
            others = self.table.exchange_on(conn, self.replica, mine, self.lease_s)
            if attained is None:
                return others, None
            attained.table.publish(conn, self.replica, version, shares)
            found: set[str] = set()
            db_now_s = 0.0
            if discover:
                db_now_s = attained.table.forget(conn, KEEP_S)
                found = attained.table.replicas(conn, self.replica)
            rows = attained.table.read(conn, attained.to_read(others, found))
        return others, (rows, db_now_s)

    def _failed(self, now_s: float, err: Exception) -> None:
        if not self._failing:
            log.warning(
                "admission reservations: the store does not answer (%s); the other replicas'"
                " last reservations count for %g s, then admission sees this replica's alone",
                str(err).splitlines()[0] if str(err) else type(err).__name__,
                self.lease_s,
            )
            self._failing = True
        if self._read_at_s is not None and now_s - self._read_at_s >= self.lease_s:
            self._read_at_s = None
            self._set({})
            if self.attained is not None:  # nobody seen live: their steps in flight stop
                self.attained.absorb([], (), now_s)

    def _set(self, others: dict[str, Snapshot]) -> None:
        peers = combine(others)
        changed = peers != self.peers
        self.by_replica, self.replicas_seen = others, len(others)
        if self._gauges is not None:
            self._gauges.show(self.replicas_seen, peers, gone=set(self.peers) - set(peers))
        self.peers = peers
        if changed and self.on_change is not None:
            self.on_change()

    def view(self) -> dict[str, Any]:
        """This replica on `GET /admin/pools`: its id, how many other replicas admission counts,
        how long ago their rows were read (monotonic seconds; None: not read, or the last read
        is older than the lease), whether the store answers; with run_las shared, how many
        runs hold another replica's share."""
        answer: dict[str, Any] = {
            "id": self.replica,
            "shared_admission": True,
            "interval_s": self.interval_s,
            "peers_counted": self.replicas_seen,
            "peers_read_age_s": None
            if self._read_at_s is None
            else round(max(0.0, self._clock() - self._read_at_s), 3),
            "store_answers": not self._failing,
        }
        if self.attained is not None:  # run_las: runs with another replica's share held
            answer["attained_peer_runs"] = self.attained.peer_runs()
        return answer

    def instance_view(self, instance_id: str) -> dict[str, Any]:
        """What admission counts of the other replicas on one instance (`adjust`): their
        reserved blocks, pending blocks and sequences, in all, per pool and per replica."""
        peer = self.peers.get(instance_id, PeerLoad())
        return {
            "kv_reserved_blocks": peer.blocks,
            "kv_pending_blocks": peer.pending_blocks,
            "running": peer.sequences,
            "kv_reserved_blocks_by_pool": dict(peer.blocks_by_pool),
            "running_by_pool": dict(peer.sequences_by_pool),
            "by_replica": {
                replica: {
                    pool: {"kv_reserved_blocks": b, "running": s, "kv_pending_blocks": p}
                    for pool, (b, s, p) in snap[instance_id].items()
                }
                for replica, snap in sorted(self.by_replica.items())
                if instance_id in snap
            },
        }

    def adjust(self, pool: str, state: InstanceState, view: InstanceView) -> InstanceView:
        """`view` (this replica's, for `pool`) with the other replicas' reservations there."""
        peer = self.peers.get(view.instance_id)
        if peer is None:
            return view
        return replace(
            view,
            used_blocks=view.used_blocks + peer.pending_blocks,
            pool_reserved_blocks=view.pool_reserved_blocks + peer.blocks_by_pool.get(pool, 0),
            pool_running=view.pool_running + peer.sequences_by_pool.get(pool, 0),
            running=view.running + peer.sequences,
        )


class _PeerGauges:
    """What admission counts of the other replicas, on GET /metrics."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.replicas = Gauge(
            "gpupool_admission_peer_replicas",
            "Other router replicas whose KV and batch reservations admission counts now",
            registry=r,
        )
        self.blocks = Gauge(
            "gpupool_admission_peer_reserved_blocks",
            "KV blocks the other router replicas reserve on the instance",
            ["instance"],
            registry=r,
        )
        self.pending = Gauge(
            "gpupool_admission_peer_pending_blocks",
            "Of those, the blocks they may still add beyond the engine's last scrape (what"
            " admission adds to the used blocks)",
            ["instance"],
            registry=r,
        )
        self.running = Gauge(
            "gpupool_admission_peer_running_requests",
            "Sequences the other router replicas run on the instance",
            ["instance"],
            registry=r,
        )

    def show(self, replicas: int, peers: Mapping[str, PeerLoad], gone: set[str]) -> None:
        self.replicas.set(replicas)
        for iid, peer in peers.items():
            self.blocks.labels(iid).set(peer.blocks)
            self.pending.labels(iid).set(peer.pending_blocks)
            self.running.labels(iid).set(peer.sequences)
        for iid in gone:
            for gauge in (self.blocks, self.pending, self.running):
                with contextlib.suppress(KeyError):
                    gauge.remove(iid)
