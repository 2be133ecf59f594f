"""Leader election on a real PostgreSQL (router/store/leader.py): two candidates on one
database, one leads; its session killed by the server (`pg_terminate_backend`) or closed by
its replica, the other takes over. The checks are stepped by hand (no loop timing) except in
the last test, which waits for a condition with a generous deadline."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import psycopg
import pytest

from router.store import PostgresStore, SqliteStore
from router.store.leader import AdvisoryLockLeader, SoleLeader, leadership_for
from tests.postgres import PASSWORD, PostgresServer

DEADLINE_S = 30.0  # generous: a loaded CI machine


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def candidate(
    url: str, name: str, clock: Callable[[], float] = time.monotonic, check_s: float = 1.0
) -> AdvisoryLockLeader:
    store = PostgresStore(url, password=PASSWORD, connect_timeout_s=2.0)
    return AdvisoryLockLeader(
        store.dedicated, replica=name, store_name=store.name, clock=clock, check_s=check_s
    )


@pytest.fixture
async def url(postgres_server: PostgresServer) -> AsyncIterator[str]:
    yield postgres_server.create_database(f"leader{time.monotonic_ns()}")


async def until(condition: Callable[[], Awaitable[bool]]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not await condition():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        await asyncio.sleep(0.05)


def terminate(url: str, replica: str) -> int:
    """End the replica's lock session from the server side; how many sessions were ended."""
    with psycopg.connect(url, password=PASSWORD, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
            (f"gpupool {replica}",),
        ).fetchall()
    return len(rows)


async def test_one_leads_and_the_other_takes_over_when_its_session_is_killed(url: str) -> None:
    a, b = candidate(url, "a"), candidate(url, "b")
    changes: list[tuple[str, bool]] = []
    a.on_change = lambda leading: changes.append(("a", leading))
    b.on_change = lambda leading: changes.append(("b", leading))
    try:
        await a.check()
        await b.check()
        assert (a.leading, b.leading) == (True, False)
        assert a.leader == b.leader == "a"
        assert a.view() == {
            "replica": "a",
            "leading": True,
            "leader": "a",
            "election": "advisory_lock",
        }

        assert terminate(url, "a") == 1

        async def b_leads() -> bool:
            await b.check()
            return b.leading

        await until(b_leads)
        assert b.leader == "b"
        await a.check()  # its session is gone: it reconnects and finds b leading
        assert not a.leading
        assert a.leader == "b"
        assert changes == [("a", True), ("b", True), ("a", False)]
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_leader_that_closes_hands_over(url: str) -> None:
    a, b = candidate(url, "a"), candidate(url, "b")
    try:
        await a.check()
        await b.check()
        assert a.leading and not b.leading
        await a.aclose()  # a clean stop: the session ends, and the server frees the lock
        assert not a.leading

        async def b_leads() -> bool:  # once the server has ended a's session
            await b.check()
            return b.leading

        await until(b_leads)
        assert b.leader == "b"
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_leader_stops_acting_when_its_checks_stop_confirming(url: str) -> None:
    clock = Clock()
    a = candidate(url, "a", clock)
    try:
        await a.check()
        assert a.leading
        clock.now_s += a.valid_s  # no check confirmed it for 3 checks (a hung network)
        assert not a.leading
        await a.check()  # confirmed again: it still holds the lock
        assert a.leading
    finally:
        await a.aclose()


async def test_a_store_that_cannot_be_reached_leads_nobody(postgres_server: PostgresServer) -> None:
    url = postgres_server.url("no_such_database")
    a = candidate(url, "a")
    try:
        await a.check()
        assert not a.leading and a.leader is None
    finally:
        await a.aclose()


async def test_the_loops_elect_exactly_one(url: str) -> None:
    a, b = candidate(url, "a", check_s=0.05), candidate(url, "b", check_s=0.05)
    await a.start()
    await b.start()
    try:

        async def one_leads() -> bool:
            return [a.leading, b.leading].count(True) == 1 and a.leader == b.leader is not None

        await until(one_leads)
        first, second = (a, b) if a.leading else (b, a)
        await first.aclose()

        async def second_leads() -> bool:
            return second.leading

        await until(second_leads)
    finally:
        await a.aclose()
        await b.aclose()


async def test_the_embedded_store_leads_alone(tmp_path: Path) -> None:
    sole = leadership_for(SqliteStore(tmp_path / "x.sqlite"), "r")
    assert isinstance(sole, SoleLeader)
    seen: list[bool] = []
    sole.on_change = seen.append
    await sole.start()
    assert sole.leading and sole.leader == "r" and seen == [True]
    assert sole.view()["election"] == "embedded"


async def test_a_check_does_not_queue_behind_the_routers_other_blocking_calls(url: str) -> None:
    """The router's other blocking calls (the store's statements) run on asyncio's default
    executor; with every one of its threads busy, a leader check still runs and leads (it has
    a thread of its own)."""
    loop = asyncio.get_running_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=2))
    hold = threading.Event()
    busy = [loop.run_in_executor(None, hold.wait, DEADLINE_S) for _ in range(2)]
    a = candidate(url, "a")
    try:
        await asyncio.wait_for(a.check(), timeout=DEADLINE_S / 3)
        assert a.leading
    finally:
        hold.set()
        await asyncio.gather(*busy)
        await a.aclose()
