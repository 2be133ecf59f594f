"""The durable GPU-seconds ledger: finished requests, rolled up per run, tenant, class and pool,
plus hourly idle/capacity totals so idle time survives a restart. Its tables live in the store
(router/store): an embedded SQLite file (WAL) at router.ledger_path, or the PostgreSQL database
router replicas share; their schema is `MIGRATIONS` (component "ledger"), applied at start.

Every write goes through one writer thread (`_Writer`, started by `start()`, joined by
`aclose()`) but durable commits to the embedded store, which the event loop makes itself
(`LoopCommit`, router/accounting/ledger_loop.py: a transaction that never waits for a lock); the
event loop never waits on the database for a lock or a checkpoint.

- Durable (`durable=True`, `router.ledger_durable`, the default): `await ledger.commit(record)`
  returns once the record is committed to the WAL. With nothing queued for the writer, the
  loop commits it (embedded store): the first of a loop iteration at once (~30 us, no thread
  round trip), the others of the iteration in one transaction at the start of the next (after
  an iteration that made more than one, under load, the first too: one commit an iteration); the
  write lock held elsewhere, an error or a slow disk send them to the thread. Otherwise commits
  are grouped: the thread writes every row queued while it was busy in one transaction and
  wakes their waiters in one callback, so concurrent requests share a commit. The router awaits
  it right before a response's final bytes, so a `kill -9` loses no record of a response the
  client received in full. `submit(record)` (O(1), never awaits) queues a record for the next
  group commit without waiting for it: refusals, errors, mid-stream failures and client
  disconnects; a kill loses those not committed yet (one commit's time; under load up to
  COMMIT_DELAY_S more). A failed commit is logged, never
  raised: the records go back to the buffer, the periodic flush retries them, and the response
  is not held or failed.
- Batched (`durable=False`, the behaviour before): `submit` appends to an in-memory buffer and
  `commit` is `submit`; a hard kill loses at most one flush interval.

A background task writes the buffer, the idle/capacity growth and run ends every
`flush_interval_s` in one transaction; `aclose()` writes everything left, so a graceful shutdown
loses nothing. Rows whose request ended more than `retention_days` ago are deleted at start and
every `maintenance_interval_s`.

Queries exist twice: sync functions over a store connection or a `sqlite3.Connection` (the CLI
reads the file with them) and async methods on `Ledger` (the HTTP layer), which first write the
buffer, so a run's latest requests are always visible. All of them return JSON-ready dicts;
see docs/accounting.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import operator
import queue
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pools.config import RouterConfig, default_of
from pools.periodic import Periodic
from router.accounting.accountant import ConservationReport
from router.accounting.ledger_loop import (
    CHECKPOINT_EVERY,
    LOOP_COMMIT_PAUSE_S,
    LOOP_COMMIT_SLOW_S,
    LoopCommit,
    checkpoint,
)
from router.accounting.ledger_queries import (
    HOUR_S,
    JsonDict,
    RunOrder,
    list_runs,
    run_summary,
    top_runs_report,
    totals,
)
from router.frozen import fast_init
from router.runtable import RunTable
from router.store import Conn, Migration, SqliteStore, Store, StoreError, migrate, savepoint, upsert

if TYPE_CHECKING:
    from router.request import RecordCompanion
    from router.store.loop_connection import LoopConnection

__all__ = [
    "MIGRATIONS",
    "OUTCOMES",
    "SCHEMA_VERSION",
    "Ledger",
    "LedgerError",
    "RequestRecord",
    "list_runs",
    "open_readonly",
    "run_summary",
    "top_runs_report",
    "totals",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

SCHEMA_VERSION = 1  # PRAGMA user_version of an embedded file (the CLI refuses newer ones)
DAY_S = 86_400.0
# Runs whose next step index is kept in memory: ~25 MB with 36-character run ids, ~47 MB at
# most (run ids are cut to 256 characters).
MAX_TRACKED_RUNS = 100_000
# The outcomes the router records; `outcome` is free text, these are the documented values.
OUTCOMES = ("ok", "client_error", "engine_error", "aborted", "rejected", "timeout")
# The longest a durable commit holds a response's final bytes: past it the response goes out,
# a warning says so, and the record is still written when the disk comes back.
COMMIT_WAIT_S = 2.0
# Group commit under concurrency: when records arrived while a commit was being written (other
# requests are finishing), the writer waits this long before the next one, so it carries many
# records (at most ~1/COMMIT_DELAY_S commits a second). A lone request (nothing arrived
# meanwhile) is committed at once. As PostgreSQL's commit_delay with commit_siblings.
COMMIT_DELAY_S = 0.002


class LedgerError(StoreError):
    """The ledger cannot be used (unreadable, or written by a newer gpupool)."""


@fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class RequestRecord:
    """One finished (or rejected) request. Times are unix seconds; durations seconds.

    `started_at_s` is the request's arrival at the router, `ended_at_s` its last byte out;
    `queue_s` the wait before dispatch. `step_index` None: the ledger numbers the run's
    requests that reached an engine 0, 1, 2, ... in submit order (see
    `Ledger.next_step_index`); one that never did (`instance` None) keeps no number.
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

