"""Statements awaited on the event loop with the PostgreSQL store (router/store/
loop_connection.py): the ledger's lone durable commits go there instead of the writer thread;
a failure or a timeout drops the connection and the record is still written. A real server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from router.accounting.ledger import Ledger
from router.store import PostgresStore
from router.store.loop_connection import LoopConnection
from tests.postgres import PASSWORD, PostgresServer
from tests.unit.ledger_records import record


@contextlib.asynccontextmanager
async def opened(
    server: PostgresServer, database: str, **options: Any
) -> AsyncIterator[LoopConnection]:
    """A `LoopConnection` on a fresh database, connected; closed after."""
    store = PostgresStore(server.create_database(database), password=PASSWORD)
    conn = LoopConnection(store, "gpupool-test", **options)
    await conn.open()
    try:
        yield conn
    finally:
        await conn.aclose()


async def test_lone_commits_go_on_the_loop_and_concurrent_ones_to_the_writer(
    postgres_server: PostgresServer,
) -> None:
    url = postgres_server.create_database("loop_commits")
    store = PostgresStore(url, password=PASSWORD)
    await asyncio.to_thread(store.open)
    ledger = Ledger(store, flush_interval_s=3600.0)
    await ledger.start()
    try:
        loop_conn = ledger._async_commit
        assert loop_conn is not None
        for k in range(5):
            assert await ledger.commit(record(request_id=f"lone-{k}"))
        assert (loop_conn.statements, ledger.loop_commits, ledger.group_commits) == (5, 5, 5)
        # the table locked by another session: the first INSERT waits in the server (a
        # statement answered at once would finish before the next commit is even called)
        async with await psycopg.AsyncConnection.connect(url, password=PASSWORD) as locker:
            await locker.execute("LOCK TABLE requests IN ACCESS EXCLUSIVE MODE")
            many = [
                asyncio.ensure_future(ledger.commit(record(request_id=f"many-{k}")))
                for k in range(8)
            ]
            await asyncio.sleep(0.05)
            assert not any(commit.done() for commit in many)
            await locker.rollback()
        together = await asyncio.gather(*many)
        assert all(together)
        assert loop_conn.statements == 6  # the first; the seven others were not lone
        assert ledger.group_commits >= 7  # the writer's: at least one
        assert (await ledger.totals())["requests"] == 13
        assert ledger.buffered == 0
    finally:
        await ledger.aclose()
        await asyncio.to_thread(store.close)


async def test_a_commit_not_answered_in_time_on_the_loop_is_written_by_the_next_flush(
    postgres_server: PostgresServer,
) -> None:
    """The table is locked by another session: the loop's INSERT waits past `commit_wait_s`,
    is abandoned (the response goes on without it) and the record stays buffered."""
    url = postgres_server.create_database("loop_commit_late")
    store = PostgresStore(url, password=PASSWORD)
    await asyncio.to_thread(store.open)
    ledger = Ledger(store, flush_interval_s=3600.0, commit_wait_s=0.2)
    await ledger.start()
    locker = await psycopg.AsyncConnection.connect(url, password=PASSWORD)
    try:
        await locker.execute("LOCK TABLE requests IN ACCESS EXCLUSIVE MODE")
        assert not await ledger.commit(record(request_id="late"))
        assert (ledger.buffered, ledger.failed_commits) == (1, 1)
        await locker.rollback()
        await ledger.flush()
        assert (await ledger.totals())["requests"] == 1 and ledger.buffered == 0
    finally:
        await locker.close()
        await ledger.aclose()
        await asyncio.to_thread(store.close)


async def test_a_statement_past_its_timeout_drops_the_connection_and_another_comes(
    postgres_server: PostgresServer,
) -> None:
    url = postgres_server.create_database("loop_timeout")
    store = PostgresStore(url, password=PASSWORD)
    conn = LoopConnection(store, "gpupool-test", timeout_s=0.2, retry_s=0.0)
    await conn.open()
    try:
        assert conn.ready()
        assert await conn.execute("SELECT ? + 1", (1,)) == [(2,)]
        assert conn.ready()
        with pytest.raises(TimeoutError):
            await conn.execute("SELECT pg_sleep(5)")
        assert not conn.ready()  # dropped; a reconnect starts
        for _ in range(200):
            await asyncio.sleep(0.01)
            if conn.ready():
                break
        assert await conn.execute("SELECT 3") == [(3,)]
        assert (conn.statements, conn.failures) == (2, 1)
    finally:
        await conn.aclose()


async def test_a_connection_the_server_closed_is_not_used(postgres_server: PostgresServer) -> None:
    url = postgres_server.create_database("loop_restart")
    store = PostgresStore(url, password=PASSWORD)
    conn = LoopConnection(store, "gpupool-test", timeout_s=2.0, retry_s=0.0)
    await conn.open()
    try:
        assert conn._conn is not None
        (pid,) = (await conn.execute("SELECT pg_backend_pid()"))[0]
        with psycopg.connect(url, password=PASSWORD, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        for _ in range(100):  # the server's goodbye reaches the socket
            await asyncio.sleep(0.01)
            if not conn.ready():
                break
        else:
            raise AssertionError("a closed connection still looks ready")
        for _ in range(200):
            await asyncio.sleep(0.01)
            if conn.ready():
                break
        assert await conn.execute("SELECT 1") == [(1,)]
        assert conn.failures == 0  # never sent on the dead one
    finally:
        await conn.aclose()


class SteppingClock:
    """Each reading 1 ms later than the one before (a poll never outlasts two readings)."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        self.now_s += 0.001
        return self.now_s


