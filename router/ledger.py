"""The durable GPU-seconds ledger: one SQLite file (WAL) of finished requests, rolled up per run,
tenant, class and pool, plus hourly idle/capacity totals so idle time survives a restart.

`Ledger.submit(record)` is O(1) and never touches disk: it appends a row to an in-memory buffer.
A background task (`start()`/`aclose()`) writes the buffer every `flush_interval_s` in one
transaction via `asyncio.to_thread`; `aclose()` writes everything left, so a graceful shutdown
loses nothing and a hard kill loses at most one flush interval. Rows whose request ended more
than `retention_days` ago are deleted at start and every `maintenance_interval_s`.

Queries exist twice: sync functions over a `sqlite3.Connection` (the CLI reads the file with
them) and async methods on `Ledger` (the HTTP layer), which first write the buffer, so a run's
latest requests are always visible. All of them return JSON-ready dicts; see docs/accounting.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import operator
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from pools.config import RouterConfig
from router.accounting import ConservationReport
from router.ledger_queries import (
    HOUR_S,
    JsonDict,
    RunOrder,
    list_runs,
    run_summary,
    top_runs_report,
    totals,
)

__all__ = [
    "OUTCOMES",
    "SCHEMA_VERSION",
    "Ledger",
    "LedgerError",
    "RequestRecord",
    "connect",
    "list_runs",
    "open_readonly",
    "run_summary",
    "top_runs_report",
    "totals",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

SCHEMA_VERSION = 1  # PRAGMA user_version of the file
DAY_S = 86_400.0
# Runs whose next step index is kept in memory: ~25 MB with 36-character run ids, ~47 MB at
# most (run ids are cut to 256 characters).
MAX_TRACKED_RUNS = 100_000
# The outcomes the router records; `outcome` is free text, these are the documented values.
OUTCOMES = ("ok", "client_error", "engine_error", "aborted", "rejected", "timeout")


class LedgerError(Exception):
    """The ledger file cannot be used (unreadable, or written by a newer gpupool)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestRecord:
    """One finished (or rejected) request. Times are unix seconds; durations seconds.

    `started_at_s` is the request's arrival at the router, `ended_at_s` its last byte out;
    `queue_s` the wait before dispatch. `step_index` None: the ledger numbers the run's
    requests 0, 1, 2, ... in submit order (see `Ledger.next_step_index`).
    """

    request_id: str
    run_id: str | None
    step_index: int | None
    tenant: str
    class_name: str
    pool: str
    instance: str | None  # None when never dispatched (rejected)
    model: str
    started_at_s: float
    ended_at_s: float
    queue_s: float
    ttft_s: float | None
    tpot_s: float | None
    prompt_tokens: int
    completion_tokens: int
    gpu_seconds: float
    outcome: str  # one of OUTCOMES
    status_code: int


_COLUMNS = tuple(f.name for f in fields(RequestRecord))  # also the table's columns
_Row = tuple[Any, ...]
# A row to insert is the record's fields in this order, then the step index.
_FIELDS_BUT_STEP = tuple(c for c in _COLUMNS if c != "step_index")
_record_fields = operator.attrgetter(*_FIELDS_BUT_STEP)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    request_id TEXT PRIMARY KEY,
    run_id TEXT,
    step_index INTEGER,
    tenant TEXT NOT NULL,
    class_name TEXT NOT NULL,
    pool TEXT NOT NULL,
    instance TEXT,
    model TEXT NOT NULL,
    started_at_s REAL NOT NULL,
    ended_at_s REAL NOT NULL,
    queue_s REAL NOT NULL,
    ttft_s REAL,
    tpot_s REAL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    gpu_seconds REAL NOT NULL,
    outcome TEXT NOT NULL,
    status_code INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS requests_run ON requests (run_id, tenant) WHERE run_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS requests_ended ON requests (ended_at_s);
