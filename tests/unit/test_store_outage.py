"""The ledger through a PostgreSQL outage (a real server of its own, stopped and started
again on the same data): while it is down, responses are answered without their commits
(`commit` says False), the records stay buffered (the metric shows them) and nothing is lost;
once it is back, one flush writes them, and a record written twice counts once."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from router.accounting.ledger import Ledger
from router.accounting.metrics import AccountingMetrics
from router.store import PostgresStore, StoreError
from tests.postgres import PASSWORD, PostgresServer, start_postgres
from tests.unit.ledger_records import record


@pytest.fixture
def own_server() -> Iterator[PostgresServer]:
    with start_postgres() as server:
        yield server


def buffered_metric(registry: CollectorRegistry) -> float | None:
    return registry.get_sample_value("gpupool_ledger_buffered_records")


async def test_an_outage_loses_and_doubles_nothing(
    own_server: PostgresServer, caplog: pytest.LogCaptureFixture
) -> None:
    url = own_server.create_database("ledger")
    store = PostgresStore(url, password=PASSWORD, connect_timeout_s=0.2)
    store.open()
    registry = CollectorRegistry()
    ledger = Ledger(store, commit_wait_s=0.5, flush_interval_s=3600.0)  # flushes: the test's
    AccountingMetrics(registry).watch_ledger(ledger)
    await ledger.start()
    try:
        for i in range(3):
            assert await ledger.commit(record(request_id=f"before-{i}", prompt_tokens=10))
        own_server.stop()
        # answered without the commit, never failed, held at most commit_wait_s
        during = [
            ledger.commit(record(request_id=f"during-{i}", prompt_tokens=10)) for i in range(3)
        ]
        assert await asyncio.gather(*during) == [False, False, False]
        ledger.submit(record(request_id="during-3", prompt_tokens=10))
        with pytest.raises(StoreError):
            await ledger.flush()  # after the failed group commits: deterministic from here
        assert ledger.buffered == 4 and ledger.dropped_records == 0
        assert ledger.failed_commits >= 1
        assert buffered_metric(registry) == 4
        failed_commits = registry.get_sample_value("gpupool_ledger_failed_commits_total")
        assert failed_commits is not None and failed_commits >= 1

        own_server.start()
        ledger.submit(record(request_id="before-0", prompt_tokens=10))  # again: counted once
        assert await ledger.flush() == 4  # the buffered ones (the resubmitted one: its own commit)
        assert "the store answers again" in caplog.text
        totals = await ledger.totals()
        assert (totals["requests"], totals["prompt_tokens"]) == (7, 70)
        assert buffered_metric(registry) == 0
        assert await ledger.commit(record(request_id="after", prompt_tokens=10))
    finally:
        await ledger.aclose()
        store.close()


async def test_a_restart_leaves_no_dead_connection_to_fail_a_write(
    own_server: PostgresServer,
) -> None:
    """The pool's idle connections die with the server; the check on checkout (a select on
    the socket, no round trip) drops them, so the first commit after the restart succeeds."""
    url = own_server.create_database("restart")
    store = PostgresStore(url, password=PASSWORD, min_connections=2, connect_timeout_s=2.0)
    store.open()
    ledger = Ledger(store, flush_interval_s=3600.0)
    await ledger.start()
    try:
        assert await ledger.commit(record(request_id="before"))
        own_server.stop()
        own_server.start()
        assert await ledger.commit(record(request_id="after"))
        assert ledger.failed_commits == 0
        assert (await ledger.totals())["requests"] == 2
    finally:
        await ledger.aclose()
        store.close()
