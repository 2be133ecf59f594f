"""A router `kill -9` right after its last client got `[DONE]`, on a PostgreSQL store (a real
server): the database has a record of every response whose final bytes reached the client,
as the embedded store does (tests/unit/test_ledger_kill.py). A real `gpupool serve` process in
front of a fake engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.faults_ledger_kill import router_config
from pools.testing.fake_engine import FakeEngineState, make_fake_engine
from pools.testing.serve import serve_asgi
from router.store import PostgresStore
from tests.postgres import PASSWORD, PostgresServer
from tests.unit.test_ledger_kill import MODEL, twenty_then_kill

ENV = "GPUPOOL_TEST_STORE_PASSWORD"


async def test_kill_9_after_the_last_done_loses_no_record_on_postgres(
    postgres_server: PostgresServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = postgres_server.create_database("kill")
    monkeypatch.setenv(ENV, PASSWORD)  # the router process inherits it
    state = FakeEngineState(ttft_s=0.002, itl_s=0.002, keep_requests=False)
    async with serve_asgi(make_fake_engine(state)) as engine_url:
        config = router_config(
            tmp_path,
            [engine_url],
            durable=True,
            model_path=MODEL,
            router={"ledger_flush_interval_s": 600.0},
        )
        data = json.loads(config.read_text())
        del data["router"]["ledger_path"]
        data["store"] = {"url": url, "password_env": ENV}
        config.write_text(json.dumps(data))
        replies = await twenty_then_kill(config, tmp_path / "router.log")
    store = PostgresStore(url, password=PASSWORD)
    store.open()
    try:
        with store.connection() as conn:
            rows = dict(conn.execute("SELECT request_id, completion_tokens FROM requests"))
    finally:
        store.close()
    recorded = [r.request_id for r in replies if r.request_id in rows]
    assert len(recorded) == 20
    assert {rows[rid] for rid in recorded} == {8}
