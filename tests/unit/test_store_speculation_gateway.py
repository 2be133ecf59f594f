"""Two routers on one real PostgreSQL database over fake engines: an agent step of a run the
router knows goes to the engine before the store's answer (router/governance/speculation.py),
and the answer decides what the client gets: the step as served (its number confirmed, or the
store's when another replica took steps), or the refusal `enter` would have given (the engine
request cancelled, nothing recorded as served).

The store's answer is held back deterministically where a test needs the engine to have the
request first: the run's row in `run_steps` is locked by another transaction, in which the
stop another replica's guard writes (`SharedBudgets.mark_run`'s statement) is committed once
the engine holds the request (its `gate`)."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from pools.config import Config
from pools.launchers import InstanceSpec
from pools.testing.config import REMOVE, config_for_test, one_pool
from pools.testing.fake_engine import FakeEngineState, make_fake_engine
from pools.testing.gateway import another_router, gateway_over_fakes
from pools.testing.serve import serve_asgi
from router.gateway.app import Gateway, create_app
from router.store import PostgresStore
from tests.postgres import PASSWORD, PostgresServer

ENV = "GPUPOOL_TEST_STORE_PASSWORD"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
RUN = "run-1"
KEY = ("default", RUN)  # the run's key in a router's run table (tenant, run id)


def _config(tmp_path: Path, url: str, *, run_lease: bool = False) -> Config:
    """Two routers' config; `run_lease` off by default: these tests are of the steps a
    replica knows without holding their run (s41, s44), the path with `store.run_lease` off
    (tests/unit/test_run_lease.py has the lease's)."""
    return config_for_test(
        tmp_path,
        pools=one_pool(),
        router={"ledger_path": REMOVE},
        store={"url": url, "password_env": ENV, "run_lease": run_lease},
    )


def speculated(text: str, outcome: str, metric: str = "speculated") -> float:
    """`gpupool_governance_step_speculated_total{outcome=...}` in a /metrics page (`metric`
    "numbered_at_commit": the steps numbered with their ledger record)."""
    pattern = rf'^gpupool_governance_step_{metric}_total\{{outcome="{outcome}"\}} (\S+)$'
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    """Wait for `condition` (checked every 5 ms), failing after `timeout_s`."""
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110 - the fake engine's counters have no event
            await asyncio.sleep(0.005)
    assert condition(), what


def ledger(url: str) -> list[tuple[str, int | None, int, str, str | None]]:
    """The run's ledger records: (request id, step, status, outcome, instance)."""
    return query(
        url,
        "SELECT request_id, step_index, status_code, outcome, instance FROM requests"
        " WHERE run_id = ? ORDER BY started_at_s, request_id",
        (RUN,),
    )


def query(url: str, sql: str, params: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
    """`sql`'s rows in the database at `url`."""
    store = PostgresStore(url, password=PASSWORD)
    store.open()
    try:
        with store.connection() as conn:
            return [tuple(r) for r in conn.execute(sql, params).fetchall()]
    finally:
        store.close()


@asynccontextmanager
async def row_locked(url: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """Another transaction holds the run's row in `run_steps` (a router's statement for the
    run's next step waits for it) until the block ends, which commits it."""
    lock = await psycopg.AsyncConnection.connect(url, password=PASSWORD)
    try:
        await lock.execute("SELECT next_step FROM run_steps WHERE run_id = %s FOR UPDATE", (RUN,))
        yield lock
        await lock.commit()
    finally:
        await lock.close()


async def post(client: httpx.AsyncClient, *, stream: bool = False) -> httpx.Response:
    body = {**BODY, "stream": True} if stream else BODY
    return await client.post("/v1/chat/completions", json=body, headers={"x-gpupool-run-id": RUN})


async def test_a_known_runs_steps_are_confirmed_and_renumbered(
    postgres_server: PostgresServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Router a takes steps 0 and 1 (1, a stream, goes on before the store's answer, which
    confirms it: a took 0), router b takes step 2 on another engine, and a's next step (not a
    stream: numbered with its ledger record) goes on as 2 on its own engine: the store
    numbers it 3 as its record is committed, and it stays where it ran."""
    url = postgres_server.create_database("speculation_renumbered")
    monkeypatch.setenv(ENV, PASSWORD)
    config = _config(tmp_path, url)
    async with gateway_over_fakes(config) as a, another_router(a, config) as (b, b_client):
        a.gateway.affinity.record(KEY, "engine-0")  # a's home for the run
        served = [s.served for s in a.states]
        first = await post(a.client)
        async with row_locked(url):  # step 1's answer waits: it goes on without it
            request = asyncio.create_task(post(a.client, stream=True))
            await until(lambda: a.states[0].served == served[0] + 2, "engine-0 answered")
            assert not request.done()  # held until the store's answer
        second = await asyncio.wait_for(request, 5)
        assert (first.status_code, second.status_code) == (200, 200)
        assert [s.served - n for s, n in zip(a.states, served, strict=True)] == [2, 0]
        page = (await a.client.get("/metrics")).text
        assert (speculated(page, "confirmed"), speculated(page, "renumbered")) == (1, 0)

        await _written(a.gateway)
        b.affinity.record(KEY, "engine-1", step=99)  # b's own, later home: engine-1
        assert (await post(b_client)).status_code == 200  # step 2, on engine-1
        await _written(b)
        served = [s.served for s in a.states]
        engine = a.states[0]
        engine.gate = asyncio.Event()  # holds the step until the answer is let through
        async with row_locked(url):  # the store's answer waits for the engine to have it
            request = asyncio.create_task(post(a.client))  # a knows step 1: goes on as 2
            await until(lambda: engine.running == 1, "the step reached engine-0")
        engine.gate.set()
        third = await asyncio.wait_for(request, 5)
        assert third.status_code == 200
        assert [s.served - n for s, n in zip(a.states, served, strict=True)] == [1, 0]
        page = (await a.client.get("/metrics")).text
        assert (speculated(page, "confirmed"), speculated(page, "renumbered")) == (1, 0)
        assert speculated(page, "renumbered", "numbered_at_commit") == 1
        assert "x-gpupool-instance" in third.headers
    records = ledger(url)
    steps = [(step, status, instance) for _, step, status, _, instance in records]
    assert steps == [(0, 200, "engine-0"), (1, 200, "engine-0"), (2, 200, "engine-1"),
                     (3, 200, "engine-0")]  # fmt: skip
    assert records[3][0] == third.headers["x-gpupool-request-id"]


async def _written(gateway: Gateway) -> None:
    """The router's background store writes (a run's home) are done."""
    replica = gateway.governor._replica
    assert replica is not None
    await asyncio.gather(*replica._pending)


class HoldingEngine:
    """The fake engine, but while `hold` is set a chat request is held after its body is read
    until the router closes the connection (vLLM aborts the sequence then): `held` counts
    those that arrived, `cancelled` those whose connection the router closed."""

    def __init__(self, state: FakeEngineState) -> None:
        self.app = make_fake_engine(state)
        self.hold = False
        self.held = 0
        self.cancelled = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if not (self.hold and scope["type"] == "http" and scope["path"] == "/v1/chat/completions"):
            await self.app(scope, receive, send)
            return
        while (await receive()).get("more_body", False):
            pass
        self.held += 1
        while (await receive())["type"] != "http.disconnect":
            pass
        self.cancelled += 1


async def test_a_run_stopped_on_another_replica_meanwhile_cancels_the_engine_request(
    postgres_server: PostgresServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Router a took the run's steps 0 and 1; its step 2 goes on to the engine before the
    store's answer, and while the engine holds it, another replica's guard stops the run in
    the store: the client gets the stop (403 run_loop), the engine's request is cancelled,
    and the ledger records the step as refused, not served."""
    url = postgres_server.create_database("speculation_stopped")
    monkeypatch.setenv(ENV, PASSWORD)
    state = FakeEngineState()
    engine = HoldingEngine(state)
    async with serve_asgi(engine) as engine_url:
        a = create_app(_config(tmp_path, url), [InstanceSpec("engine-0", engine_url, 1)])
        await a.start()
        try:
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=a), base_url="http://gw", timeout=5
            ) as client:
                for _ in range(2):  # steps 0 and 1 on a: it knows the run
                    assert (await post(client)).status_code == 200
                engine.hold = True
                async with row_locked(url) as lock:  # a's statement for the step waits for it
                    # a stream: its step is numbered before its first byte (not a stream:
                    # with its record, the next test)
                    request = asyncio.create_task(post(client, stream=True))
                    await until(lambda: engine.held == 1, "the step reached the engine")
                    assert not request.done()
                    # the stop another replica's guard writes (SharedBudgets.mark_run)
                    await lock.execute(
                        "UPDATE run_steps SET stop_code = 'run_loop' WHERE run_id = %s", (RUN,)
                    )
                resp = await asyncio.wait_for(request, 5)
                assert resp.status_code == 403
                error = resp.json()["error"]
                assert error["code"] == "run_loop"
                assert "another router replica" in error["message"]
                assert "x-gpupool-instance" not in resp.headers  # as a refusal at `enter`
                await until(lambda: engine.cancelled == 1, "the engine request was cancelled")
                assert state.served == 2
                page = (await client.get("/metrics")).text
                assert speculated(page, "refused") == 1
                refused_id = resp.headers["x-gpupool-request-id"]
                again = await post(client, stream=True)  # stopped on a: refused at `enter`
                assert again.status_code == 403 and engine.held == 1
        finally:
            await a.aclose()
    records = {r[0]: r for r in ledger(url)}
    assert Counter(r[1] for r in records.values() if r[2] == 200) == Counter([0, 1])  # served: 0, 1
    # recorded as the step refused at `enter` after it is: no instance, 403, and no step
    # number (neither reached an engine; a number from this router's own counter could be one
    # another replica's served step has)
    refused_at_enter = records[again.headers["x-gpupool-request-id"]]
    assert records[refused_id][1:] == refused_at_enter[1:] == (None, 403, "client_error", None)