CREATE TABLE IF NOT EXISTS idle_hourly (
    hour_start_s INTEGER NOT NULL,
    pool TEXT NOT NULL,
    idle_gpu_seconds REAL NOT NULL,
    PRIMARY KEY (hour_start_s, pool)
);
CREATE TABLE IF NOT EXISTS capacity_hourly (
    hour_start_s INTEGER PRIMARY KEY,
    capacity_gpu_seconds REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS run_ends (
    tenant TEXT NOT NULL,
    run_id TEXT NOT NULL,
    reason TEXT NOT NULL,
    ended_at_s REAL NOT NULL,
    steps INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    gpu_seconds REAL NOT NULL,
    PRIMARY KEY (tenant, run_id, ended_at_s)
);
"""

_INSERT = (
    f"INSERT OR REPLACE INTO requests ({', '.join(_FIELDS_BUT_STEP)}, step_index) "
    f"VALUES ({', '.join('?' for _ in _COLUMNS)})"
)
_ADD_IDLE = (
    "INSERT INTO idle_hourly (hour_start_s, pool, idle_gpu_seconds) VALUES (?, ?, ?) "
    "ON CONFLICT (hour_start_s, pool) DO UPDATE SET "
    "idle_gpu_seconds = idle_gpu_seconds + excluded.idle_gpu_seconds"
)
_ADD_RUN_END = (
    "INSERT OR REPLACE INTO run_ends (tenant, run_id, reason, ended_at_s, steps, tokens,"
    " gpu_seconds) VALUES (?, ?, ?, ?, ?, ?, ?)"
)
_ADD_CAPACITY = (
    "INSERT INTO capacity_hourly (hour_start_s, capacity_gpu_seconds) VALUES (?, ?) "
    "ON CONFLICT (hour_start_s) DO UPDATE SET "
    "capacity_gpu_seconds = capacity_gpu_seconds + excluded.capacity_gpu_seconds"
)


# ---------------------------------------------------------------------------------------------
# Opening the file
# ---------------------------------------------------------------------------------------------


def connect(path: Path) -> sqlite3.Connection:
    """Open (creating if missing) a ledger for writing: WAL, schema ensured, version checked.

    The connection is in autocommit mode and may be used from any one thread at a time.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10.0)
    try:
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        if version > SCHEMA_VERSION:
            raise LedgerError(
                f"{path}: ledger schema version {version} is newer than this gpupool's "
                f"({SCHEMA_VERSION})"
            )
        conn.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode: a committed batch survives a process kill; an OS crash may lose
        # the last batches, never corrupt the file.
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.executescript(_SCHEMA)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    except sqlite3.DatabaseError as err:
        conn.close()
        raise LedgerError(f"{path}: cannot open the ledger: {err}") from err
    except BaseException:
        conn.close()
        raise
    return conn


def open_readonly(path: Path) -> sqlite3.Connection:
    """Open an existing ledger to read (the CLI). Raises `LedgerError` if missing or foreign."""
    if not path.is_file():
        raise LedgerError(f"{path}: no ledger file there")
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        conn.execute("SELECT 1 FROM requests LIMIT 1").fetchall()
    except sqlite3.DatabaseError as err:
        raise LedgerError(f"{path}: not a gpupool ledger: {err}") from err
    if version > SCHEMA_VERSION:
        conn.close()
        raise LedgerError(f"{path}: ledger schema version {version} is newer than supported")
    return conn


# ---------------------------------------------------------------------------------------------
# Writing (run in a worker thread)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Batch:
    rows: Sequence[_Row]
    idle_by_pool_gpu_s: Mapping[str, float]  # deltas since the last batch
    capacity_gpu_s: float  # delta since the last batch
    hour_start_s: int
    run_ends: Sequence[_Row] = ()  # (tenant, run_id, reason, ended_at_s, steps, tokens, gpu_s)