_SQLITE_SCHEMA = """
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

_POSTGRES_SCHEMA = _SQLITE_SCHEMA.replace(" REAL", " DOUBLE PRECISION").replace(
    " INTEGER", " BIGINT"
)


def _sqlite_v1(conn: Conn) -> None:
    """The tables (a file written before migrations has them: adopted), and the file's
    user_version, which `open_readonly` (and gpupool before the store) checks."""
    (version,) = conn.execute("PRAGMA user_version").fetchone()
    if int(version) > SCHEMA_VERSION:
        raise LedgerError(
            f"ledger schema version {version} is newer than this gpupool's ({SCHEMA_VERSION})"
        )
    for statement in _SQLITE_SCHEMA.split(";"):
        if statement.strip():
            conn.execute(statement)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


MIGRATIONS = (
    Migration(
        "ledger",
        1,
        "requests, idle_hourly, capacity_hourly, run_ends",
        _sqlite_v1,
        _POSTGRES_SCHEMA,
    ),
)

_INSERT = upsert("requests", ("request_id",), (*_FIELDS_BUT_STEP[1:], "step_index"))
# one INSERT of many rows: a group commit is one statement (one step on the writer thread)
_INSERT_ROWS_HEAD = _INSERT[: _INSERT.index("VALUES") + len("VALUES ")]
_INSERT_ROWS_TAIL = _INSERT[_INSERT.index(" ON CONFLICT") :]
_ONE_ROW = "(" + ", ".join("?" for _ in _COLUMNS) + ")"
_ADD_IDLE = (
    "INSERT INTO idle_hourly (hour_start_s, pool, idle_gpu_seconds) VALUES (?, ?, ?) "
    "ON CONFLICT (hour_start_s, pool) DO UPDATE SET "
    "idle_gpu_seconds = idle_hourly.idle_gpu_seconds + excluded.idle_gpu_seconds"
)
_ADD_RUN_END = (
    "INSERT INTO run_ends (tenant, run_id, reason, ended_at_s, steps, tokens, gpu_seconds)"
    " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, run_id, ended_at_s) DO UPDATE SET"
    " reason = excluded.reason, steps = excluded.steps, tokens = excluded.tokens,"
    " gpu_seconds = excluded.gpu_seconds"
)
_ADD_CAPACITY = (
    "INSERT INTO capacity_hourly (hour_start_s, capacity_gpu_seconds) VALUES (?, ?) "
    "ON CONFLICT (hour_start_s) DO UPDATE SET "
    "capacity_gpu_seconds = capacity_hourly.capacity_gpu_seconds + excluded.capacity_gpu_seconds"
)


# ---------------------------------------------------------------------------------------------
# Opening the file
# ---------------------------------------------------------------------------------------------


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


def _write_batch(conn: Conn, batch: _Batch, bad_row: tuple[type[Exception], ...] = ()) -> int:
    """One transaction. Returns how many rows were malformed (`bad_row` errors) and skipped
    (they would otherwise fail every retry); disk, lock and connection errors roll everything
    back and raise."""
    skipped = 0
    with conn.transaction():
        try:
            with savepoint(conn, "batch_rows"):
                conn.executemany(_INSERT, batch.rows)
        except bad_row:
            for row in batch.rows:  # find the bad rows; the upsert makes a re-insert idempotent
                try:
                    with savepoint(conn, "one_row"):
                        conn.execute(_INSERT, row)
                except bad_row:
                    skipped += 1
        for pool, idle_gpu_s in batch.idle_by_pool_gpu_s.items():
            conn.execute(_ADD_IDLE, (batch.hour_start_s, pool, idle_gpu_s))
        if batch.capacity_gpu_s > 0.0:
            conn.execute(_ADD_CAPACITY, (batch.hour_start_s, batch.capacity_gpu_s))
        if batch.run_ends:
            conn.executemany(_ADD_RUN_END, batch.run_ends)
    return skipped


@functools.lru_cache(maxsize=64)
def _insert_rows_sql(n: int) -> str:
    """One INSERT (upsert) of `n` rows."""
    return _INSERT_ROWS_HEAD + ", ".join([_ONE_ROW] * n) + _INSERT_ROWS_TAIL


def _insert_rows(
    conn: Conn, rows: list[_Row], max_rows: int, bad_row: tuple[type[Exception], ...]
) -> int:
    """Write `rows` in one transaction: one multi-row INSERT (its own transaction), or, with a
    malformed row or more than `max_rows`, `_write_batch` (which skips what is malformed).
    Returns how many rows were skipped."""
    if len(rows) <= max_rows:
        try:
            conn.execute(_insert_rows_sql(len(rows)), [value for row in rows for value in row])
        except bad_row:
            pass  # nothing was written: find the bad rows below
        else:
            return 0
    return _write_batch(conn, _Batch(rows, {}, 0.0, 0), bad_row)


@functools.lru_cache(maxsize=8)
def _with_companion_sql(companion_sql: str) -> str:
    """One row's INSERT after `companion_sql` (a data-modifying statement), in one statement."""
    return f"WITH companion AS ({companion_sql}) {_insert_rows_sql(1)}"


@functools.lru_cache(maxsize=8)
def _numbered_insert_sql(step_sql: str) -> str:
    """One row's INSERT whose step index comes from `step_sql`'s row (its first column, the
    step + 1), both in one statement: `step_sql`'s row is what it returns."""
    values = ", ".join(["?"] * (len(_COLUMNS) - 1) + ["(SELECT next_step - 1 FROM step)"])
    return (
        f"WITH step AS ({step_sql}), rec AS ({_INSERT_ROWS_HEAD}({values}){_INSERT_ROWS_TAIL})"
        " SELECT * FROM step"
    )


