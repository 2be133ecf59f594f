"""The shared backend: one PostgreSQL database, through psycopg 3 and a connection pool.

`store: {url: "postgresql://user@host:5432/db", password_env: GPUPOOL_STORE_PASSWORD}`. The
password never sits in the URL or the config file (the config refuses one there): it is read
from the environment at open. `open()` makes one connection first, so a wrong host, password or
database name fails at start with PostgreSQL's own words, then opens the pool. A connection
taken from the pool is checked first (a server restart leaves dead ones behind: they are
replaced, not handed out: the check is one `select` on the socket, no round trip); every
statement runs under `statement_timeout` and every connect under `connect_timeout`, so no call
waits without a bound.

`synchronous_commit` off (the default): a commit returns once PostgreSQL has it, before its WAL
is on disk: it survives the router's kill -9 and a clean database restart; a crash of the
database server itself may lose the last ~0.6 s (3 x wal_writer_delay), as an OS crash may
lose the embedded store's last transactions (SQLite's synchronous=NORMAL). On: each commit
waits for the server's fsync (milliseconds more per request; docs/replicas.md).

SQL arrives in the store's portable dialect (`?` placeholders) and is rewritten once per
statement text to psycopg's (`%s`).
"""

from __future__ import annotations

import contextlib
import functools
import select
import time
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
import psycopg_pool

from router.store.base import Conn, Rows, Store, StoreError, redact

__all__ = ["PostgresStore", "redact"]

POOL_FILL_S = 5.0  # the least `open` waits for the pool's first connections


