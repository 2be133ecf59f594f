"""The durable ledger's commit on the event loop (the embedded SQLite store only).

A lone durable commit handed to the writer thread costs a thread round trip (the writer's
wake-up, the GIL hand-over, `call_soon_threadsafe`, the loop's wake-up): ~60 us of CPU beside
the ~30 us INSERT itself, and at one request in flight the largest single cost of the request
path (benchmarks/router_overhead/notes.md). `LoopCommit` writes such a record from the event
loop instead: one INSERT on a connection of its own, committed to the WAL exactly as the
writer's (`synchronous=NORMAL`: it survives a process kill), before the response's final bytes.

The loop never waits on the database for it:

- the connection's busy timeout is 0: when another connection holds the write lock (the
  writer's flush or group commit, maintenance, another process) the INSERT fails at once,
  nothing is written, and the ledger hands the record to the writer thread as before;
- it never checkpoints (`wal_autocheckpoint=0`); the writer thread checkpoints the WAL every
  `CHECKPOINT_EVERY` loop commits (PASSIVE: never blocks a writer) and on its own commits;
- a commit that took longer than `slow_s` (a stalled disk: `write()` throttled) switches the
  loop path off for `pause_s`, doubled each time the first loop commit after a pause is slow
  again (up to `max_pause_s`), reset by a fast one; commits go to the writer thread meanwhile.
  The time is wall time, so a router preempted mid-commit on a busy machine pauses it too: a
  short pause, the writer thread's path as before, harmless.

Any error (a malformed record, a broken disk) is not handled here: nothing was written, and the
writer thread's path (which skips malformed rows, logs, retries) takes the record.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from router.store import Conn

__all__ = [
    "CHECKPOINT_EVERY",
    "LOOP_COMMIT_MAX_PAUSE_S",
    "LOOP_COMMIT_PAUSE_S",
    "LOOP_COMMIT_SLOW_S",
    "LoopCommit",
    "checkpoint",
]

logger = logging.getLogger(__name__)

# A loop commit slower than this (a stalled disk: `write()` throttled) sends commits to the
# writer thread for LOOP_COMMIT_PAUSE_S, doubling up to LOOP_COMMIT_MAX_PAUSE_S while the disk
# stays slow. A normal one takes ~30 us; wall time, so a process preempted mid-commit on a
# loaded machine (5-10 ms seen, more under py-spy) pauses it too: hence a bound well above
# that, and a first pause short enough that a false alarm costs little.
LOOP_COMMIT_SLOW_S = 0.025
LOOP_COMMIT_PAUSE_S = 1.0
LOOP_COMMIT_MAX_PAUSE_S = 60.0
# Loop commits between two checkpoints by the writer thread (~2-3 WAL pages each: the WAL stays
# near SQLite's default autocheckpoint of 1,000 pages).
CHECKPOINT_EVERY = 256


class LoopCommit:
    """One-row durable commits from the event loop on a connection of their own. `open` and
    `close` block (run them in a thread); `commit` is called on the loop."""

    def __init__(
        self,
        path: Path,
        insert_sql: Callable[[int], str],
        width: int,
        *,
        max_rows: int | None = None,
        slow_s: float = LOOP_COMMIT_SLOW_S,
        pause_s: float = LOOP_COMMIT_PAUSE_S,
        max_pause_s: float = LOOP_COMMIT_MAX_PAUSE_S,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if slow_s < 0.0 or pause_s < 0.0 or max_pause_s < pause_s:
            raise ValueError("need slow_s >= 0 and 0 <= pause_s <= max_pause_s")
        self._path = path
        self._sql = insert_sql  # n -> one INSERT of n rows
        self._width = width  # values a row binds
        self._max_rows_cap = max_rows
        self._max_rows = 1  # rows one INSERT may carry (the limit on bound variables)
        self._slow_s = slow_s
        self._pause_s = pause_s
        self._max_pause_s = max_pause_s
        self._next_pause_s = pause_s  # doubles while commits after a pause stay slow
        self._clock = clock
        self._conn: sqlite3.Connection | None = None
        self._paused_until = -math.inf
        self.commits = 0  # transactions committed from the loop
        self.since_checkpoint = 0  # of them, since the writer's last checkpoint
        self.slow_commits = 0  # commits over slow_s (each paused the loop path)

    def open(self) -> None:
        """Connect (blocking). Leaves the loop path off when the file is not in WAL mode (a
        rollback journal would make readers block the loop's writes)."""
        try:
            conn = sqlite3.connect(
                self._path, isolation_level=None, check_same_thread=False, timeout=0.0
            )
        except sqlite3.Error:
            logger.exception("ledger: no connection for commits on the loop; the writer does all")
            return
        try:
            (mode,) = conn.execute("PRAGMA journal_mode").fetchone()
            conn.execute("PRAGMA synchronous=NORMAL")  # as the store's: survives a process kill
            conn.execute("PRAGMA wal_autocheckpoint=0")  # the writer thread checkpoints
        except sqlite3.Error:
            logger.exception("ledger: no connection for commits on the loop; the writer does all")
            conn.close()
            return
        if str(mode).lower() != "wal":
            conn.close()
            return
        limit = conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
        self._max_rows = max(1, limit // self._width)
        if self._max_rows_cap is not None:
            self._max_rows = max(1, min(self._max_rows, self._max_rows_cap))
        self._conn = conn

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    @property
    def active(self) -> bool:
        """Open and not paused by a slow commit."""
        return self._conn is not None and self._clock() >= self._paused_until

    def commit(self, rows: Sequence[Sequence[Any]]) -> bool:
        """Insert and commit `rows` now, in one transaction. True: committed to the WAL. False:
        nothing written (closed, paused, the write lock held elsewhere, any error): the writer
        thread's turn."""
        conn = self._conn
        if conn is None:
            return False
        start = self._clock()
        if start < self._paused_until:
            return False
        try:
            if len(rows) <= self._max_rows:  # one statement: its own transaction
                conn.execute(self._sql(len(rows)), [value for row in rows for value in row])
            else:
                self._many(conn, rows)
        except sqlite3.Error:
            return False
        end = self._clock()
        self.commits += 1
        self.since_checkpoint += 1
        if end - start <= self._slow_s:
            self._next_pause_s = self._pause_s
            return True
        pause_s = self._next_pause_s
        self._paused_until = end + pause_s
        self._next_pause_s = min(pause_s * 2.0, self._max_pause_s)
        self.slow_commits += 1
        if self.slow_commits == 1 or self.slow_commits % 100 == 0 or pause_s >= self._max_pause_s:
            logger.warning(
                "ledger: a commit on the event loop took %.1f ms (%d so far): commits go to "
                "the writer thread for %g s",
                (end - start) * 1e3,
                self.slow_commits,
                pause_s,
            )
        return True

    def _many(self, conn: sqlite3.Connection, rows: Sequence[Sequence[Any]]) -> None:
        conn.execute("BEGIN IMMEDIATE")  # busy timeout 0: fails at once when locked
        try:
            conn.executemany(self._sql(1), rows)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise


def checkpoint(conn: Conn) -> None:
    """A writer-thread job: copy the WAL into the file without blocking any writer."""
    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