def _delete_older_than(conn: Conn, cutoff_s: float) -> int:
    with conn.transaction():
        deleted = conn.execute("DELETE FROM requests WHERE ended_at_s < ?", (cutoff_s,)).rowcount
        hour = math.floor(cutoff_s / HOUR_S) * HOUR_S
        conn.execute("DELETE FROM idle_hourly WHERE hour_start_s < ?", (hour,))
        conn.execute("DELETE FROM capacity_hourly WHERE hour_start_s < ?", (hour,))
        conn.execute("DELETE FROM run_ends WHERE ended_at_s < ?", (cutoff_s,))
    return int(deleted)


def _recent_steps(conn: Conn, since_s: float, limit: int) -> list[tuple[str, str, int, float]]:
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


# ---------------------------------------------------------------------------------------------
# The writer thread
# ---------------------------------------------------------------------------------------------

_RUN_AT = _FIELDS_BUT_STEP.index("run_id")
_TENANT_AT = _FIELDS_BUT_STEP.index("tenant")
_STEP_AT = len(_FIELDS_BUT_STEP)
# rows, their waiters (None: nobody waits), malformed rows skipped, the error (None: committed)
_OnCommit = Callable[[list[_Row], list["asyncio.Future[bool] | None"], int, Exception | None], None]


@dataclass(frozen=True, slots=True)
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    done: asyncio.Future[Any]


_STOP = object()
_NO_WAITER: list[asyncio.Future[bool] | None] = [None]


def _resolve(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.done():  # its waiter gave up (cancelled, timed out)
        return
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)