def _write_batch(conn: sqlite3.Connection, batch: _Batch) -> int:
    """One transaction. Returns how many rows were malformed and skipped (they would otherwise
    fail every retry); disk and lock errors roll everything back and raise."""
    skipped = 0
    conn.execute("BEGIN IMMEDIATE")
    try:
        try:
            conn.executemany(_INSERT, batch.rows)
        except (sqlite3.InterfaceError, sqlite3.IntegrityError, sqlite3.ProgrammingError):
            for row in batch.rows:  # find the bad rows; OR REPLACE makes the re-insert idempotent
                try:
                    conn.execute(_INSERT, row)
                except (sqlite3.InterfaceError, sqlite3.IntegrityError, sqlite3.ProgrammingError):
                    skipped += 1
        for pool, idle_gpu_s in batch.idle_by_pool_gpu_s.items():
            conn.execute(_ADD_IDLE, (batch.hour_start_s, pool, idle_gpu_s))
        if batch.capacity_gpu_s > 0.0:
            conn.execute(_ADD_CAPACITY, (batch.hour_start_s, batch.capacity_gpu_s))
        conn.executemany(_ADD_RUN_END, batch.run_ends)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return skipped


def _delete_older_than(conn: sqlite3.Connection, cutoff_s: float) -> int:
    conn.execute("BEGIN IMMEDIATE")
    try:
        deleted = conn.execute("DELETE FROM requests WHERE ended_at_s < ?", (cutoff_s,)).rowcount
        hour = math.floor(cutoff_s / HOUR_S) * HOUR_S
        conn.execute("DELETE FROM idle_hourly WHERE hour_start_s < ?", (hour,))
        conn.execute("DELETE FROM capacity_hourly WHERE hour_start_s < ?", (hour,))
        conn.execute("DELETE FROM run_ends WHERE ended_at_s < ?", (cutoff_s,))
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return int(deleted)


def _recent_steps(
    conn: sqlite3.Connection, since_s: float, limit: int
) -> list[tuple[str, str, int, float]]:
    """The `limit` runs that ended a request most recently (since `since_s`), oldest first."""
    cur = conn.execute(
        "SELECT tenant, run_id, MAX(step_index), MAX(ended_at_s) AS last FROM requests "
        "WHERE run_id IS NOT NULL AND ended_at_s >= ? GROUP BY tenant, run_id "
        "ORDER BY last DESC LIMIT ?",
        (since_s, limit),
    )
    rows = [(t, r, -1 if s is None else int(s), float(e)) for t, r, s, e in cur]
    rows.reverse()
    return rows


_STORED_STEP = "SELECT MAX(step_index) FROM requests WHERE run_id = ? AND tenant = ?"


def _open_reader(path: Path) -> sqlite3.Connection:
    """A second, read-only connection for step look-ups on the event loop (WAL: readers never
    wait for the writer)."""
    conn = sqlite3.connect(
        f"{path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False, timeout=1.0
    )
    conn.execute("PRAGMA query_only = ON")
    return conn


