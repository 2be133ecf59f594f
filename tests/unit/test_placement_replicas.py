"""A Responses API follow-up (`previous_response_id`) on any router replica sharing a real
PostgreSQL store: the response's placement is in the store before its final bytes, so a
follow-up sent to another replica the moment the response ended goes to the engine holding it;
another tenant's follow-up is still "not found"; a store that cannot answer the lookup is a
503 `store_unavailable`; the shared table's bound keeps the newest rows of all replicas; the
embedded store is written in batches as before."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import psycopg
import pytest

from pools.config import Config
from pools.testing.config import REMOVE, config_for_test, one_pool
from pools.testing.gateway import GatewayOverFakes, another_router, gateway_over_fakes
from router.accounting.ledger import Ledger
from router.gateway.response_placement import ResponsePlacement, StoredResponse
from router.store import SqliteStore, Store
from tests.postgres import PASSWORD, PostgresServer
from tests.unit.conftest import fresh_postgres_store
from tests.unit.ledger_records import T0, record

ENV = "GPUPOOL_TEST_STORE_PASSWORD"
KEYS = {"team-a": "sk-placement-a", "team-b": "sk-placement-b"}
BODY = {"model": "tiny", "input": "hello there", "max_output_tokens": 4}


def _config(tmp_path: Path, url: str) -> Config:
    return config_for_test(
        tmp_path,
        pools=one_pool(),
        router={"ledger_path": REMOVE},
        store={"url": url, "password_env": ENV, "connect_timeout_s": 1.0},
        tenants=[
            {"name": name, "api_key_env": f"PLACEMENT_{name[-1].upper()}_KEY"} for name in KEYS
        ],
    )


@pytest.fixture
def url(postgres_server: PostgresServer, monkeypatch: pytest.MonkeyPatch, request: Any) -> str:
    monkeypatch.setenv(ENV, PASSWORD)
    for name, key in KEYS.items():
        monkeypatch.setenv(f"PLACEMENT_{name[-1].upper()}_KEY", key)
    return postgres_server.create_database(f"placement_{request.node.name[5:40]}")


async def respond(
    client: httpx.AsyncClient,
    *,
    previous: str | None = None,
    stream: bool = False,
    tenant: str = "team-a",
) -> httpx.Response:
    body: dict[str, Any] = {**BODY, "stream": stream}
    if previous is not None:
        body["previous_response_id"] = previous
    auth = {"authorization": f"Bearer {KEYS[tenant]}"}
    return await client.post("/v1/responses", json=body, headers=auth)


def response_id(resp: httpx.Response) -> str:
    """A response's id: the body's, or a stream's first event's (`response.created`)."""
    if resp.headers["content-type"].startswith("text/event-stream"):
        created = resp.content.split(b"\n\n", 1)[0].split(b"data: ", 1)[1]
        rid = orjson.loads(created)["response"]["id"]
    else:
        rid = resp.json()["id"]
    assert isinstance(rid, str)
    return rid


def stored_row(url: str, rid: str) -> tuple[Any, ...] | None:
    """The placement's row in the shared table, read from outside the routers."""
    with psycopg.connect(url, password=PASSWORD) as conn:
        return conn.execute(
            "SELECT tenant, instance_id, chain_root FROM responses WHERE response_id = %s",
            (rid,),
        ).fetchone()


def served(rig: GatewayOverFakes) -> list[int]:
    return [s.served for s in rig.states]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_follow_up_on_the_other_replica_goes_to_the_engine_that_stored_it(
    url: str, tmp_path: Path, stream: bool
) -> None:
    """Router a makes a response (a whole body, or a stream); the moment its last byte is in,
    its placement is in the store, and router b, which never saw it, sends its follow-up
    (and the follow-up's own follow-up back on a) to that engine: a chain of one run."""
    config = _config(tmp_path, url)
    async with gateway_over_fakes(config) as a, another_router(a, config) as (b, b_client):
        first = await respond(a.client, stream=stream)
        assert first.status_code == 200, first.text
        home = first.headers["x-gpupool-instance"]
        rid = response_id(first)
        assert stored_row(url, rid) == ("team-a", home, rid)  # before the client had it all
        assert b.placement.get(rid) is None  # b knows it only through the store
        before = served(a)

        second = await respond(b_client, previous=rid, stream=stream)
        assert second.status_code == 200, second.text
        assert second.headers["x-gpupool-instance"] == home
        assert b.placement.fetched == 1
        third = await respond(a.client, previous=response_id(second))  # b's, followed on a
        assert third.status_code == 200, third.text
        assert third.headers["x-gpupool-instance"] == home
        at_home = int(home.rsplit("-", 1)[1])
        assert [n - m for n, m in zip(served(a), before, strict=True)] == [
            2 if i == at_home else 0 for i in range(len(before))
        ]
        assert a.gateway.placement.fetched == 1  # the second response: b's
        assert stored_row(url, response_id(third)) == ("team-a", home, rid)  # one chain
        auth = {"authorization": f"Bearer {KEYS['team-a']}"}
        got = await b_client.get(f"/v1/responses/{response_id(third)}", headers=auth)
        assert got.status_code == 200, got.text  # a's response, read through b
        assert got.json()["id"] == response_id(third)
        assert (a.gateway.placement.written, b.placement.written) == (2, 1)
        # each rode in its ledger record's statement (c=1: lone commits on the loop)
        assert (a.gateway.placement.written_with_record, b.placement.written_with_record) == (2, 1)
        assert a.gateway.placement.failed_writes == b.placement.failed_writes == 0