def _reason(err: psycopg.Error) -> str:
    """PostgreSQL's (or libpq's) words for a failed connection, on one line."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return " ".join(lines) if lines else type(err).__name__


def _alive(conn: psycopg.Connection[Any]) -> bool:
    """Whether an idle connection is still open, without a round trip: an idle connection has
    nothing to read, so a readable socket means the server closed it (a restart sends its
    goodbye, or EOF)."""
    if conn.broken or conn.closed:
        return False
    readable, _, _ = select.select([conn.fileno()], [], [], 0)
    return not readable


@functools.lru_cache(maxsize=1024)
def _psycopg_sql(sql: str) -> str:
    return sql.replace("%", "%%").replace("?", "%s")


class _PgConn:
    __slots__ = ("raw",)

    def __init__(self, raw: psycopg.Connection[Any]) -> None:
        self.raw = raw

    def execute(self, sql: str, params: Sequence[Any] = (), /) -> Rows:
        return self.raw.execute(_psycopg_sql(sql), params)

    def executemany(self, sql: str, params: Sequence[Sequence[Any]], /) -> None:
        with self.raw.cursor() as cur:
            cur.executemany(_psycopg_sql(sql), params)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        with self.raw.transaction():
            yield


class PostgresStore(Store):
    dialect = "postgresql"
    max_params = 65_535
    data_errors = (psycopg.DataError, psycopg.IntegrityError, psycopg.ProgrammingError)
    errors = (psycopg.Error,)

    def __init__(
        self,
        url: str,
        *,
        password: str | None = None,
        min_connections: int = 1,
        max_connections: int = 8,
        connect_timeout_s: float = 5.0,
        statement_timeout_s: float = 10.0,
        synchronous_commit: bool = False,
    ) -> None:
        self.url = url
        self._kwargs: dict[str, Any] = {
            "autocommit": True,
            "connect_timeout": max(1, round(connect_timeout_s)),
            "options": f"-c statement_timeout={round(statement_timeout_s * 1000)}"
            f" -c synchronous_commit={'on' if synchronous_commit else 'off'}",
            "application_name": "gpupool",
        }
        if password is not None:
            self._kwargs["password"] = password
        self._min, self._max = min_connections, max_connections
        self._timeout_s = connect_timeout_s
        self._pool: psycopg_pool.ConnectionPool[psycopg.Connection[Any]] | None = None

    @property
    def name(self) -> str:
        return redact(self.url)

    @property
    def connect_timeout_s(self) -> float:
        """The bound on connecting and on waiting for a pooled connection."""
        return self._timeout_s

    def open(self) -> None:
        if self._pool is not None:
            return
        try:  # one connection first: PostgreSQL's own reason when it fails
            psycopg.connect(self.url, **self._kwargs).close()
        except psycopg.Error as err:
            raise StoreError(
                f"cannot connect to the PostgreSQL store {self.name}: {_reason(err)}"
            ) from err
        pool: psycopg_pool.ConnectionPool[psycopg.Connection[Any]] = psycopg_pool.ConnectionPool(
            self.url,
            kwargs=self._kwargs,
            min_size=self._min,
            max_size=self._max,
            open=False,
            timeout=self._timeout_s,
            name="gpupool-store",
        )
        # The server has just answered a connect: filling the pool is the same connects in the
        # pool's threads, which a loaded machine can delay past a short `connect_timeout_s`
        # (a bound meant for an outage), so the fill gets at least POOL_FILL_S.
        fill_s = max(self._timeout_s, POOL_FILL_S)
        try:
            pool.open(wait=True, timeout=fill_s)
        except psycopg_pool.PoolTimeout as err:
            pool.close()
            raise StoreError(
                f"the PostgreSQL store {self.name} gave no {self._min} connections within"
                f" {fill_s:g} s"
            ) from err
        self._pool = pool

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    @contextlib.contextmanager
    def connection(self) -> Iterator[Conn]:
        """A pooled connection. When the pool has none to give (the server was down: its
        reconnection backs off for seconds after the server is back), one direct connection
        is tried, so the first write after an outage goes through; it is closed after use.
        During an outage a call waits up to `connect_timeout_s` for the pool, then one connect
        attempt: call it off the event loop (a thread), as every caller does."""
        pool = self._pool
        if pool is None:
            raise StoreError(f"{self.name}: the store is not open")
        raw = self._live_pooled(pool)
        if raw is None:
            with self._direct() as direct:
                yield direct
            return
        try:
            yield _PgConn(raw)
        finally:
            pool.putconn(raw)  # a transaction left open is rolled back; a broken one dropped

    def _live_pooled(
        self, pool: psycopg_pool.ConnectionPool[psycopg.Connection[Any]]
    ) -> psycopg.Connection[Any] | None:
        """A pooled connection that is alive, or None within `connect_timeout_s`. A dead one
        (the server restarted) is closed and given back, so the pool drops it and opens
        another; the next is tried at once (the pool's own check would back off a second)."""
        deadline = time.monotonic() + self._timeout_s
        for _ in range(self._max + 1):
            try:
                raw = pool.getconn(timeout=max(0.001, deadline - time.monotonic()))
            except psycopg_pool.PoolTimeout:
                return None
            if _alive(raw):
                return raw
            raw.close()
            pool.putconn(raw)
        return None

    def dedicated(self, application_name: str) -> psycopg.Connection[Any]:
        """A connection of its own, outside the pool, for a session that must outlive a unit of
        work (the leader's advisory lock: router/store/leader.py). TCP keepalives on both ends
        (idle 5 s, then 3 probes 2 s apart), so a peer that vanishes without closing its
        socket is noticed in about 11 s, by the server (which then ends the session and its
        locks) and by the client. The caller closes it. Raises `StoreError`."""
        kwargs = {
            **self._kwargs,
            "application_name": application_name[:63],  # PostgreSQL keeps 63 bytes
            "options": self._kwargs["options"]
            + " -c tcp_keepalives_idle=5 -c tcp_keepalives_interval=2 -c tcp_keepalives_count=3",
            "keepalives": 1,
            "keepalives_idle": 5,
            "keepalives_interval": 2,
            "keepalives_count": 3,
        }
        try:
            return psycopg.connect(self.url, **kwargs)
        except psycopg.Error as err:
            raise StoreError(
                f"cannot connect to the PostgreSQL store {self.name}: {_reason(err)}"
            ) from err

    async def connect_async(self, application_name: str) -> psycopg.AsyncConnection[Any]:
        """An asyncio connection of its own, outside the pool, for writes awaited on the event
        loop (the ledger's lone durable commits: router/accounting/ledger_async.py), with the
        pool's settings (autocommit, timeouts, synchronous_commit) and `dedicated`'s
        keepalives. The caller closes it. Raises `StoreError`."""
        kwargs = {
            **self._kwargs,
            "application_name": application_name[:63],
            "keepalives": 1,
            "keepalives_idle": 5,
            "keepalives_interval": 2,
            "keepalives_count": 3,
        }
        try:
            return await psycopg.AsyncConnection.connect(self.url, **kwargs)
        except psycopg.Error as err:
            raise StoreError(
                f"cannot connect to the PostgreSQL store {self.name}: {_reason(err)}"
            ) from err

    @contextlib.contextmanager
    def _direct(self) -> Iterator[Conn]:
        try:
            raw = psycopg.connect(self.url, **self._kwargs)
        except psycopg.Error as err:
            raise StoreError(
                f"the PostgreSQL store {self.name} gave no connection within"
                f" {self._timeout_s:g} s: {_reason(err)}"
            ) from err
        try:
            yield _PgConn(raw)
        finally:
            raw.close()
