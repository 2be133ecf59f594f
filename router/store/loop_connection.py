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
- Lean: the statement goes straight to libpq (psycopg's documented `pgconn`), prepared on
  its first use on the connection (a server-side plan), parameters in text format (the
  server infers their types from the statement) and rows read back by psycopg's loaders;
  no cursor, no task, no per-statement `asyncio.wait_for`. Measured at c=1 on this 2-CPU
  machine (load 1.2) with the cores idle 1 ms between statements, an 18-column INSERT:
  186-243 us p50 through `AsyncConnection.execute`, 151 us this way waiting on the socket,
  95-107 us polled (below; tests' server, unix socket).
- The answer is polled, not slept on, for its first `spin_s` (0.3 ms by default): the loop
  yields after each poll (`await asyncio.sleep(0)`: other callbacks and I/O run between two
  polls), so the process does not go to sleep for a reply that comes within a round trip
  (waking a sleeping process costs a quiet virtual CPU ~50 us, as much as the statement);
  after `spin_s`, it waits for the socket to be readable as before. On a busy machine the
  poll takes the core the server needs (measured at load 8-15: 0.65 ms p50 polled against
  0.28 slept), so an answer that did not come within `spin_s` stops the polling for
  `spin_backoff_s` (1 s): the price is then one `spin_s` of CPU a second; quiet, up to the
  round trip's CPU per statement a response waits for.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import select
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import psycopg
from psycopg import abc as pg_abc
from psycopg import adapt, pq
from psycopg import errors as pg_errors
from psycopg.adapt import PyFormat

from router.store.base import StoreError
from router.store.postgres import PostgresStore

__all__ = ["LoopConnection"]

logger = logging.getLogger(__name__)

RETRY_S = 5.0  # between two attempts to (re)connect
SPIN_S = 0.0003  # an answer is polled this long before the loop sleeps on the socket
SPIN_BACKOFF_S = 1.0  # no polling for this long after an answer that came later than SPIN_S
MAX_PREPARED = 64  # statements prepared per connection; others are sent unprepared

_PLACEHOLDER = re.compile(r"\?")


@functools.lru_cache(maxsize=256)
def _libpq_sql(sql: str) -> bytes:
    """`?` placeholders as libpq's `$1, $2, ...` (the statements have no literal `?`)."""
    count = iter(range(1, 1 << 16))
    return _PLACEHOLDER.sub(lambda _: f"${next(count)}", sql).encode()


@functools.lru_cache(maxsize=64)
def _text_formats(n: int) -> list[PyFormat]:
    return [PyFormat.TEXT] * n


class LoopConnection:
    """An asyncio connection for one statement at a time; everything runs on the loop."""

    def __init__(
        self,
        store: PostgresStore,
        application_name: str,
        *,
        timeout_s: float,
        retry_s: float = RETRY_S,
        spin_s: float = SPIN_S,
        spin_backoff_s: float = SPIN_BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._name = application_name
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._spin_s = spin_s
        self._spin_backoff_s = spin_backoff_s
        self._no_spin_until = 0.0  # the last polled answer came late: no polling until then
        self.late_spins = 0  # polls that ended without the answer (each paused polling)
        self._unhurried = False  # the statement in flight is not waited for now: no polling
        self._begun: asyncio.Task[list[tuple[Any, ...]]] | None = None  # `begin`'s latest
        self._clock = clock
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._prepared: dict[bytes, bytes] = {}  # statement -> its name on this connection
        self._tx: pg_abc.Transformer | None = None  # the connection's dumpers and loaders
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

    async def execute(
        self, sql: str, params: Sequence[Any] = (), *, spin: bool = True
    ) -> list[tuple[Any, ...]]:
        """Run one statement (`?` placeholders) and return its rows ([] when it returns none).
        `spin`: poll for the answer for `spin_s` first (a response waits for it); False for
        one nobody waits for (a slot's release). Call it only when `ready()`. Raises the
        driver's error, `TimeoutError` after `timeout_s` (the connection is then dropped), or
        `StoreError` when not ready."""
        conn = self._conn
        if conn is None or self._busy:
            raise StoreError(f"{self._store.name}: no idle connection on the loop")
        self._busy = True
        self._unhurried = False
        return await self._answered(self._run(conn, _libpq_sql(sql), params, spin))

    def begin(
        self, sql: str, params: Sequence[Any] = (), *, spin: bool = True
    ) -> asyncio.Task[list[tuple[Any, ...]]] | None:
        """`execute`, its statement sent before this returns and its answer awaited in the
        task returned (a request asks at its arrival and awaits the answer where it needs it);
        None when it cannot be sent now (not idle, or `sql` not yet prepared on this
        connection: call `execute`). The connection stays busy until the task ends; a task
        nobody awaits still reads its answer (and raises as `execute` would)."""
        conn, tx = self._conn, self._tx
        if conn is None or self._busy or tx is None:
            return None
        name = self._prepared.get(_libpq_sql(sql))
        if name is None:
            return None
        pgconn = conn.pgconn
        values = tx.dump_sequence(params, _text_formats(len(params))) if params else None
        try:
            pgconn.send_query_prepared(name, values)
            pgconn.flush()  # nonblocking: whatever the socket did not take, `_answer` sends
        except psycopg.Error:
            self.failures += 1
            self._drop()
            return None
        self._busy = True
        self._unhurried = False
        answer = self._answer(pgconn, tx, spin)
        task = self._begun = asyncio.get_running_loop().create_task(self._answered(answer))
        return task

    def unhurry(self, task: asyncio.Task[list[tuple[Any, ...]]]) -> None:
        """Nothing waits for `task`'s statement now (`begin`'s; a request went on without
        its answer, router/governance/speculation.py): while it is the one in flight, its
        answer is no longer polled for but waited for on the socket, so the poll does not
        take a core the work going on beside it needs (at c=1 on two cores: the engine's,
        beside the server's)."""
        if task is self._begun and not task.done():
            self._unhurried = True

    async def _answered(
        self, answer: Coroutine[Any, Any, list[tuple[Any, ...]]]
    ) -> list[tuple[Any, ...]]:
        """`answer` within `timeout_s`, counted; the connection idle again after it and
        dropped when it fails."""
        try:
            async with asyncio.timeout(self._timeout_s):
                rows = await answer
        except BaseException:
            self.failures += 1
            self._drop()
            raise
        finally:
            self._busy = False
        self.statements += 1
        return rows

    async def _run(
        self, conn: psycopg.AsyncConnection[Any], sql: bytes, params: Sequence[Any], spin: bool
    ) -> list[tuple[Any, ...]]:
        pgconn = conn.pgconn
        tx = self._tx
        if tx is None:
            tx = self._tx = adapt.Transformer.from_context(conn)
        values = tx.dump_sequence(params, _text_formats(len(params))) if params else None
        name = self._prepared.get(sql)
        if name is None and len(self._prepared) < MAX_PREPARED:
            name = b"gpupool_%d" % len(self._prepared)
            pgconn.send_prepare(name, sql)  # types unnamed: the server infers them
            await self._answer(pgconn, tx, spin)
            self._prepared[sql] = name
        if name is None:
            pgconn.send_query_params(sql, values)
        else:
            pgconn.send_query_prepared(name, values)
        return await self._answer(pgconn, tx, spin)

    async def _answer(
        self, pgconn: pq.abc.PGconn, tx: pg_abc.Transformer, spin: bool
    ) -> list[tuple[Any, ...]]:
        """Send what is queued, wait for the statement's results; its rows (the last
        result's). Raises the server's error as psycopg's exception."""
        loop = asyncio.get_running_loop()
        fd = pgconn.socket
        while pgconn.flush():  # nonblocking: the rest when the socket can take it
            await _ready(loop, fd, write=True)
        now = self._clock()
        spinning = spin and now >= self._no_spin_until
        spin_until = now + self._spin_s if spinning else now
        while True:
            pgconn.consume_input()
            if not pgconn.is_busy():
                break
            now = self._clock()
            if now < spin_until and not self._unhurried:
                await asyncio.sleep(0)
                continue
            if spinning and not self._unhurried:  # polled in vain: busy, or the server slow
                spinning = False
                self._no_spin_until = now + self._spin_backoff_s
                self.late_spins += 1
            await _ready(loop, fd, write=False)
        results = []
        while (res := pgconn.get_result()) is not None:
            results.append(res)
        rows: list[tuple[Any, ...]] = []
        for res in results:
            if res.status == pq.ExecStatus.TUPLES_OK:
                tx.set_pgresult(res)
                rows = tx.load_rows(0, res.ntuples, tuple)
            elif res.status != pq.ExecStatus.COMMAND_OK:
                raise pg_errors.error_from_result(res, encoding=tx.encoding)
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
        self._prepared, self._tx = {}, None
        self._next_try_s = self._clock() + self._retry_s
        if conn is not None:
            self._spawn(_close(conn))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def _ready(loop: asyncio.AbstractEventLoop, fd: int, *, write: bool) -> None:
    """Until the socket is readable (or writable)."""
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    if write:
        loop.add_writer(fd, wake)
    else:
        loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


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