class _Writer:
    """The ledger's one writer: a thread fed by a queue, taking a store connection per
    transaction (the embedded store's is the thread's own; PostgreSQL's comes from the pool, a
    new one after the server restarted).

    Rows queued with `put` are written in group commits: the thread takes every row queued
    while it was busy and writes them in one transaction (`_write_batch`: one WAL commit), then
    hands the outcome to `on_commit` on the event loop in one callback. `call(fn, *args)` runs
    `fn(conn, *args)` on the thread after every row queued before it, and its future gets the
    result. Order: rows commit in `put` order; a job sees every row put before it.
    """

    def __init__(
        self,
        store: Store,
        loop: asyncio.AbstractEventLoop,
        on_commit: _OnCommit,
        *,
        delay_s: float = COMMIT_DELAY_S,
    ) -> None:
        self._store = store
        self._delay_s = delay_s
        # rows one INSERT may carry (the backend's limit on bound variables)
        self._max_rows = store.max_params // len(_COLUMNS)
        self._loop = loop
        self._on_commit = on_commit
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._main, name="gpupool-ledger-writer", daemon=True
        )
        self.commits = 0  # transactions of rows (a group commit each)

    def start(self) -> None:
        self._thread.start()

    def put(self, row: _Row, waiter: asyncio.Future[bool] | None) -> None:
        self._queue.put((row, waiter))

    def call(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        done: asyncio.Future[T] = self._loop.create_future()
        self._queue.put(_Job(fn, args, done))
        return done

    async def aclose(self) -> None:
        """Write what is queued, stop the thread."""
        self._queue.put(_STOP)
        await asyncio.to_thread(self._thread.join)

    # -- on the thread ---------------------------------------------------------------------

    def _main(self) -> None:
        while True:
            items = [self._queue.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    items.append(self._queue.get_nowait())
            rows: list[_Row] = []
            waiters: list[asyncio.Future[bool] | None] = []
            for item in items:
                if item is _STOP:
                    self._commit(rows, waiters)
                    return
                if isinstance(item, _Job):
                    self._commit(rows, waiters)
                    rows, waiters = [], []
                    self._run(item)
                else:
                    rows.append(item[0])
                    waiters.append(item[1])
            self._commit(rows, waiters)
            if self._delay_s > 0.0 and not self._queue.empty():
                time.sleep(self._delay_s)  # others arrived meanwhile: let more join them

    def _commit(self, rows: list[_Row], waiters: list[asyncio.Future[bool] | None]) -> None:
        if not rows:
            return
        error: Exception | None = None
        skipped = 0
        try:
            with self._store.connection() as conn:
                skipped = _insert_rows(conn, rows, self._max_rows, self._store.data_errors)
            self.commits += 1
        except Exception as err:  # handed to the event loop: logged there, rows retried
            error = err
        self._post(self._on_commit, rows, waiters, skipped, error)

    def _run(self, job: _Job) -> None:
        try:
            with self._store.connection() as conn:
                result = job.fn(conn, *job.args)
        except Exception as err:
            self._post(_resolve, job.done, None, err)
        else:
            self._post(_resolve, job.done, result, None)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to tell
            self._loop.call_soon_threadsafe(fn, *args)


class Ledger:
    """Writes request records to the store: each durably before its response ends (`commit`),
    or buffered and written in batches (`submit`; see the module's docstring).

    `store`: the router's store (opened and closed by its owner), or a path: an embedded store
    of its own, opened and closed here.

    `clock` is wall time (unix seconds): retention and hourly buckets. `snapshot_source`,
    when given, is polled on the event loop at every flush (e.g.
    `lambda: accountant.conservation(loop.time())`); the growth of its cumulative idle per pool
    and capacity since the last poll is added to the hourly tables.
    """

    def __init__(
        self,
        store: Store | Path,
        *,
        flush_interval_s: float = default_of(RouterConfig, "ledger_flush_interval_s"),
        retention_days: float = 30.0,
        clock: Callable[[], float] = time.time,
        snapshot_source: Callable[[], ConservationReport] | None = None,
        maintenance_interval_s: float = 3600.0,
        step_memory_s: float = DAY_S,
        max_buffered_records: int = 200_000,
        max_tracked_runs: int = MAX_TRACKED_RUNS,
        durable: bool = True,
        commit_wait_s: float = COMMIT_WAIT_S,
        runs: RunTable | None = None,
        loop_commit_slow_s: float = LOOP_COMMIT_SLOW_S,
        loop_commit_pause_s: float = LOOP_COMMIT_PAUSE_S,
        checkpoint_every: int = CHECKPOINT_EVERY,
    ) -> None:
        if flush_interval_s <= 0 or retention_days <= 0:
            raise ValueError("flush_interval_s and retention_days must be > 0")
        if max_tracked_runs < 1:
            raise ValueError("max_tracked_runs must be >= 1")
        if checkpoint_every < 1:
            raise ValueError("checkpoint_every must be >= 1")
        self._checkpoint_every = checkpoint_every
        self.checkpoints = 0  # WAL checkpoints after commits on the loop
        self._owned = isinstance(store, Path)
        self.store: Store = SqliteStore(store) if isinstance(store, Path) else store
        self._flush_interval_s = flush_interval_s
        self._retention_s = retention_days * DAY_S
        self._clock = clock
        self._snapshot_source = snapshot_source
        self._maintenance_interval_s = maintenance_interval_s
        self._step_memory_s = step_memory_s
        self._max_buffered = max_buffered_records
        self.durable = durable
        self._commit_wait_s = commit_wait_s
        self._buffer: list[_Row] = []
        self._run_ends: list[_Row] = []  # why runs ended, written with the next batch
        # Step numbering. Each run's next step index is kept in its record of `runs`, the
        # router's one `RunTable` (router.runtable; without one the ledger keeps its own of
        # `max_tracked_runs`): bounded, a run with a step in flight never forgotten. A run not
        # in it continues after the highest step stored: in the file, in the buffer
        # (`_unwritten`), in the batch being written (`_writing`) or queued for a group commit
        # (`_committing`); those hold (tenant, run_id) -> highest step + 1 and are bounded by
        # the buffer and the queue.
        self._max_tracked_runs = max_tracked_runs if runs is None else runs.max_runs
        self._runs = runs if runs is not None else RunTable(max_tracked_runs)
        self._unwritten: dict[tuple[str, str], int] = {}
        self._writing: dict[tuple[str, str], int] = {}
        self._committing: dict[tuple[str, str], int] = {}
        self._last_idle_gpu_s: dict[str, float] = {}
        self._last_capacity_gpu_s = 0.0
        self._started = False
        self._writer: _Writer | None = None  # every write but lone durable commits
        # lone durable commits on the loop (ledger_loop.py): the embedded store, durable only
        self._loop_commit: LoopCommit | None = None
        # records committed on the loop after the first of their iteration, and their waiters
        self._loop_group: list[_Row] = []
        self._loop_waiters: list[asyncio.Future[bool]] = []
        self._loop_group_armed = False  # `_commit_loop_group` is scheduled
        # the last iteration's loop commits were more than one: under load, the first of an
        # iteration joins its group too (one transaction an iteration, not two)
        self._loop_busy = False
        self._loop_lead = 0  # this iteration's commit made at once (0 or 1)
        if durable and isinstance(self.store, SqliteStore):
            self._loop_commit = LoopCommit(
                self.store.path,
                _insert_rows_sql,
                len(_COLUMNS),
                slow_s=loop_commit_slow_s,
                pause_s=loop_commit_pause_s,
            )
        # lone durable commits awaited on the loop (router/store/loop_connection.py):
        # PostgreSQL, durable only
        self._async_commit: LoopConnection | None = None
        if durable and self.store.dialect == "postgresql":
            from router.store import PostgresStore
            from router.store.loop_connection import LoopConnection

            assert isinstance(self.store, PostgresStore)
            self._async_commit = LoopConnection(
                self.store, "gpupool-ledger", timeout_s=commit_wait_s
            )
        self._queued = 0  # rows put to the writer and not yet committed (or failed)
        # durable commits' waiters, oldest first, with their deadlines (loop time); one timer
        # answers those past `commit_wait_s` (cheaper than a timeout per request)
        self._waiters: deque[tuple[float, asyncio.Future[bool]]] = deque()
        self._watchdog: asyncio.TimerHandle | None = None
        self._db_lock = asyncio.Lock()
        # a flush in progress finishes on close (aclose then writes the rest)
        self._flush_loop = Periodic(
            "gpupool-ledger-flush", self._flush_and_maintain, flush_interval_s, interrupt_tick=False
        )
        self._next_maintenance_s = math.inf
        self.dropped_records = 0  # lost: buffer full (disk stalled) or malformed
        self.written_records = 0
        self.failed_commits = 0  # group commits that failed (their rows went back to the buffer)
        self.late_commits = 0  # durable commits that took longer than `commit_wait_s`
        self._failing = False  # the last write failed (the store unreachable): say when it heals

    @classmethod
    def from_config(
        cls,
        config: RouterConfig,
        *,
        clock: Callable[[], float] = time.time,
        snapshot_source: Callable[[], ConservationReport] | None = None,
        runs: RunTable | None = None,
        store: Store | None = None,
    ) -> Ledger:
        """`store`: the router's (router.store.Stores); none: the embedded file at
        `config.ledger_path`."""
        return cls(
            config.ledger_path if store is None else store,
            flush_interval_s=config.ledger_flush_interval_s,
            retention_days=config.ledger_retention_days,
            clock=clock,
            snapshot_source=snapshot_source,
            durable=config.ledger_durable,
            runs=runs,
        )

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Open (or create) the tables (migrations), apply retention, load the step counters of
        the most recent runs (at most `max_tracked_runs`, active in the last `step_memory_s`;
        others are read when they come back) and start the flush task. Raises `StoreError`
        (`LedgerError` for a ledger of a newer gpupool) when the store cannot be used."""
        if self._started:
            raise RuntimeError("ledger already started")
        if self._owned:
            await asyncio.to_thread(self.store.open)
        try:
            await asyncio.to_thread(migrate, self.store, MIGRATIONS)
        except BaseException:
            if self._owned:
                await asyncio.to_thread(self.store.close)
            raise
        self._started = True
        self._writer = _Writer(self.store, asyncio.get_running_loop(), self._committed)
        self._writer.start()
        now_s = self._clock()
        try:
            await self._maintain(now_s)
            recent = await self._in_db(
                _recent_steps, now_s - self._step_memory_s, self._max_tracked_runs
            )
            if self._loop_commit is not None:
                await asyncio.to_thread(self._loop_commit.open)
            if self._async_commit is not None:
                await self._async_commit.open()
        except BaseException:
            self._started = False
            writer, self._writer = self._writer, None
            await writer.aclose()
            if self._loop_commit is not None:
                self._loop_commit.close()
            if self._async_commit is not None:
                await self._async_commit.aclose()
            if self._owned:
                await asyncio.to_thread(self.store.close)
            raise
        for tenant, run_id, step, _ in recent:  # oldest first: the newest end up most recent
            key = (tenant, run_id)
            known = self._runs.get(key)
            next_step = None if known is None else known.next_step
            self._remember(key, max(step + 1, next_step or 0))
        self._flush_loop.start()

    async def aclose(self) -> None:
        """Stop the flush task, write everything buffered, close the store (when its own).
        Idempotent."""
        await self._flush_loop.aclose()
        self._commit_loop_group()  # those of the last iteration: before the writer stops
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if not self._started:
            if self._buffer:
                logger.warning("ledger closed before start: %d records not written", self.buffered)
            return
        try:
            await self.flush()
        finally:
            self._started = False
            writer, self._writer = self._writer, None
            async with self._db_lock:
                if self._loop_commit is not None:
                    self._loop_commit.close()
                if self._async_commit is not None:
                    await self._async_commit.aclose()
                if writer is not None:
                    await writer.aclose()  # what is queued is written first
                if self._owned:
                    await asyncio.to_thread(self.store.close)
            if self._buffer:  # a group commit failed at the end
                logger.error("ledger closed: %d records not written", len(self._buffer))

    # -- the request path (sync, O(1)) -----------------------------------------------------------

    def next_step_index(self, tenant: str, run_id: str) -> int:
        """Reserve the run's next step index: 0, 1, 2, ... per tenant and run id. Call it at
        arrival to number steps in arrival order; `submit` calls it when `step_index` is None.

        The counters of the `max_tracked_runs` most recently used runs stay in memory (O(1), no
        I/O), so random run ids cannot grow memory. A run not among them (new, evicted, or from
        before a restart) continues after the highest step stored for it, found with one
        indexed read of the embedded store (WAL: no waiting on the writer; ~6-8 us with the page
        cached) and the unwritten buffer. With PostgreSQL the read would be a network round trip
        on the event loop (seconds in an outage), so it is not made: the runs of the last
        `step_memory_s` are loaded at start, and a run older than that (or evicted) that comes
        back continues from what memory holds (docs/replicas.md).
        A run with a step in flight is never forgotten (the run table's rule), so a step
        number is never reused while its request runs.
        """
        key = (tenant, run_id)
        known = self._runs.get(key)
        step = None if known is None else known.next_step
        if step is None:
            step = self._stored_next_step(key)
        self._remember(key, step + 1)
        return step

    @property
    def tracked_runs(self) -> int:
        """Runs kept in memory (at most `max_tracked_runs`, but for runs with a step in
        flight; with the router's shared run table, every run it keeps)."""
        return len(self._runs)

    @property
    def evicted_runs(self) -> int:
        """Runs forgotten from memory to keep the bound (they may come back)."""
        return self._runs.evicted

    def _remember(self, key: tuple[str, str], next_step: int) -> None:
        self._runs.touch(key).next_step = next_step

    def _stored_next_step(self, key: tuple[str, str]) -> int:
        step = max(
            self._unwritten.get(key, 0),
            self._writing.get(key, 0),
            self._committing.get(key, 0),
        )
        if self._started and self.store.dialect == "sqlite":
            tenant, run_id = key
            failures: tuple[type[Exception], ...] = (StoreError, *self.store.errors)
            try:
                with self.store.connection() as conn:
                    (stored,) = conn.execute(_STORED_STEP, (run_id, tenant)).fetchone()
            except failures:
                logger.exception("ledger: cannot read a run's stored steps; numbering from memory")
            else:
                if stored is not None:
                    step = max(step, int(stored) + 1)
        return step

    def submit(self, record: RequestRecord) -> None:
        """Queue the record without waiting: for the next group commit (durable, started), else
        for the next flush. O(1); never blocks, never awaits."""
        writer = self._writer if self.durable else None
        row = self._row(record, queued=writer is not None)
        if row is not None and writer is not None:
            writer.put(row, None)

    async def commit(self, record: RequestRecord, companion: RecordCompanion | None = None) -> bool:
        """Write the record durably and return once it is committed (True). Concurrent commits
        share a transaction. False, never an exception, when the record is not on disk yet: the
        commit failed (logged; the record is retried with the next flush), took longer than
        `commit_wait_s` (logged; it is still written), the buffer was full, or the ledger is not
        durable or not started (then this is `submit`). `companion`: a write committed in the
        same statement when the record goes as a lone PostgreSQL commit (`carried`), else
        `declined` at once, before any wait."""
        writer = self._writer if self.durable else None
        row = self._row(record, queued=writer is not None)
        if companion is not None and (
            row is None or writer is None or not self._lone_async_commit()
        ):
            companion.declined()
            companion = None
        if row is None or writer is None:
            return False
        loop = asyncio.get_running_loop()
        # Nothing queued for the writer before it (whose order to keep) and healthy: committed
        # from the loop (ledger_loop.py). The first of a loop iteration at once; the others of
        # the same iteration together, at the start of the next (one transaction); after an
        # iteration with more than one (under load), the first joins its group too. Locked,
        # slow or failing, it goes to the writer thread.
        loop_commit = self._loop_commit
        group = self._loop_group
        if loop_commit is not None and self._queued - len(group) == 1 and not self._failing:
            armed = self._loop_group_armed
            if not armed and not self._loop_busy and loop_commit.commit((row,)):
                self._committed([row], _NO_WAITER, 0, None)
                self._loop_lead = 1
                self._loop_group_armed = True
                loop.call_soon(self._commit_loop_group)
                return True
            if (armed or self._loop_busy) and loop_commit.active:
                if not armed:  # under load: the first of the iteration waits for its group
                    self._loop_lead = 0
                    self._loop_group_armed = True
                    loop.call_soon(self._commit_loop_group)
                waiter: asyncio.Future[bool] = loop.create_future()
                group.append(row)
                self._loop_waiters.append(waiter)
                return await waiter
        # PostgreSQL: a lone commit (nothing else queued or in flight) is one INSERT awaited on
        # the loop (router/store/loop_connection.py), sparing the writer thread's round trip.
        # Failed or not answered within `commit_wait_s`: buffered for the next flush, as a
        # failed group commit's rows (an upsert: a row that did land counts once).
        async_commit = self._async_commit
        if async_commit is not None and self._lone_async_commit():
            sql, params = _insert_rows_sql(1), row
            if companion is not None:  # one statement: the companion's, then the record's
                sql, params = _with_companion_sql(companion.sql), (*companion.params, *row)
            try:
                await async_commit.execute(sql, params)
            except Exception as err:
                self._committed([row], _NO_WAITER, 0, err)
                if companion is not None:
                    companion.declined()
                return False
            except BaseException:  # cancelled: the writer writes it (an upsert)
                writer.put(row, None)
                if companion is not None:
                    companion.declined()
                raise
            self._committed([row], _NO_WAITER, 0, None)
            if companion is not None:
                companion.carried()
            return True
        return await self._commit_on_writer(writer, loop, row)

    def _lone_async_commit(self) -> bool:
        """`commit` goes as one INSERT on the loop's PostgreSQL connection now: nothing else
        queued (this record counted) or failing, the connection idle."""
        conn = self._async_commit
        return conn is not None and self._queued == 1 and not self._failing and conn.ready()

    @property
    def numbers_steps(self) -> bool:
        """`commit_numbered` can commit a record with its step's statement (PostgreSQL,
        durable)."""
        return self._async_commit is not None

    async def commit_numbered(
        self, record: RequestRecord, step_sql: str, step_params: Sequence[Any]
    ) -> tuple[Any, ...] | None:
        """`commit`, in one statement with `step_sql`, a data-modifying statement returning
        one row whose first column is the record's step index + 1 (a run's step number, as
        router/governance/shared.py's `NEXT_STEP_SQL` takes it): the record is written with
        that step index, and the statement's row is returned. One round trip for both.

        None when it cannot go that way now (not PostgreSQL or not durable, another commit
        queued or in flight, the last one failed): nothing is written; number the step
        otherwise, then `commit`. () when the statement failed or did not answer within
        `commit_wait_s`: the record is buffered for the next flush (with `record.step_index`)
        as a failed commit's, and the step was not numbered."""
        writer = self._writer if self.durable else None
        conn = self._async_commit
        if writer is None or conn is None or self._queued or self._failing or not conn.ready():
            return None
        row = self._row(record, queued=True)
        if row is None:  # the buffer is full: dropped (counted)
            return ()
        try:
            rows = await conn.execute(_numbered_insert_sql(step_sql), (*step_params, *row[:-1]))
        except Exception as err:
            self._committed([row], _NO_WAITER, 0, err)
            return ()
        except BaseException:  # cancelled: the writer writes it (an upsert), unnumbered
            writer.put(row, None)
            raise
        self._committed([row], _NO_WAITER, 0, None)
        return rows[0] if rows else ()

    async def _commit_on_writer(
        self, writer: _Writer, loop: asyncio.AbstractEventLoop, row: _Row
    ) -> bool:
        waiter: asyncio.Future[bool] = loop.create_future()
        self._hand_to_writer(writer, loop, row, waiter)
        return await waiter

    def _hand_to_writer(
        self,
        writer: _Writer,
        loop: asyncio.AbstractEventLoop,
        row: _Row,
        waiter: asyncio.Future[bool],
    ) -> None:
        writer.put(row, waiter)
        self._waiters.append((loop.time() + self._commit_wait_s, waiter))
        if self._watchdog is None:
            self._watchdog = loop.call_later(self._commit_wait_s, self._expire_waiters)

    def _commit_loop_group(self) -> None:
        """At the start of the loop iteration after a commit on the loop: commit the records
        that came after it in its iteration, in one transaction; failing that, hand them to
        the writer thread."""
        self._loop_group_armed = False
        rows, waiters = self._loop_group, self._loop_waiters
        self._loop_busy = self._loop_lead + len(rows) > 1
        if not rows:
            return
        self._loop_group, self._loop_waiters = [], []
        loop_commit, writer = self._loop_commit, self._writer
        if writer is None or loop_commit is None:  # closed meanwhile: the buffer keeps them
            self._queued -= len(rows)
            self._buffer.extend(rows)
            for waiter in waiters:
                _resolve(waiter, False, None)
            return
        if not self._failing and loop_commit.commit(rows):
            self._committed(rows, list(waiters), 0, None)
            return
        loop = asyncio.get_running_loop()
        for row, waiter in zip(rows, waiters, strict=True):
            self._hand_to_writer(writer, loop, row, waiter)

    def _expire_waiters(self) -> None:
        """Answer False to the commits waiting longer than `commit_wait_s`; re-arm."""
        self._watchdog = None
        waiters = self._waiters
        loop = asyncio.get_running_loop()
        now = loop.time()
        while waiters:
            deadline, waiter = waiters[0]
            if not waiter.done():
                if deadline > now:
                    self._watchdog = loop.call_at(deadline, self._expire_waiters)
                    return
                waiter.set_result(False)
                self.late_commits += 1
                if self.late_commits == 1 or self.late_commits % 1000 == 0:
                    logger.warning(
                        "ledger: a durable commit took over %g s (%d so far); answered "
                        "without it (it is still written)",
                        self._commit_wait_s,
                        self.late_commits,
                    )
            waiters.popleft()

    def _row(self, record: RequestRecord, *, queued: bool) -> _Row | None:
        """The record's row, its step numbered, counted as buffered (`queued`: in the writer's
        queue, else in `_buffer`). None when the buffer is full (dropped and counted)."""
        if len(self._buffer) + self._queued >= self._max_buffered:
            self.dropped_records += 1
            if self.dropped_records == 1 or self.dropped_records % 10_000 == 0:
                logger.error(
                    "ledger buffer full (%d records): dropped %d records so far",
                    self._max_buffered,
                    self.dropped_records,
                )
            return None
        step = record.step_index
        # a run's request that never reached an engine (no instance: refused, timed out or
        # left while queued) is not a step of the run and takes no number; with a shared store
        # a number from this ledger's own counter could be one another replica's step has
        if record.run_id is not None and (step is not None or record.instance is not None):
            if step is None:
                step = self.next_step_index(record.tenant, record.run_id)
            key = (record.tenant, record.run_id)
            pending = self._committing if queued else self._unwritten
            if step >= pending.get(key, 0):
                pending[key] = step + 1
        row = (*_record_fields(record), step)
        if queued:
            self._queued += 1
        else:
            self._buffer.append(row)
        return row

    def _committed(
        self,
        rows: list[_Row],
        waiters: list[asyncio.Future[bool] | None],
        skipped: int,
        error: Exception | None,
    ) -> None:
        """On the event loop, after a group commit of `rows` (the writer's `on_commit`)."""
        self._queued -= len(rows)
        for row in rows:
            run_id = row[_RUN_AT]
            if run_id is None:
                continue
            key = (row[_TENANT_AT], run_id)
            step = row[_STEP_AT]
            if self._committing.get(key) == step + 1:  # no later step of it is queued
                del self._committing[key]
            if error is not None and step + 1 > self._unwritten.get(key, 0):
                self._unwritten[key] = step + 1
        if error is None:
            if skipped:
                logger.error("ledger: skipped %d malformed records", skipped)
                self.dropped_records += skipped
            self.written_records += len(rows) - skipped
        else:
            self.failed_commits += 1
            self._failing = True
            self._buffer.extend(rows)  # the next flush retries them
            if self.failed_commits == 1 or self.failed_commits % 1000 == 0:
                logger.error(
                    "ledger: a group commit of %d records failed (%d failures so far; the "
                    "records stay buffered and are retried, responses are not held): %s",
                    len(rows),
                    self.failed_commits,
                    error,
                )
        for waiter in waiters:
            if waiter is not None:
                _resolve(waiter, error is None, None)

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
        """Records submitted and not yet written (buffered, or queued for a group commit)."""
        return len(self._buffer) + self._queued

    @property
    def group_commits(self) -> int:
        """Transactions of request rows committed: the writer's group commits and the lone
        commits made on the event loop."""
        writer = 0 if self._writer is None else self._writer.commits
        return writer + self.loop_commits

    @property
    def loop_commits(self) -> int:
        """Durable commits made on the event loop (one record each; ledger_loop.py, and
        router/store/loop_connection.py with PostgreSQL)."""
        on_pg = 0 if self._async_commit is None else self._async_commit.statements
        return on_pg + (0 if self._loop_commit is None else self._loop_commit.commits)

    # -- writing ---------------------------------------------------------------------------------

    async def flush(self) -> int:
        """Write the buffer (and idle/capacity growth) in one transaction now, after every
        record queued for a group commit. Returns the number of buffered records written. On a
        write error the records go back to the buffer."""
        async with self._db_lock:
            written = await self._flush_locked()
            await self._checkpoint_locked()
            return written

    async def _checkpoint_locked(self) -> None:
        """Checkpoint the WAL on the writer thread once `checkpoint_every` commits were made on
        the loop (whose connection never checkpoints)."""
        loop_commit, writer = self._loop_commit, self._writer
        if loop_commit is None or writer is None:
            return
        if loop_commit.since_checkpoint < self._checkpoint_every:
            return
        due = loop_commit.since_checkpoint
        try:
            await _finish(writer.call(checkpoint))
        except Exception:  # retried at the next flush; the records are committed already
            logger.exception("ledger: WAL checkpoint failed")
            return
        loop_commit.since_checkpoint -= due  # those made meanwhile count to the next one
        self.checkpoints += 1

    async def _flush_locked(self) -> int:
        writer = self._writer
        if writer is None:
            raise RuntimeError("ledger not started")
        idle, capacity = self._snapshot_deltas()
        rows, self._buffer = self._buffer, []
        run_ends, self._run_ends = self._run_ends, []
        if not rows and not idle and capacity <= 0.0 and not run_ends:
            if self._queued:  # wait for the group commits under way (queries see them)
                await _finish(writer.call(_nothing))
            return 0
        self._writing, self._unwritten = self._unwritten, {}
        batch = _Batch(rows, idle, capacity, math.floor(self._clock() / HOUR_S) * HOUR_S, run_ends)
        work = writer.call(_write_batch, batch, self.store.data_errors)
        try:
            skipped = await _finish(work)
        finally:
            if work.done() and (work.cancelled() or work.exception() is not None):
                self._failing = True
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
        if self._failing:
            self._failing = False
            logger.warning(
                "ledger: the store answers again: wrote %d records kept while it did not",
                len(rows) - skipped,
            )
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
        if self._writer is None:
            raise RuntimeError("ledger not started")
        async with self._db_lock:
            deleted = await _finish(
                self._writer.call(_delete_older_than, now_s - self._retention_s)
            )
        if deleted:
            logger.info("ledger retention: deleted %d requests older than the window", deleted)
        self._next_maintenance_s = now_s + self._maintenance_interval_s

    async def _flush_and_maintain(self) -> None:
        """The flush loop's tick, every `flush_interval_s`. A failure (a bad disk) is logged
        and retried next interval; the rows stay buffered."""
        await self.flush()
        now_s = self._clock()
        if now_s >= self._next_maintenance_s:
            await self._maintain(now_s)

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

        def query(conn: Conn) -> list[JsonDict]:
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

        def query(conn: Conn) -> JsonDict:
            return top_runs_report(conn, top_n=top_n, tenant=tenant, since_s=since_s, live=live)

        return await self._query(query)

    async def _query(self, fn: Callable[..., T], *args: Any) -> T:
        """Flush first (so buffered requests are visible), then run `fn(conn, *args)`."""
        async with self._db_lock:
            try:
                await self._flush_locked()
            except Exception:  # answer from what is on disk; the rows stay buffered
                logger.exception("ledger write before a query failed")
            return await _finish(
                asyncio.ensure_future(asyncio.to_thread(self._with_conn, fn, *args))
            )

    async def _in_db(self, fn: Callable[..., T], *args: Any) -> T:
        async with self._db_lock:
            if not self._started:
                raise RuntimeError("ledger not started")
            return await _finish(
                asyncio.ensure_future(asyncio.to_thread(self._with_conn, fn, *args))
            )

    def _with_conn(self, fn: Callable[..., T], *args: Any) -> T:
        with self.store.connection() as conn:
            return fn(conn, *args)


def _nothing(conn: Conn) -> None:
    """A writer job that does nothing: awaiting it waits for every row queued before it."""


async def _finish(work: asyncio.Future[T]) -> T:
    """Await worker-thread `work`. If the caller is cancelled, still wait for the thread to end
    before the caller lets go of the lock (one connection is never used by two threads; a write
    that was cancelled here has still happened or failed)."""
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait([work])
        raise
