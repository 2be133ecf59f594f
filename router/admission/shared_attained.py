"""run_las across router replicas: each replica publishes its own share of each active run's
attained GPU-seconds to the shared store, reads the other replicas' shares into memory, and
the admitter's run-aware order (`queue.order: run_las`) adds them to its own.

Rides on the admission exchange (router/admission/shared_reservations.py: same tick, same
connection, same worker thread); only with a PostgreSQL store and a pool ordered by run_las.
docs/replicas.md, "Run-aware order across replicas (s46)".

- **What a replica publishes**: per run (`admission_attained`, admission migration 1: one row
  per replica and run), the GPU-seconds of the run's steps that ended on it, its steps in
  flight there, and how long the run had been idle there at the write (0 with a step in
  flight). A row is rewritten only when the run changed there (a step began or ended): the
  tick compares the runs of the router's `RunTable` touched since the last tick (a step's
  start and its end's settlement both touch its run; the table counts its touches, so a
  quiet tick compares none), at most `max_scan_runs` of them, most recent first, and the
  runs it last wrote in flight, with what it last wrote. Past `max_scan_runs` touches in one
  interval the older ones are missed until their next touch (a step's end). At most
  `max_rows_per_tick` rows a tick; past that the rest wait for the next tick, oldest change
  first (each tick adds one interval to their staleness).
- **What it reads**: the rows other replicas wrote since the last read, per replica by its own
  publication number (`version`: one writer per replica, so a row it has not read is never
  behind one it has), into `{run: {replica: share}}`. Idle times are converted to this
  replica's clock through the database's clock, once per row written.
- **What run_las sees** (`with_peers`): the run's own usage here plus the others' shares
  summed; in flight if a step is in flight on any live replica; last active at the latest of
  them. So idle forgiveness (router/admission/queueing.py, `AttainedService`) forgives the
  shared total, from the run's idle time across all replicas, on every replica alike.
- **A dead replica** (its reservations row no longer read, 3 s after its last write): its
  shares keep counting (the service was received) but its steps in flight do not (vLLM
  aborted them with its connections): the run is idle there since the replica was last seen.
  A replica that has never been seen live (it died before this one started) is found by a
  `DISTINCT` read at the first exchange and every minute.
- **Retention**: a row not rewritten for `KEEP_S` (1 h, by the database's clock) is deleted by
  whichever replica sees it, and forgotten by every replica's map; a run idle that long has
  had its service halved 59 times at run_las's default `idle_decay_s` (60 s). The map holds
  at most `max_peer_runs` runs; past it, a run new to it counts by this replica's share alone
  (one warning) until retention has freed room and the run's row is rewritten.

Staleness: another replica's step end is seen here at most one `interval_s` (its publish)
plus one (this replica's read) plus two round trips after it, 0.2 s by default; a step still
in flight there counts from its end (its service so far is not published).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import orjson

from router.admission.queueing import RunUsage
from router.runtable import RunTable
from router.store import Migration
from router.store.base import Conn

__all__ = ["MIGRATIONS", "AttainedRow", "AttainedTable", "SharedAttained"]

log = logging.getLogger(__name__)

MAX_ROWS_PER_TICK = 1000  # changed runs published per tick; the rest wait for the next
MAX_SCAN_RUNS = 4096  # runs touched since the last tick compared, at most
MAX_PEER_RUNS = 100_000  # runs the map of the others' shares holds (the RunTable's default cap)
KEEP_S = 3600.0  # a row not rewritten this long is deleted and forgotten

_TABLE = """
CREATE TABLE IF NOT EXISTS admission_attained (
    replica TEXT NOT NULL,
    tenant TEXT NOT NULL,
    run_id TEXT NOT NULL,
    gpu_s {real} NOT NULL,
    in_flight INTEGER NOT NULL,
    idle_s {real} NOT NULL,
    version BIGINT NOT NULL,
    updated_at_s {real} NOT NULL,
    PRIMARY KEY (replica, tenant, run_id)
);
CREATE INDEX IF NOT EXISTS admission_attained_version ON admission_attained (replica, version)
"""
# the admission component's first migration: each replica's share of each run's attained
# service (applied by the replica's exchange, and by `gpupool store migrate`)
MIGRATIONS = (
    Migration(
        "admission",
        1,
        "admission_attained (run_las's attained service across replicas)",
        _TABLE.format(real="REAL"),
        _TABLE.format(real="DOUBLE PRECISION"),
    ),
)

_NOW = {
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
    "postgresql": "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)",
}

# one JSON array of rows, each [tenant, run id, gpu_s, in_flight, idle_s], as columns
_ROWS = {
    "sqlite": ", ".join(f"json_extract(value, '$[{i}]')" for i in range(5)),
    "postgresql": "r->>0, r->>1, (r->>2)::double precision, (r->>3)::integer,"
    " (r->>4)::double precision",
}
_EACH = {"sqlite": "json_each(?)", "postgresql": "json_array_elements(?::json) AS r"}

# (tenant, run id, GPU-seconds of ended steps, steps in flight, idle seconds at the write)
Share = tuple[str, str, float, int, float]


@dataclass(frozen=True, slots=True)
class AttainedRow:
    """Another replica's share of one run, as read."""

    replica: str
    tenant: str
    run_id: str
    gpu_s: float
    in_flight: int
    idle_s: float  # how long the run had been idle there when written (0: in flight)
    version: int
    updated_at_s: float  # the database's clock at the write
    read_at_s: float  # the database's clock at the read


