"""The store interface: what every backend gives the features that keep state in it.

A `Store` hands out connections (`with store.connection() as conn:`), each a `Conn` that runs
one portable SQL dialect: `?` placeholders, `INSERT ... ON CONFLICT (key) DO UPDATE SET
col = excluded.col`, `COALESCE(SUM(x), 0)`, `CAST(... AS BIGINT)`, explicit `SAVEPOINT`s.
Where the dialects differ (column types, identity columns) a feature's migrations give one
text per backend. Calls are synchronous and may block: the async callers run them through
`asyncio.to_thread` or a thread of their own, never on the event loop's hot path.

Two backends: `SqliteStore` (one embedded file, WAL; the default, one machine) and
`PostgresStore` (one database shared by router replicas, psycopg 3 with a connection pool).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit, urlunsplit

__all__ = [
    "Conn",
    "Dialect",
    "Rows",
    "Store",
    "StoreError",
    "redact",
    "savepoint",
    "split_statements",
    "upsert",
]

Dialect = Literal["sqlite", "postgresql"]


class StoreError(Exception):
    """The store cannot be used: unreachable, refused credentials, written by a newer gpupool,
    a bad URL. The message names the store (never its password) and what to do."""


class Rows(Protocol):
    """A statement's result: a DB-API cursor (sqlite3's and psycopg's both fit)."""

    @property
    def description(self) -> Any: ...

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


class Conn(Protocol):
    """One connection, used by one thread at a time. Autocommit: every statement commits on
    its own unless inside `transaction()`."""

    def execute(self, sql: str, params: Sequence[Any] = (), /) -> Rows: ...

    def executemany(self, sql: str, params: Sequence[Sequence[Any]], /) -> None: ...

    def transaction(self) -> contextlib.AbstractContextManager[None]:
        """BEGIN ... COMMIT (ROLLBACK on an exception); the SQLite backend takes the write
        lock at BEGIN. Not nested: use `SAVEPOINT` statements inside."""
        ...


class Store(ABC):
    """Connections to one database. `open()` before use (idempotent), `close()` after; both
    block. Thread-safe: any thread may take a connection."""

    dialect: Dialect
    # most bound parameters one statement may carry
    max_params: int
    # errors that mean "this row (or statement) is bad", not "the database is unreachable":
    # a batch writer skips the row instead of retrying it forever
    data_errors: tuple[type[Exception], ...]
    # every error the driver raises
    errors: tuple[type[Exception], ...]

    @property
    @abstractmethod
    def name(self) -> str:
        """What to call it in messages: a file path, or the URL without its password."""

    @abstractmethod
    def open(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def connection(self) -> contextlib.AbstractContextManager[Conn]:
        """A connection for one unit of work; give it back by leaving the block. Raises
        `StoreError` when none can be had (the database is unreachable)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


def redact(url: str) -> str:
    """The URL without a password (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = (parts.username or "") + ":***"
    return urlunsplit(parts._replace(netloc=f"{user}@{netloc[-1]}"))


def split_statements(script: str) -> list[str]:
    """A migration's statements (`;`-separated; no `;` inside literals)."""
    return [s.strip() for s in script.split(";") if s.strip()]


@contextlib.contextmanager
def savepoint(conn: Conn, name: str) -> Iterator[None]:
    """A nested unit inside `conn.transaction()`: rolled back alone on an exception (which is
    re-raised). Both backends speak the same SQL for it."""
    conn.execute(f"SAVEPOINT {name}")
    try:
        yield
    except BaseException:
        conn.execute(f"ROLLBACK TO SAVEPOINT {name}")
        conn.execute(f"RELEASE SAVEPOINT {name}")
        raise
    conn.execute(f"RELEASE SAVEPOINT {name}")


def upsert(table: str, key: Sequence[str], rest: Sequence[str]) -> str:
    """INSERT of every column (`key`, then `rest`) that replaces the row with the same key:
    the portable `INSERT OR REPLACE`."""
    columns = (*key, *rest)
    return (
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' for _ in columns)})"
        f" ON CONFLICT ({', '.join(key)}) DO UPDATE SET "
        + ", ".join(f"{c} = excluded.{c}" for c in rest)
    )
