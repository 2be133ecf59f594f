"""The embedded backend: one SQLite file in WAL mode (the default; one machine).

Each thread that asks for a connection gets its own, opened on first use and kept until
`close()` (a writer thread keeps one for its life; a reader in WAL mode never waits for it).
`synchronous=NORMAL`: a committed transaction survives a process kill; an OS crash may lose the
last ones, never corrupt the file.

Importing this module registers an adapter None -> None with `sqlite3` (process-wide): Python
3.11's sqlite3 sends every bound value that is not exactly an int, float, str or bytearray
through its adapter protocol, and for None that is two failed attribute look-ups (~0.45 us a
value, an int binds in ~0.02 us); with an adapter registered it is one dict hit and a call (~0.15
us). A ledger row of a plain request binds 3-4 Nones (run_id, step_index, ttft_s / tpot_s) on
every durable commit (benchmarks/results/ledger-2026-12-04-s49). None still binds as SQL NULL.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from router.store.base import Conn, Rows, Store, StoreError

__all__ = ["SqliteStore"]

BUSY_TIMEOUT_S = 10.0  # another process (the CLI, a second router by mistake) holds the lock


def _null(value: None) -> None:
    """None binds as NULL, by the adapter's fast path (the module's docstring)."""
    return value


sqlite3.register_adapter(type(None), _null)


class _SqliteConn:
    __slots__ = ("raw",)

    def __init__(self, raw: sqlite3.Connection) -> None:
        self.raw = raw

    def execute(self, sql: str, params: Sequence[Any] = (), /) -> Rows:
        return self.raw.execute(sql, params)

    def executemany(self, sql: str, params: Sequence[Sequence[Any]], /) -> None:
        self.raw.executemany(sql, params)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        self.raw.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.raw.execute("ROLLBACK")
            raise
        self.raw.execute("COMMIT")


class SqliteStore(Store):
    dialect = "sqlite"
    data_errors = (sqlite3.InterfaceError, sqlite3.IntegrityError, sqlite3.ProgrammingError)
    errors = (sqlite3.Error,)

    def __init__(self, path: Path) -> None:
        self.path = path
        self.max_params = 999
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._open = False

    @property
    def name(self) -> str:
        return str(self.path)

    def open(self) -> None:
        if self._open:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StoreError(f"{self.path}: cannot create its folder: {err}") from err
        self._open = True
        try:
            with self.connection() as conn:
                assert isinstance(conn, _SqliteConn)
                self.max_params = conn.raw.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
            self._open = False
            self._local = threading.local()
        for raw in conns:
            raw.close()

    @contextlib.contextmanager
    def connection(self) -> Iterator[Conn]:
        if not self._open:
            raise StoreError(f"{self.path}: the store is not open")
        conn: _SqliteConn | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = _SqliteConn(self._connect())
            self._local.conn = conn
        yield conn

    def _connect(self) -> sqlite3.Connection:
        try:
            raw = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_S
            )
        except sqlite3.Error as err:
            raise StoreError(f"{self.path}: cannot open: {err}") from err
        try:
            raw.execute("PRAGMA journal_mode=WAL")
            raw.execute("PRAGMA synchronous=NORMAL")
        except sqlite3.DatabaseError as err:
            raw.close()
            raise StoreError(f"{self.path}: not a SQLite database: {err}") from err
        with self._lock:
            self._all.append(raw)
        return raw
