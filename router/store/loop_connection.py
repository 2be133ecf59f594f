"""Single statements awaited on the event loop, on a PostgreSQL connection of their own.

What the PostgreSQL store adds to a request is mostly hand-overs, not SQL: a call run in a
worker thread (or the ledger's writer thread) costs, beside the database's round trip, the
thread's wake-up, the GIL hand-over and the loop's wake-up, and each wake-up waits for a core
on a busy machine (benchmarks/store_router_latency.py). The calls a response waits for (the
ledger's lone durable commit, a tier's request slot, an agent step's number) are one
statement each, so `LoopConnection` sends them from the event loop on an asyncio connection
(psycopg's `AsyncConnection`, autocommit: each statement its own transaction, with the pool's
timeouts and `synchronous_commit`): one round trip, no thread.

- One statement at a time: `ready()` is False while one is in flight, and the caller then
  takes its thread path as before, so the connection never queues requests behind each other.
- Bounded: a statement that has not answered within `timeout_s` is abandoned and the
  connection closed (its state is unknown); the error goes to the caller, whose thread path
  decides what that means (a retry, an outage).
- A lost connection is replaced in the background, at most one attempt per `retry_s`; until
  then `ready()` is False. `ready()` checks an idle connection without a round trip (a
  readable socket: the server closed it, e.g. a restart), so a dead one is never used.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import select
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg

from router.store.base import StoreError
from router.store.postgres import PostgresStore

__all__ = ["LoopConnection"]

logger = logging.getLogger(__name__)

RETRY_S = 5.0  # between two attempts to (re)connect


@functools.lru_cache(maxsize=256)
def _psycopg_sql(sql: str) -> str:
    return sql.replace("%", "%%").replace("?", "%s")


class LoopConnection:
    """An asyncio connection for one statement at a time; everything runs on the loop."""

    def __init__(
        self,
        store: PostgresStore,
        application_name: str,
        *,
        timeout_s: float,
        retry_s: float = RETRY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._name = application_name
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._clock = clock
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._busy = False
        self._closed = False
        self._next_try_s = 0.0
        self._tasks: set[asyncio.Task[None]] = set()  # a reconnect, closes of dropped ones
        self._connecting = False
        self.statements = 0  # answered
        self.failures = 0  # failed or abandoned (each dropped the connection)

    async def open(self) -> None:
        """Connect now; a failure is logged and retried later (`ready()` stays False)."""
        await self._connect()

    def ready(self) -> bool:
        """Connected and idle. Not connected: a reconnect is started in the background (at
        most one per `retry_s`)."""
        conn = self._conn
        if conn is not None:
            if self._busy:
                return False
            if _alive(conn):
                return True
            self._drop()  # the server closed it (a restart): another at once
            self._next_try_s = self._clock()
        if not (self._closed or self._connecting) and self._clock() >= self._next_try_s:
            self._spawn(self._connect())
        return False

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Run one statement (`?` placeholders) and return its rows ([] when it returns none).
        Call it only when `ready()`. Raises the driver's error, `TimeoutError` after
        `timeout_s` (the connection is then dropped), or `StoreError` when not ready."""
        conn = self._conn
        if conn is None or self._busy:
            raise StoreError(f"{self._store.name}: no idle connection on the loop")
        self._busy = True
        try:
            cur = await asyncio.wait_for(conn.execute(_psycopg_sql(sql), params), self._timeout_s)
            rows = await cur.fetchall() if cur.description is not None else []
        except BaseException:
            self.failures += 1
            self._drop()
            raise
        finally:
            self._busy = False
        self.statements += 1
        return rows

    async def aclose(self) -> None:
        """Close the connection and wait for what runs in the background. Idempotent."""
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error, OSError):
                await conn.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _connect(self) -> None:
        self._connecting = True
        self._next_try_s = self._clock() + self._retry_s
        try:
            conn = await self._store.connect_async(self._name)
        except StoreError as err:
            logger.warning("%s: no connection on the event loop (%s); retrying", self._name, err)
            return
        finally:
            self._connecting = False
        if self._closed:
            await conn.close()
        else:
            self._conn = conn

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        self._next_try_s = self._clock() + self._retry_s
        if conn is not None:
            self._spawn(_close(conn))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _alive(conn: psycopg.AsyncConnection[Any]) -> bool:
    """An idle connection has nothing to read: a readable socket means the server closed it
    (as router/store/postgres.py checks its pool's). No round trip."""
    if conn.broken or conn.closed:
        return False
    readable, _, _ = select.select([conn.fileno()], [], [], 0)
    return not readable


async def _close(conn: psycopg.AsyncConnection[Any]) -> None:
    with contextlib.suppress(psycopg.Error, OSError):
        await conn.close()