async def test_another_tenants_response_is_not_found_on_any_replica(
    url: str, tmp_path: Path
) -> None:
    config = _config(tmp_path, url)
    async with gateway_over_fakes(config) as a, another_router(a, config) as (_b, b_client):
        first = await respond(a.client)
        rid = response_id(first)
        before = served(a)
        for client in (b_client, a.client):  # the store's row, then a's memory
            resp = await respond(client, previous=rid, tenant="team-b")
            assert resp.status_code == 400
            error = resp.json()["error"]
            assert error["code"] == "previous_response_not_found", error
            assert error["param"] == "previous_response_id"
        unknown = await respond(b_client, previous="resp_nobody")
        assert unknown.status_code == 400
        assert unknown.json()["error"]["code"] == "previous_response_not_found"
        assert served(a) == before  # no engine saw any of them


@contextmanager
def database_refusing_connections(url: str) -> Iterator[None]:
    """The routers' database takes no connections and its sessions are ended (an outage of
    that database) until the block ends."""
    name = url.split("?", 1)[0].rsplit("/", 1)[1]
    admin = url.replace(f"/{name}?", "/postgres?")
    with psycopg.connect(admin, password=PASSWORD, autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        others = "FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()"
        conn.execute(f"SELECT pg_terminate_backend(pid) {others}", (name,))
        for _ in range(500):  # until they are gone: each client has its FATAL message
            row = conn.execute(f"SELECT COUNT(*) {others}", (name,)).fetchone()
            if row is not None and row[0] == 0:
                break
            time.sleep(0.01)
        try:
            yield
        finally:
            conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')


async def test_a_lookup_the_store_cannot_answer_is_a_503_and_served_again_after(
    url: str, tmp_path: Path
) -> None:
    """A follow-up missing in the replica's memory while the store is down: 503
    `store_unavailable` with `Retry-After` (the OpenAI clients retry it), not a 400 that
    reads as "not made through gpupool"; once the store answers, the same follow-up works.
    A follow-up the replica holds in memory needs no store."""
    config = _config(tmp_path, url)
    async with gateway_over_fakes(config) as a, another_router(a, config) as (b, b_client):
        first = await respond(a.client)
        rid = response_id(first)
        home = first.headers["x-gpupool-instance"]
        with database_refusing_connections(url):
            down = await respond(b_client, previous=rid)
            assert down.status_code == 503, down.text
            error = down.json()["error"]
            assert (error["code"], error["retryable"]) == ("store_unavailable", True)
            assert "shared store" in error["message"]
            assert down.headers["retry-after"] == "1"
            assert b.placement.get(rid) is None
        again = await respond(b_client, previous=rid)
        assert again.status_code == 200, again.text
        assert again.headers["x-gpupool-instance"] == home


async def test_a_write_that_fails_stays_in_memory_and_the_flush_writes_it(
    postgres_server: PostgresServer,
) -> None:
    """The store down while a response ends: its placement's write fails within `wait_s`
    (the response is not held longer), the replica keeps it, and the periodic flush writes it
    once the store answers, for the other replicas to find."""
    store = fresh_postgres_store(postgres_server, connect_timeout_s=0.5)
    store.open()
    a, b = (ResponsePlacement(store, flush_every_s=3600, wait_s=1.0) for _ in range(2))
    try:
        await a.start()
        await b.start()
        with database_refusing_connections(store.url):
            started = asyncio.get_running_loop().time()
            written = a.remember("resp-down", StoredResponse("team-a", "engine-1", "resp-down", 7))
            assert written is not None and await written is False
            assert asyncio.get_running_loop().time() - started < 1.5
        assert a.get("resp-down") is not None and a.failed_writes == 1
        assert await b.fetch("resp-down") is None
        await a.flush()
        assert await b.fetch("resp-down") == StoredResponse("team-a", "engine-1", "resp-down", 7)
    finally:
        await a.aclose()
        await b.aclose()
        store.close()


async def test_a_write_nobody_awaits_is_sent_by_the_flush_after_wait_s(
    postgres_server: PostgresServer,
) -> None:
    """A placement neither offered to the ledger nor awaited (its response never got to its
    final bytes) is still written: by the first flush after `wait_s`."""
    store = fresh_postgres_store(postgres_server)
    store.open()
    a, b = (ResponsePlacement(store, flush_every_s=3600, wait_s=0.5) for _ in range(2))
    try:
        await a.start()
        await b.start()
        assert a.remember("resp-1", StoredResponse("t", "e0", "resp-1", 1)) is not None
        await a.flush()  # too young: it may still be offered or awaited
        assert await b.fetch("resp-1") is None
        await asyncio.sleep(0.55)
        await a.flush()
        for _ in range(100):  # its statement is on the way
            if (found := await b.fetch("resp-1")) is not None:
                break
            await asyncio.sleep(0.01)
        assert found == StoredResponse("t", "e0", "resp-1", 1)
        assert (a.written, a.written_with_record) == (1, 0)
    finally:
        await a.aclose()
        await b.aclose()
        store.close()


async def test_the_shared_bound_keeps_the_newest_rows_of_all_replicas(
    postgres_server: PostgresServer,
) -> None:
    """Two replicas writing to one table bounded at 4: a prune deletes the oldest rows of
    both, never a newer row of the other; a response id given again is the newest."""
    store = fresh_postgres_store(postgres_server)
    store.open()
    a, b = (ResponsePlacement(store, max_entries=4, flush_every_s=3600) for _ in range(2))

    def stored() -> list[str]:
        with store.connection() as conn:
            rows = conn.execute("SELECT response_id FROM responses ORDER BY seq").fetchall()
        return [r[0] for r in rows]

    try:
        await a.start()
        await b.start()
        for i in range(6):
            replica = a if i % 2 == 0 else b
            written = replica.remember(f"resp-{i}", StoredResponse("t", f"e{i}", f"resp-{i}", i))
            assert written is not None and await written is True
        assert len(stored()) == 6  # written on the request path, pruned by the flush
        await b.flush()  # b's prune: the oldest of a's and b's together
        assert stored() == ["resp-2", "resp-3", "resp-4", "resp-5"]
        await a.flush()
        assert stored() == ["resp-2", "resp-3", "resp-4", "resp-5"]
        again = a.remember("resp-3", StoredResponse("t", "e9", "resp-3", 99))
        assert again is not None and await again is True
        assert stored() == ["resp-2", "resp-4", "resp-5", "resp-3"]
        c = ResponsePlacement(store, max_entries=4)
        await c.start()  # a third replica starts with the newest
        try:
            assert c.get("resp-3") == StoredResponse("t", "e9", "resp-3", 99)
            assert c.get("resp-1") is None and len(c) == 4
            assert await c.fetch("resp-0") is None  # pruned: gone for every replica
            assert await c.fetch("resp-2") == StoredResponse("t", "e2", "resp-2", 2)
        finally:
            await c.aclose()
    finally:
        await a.aclose()
        await b.aclose()
        store.close()


async def test_the_embedded_store_is_written_in_batches_as_before(tmp_path: Path) -> None:
    """One router (SQLite): `remember` sends nothing and returns nothing to wait for; a miss
    reads nothing; the flush writes the batch."""
    store: Store = SqliteStore(tmp_path / "responses.sqlite")
    store.open()
    placement = ResponsePlacement(store, flush_every_s=3600)
    try:
        await placement.start()
        assert not placement.shared
        assert placement.remember("resp-1", StoredResponse("t", "e0", "resp-1", 3)) is None
        assert await placement.fetch("resp-2") is None
        with store.connection() as conn:
            assert conn.execute("SELECT COUNT(*) FROM responses").fetchone()[0] == 0
        await placement.flush()
        with store.connection() as conn:
            assert conn.execute("SELECT COUNT(*) FROM responses").fetchone()[0] == 1
    finally:
        await placement.aclose()
        store.close()


async def test_the_ledger_commits_a_placement_with_its_record_or_declines_it(
    any_store: Store,
) -> None:
    """PostgreSQL: a lone commit carries the placement in its statement (both rows in, one
    statement); a commit that finds another queued (it goes to the writer thread's group
    commit) declines it at once and the placement's own connection writes it beside. The embedded
    store declines always (its placements are written by the flush, nothing awaited)."""
    ledger = Ledger(any_store, clock=lambda: T0 + 10.0)
    placement = ResponsePlacement(any_store, flush_every_s=3600)
    await ledger.start()
    await placement.start()
    try:
        if not placement.shared:  # SQLite: nothing to carry
            assert placement.remember("resp-1", StoredResponse("t", "e0", "resp-1", 1)) is None
            return
        lone = placement.remember("resp-1", StoredResponse("t", "e0", "resp-1", 1))
        assert lone is not None
        assert await ledger.commit(record(request_id="r1"), lone) is True
        assert (placement.written, placement.written_with_record) == (1, 1)
        assert await lone is True
        ledger.submit(record(request_id="r2"))  # queued for the writer thread's group commit
        third = placement.remember("resp-3", StoredResponse("t", "e1", "x", 3))
        assert third is not None
        assert await ledger.commit(record(request_id="r3"), third) is True  # after r2's
        assert await third is True
        assert (placement.written, placement.written_with_record) == (2, 1)
        with any_store.connection() as conn:
            placed = conn.execute("SELECT response_id FROM responses ORDER BY seq").fetchall()
            records = conn.execute("SELECT request_id FROM requests ORDER BY 1").fetchall()
        assert sorted(r[0] for r in placed) == ["resp-1", "resp-3"]
        assert [r[0] for r in records] == ["r1", "r2", "r3"]
    finally:
        await placement.aclose()
        await ledger.aclose()