class Ledger:
    """Buffers request records in memory and writes them to SQLite in batches.

    `clock` is wall time (unix seconds): retention and hourly buckets. `snapshot_source`,
    when given, is polled on the event loop at every flush (e.g.
    `lambda: accountant.conservation(loop.time())`); the growth of its cumulative idle per pool
    and capacity since the last poll is added to the hourly tables.
    """

    def __init__(
        self,
        path: Path,
        *,
        flush_interval_s: float = 0.5,
        retention_days: float = 30.0,
        clock: Callable[[], float] = time.time,
        snapshot_source: Callable[[], ConservationReport] | None = None,
        maintenance_interval_s: float = 3600.0,
        step_memory_s: float = DAY_S,
        max_buffered_records: int = 200_000,
        max_tracked_runs: int = MAX_TRACKED_RUNS,
    ) -> None:
        if flush_interval_s <= 0 or retention_days <= 0:
            raise ValueError("flush_interval_s and retention_days must be > 0")
        if max_tracked_runs < 1:
            raise ValueError("max_tracked_runs must be >= 1")
        self.path = path
        self._flush_interval_s = flush_interval_s
        self._retention_s = retention_days * DAY_S
        self._clock = clock
        self._snapshot_source = snapshot_source
        self._maintenance_interval_s = maintenance_interval_s
        self._step_memory_s = step_memory_s
        self._max_buffered = max_buffered_records
        self._buffer: list[_Row] = []
        self._run_ends: list[_Row] = []  # why runs ended, written with the next batch
        # Step numbering. `_steps` is an LRU of (tenant, run_id) -> next step index, at most
        # `max_tracked_runs` long. A run not in it continues after the highest step stored: in
        # the file, in the buffer (`_unwritten`) or in the batch being written (`_writing`);
        # those two hold (tenant, run_id) -> highest step + 1 and are bounded by the buffer.
        self._max_tracked_runs = max_tracked_runs
        self._steps: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._unwritten: dict[tuple[str, str], int] = {}
        self._writing: dict[tuple[str, str], int] = {}
        self._reader: sqlite3.Connection | None = None
        self.evicted_runs = 0  # step counters dropped from memory (their runs may come back)
        self._last_idle_gpu_s: dict[str, float] = {}
        self._last_capacity_gpu_s = 0.0
        self._conn: sqlite3.Connection | None = None
        self._db_lock = asyncio.Lock()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._next_maintenance_s = math.inf
        self.dropped_records = 0  # lost: buffer full (disk stalled) or malformed
        self.written_records = 0

    @classmethod
    def from_config(
        cls,
        config: RouterConfig,
        *,
        clock: Callable[[], float] = time.time,
        snapshot_source: Callable[[], ConservationReport] | None = None,
    ) -> Ledger:
        return cls(
            config.ledger_path,
            flush_interval_s=config.ledger_flush_interval_s,
            retention_days=config.ledger_retention_days,
            clock=clock,
            snapshot_source=snapshot_source,
        )

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Open (or create) the file, apply retention, load the step counters of the most recent
        runs (at most `max_tracked_runs`, active in the last `step_memory_s`; others are read
        when they come back) and start the flush task. Raises `LedgerError` when the file
        cannot be used."""
        if self._conn is not None:
            raise RuntimeError("ledger already started")
        self._conn = await asyncio.to_thread(connect, self.path)
        now_s = self._clock()
        try:
            await self._maintain(now_s)
            recent = await self._in_db(
                _recent_steps, now_s - self._step_memory_s, self._max_tracked_runs
            )
            self._reader = await asyncio.to_thread(_open_reader, self.path)
        except BaseException:
            conn, self._conn = self._conn, None
            await asyncio.to_thread(conn.close)
            raise
        for tenant, run_id, step, _ in recent:  # oldest first: the newest end up most recent
            key = (tenant, run_id)
            self._remember(key, max(step + 1, self._steps.get(key, 0)))
        self._stop.clear()
        self._task = asyncio.create_task(self._run(), name="gpupool-ledger-flush")

    async def aclose(self) -> None:
        """Stop the flush task, write everything buffered, close the file. Idempotent."""
        if self._task is not None:
            self._stop.set()
            await self._task
            self._task = None
        if self._conn is None:
            if self._buffer:
                logger.warning("ledger closed before start: %d records not written", self.buffered)
            return
        try:
            await self.flush()
        finally:
            conn, self._conn = self._conn, None
            reader, self._reader = self._reader, None
            async with self._db_lock:
                await asyncio.to_thread(conn.close)
                if reader is not None:
                    await asyncio.to_thread(reader.close)

    # -- the request path (sync, O(1)) -----------------------------------------------------------

    def next_step_index(self, tenant: str, run_id: str) -> int:
        """Reserve the run's next step index: 0, 1, 2, ... per tenant and run id. Call it at
        arrival to number steps in arrival order; `submit` calls it when `step_index` is None.

        The counters of the `max_tracked_runs` most recently used runs stay in memory (O(1), no
        I/O), so random run ids cannot grow memory. A run not among them (new, evicted, or from
        before a restart) continues after the highest step stored for it, found with one
        indexed read of the file (WAL: no waiting on the writer; ~6-8 us with the page cached)
        and the unwritten buffer.
        Known gap: a run evicted while a request of it is still in flight, and back before
        that request ends, may reuse that request's step number; it takes `max_tracked_runs`
        other runs starting during one request.
        """
        key = (tenant, run_id)
        step = self._steps.pop(key, None)
        if step is None:
            step = self._stored_next_step(key)
        self._remember(key, step + 1)
        return step

    @property
    def tracked_runs(self) -> int:
        """Runs whose step counter is in memory (at most `max_tracked_runs`)."""
        return len(self._steps)

    def _remember(self, key: tuple[str, str], next_step: int) -> None:
        self._steps[key] = next_step
        self._steps.move_to_end(key)
        if len(self._steps) > self._max_tracked_runs:
            self._steps.popitem(last=False)
            self.evicted_runs += 1

    def _stored_next_step(self, key: tuple[str, str]) -> int:
        step = max(self._unwritten.get(key, 0), self._writing.get(key, 0))
        if self._reader is not None:
            tenant, run_id = key
            try:
                (stored,) = self._reader.execute(_STORED_STEP, (run_id, tenant)).fetchone()
            except sqlite3.Error:
                logger.exception("ledger: cannot read a run's stored steps; numbering from memory")
            else:
                if stored is not None:
                    step = max(step, int(stored) + 1)
        return step

    def submit(self, record: RequestRecord) -> None:
        """Queue the record for the next flush. O(1); never blocks, never awaits."""
        if len(self._buffer) >= self._max_buffered:
            self.dropped_records += 1
            if self.dropped_records == 1 or self.dropped_records % 10_000 == 0:
                logger.error(
                    "ledger buffer full (%d records): dropped %d records so far",
                    self._max_buffered,
                    self.dropped_records,
                )
            return
        step = record.step_index
        if record.run_id is not None:
            if step is None:
                step = self.next_step_index(record.tenant, record.run_id)
            key = (record.tenant, record.run_id)
            if step >= self._unwritten.get(key, 0):
                self._unwritten[key] = step + 1
        self._buffer.append((*_record_fields(record), step))

    def submit_run_end(
        self,
        *,
        tenant: str,
        run_id: str,
        reason: str,
        ended_at_s: float,
        steps: int,
        tokens: int,
        gpu_seconds: float,
    ) -> None:
        """Record why a run ended (client_end, idle_timeout, or the run guard's code: run_steps,
        run_tokens, run_gpu_seconds, run_duration, run_loop); `ended_at_s` is unix seconds.
        O(1); written with the next batch."""
        if len(self._run_ends) < self._max_buffered:
            self._run_ends.append((tenant, run_id, reason, ended_at_s, steps, tokens, gpu_seconds))

    @property
    def buffered(self) -> int:
        """Records submitted and not yet written."""
        return len(self._buffer)

    # -- writing ---------------------------------------------------------------------------------

    async def flush(self) -> int:
        """Write the buffer (and idle/capacity growth) in one transaction now. Returns the number
        of records written. On a write error the records go back to the buffer."""
        async with self._db_lock:
            return await self._flush_locked()

    async def _flush_locked(self) -> int:
        if self._conn is None:
            raise RuntimeError("ledger not started")
        idle, capacity = self._snapshot_deltas()
        rows, self._buffer = self._buffer, []
        run_ends, self._run_ends = self._run_ends, []
        if not rows and not idle and capacity <= 0.0 and not run_ends:
            return 0
        self._writing, self._unwritten = self._unwritten, {}
        batch = _Batch(rows, idle, capacity, math.floor(self._clock() / HOUR_S) * HOUR_S, run_ends)
        work = asyncio.ensure_future(asyncio.to_thread(_write_batch, self._conn, batch))
        try:
            skipped = await _finish(work)
        finally:
            if work.done() and (work.cancelled() or work.exception() is not None):
                self._buffer[:0] = rows  # the transaction rolled back: try again next time
                self._run_ends[:0] = run_ends
                self._unsnapshot(idle, capacity)
                for key, step in self._writing.items():
                    if step > self._unwritten.get(key, 0):
                        self._unwritten[key] = step
            self._writing = {}
        if skipped:
            logger.error("ledger: skipped %d malformed records", skipped)
            self.dropped_records += skipped
        self.written_records += len(rows) - skipped
        return len(rows) - skipped

    def _snapshot_deltas(self) -> tuple[dict[str, float], float]:
        if self._snapshot_source is None:
            return {}, 0.0
        snap = self._snapshot_source()
        idle: dict[str, float] = {}
        for pool, total in snap.idle_by_pool_gpu_seconds.items():
            delta = total - self._last_idle_gpu_s.get(pool, 0.0)
            if delta < 0.0:  # a new accountant started from zero
                delta = total
            if delta > 0.0:
                idle[pool] = delta
            self._last_idle_gpu_s[pool] = total
        capacity = snap.capacity_gpu_seconds - self._last_capacity_gpu_s
        if capacity < 0.0:
            capacity = snap.capacity_gpu_seconds
        self._last_capacity_gpu_s = snap.capacity_gpu_seconds
        return idle, capacity

    def _unsnapshot(self, idle: Mapping[str, float], capacity: float) -> None:
        for pool, delta in idle.items():
            self._last_idle_gpu_s[pool] -= delta
        self._last_capacity_gpu_s -= capacity

    async def _maintain(self, now_s: float) -> None:
        deleted = await self._in_db(_delete_older_than, now_s - self._retention_s)
        if deleted:
            logger.info("ledger retention: deleted %d requests older than the window", deleted)
        self._next_maintenance_s = now_s + self._maintenance_interval_s

    async def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self._flush_interval_s)
            if self._stop.is_set():
                return  # aclose writes the rest
            try:
                await self.flush()
                now_s = self._clock()
                if now_s >= self._next_maintenance_s:
                    await self._maintain(now_s)
            except Exception:  # the task must outlive a bad disk; the rows stay buffered
                logger.exception("ledger write failed (will retry next interval)")

    # -- queries ---------------------------------------------------------------------------------

    async def run_summary(self, run_id: str, tenant: str | None) -> JsonDict | None:
        """`GET /v1/runs/{run_id}` for `tenant` (None: any tenant). See `run_summary`."""
        return await self._query(run_summary, run_id, tenant)

    async def list_runs(
        self,
        tenant: str | None,
        *,
        since_s: float | None = None,
        limit: int = 50,
        class_name: str | None = None,
        order_by: RunOrder = "last_seen",
    ) -> list[JsonDict]:
        """`GET /v1/runs` for `tenant`. See `list_runs`."""

        def query(conn: sqlite3.Connection) -> list[JsonDict]:
            return list_runs(
                conn,
                tenant,
                since_s=since_s,
                limit=limit,
                class_name=class_name,
                order_by=order_by,
            )

        return await self._query(query)

    async def totals(self, since_s: float | None = None) -> JsonDict:
        return await self._query(totals, since_s)

    async def admin_report(
        self,
        *,
        top_n: int = 10,
        tenant: str | None = None,
        since_s: float | None = None,
        live: ConservationReport | None = None,
    ) -> JsonDict:
        """`GET /admin/accounting`. See `top_runs_report`."""

        def query(conn: sqlite3.Connection) -> JsonDict:
            return top_runs_report(conn, top_n=top_n, tenant=tenant, since_s=since_s, live=live)

        return await self._query(query)

    async def _query(self, fn: Callable[..., T], *args: Any) -> T:
        """Flush first (so buffered requests are visible), then run `fn(conn, *args)`."""
        async with self._db_lock:
            try:
                await self._flush_locked()
            except Exception:  # answer from what is on disk; the rows stay buffered
                logger.exception("ledger write before a query failed")
            return await _finish(asyncio.ensure_future(asyncio.to_thread(fn, self._conn, *args)))

    async def _in_db(self, fn: Callable[..., T], *args: Any) -> T:
        async with self._db_lock:
            if self._conn is None:
                raise RuntimeError("ledger not started")
            return await _finish(asyncio.ensure_future(asyncio.to_thread(fn, self._conn, *args)))


async def _finish(work: asyncio.Future[T]) -> T:
    """Await worker-thread `work`. If the caller is cancelled, still wait for the thread to end
    before the caller lets go of the lock: one connection is never used by two threads."""
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait([work])
        raise