async def test_a_step_numbered_with_its_record_is_refused_by_a_stop_written_meanwhile(
    postgres_server: PostgresServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A known run's non-streaming step goes on with no statement and is numbered by its
    ledger record's commit; another replica's guard stops the run while the engine works on
    it: the engine answers, but the client gets the stop (403 run_loop, no instance), the
    record written with the commit is replaced by the refusal's, the step counts nowhere,
    and the run's next step is refused before any engine."""
    url = postgres_server.create_database("numbered_at_commit_stopped")
    monkeypatch.setenv(ENV, PASSWORD)
    async with gateway_over_fakes(_config(tmp_path, url)) as a:
        a.gateway.affinity.record(KEY, "engine-0")
        engine = a.states[0]
        for _ in range(2):  # steps 0 and 1 (1 numbered with its record): a knows the run
            assert (await post(a.client)).status_code == 200
        page = (await a.client.get("/metrics")).text
        assert speculated(page, "confirmed", "numbered_at_commit") == 1
        served = engine.served
        engine.gate = asyncio.Event()
        request = asyncio.create_task(post(a.client))
        await until(lambda: engine.running == 1, "the step reached engine-0")
        lock = await psycopg.AsyncConnection.connect(url, password=PASSWORD)
        try:  # the stop another replica's guard writes (SharedBudgets.mark_run)
            await lock.execute(
                "UPDATE run_steps SET stop_code = 'run_loop' WHERE run_id = %s", (RUN,)
            )
            await lock.commit()
        finally:
            await lock.close()
        engine.gate.set()
        resp = await asyncio.wait_for(request, 5)
        assert resp.status_code == 403
        error = resp.json()["error"]
        assert error["code"] == "run_loop" and "another router replica" in error["message"]
        assert "x-gpupool-instance" not in resp.headers
        assert engine.served == served + 1  # the engine's work was done: refused after it
        page = (await a.client.get("/metrics")).text
        assert speculated(page, "refused", "numbered_at_commit") == 1
        again = await post(a.client)
        assert again.status_code == 403 and engine.served == served + 1
        refused_id = resp.headers["x-gpupool-request-id"]
        await a.gateway.ledger.flush()
    records = {r[0]: r for r in ledger(url)}
    assert Counter(r[1] for r in records.values() if r[2] == 200) == Counter([0, 1])
    refused_at_enter = records[again.headers["x-gpupool-request-id"]]
    assert records[refused_id][1:] == refused_at_enter[1:] == (None, 403, "client_error", None)


async def test_a_sessions_steps_on_two_routers_are_one_run_numbered_with_their_records(
    postgres_server: PostgresServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An `x-session-id` session: router a takes task 1 alone, then task 2's steps go to a,
    b, a, b (a load balancer's round robin): one run, `S:2`, its steps 0..3 in the ledger
    whichever router served them, a's second step numbered with its ledger record (the
    store maps its anchor in the same statement)."""
    url = postgres_server.create_database("speculation_session")
    monkeypatch.setenv(ENV, PASSWORD)
    config = _config(tmp_path, url, run_lease=True)  # a session's runs are never held

    async def session_step(client: httpx.AsyncClient, task: str) -> httpx.Response:
        body = {**BODY, "messages": [{"role": "user", "content": task}]}
        headers = {"x-session-id": "S"}
        response = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 200
        return response

    async with gateway_over_fakes(config) as a, another_router(a, config) as (_, b_client):
        await session_step(a.client, "task one")
        for client in (a.client, b_client, a.client, b_client):
            await session_step(client, "task two")
        page = (await a.client.get("/metrics")).text
        assert speculated(page, "confirmed", "numbered_at_commit") == 0
        assert speculated(page, "renumbered", "numbered_at_commit") == 1  # b took step 1
    rows = query(
        url,
        "SELECT run_id, step_index FROM requests WHERE run_id LIKE 'S:%'"
        " ORDER BY started_at_s, request_id",
    )
    assert rows == [("S:1", 0), *(("S:2", n) for n in range(4))]


async def test_a_held_runs_steps_carry_their_numbers_in_the_ledger_across_a_move(
    postgres_server: PostgresServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`store.run_lease` on: router a takes steps 0, 1, 2 (1 and 2 numbered from its memory:
    the run's row still says 1), then router b takes the next step (it waits for a to hand
    the run over: its listener, or its sweep) and a the one after (b hands it back): the
    ledger holds 0..4, each once, whichever router served it."""
    url = postgres_server.create_database("speculation_lease")
    monkeypatch.setenv(ENV, PASSWORD)
    config = _config(tmp_path, url, run_lease=True)
    async with gateway_over_fakes(config) as a, another_router(a, config) as (_, b_client):
        for _ in range(3):
            assert (await post(a.client)).status_code == 200
        assert (
            query(url, "SELECT next_step, holder FROM run_steps WHERE run_id = ?", (RUN,))[0][0]
            == 1
        )
        assert (await post(b_client)).status_code == 200
        assert (await post(a.client)).status_code == 200
        page = (await b_client.get("/metrics")).text
        assert re.search(r"^gpupool_governance_run_lease_moves_total (\S+)$", page, re.M)
    assert [(step, status) for _, step, status, _, _ in ledger(url)] == [(n, 200) for n in range(5)]