async def test_an_answer_polled_in_vain_stops_the_polling_for_a_while(
    postgres_server: PostgresServer,
) -> None:
    """An answer that does not come within `spin_s` (a busy machine) pauses the polling for
    `spin_backoff_s`: the statements meanwhile wait on the socket; then it polls again."""
    clock = SteppingClock()
    options = {"timeout_s": 2.0, "spin_s": 0.0005, "spin_backoff_s": 0.1, "clock": clock}
    async with opened(postgres_server, "loop_spin", **options) as conn:
        slow = "SELECT pg_sleep(0.02)"
        await conn.execute(slow)  # prepared, then polled in vain
        assert conn.late_spins == 1
        await conn.execute(slow)
        await conn.execute(slow, spin=False)
        assert conn.late_spins == 1  # within the backoff, or not asked to poll
        clock.now_s += 0.1
        await conn.execute(slow)
        assert conn.late_spins == 2


async def test_a_begun_statement_nobody_waits_for_is_not_polled(
    postgres_server: PostgresServer,
) -> None:
    """`unhurry(task)` (a request went on without the answer): that statement's answer is
    waited for on the socket, so a slow one pauses no polling; another task's is untouched."""
    options = {"timeout_s": 2.0, "spin_s": 0.0005, "spin_backoff_s": 0.1, "clock": SteppingClock()}
    async with opened(postgres_server, "loop_unhurried", **options) as conn:
        slow = "SELECT pg_sleep(0.02)"
        with_spin_off = "SELECT pg_sleep(0.02) WHERE TRUE"
        await conn.execute(slow, spin=False)  # both prepared, not polled
        await conn.execute(with_spin_off, spin=False)
        task = conn.begin(with_spin_off)
        assert task is not None

        async def no_rows() -> list[tuple[Any, ...]]:
            return []

        other = asyncio.ensure_future(no_rows())  # another task, not the statement in flight:
        conn.unhurry(other)  # nothing changes
        conn.unhurry(task)
        assert await task == [("",)]
        assert await other == []
        assert conn.late_spins == 0  # not polled in vain: no backoff
        task = conn.begin(slow)
        assert task is not None
        await task
        assert conn.late_spins == 1  # polled as before


async def test_the_servers_error_is_raised_and_types_round_trip(
    postgres_server: PostgresServer,
) -> None:
    async with opened(postgres_server, "loop_types", timeout_s=2.0, retry_s=0.0) as conn:
        await conn.execute("CREATE TABLE t (s TEXT, f DOUBLE PRECISION, n BIGINT, b BOOLEAN)")
        await conn.execute("INSERT INTO t VALUES (?, ?, ?, ?)", ("it's 100%", 0.25, 2**40, True))
        await conn.execute("INSERT INTO t VALUES (?, ?, ?, ?)", (None, None, None, None))
        assert await conn.execute("SELECT s, f, n, b FROM t ORDER BY s") == [
            ("it's 100%", 0.25, 2**40, True),
            (None, None, None, None),
        ]
        with pytest.raises(psycopg.errors.DivisionByZero):
            await conn.execute("SELECT 1 / ?", (0,))
        assert conn.failures == 1