class AttainedTable:
    """The `admission_attained` rows. Sync; each call runs on a connection the caller holds
    (the admission exchange's, in its worker thread)."""

    def __init__(self, dialect: str) -> None:
        now = _NOW[dialect]
        self._now = now
        # the rows as one JSON parameter ([[tenant, run id, gpu_s, in_flight, idle_s], ...]):
        # one statement, one round trip, one parameter to adapt, whatever their number
        rows = _ROWS[dialect]
        self._upsert = (
            "INSERT INTO admission_attained"
            " (replica, tenant, run_id, gpu_s, in_flight, idle_s, version, updated_at_s)"
            f" SELECT ?, {rows}, ?, {now} FROM {_EACH[dialect]} WHERE true"
            " ON CONFLICT (replica, tenant, run_id) DO UPDATE SET gpu_s = excluded.gpu_s,"
            " in_flight = excluded.in_flight, idle_s = excluded.idle_s,"
            " version = excluded.version, updated_at_s = excluded.updated_at_s"
        )
        self._columns = (
            f"SELECT replica, tenant, run_id, gpu_s, in_flight, idle_s, version, updated_at_s,"
            f" {now} FROM admission_attained WHERE "
        )
        self._replicas = "SELECT DISTINCT replica FROM admission_attained WHERE replica <> ?"
        self._forget = f"DELETE FROM admission_attained WHERE updated_at_s < {now} - ?"

    def publish(self, conn: Conn, replica: str, version: int, shares: Sequence[Share]) -> None:
        """Write this replica's `shares` as publication `version` (one statement)."""
        if shares:
            conn.execute(self._upsert, (replica, version, orjson.dumps(shares).decode()))

    def read(self, conn: Conn, since: Mapping[str, int]) -> list[AttainedRow]:
        """The rows of the replicas in `since` written after the version given for each."""
        if not since:
            return []
        where = " OR ".join(["(replica = ? AND version > ?)"] * len(since))
        params = [p for replica, version in since.items() for p in (replica, version)]
        return [
            AttainedRow(
                str(r), str(t), str(run), float(g), int(n), float(i), int(v), float(u), float(at)
            )
            for r, t, run, g, n, i, v, u, at in conn.execute(self._columns + where, params)
        ]

    def replicas(self, conn: Conn, replica: str) -> set[str]:
        """Every other replica with a row (live or not)."""
        return {str(r) for (r,) in conn.execute(self._replicas, (replica,))}

    def forget(self, conn: Conn, older_than_s: float) -> float:
        """Delete the rows not rewritten for `older_than_s`; the database's clock now."""
        conn.execute(self._forget, (older_than_s,))
        return float(conn.execute(f"SELECT {self._now}").fetchone()[0])


@dataclass(slots=True)
class _PeerShare:
    gpu_s: float
    in_flight: int
    last_active_s: float  # this replica's clock
    updated_at_s: float  # the database's clock


# (GPU-seconds of ended steps, steps in flight, last active): what a run's row says
_Signature = tuple[float, int, float]


class SharedAttained:
    """This replica's side: what to publish (`changes`, then `published`), what the others
    published (`absorb`), and the run's usage with theirs (`with_peers`). All on the event
    loop; the statements are `AttainedTable`'s, run by the exchange's worker thread.
    `now_s` arguments are the clock the accountant's `last_active_s` is on."""

    def __init__(
        self,
        runs: RunTable,
        dialect: str,
        *,
        max_rows_per_tick: int = MAX_ROWS_PER_TICK,
        max_scan_runs: int = MAX_SCAN_RUNS,
        max_peer_runs: int = MAX_PEER_RUNS,
    ) -> None:
        if max_rows_per_tick < 1 or max_scan_runs < 1 or max_peer_runs < 1:
            raise ValueError("max_rows_per_tick, max_scan_runs and max_peer_runs must be >= 1")
        self.table = AttainedTable(dialect)
        self.runs = runs
        self.max_rows_per_tick = max_rows_per_tick
        self.max_scan_runs = max_scan_runs
        self.max_peer_runs = max_peer_runs
        self.version = 0  # this replica's publications attempted so far
        self._written: dict[tuple[str, str], _Signature] = {}  # what its rows say now
        self._dirty: dict[tuple[str, str], None] = {}  # changed, not written yet (oldest first)
        self._in_flight: set[tuple[str, str]] = set()  # written with a step in flight
        self._sending: dict[tuple[str, str], _Signature] = {}  # what `changes` last gave
        self.since: dict[str, int] = {}  # other replica -> the last version read of it
        self._live: dict[str, float] = {}  # live replica -> when last seen (this clock)
        self._gone_at: dict[str, float] = {}  # replica no longer live -> when last seen
        self._shares: dict[Hashable, dict[str, _PeerShare]] = {}
        self._full_warned = False
        self._touches_seen = 0  # the run table's `touches` at the last scan
        self.migrated = False  # admission's migration applied (by the exchange's thread)
        self.migrate_warned = False

    # ------------------------------------------------------------------ publish

    def changes(self, now_s: float) -> tuple[int, list[Share]]:
        """The next publication: its version (one more than the last attempt's) and the rows
        of up to `max_rows_per_tick` runs changed here since they were last written (none:
        nothing to write)."""
        records = self.runs
        touched = min(records.touches - self._touches_seen, self.max_scan_runs)
        self._touches_seen = records.touches
        for n, key in enumerate(records.recent()):
            if n >= touched:  # past the runs touched since the last tick
                break
            self._compare(key)
        for key in list(self._in_flight):
            self._compare(key)
        if not self._dirty:
            return self.version, []
        shares: list[Share] = []
        self._sending = {}
        for key in self._dirty:
            if len(shares) >= self.max_rows_per_tick:
                break
            record = records.get(key)
            if record is None:  # forgotten here before it was written: nothing to say
                continue
            in_flight = len(record.in_flight)
            idle_s = 0.0 if in_flight else max(0.0, now_s - record.last_active_s)
            shares.append((key[0], key[1], record.ended_gpu_s, in_flight, idle_s))
            self._sending[key] = (record.ended_gpu_s, in_flight, record.last_active_s)
        if shares:  # a number per attempt: a write retried after a failed read is a new one
            self.version += 1
        return self.version, shares

    def _compare(self, key: Hashable) -> None:
        if not (isinstance(key, tuple) and len(key) == 2):
            return
        record = self.runs.get(key)
        if record is None or not record.metered:
            return
        signature = (record.ended_gpu_s, len(record.in_flight), record.last_active_s)
        if self._written.get(key) != signature:
            self._dirty.setdefault(key, None)

    def published(self, shares: Iterable[Share]) -> None:
        """`shares` (the last `changes`) were written. What they said is what the rows say
        now, even if a run changed while they were written (its change is compared at the
        next tick: a step's start touches it, and a run written in flight is compared every
        tick)."""
        for tenant, run_id, *_ in shares:
            key = (tenant, run_id)
            self._dirty.pop(key, None)
            signature = self._sending.get(key)
            if signature is None:
                continue
            self._written[key] = signature
            if signature[1]:  # in flight
                self._in_flight.add(key)
            else:
                self._in_flight.discard(key)
        for key in [k for k in self._dirty if k not in self.runs]:
            del self._dirty[key]

    # ------------------------------------------------------------------ read

    def to_read(self, live: Iterable[str], found: Iterable[str] = ()) -> dict[str, int]:
        """The replicas to read, each with the version read so far: those live now, those
        live at the last exchange (one that stopped since: its last rows), and `found` (with
        rows in the store: `replicas`). Runs in the exchange's thread; reads only what the
        loop changes between exchanges."""
        wanted = set(live) | set(self._live) | set(found)
        return {r: self.since.get(r, -1) for r in sorted(wanted)}

    def absorb(self, rows: Iterable[AttainedRow], live: Iterable[str], now_s: float) -> None:
        """The exchange's answer: `rows` read, the replicas whose reservations are live."""
        live = set(live)
        for replica in [r for r in self._live if r not in live]:
            # stopped or dead: its steps in flight stop counting; the run idles from here
            self._gone_at[replica] = self._live.pop(replica)
        for replica in live:
            self._live[replica] = now_s
            self._gone_at.pop(replica, None)
        for row in rows:
            self.since[row.replica] = max(self.since.get(row.replica, -1), row.version)
            key = (row.tenant, row.run_id)
            by_replica = self._shares.get(key)
            if by_replica is None:
                if len(self._shares) >= self.max_peer_runs:
                    self._full(row)
                    continue
                by_replica = self._shares[key] = {}
            age_s = max(0.0, row.read_at_s - row.updated_at_s)
            by_replica[row.replica] = _PeerShare(
                row.gpu_s, row.in_flight, now_s - age_s - row.idle_s, row.updated_at_s
            )

    def _full(self, row: AttainedRow) -> None:
        if not self._full_warned:
            log.warning(
                "run_las across replicas: %d runs' shares held, the cap; runs new to it (first:"
                " tenant %s) count by this replica's share alone until rows age out (%g s)",
                self.max_peer_runs,
                row.tenant,
                KEEP_S,
            )
            self._full_warned = True

    def forget(self, read_at_s: float) -> None:
        """Drop shares whose rows were not rewritten for `KEEP_S` (`read_at_s`: the
        database's clock now), replicas left with none, and what this replica wrote of
        runs it has forgotten."""
        cutoff = read_at_s - KEEP_S
        for key in list(self._shares):
            by_replica = self._shares[key]
            for replica in [r for r, s in by_replica.items() if s.updated_at_s < cutoff]:
                del by_replica[replica]
            if not by_replica:
                del self._shares[key]
        holding = {r for by_replica in self._shares.values() for r in by_replica}
        for replica in [r for r in self.since if r not in holding and r not in self._live]:
            del self.since[replica]
            self._gone_at.pop(replica, None)
        for key in [k for k in self._written if k not in self.runs]:
            del self._written[key]
            self._in_flight.discard(key)
        if len(self._shares) < self.max_peer_runs:
            self._full_warned = False

    # ------------------------------------------------------------------ use

    def with_peers(self, run_key: Hashable, own: RunUsage | None) -> RunUsage | None:
        """The run's usage here (`own`) with the other replicas' shares: GPU-seconds summed,
        steps in flight on live replicas added, last active at the latest."""
        by_replica = self._shares.get(run_key)
        if not by_replica:
            return own
        gpu_s = own.gpu_seconds if own is not None else 0.0
        in_flight = own.in_flight if own is not None else 0
        last_active_s = own.last_active_s if own is not None else -float("inf")
        for replica, share in by_replica.items():
            gpu_s += share.gpu_s
            seen_s = self._live.get(replica)
            if share.in_flight and seen_s is not None:
                in_flight += share.in_flight
                last_active_s = max(last_active_s, share.last_active_s)
            elif share.in_flight:  # dead with a step in flight: idle since last seen
                last_active_s = max(last_active_s, self._last_seen(replica, share))
            else:
                last_active_s = max(last_active_s, share.last_active_s)
        return RunUsage(gpu_s, in_flight, last_active_s)

    def _last_seen(self, replica: str, share: _PeerShare) -> float:
        return self._gone_at.get(replica, share.last_active_s)

    def peer_runs(self) -> int:
        """Runs with a share of another replica held."""
        return len(self._shares)
