"""The durable ledger (router/accounting/ledger.py `commit`, router.ledger_durable): a record is
on disk before its response's final bytes leave the router; concurrent requests share one
commit; a failed or slow commit is logged and retried and never fails or holds the response."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from pools.config import Config, ConfigError
from pools.testing.config import config_for_test, one_pool
from pools.testing.fake_engine import FakeEngineState
from pools.testing.gateway import gateway_over_fakes
from router.accounting.ledger import (
    _COLUMNS,
    MIGRATIONS,
    Ledger,
    _insert_rows_sql,
    _record_fields,
)
from router.accounting.ledger_loop import LoopCommit
from router.gateway.app import Gateway
from router.request import Message, Receive, Scope, Send
from router.store import SqliteStore, migrate
from tests.unit.ledger_records import T0, record
from tests.unit.test_ledger import run_then_kill

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}


def rows(path: Path, where: str = "1") -> list[sqlite3.Row]:
    with sqlite3.connect(path) as conn:
        conn.row_factory = sqlite3.Row
        return list(conn.execute(f"SELECT * FROM requests WHERE {where} ORDER BY rowid"))


def drop_requests_table(path: Path) -> None:
    """A ledger whose next write fails (an OperationalError, as a broken disk would give)."""
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE requests")


def restore_requests_table(path: Path) -> None:
    """The schema again: the ledger's migrations, run as on a file that never had them."""
    with sqlite3.connect(path) as conn:
        conn.execute("DELETE FROM gpupool_schema WHERE component = 'ledger'")
    create_tables(path)


def create_tables(path: Path) -> None:
    """The ledger's migrations on `path` (created when missing)."""
    store = SqliteStore(path)
    store.open()
    try:
        migrate(store, MIGRATIONS)
    finally:
        store.close()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "ledger.sqlite"


@pytest.fixture
async def make_ledger(db: Path) -> AsyncIterator[Callable[..., Any]]:
    started: list[Ledger] = []

    async def make(**kwargs: Any) -> Ledger:
        kwargs.setdefault("flush_interval_s", 1000.0)  # no periodic flush unless a test says
        # a loaded machine may preempt a loop commit past the slow-disk bound: not here
        kwargs.setdefault("loop_commit_slow_s", 60.0)
        ledger = Ledger(db, clock=lambda: T0, **kwargs)
        await ledger.start()
        started.append(ledger)
        return ledger

    yield make
    for ledger in started:
        await ledger.aclose()


class WriteLock:
    """Holds the file's write lock from another connection: the ledger's writer waits."""

    def __init__(self, path: Path) -> None:
        self._conn = sqlite3.connect(path, isolation_level=None)
        self._conn.execute("BEGIN IMMEDIATE")

    def release(self) -> None:
        self._conn.execute("COMMIT")
        self._conn.close()


# --- the ledger ---------------------------------------------------------------------------------


async def test_a_commit_returns_once_the_record_is_on_disk(
    make_ledger: Callable[..., Any], db: Path
) -> None:
    ledger: Ledger = await make_ledger()
    assert await ledger.commit(record(request_id="r1")) is True
    assert [r["request_id"] for r in rows(db)] == ["r1"]  # read by another connection
    assert (ledger.buffered, ledger.written_records) == (0, 1)


async def test_concurrent_commits_share_one_transaction(
    make_ledger: Callable[..., Any], db: Path
) -> None:
    ledger: Ledger = await make_ledger()
    lock = WriteLock(db)
    first = asyncio.ensure_future(ledger.commit(record(request_id="first")))
    await asyncio.sleep(0.05)  # the writer takes it and waits for the lock
    rest = [asyncio.ensure_future(ledger.commit(record(request_id=f"r{i}"))) for i in range(20)]
    await asyncio.sleep(0.05)
    assert ledger.buffered == 21
    assert not first.done() and not any(t.done() for t in rest)  # nobody answers before disk
    lock.release()
    assert await first is True and all(await asyncio.gather(*rest))
    # one transaction for the first, at most one more for the 20 that queued behind it
    assert ledger.group_commits <= 2
    assert len(rows(db)) == 21


async def test_rows_commit_in_order_and_a_later_record_replaces_an_earlier(
    make_ledger: Callable[..., Any], db: Path
) -> None:
    ledger: Ledger = await make_ledger()
    ledger.submit(record(request_id="x", outcome="ok", status_code=200))
    assert await ledger.commit(record(request_id="x", outcome="aborted", status_code=499))
    assert [(r["outcome"], r["status_code"]) for r in rows(db)] == [("aborted", 499)]
    for i in range(5):  # steps of one run are numbered in commit order
        ledger.submit(record(request_id=f"s{i}", run_id="ordered"))
    await ledger.flush()  # waits for every row queued before it
    steps = rows(db, "run_id = 'ordered'")
    assert [(r["request_id"], r["step_index"]) for r in steps] == [(f"s{i}", i) for i in range(5)]


async def test_a_malformed_record_is_skipped_and_its_group_still_commits(
    make_ledger: Callable[..., Any], db: Path
) -> None:
    ledger: Ledger = await make_ledger()
    lock = WriteLock(db)  # the three queue up and go in one group
    commits = [
        asyncio.ensure_future(ledger.commit(record(request_id=rid, prompt_tokens=tokens)))
        for rid, tokens in (("good-1", 1), ("bad", object()), ("good-2", 2))
    ]
    await asyncio.sleep(0.05)
    lock.release()
    await asyncio.gather(*commits)
    assert [r["request_id"] for r in rows(db)] == ["good-1", "good-2"]
    assert (ledger.dropped_records, ledger.failed_commits) == (1, 0)


async def test_a_failed_commit_is_logged_and_retried_never_raised(
    make_ledger: Callable[..., Any], db: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ledger: Ledger = await make_ledger()
    drop_requests_table(db)
    with caplog.at_level(logging.ERROR, logger="router.accounting.ledger"):
        assert await ledger.commit(record(request_id="kept")) is False
    assert any("group commit of 1 records failed" in r.getMessage() for r in caplog.records)
    assert (ledger.failed_commits, ledger.buffered) == (1, 1)  # back in the buffer
    restore_requests_table(db)
    assert await ledger.flush() == 1  # the periodic flush's retry
    assert [r["request_id"] for r in rows(db)] == ["kept"]


async def test_a_slow_commit_lets_the_response_go_and_still_writes(
    make_ledger: Callable[..., Any], db: Path
) -> None:
    ledger: Ledger = await make_ledger(commit_wait_s=0.05)
    lock = WriteLock(db)
    assert await ledger.commit(record(request_id="late")) is False
    assert ledger.late_commits == 1
    lock.release()
    await ledger.flush()
    assert [r["request_id"] for r in rows(db)] == ["late"]


async def test_not_durable_is_the_batched_ledger(make_ledger: Callable[..., Any], db: Path) -> None:
    ledger: Ledger = await make_ledger(durable=False)
    assert await ledger.commit(record(request_id="b")) is False
    assert ledger.buffered == 1 and rows(db) == []
    assert await ledger.flush() == 1
    assert ledger.group_commits == 0


def test_a_hard_kill_right_after_the_commits_loses_none(db: Path) -> None:
    body = """
        for i in range(50):
            assert await ledger.commit(rec(request_id=f"committed-{i}"))
    """
    run_then_kill(db, body, durable=True)
    assert len(rows(db, "request_id LIKE 'committed-%'")) == 50


# --- lone commits on the event loop (router/accounting/ledger_loop.py) -------------------------


async def test_a_lone_commit_is_written_from_the_loop_not_the_writer_thread(
    make_ledger: Callable[..., Any], db: Path
) -> None:
    ledger: Ledger = await make_ledger()
    for i in range(3):
        assert await ledger.commit(record(request_id=f"lone-{i}", run_id="loop")) is True
    assert (ledger.loop_commits, ledger.group_commits) == (3, 3)  # no group commit by the writer
    steps = rows(db, "run_id = 'loop'")  # read by another connection
    assert [(r["request_id"], r["step_index"]) for r in steps] == [
        (f"lone-{i}", i) for i in range(3)
    ]
    assert (ledger.buffered, ledger.written_records) == (0, 3)


async def test_the_commits_of_one_loop_iteration_after_the_first_share_one_transaction(
    make_ledger: Callable[..., Any], db: Path
) -> None:
    ledger: Ledger = await make_ledger()
    answers = await asyncio.gather(*(ledger.commit(record(request_id=f"g{i}")) for i in range(20)))
    assert all(answers)
    # the first at once, the 19 others of its iteration together at the start of the next
    assert (ledger.loop_commits, ledger.group_commits) == (2, 2)
    assert len(rows(db)) == 20 and (ledger.buffered, ledger.written_records) == (0, 20)


async def test_after_an_iteration_of_several_commits_the_first_joins_the_group_too(
    make_ledger: Callable[..., Any], db: Path
) -> None:
    ledger: Ledger = await make_ledger()
    assert all(await asyncio.gather(*(ledger.commit(record(request_id=f"a{i}")) for i in range(5))))
    assert ledger.loop_commits == 2  # the first at once, the 4 others together
    # under load: the next iteration's 5 are one transaction, the first not at once
    assert all(await asyncio.gather(*(ledger.commit(record(request_id=f"b{i}")) for i in range(5))))
    assert ledger.loop_commits == 3
    # a lone commit after it waits one iteration (its group of one), then the next is at once
    assert await ledger.commit(record(request_id="c0")) is True
    assert ledger.loop_commits == 4
    lone = asyncio.ensure_future(ledger.commit(record(request_id="c1")))
    await asyncio.sleep(0)
    assert lone.done() and lone.result() is True and ledger.loop_commits == 5
    assert len(rows(db)) == 12 and (ledger.buffered, ledger.written_records) == (0, 12)


async def test_a_loop_group_that_finds_the_file_locked_goes_to_the_writer(
    make_ledger: Callable[..., Any], db: Path
) -> None:
    ledger: Ledger = await make_ledger()
    commits = [asyncio.ensure_future(ledger.commit(record(request_id=f"h{i}"))) for i in range(5)]
    await asyncio.sleep(0)  # they run: the first commits, the others wait for the next iteration
    assert commits[0].done() and ledger.loop_commits == 1
    lock = WriteLock(db)  # taken before their group's turn
    await asyncio.sleep(0.05)
    assert not any(c.done() for c in commits[1:])  # with the writer thread, waiting for the lock
    lock.release()
    assert all(await asyncio.gather(*commits))
    # the 4 went to the writer thread: one transaction or more (how many of them the thread
    # finds handed over when it wakes is the threads' timing), none on the loop
    assert ledger.loop_commits == 1 and 2 <= ledger.group_commits <= 5
    assert len(rows(db)) == 5


def test_a_group_over_one_statement_s_rows_is_one_transaction(db: Path) -> None:
    create_tables(db)
    loop_commit = LoopCommit(db, _insert_rows_sql, len(_COLUMNS), max_rows=2)
    loop_commit.open()
    try:
        made = [record(request_id=f"m{i}", run_id=None) for i in range(5)]
        assert loop_commit.commit([(*_record_fields(r), None) for r in made])
        lock = WriteLock(db)
        assert not loop_commit.commit([(*_record_fields(record()), None)] * 3)  # never waits
        lock.release()
    finally:
        loop_commit.close()
    assert [r["request_id"] for r in rows(db)] == [f"m{i}" for i in range(5)]
    assert loop_commit.commits == 1


class SteppingClock:
    """Each reading advances the time by `step`: a commit between two readings takes `step`."""

    def __init__(self) -> None:
        self.now, self.step = 0.0, 0.0

    def __call__(self) -> float:
        now = self.now
        self.now += self.step
        return now


def test_slow_loop_commits_pause_the_loop_path_longer_each_time_until_a_fast_one(
    db: Path,
) -> None:
    create_tables(db)
    clock = SteppingClock()
    loop_commit = LoopCommit(
        db, _insert_rows_sql, len(_COLUMNS), slow_s=0.05, pause_s=1.0, max_pause_s=4.0, clock=clock
    )
    loop_commit.open()

    def commit_at(now_s: float, step_s: float) -> bool:
        clock.now, clock.step = now_s, step_s
        return loop_commit.commit([(*_record_fields(record()), None)])

    try:
        assert commit_at(0.0, 0.1)  # slow (0.1 s): paused 1 s from its end (0.1)
        assert not commit_at(1.0, 0.0)  # still paused: the writer's turn
        assert commit_at(1.2, 0.1)  # slow again: 2 s from 1.3
        assert not commit_at(3.2, 0.0)
        assert commit_at(3.4, 0.1)  # 4 s from 3.5 (the cap)
        assert commit_at(7.6, 0.1)  # 4 s again
        assert not commit_at(11.6, 0.0)
        assert commit_at(11.8, 0.0)  # fast: the next pause is 1 s again
        assert commit_at(12.0, 0.1)
        assert commit_at(13.2, 0.0)
    finally:
        loop_commit.close()
    assert (loop_commit.commits, loop_commit.slow_commits) == (7, 5)


async def test_with_the_write_lock_held_elsewhere_the_commit_waits_on_the_writer(
    make_ledger: Callable[..., Any], db: Path
) -> None:
    ledger: Ledger = await make_ledger()
    lock = WriteLock(db)  # the loop's connection never waits for it: the writer thread does
    commit = asyncio.ensure_future(ledger.commit(record(request_id="locked")))
    await asyncio.sleep(0.05)
    assert not commit.done() and ledger.loop_commits == 0
    lock.release()
    assert await commit is True
    assert [r["request_id"] for r in rows(db)] == ["locked"]
    assert await ledger.commit(record(request_id="free")) is True  # the loop's again
    assert ledger.loop_commits == 1


async def test_a_slow_loop_commit_sends_the_next_ones_to_the_writer(
    make_ledger: Callable[..., Any], db: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ledger: Ledger = await make_ledger(loop_commit_slow_s=0.0, loop_commit_pause_s=30.0)
    with caplog.at_level(logging.WARNING, logger="router.accounting.ledger_loop"):
        assert await ledger.commit(record(request_id="slow")) is True  # on the loop, "slow"
        assert await ledger.commit(record(request_id="after")) is True
    assert (ledger.loop_commits, ledger.group_commits) == (1, 2)
    assert any("took" in r.getMessage() for r in caplog.records)
    assert [r["request_id"] for r in rows(db)] == ["slow", "after"]


async def test_a_malformed_record_falls_to_the_writer_which_skips_it(
    make_ledger: Callable[..., Any], db: Path
) -> None:
    ledger: Ledger = await make_ledger()
    await ledger.commit(record(request_id="bad", prompt_tokens=object()))
    assert await ledger.commit(record(request_id="good")) is True
    assert [r["request_id"] for r in rows(db)] == ["good"]
    assert (ledger.loop_commits, ledger.dropped_records, ledger.failed_commits) == (1, 1, 0)


async def test_the_writer_checkpoints_the_wal_the_loop_commits_grow(
    make_ledger: Callable[..., Any], db: Path
) -> None:
    ledger: Ledger = await make_ledger(checkpoint_every=50)
    wal = db.with_name(db.name + "-wal")
    sizes = []
    for round_ in range(3):
        for i in range(50):
            assert await ledger.commit(record(request_id=f"c{round_}-{i}"))
        await ledger.flush()
        sizes.append(wal.stat().st_size)
    assert ledger.checkpoints == 3
    assert sizes[2] <= sizes[0]  # the WAL is reused from its start, not grown
    assert len(rows(db)) == 150


def test_the_setting_takes_only_a_boolean(tmp_path: Path) -> None:
    assert _config(tmp_path).router.ledger_durable is True  # the default
    assert _config(tmp_path, ledger_durable=False).router.ledger_durable is False
    for meaningless in ("yes", "off", 1, None):
        with pytest.raises(ConfigError, match="ledger_durable"):
            _config(tmp_path, ledger_durable=meaningless)


# --- through the router ---------------------------------------------------------------------


def _config(tmp_path: Path, **router: Any) -> Config:
    router = {"ledger_flush_interval_s": 600.0, **router}  # no periodic flush within a test
    return config_for_test(tmp_path, pools=one_pool(), router=router)


# a stream's last event, per protocol: chat and completions, the Responses API, Anthropic Messages
_LAST_EVENTS = (b"data: [DONE]", b"event: response.completed", b"event: message_stop")


class FinalBytesProbe:
    """An ASGI wrapper that, when a response's final bytes are about to leave the router (the
    body of a non-streaming response, the message carrying a stream's `[DONE]`), reads the
    ledger file from another connection: is the request's record there already?"""

    def __init__(self, app: Gateway, path: Path) -> None:
        self.app = app
        self.path = path
        self.seen: dict[str, list[sqlite3.Row]] = {}  # request id -> rows at its final bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = ""
        streaming = False

        async def probe(message: Message) -> None:
            nonlocal request_id, streaming
            if message["type"] == "http.response.start":
                headers = dict(message["headers"])
                request_id = headers.get(b"x-gpupool-request-id", b"").decode()
                streaming = headers.get(b"content-type") == b"text/event-stream"
            elif message["type"] == "http.response.body" and request_id:
                body = message.get("body", b"")
                final = (
                    any(marker in body for marker in _LAST_EVENTS)
                    if streaming
                    else not message.get("more_body")
                )
                if final and request_id not in self.seen:
                    try:
                        found = rows(self.path, f"request_id = '{request_id}'")
                    except sqlite3.OperationalError:  # a test broke the file on purpose
                        found = []
                    self.seen[request_id] = found
            await send(message)

        await self.app(scope, receive, probe)


@pytest.fixture
async def router(
    tmp_path: Path,
) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient, FakeEngineState]]:
    state = FakeEngineState()
    async with gateway_over_fakes(_config(tmp_path), [state]) as rig:
        probe = FinalBytesProbe(rig.gateway, tmp_path / "l.sqlite")
        transport = httpx.ASGITransport(app=probe)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            client.probe = probe  # type: ignore[attr-defined]
            yield rig.gateway, client, state


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
async def test_the_record_is_on_disk_before_the_final_bytes(
    router: tuple[Gateway, httpx.AsyncClient, FakeEngineState], stream: bool
) -> None:
    _, client, _ = router
    probe: FinalBytesProbe = client.probe  # type: ignore[attr-defined]
    body = {**BODY, "stream": stream, "stream_options": {"include_usage": True}}
    if not stream:
        del body["stream_options"]
    resp = await client.post("/v1/chat/completions", json=body, headers={"x-gpupool-run-id": "r"})
    assert resp.status_code == 200
    request_id = resp.headers["x-gpupool-request-id"]
    (row,) = probe.seen[request_id]  # there when the final bytes left, not after
    usage = (
        resp.json()["usage"]
        if not stream
        else next(
            __import__("orjson").loads(line[6:])["usage"]
            for line in resp.content.split(b"\n")
            if line.startswith(b"data: {") and b'"usage"' in line
        )
    )
    assert (row["outcome"], row["status_code"], row["run_id"], row["step_index"]) == (
        "ok",
        200,
        "r",
        0,
    )
    # the whole record: the tokens the client was told, a cost, an end after the start
    assert (row["prompt_tokens"], row["completion_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert row["gpu_seconds"] > 0 and row["ended_at_s"] >= row["started_at_s"]
    if stream:
        assert row["ttft_s"] is not None and row["tpot_s"] is not None
        assert resp.content.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/responses", {"model": "tiny", "input": "hello", "max_output_tokens": 5}),
        ("/v1/messages", {**BODY, "max_tokens": 5}),
    ],
    ids=["responses", "messages"],
)
async def test_every_protocol_s_stream_is_recorded_before_its_last_event(
    router: tuple[Gateway, httpx.AsyncClient, FakeEngineState], path: str, body: dict[str, Any]
) -> None:
    _, client, _ = router
    probe: FinalBytesProbe = client.probe  # type: ignore[attr-defined]
    resp = await client.post(path, json={**body, "stream": True})
    assert resp.status_code == 200
    assert any(marker in resp.content for marker in _LAST_EVENTS)  # the stream ended whole
    (row,) = probe.seen[resp.headers["x-gpupool-request-id"]]
    assert (row["outcome"], row["status_code"], row["completion_tokens"]) == ("ok", 200, 5)


async def test_a_ledger_failure_does_not_fail_the_request(
    router: tuple[Gateway, httpx.AsyncClient, FakeEngineState],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    gateway, client, _ = router
    path = tmp_path / "l.sqlite"
    drop_requests_table(path)
    with caplog.at_level(logging.ERROR, logger="router.accounting.ledger"):
        resp = await client.post("/v1/chat/completions", json={**BODY, "stream": True})
    assert resp.status_code == 200 and resp.content.endswith(b"data: [DONE]\n\n")
    assert any("group commit" in r.getMessage() for r in caplog.records)
    restore_requests_table(path)
    await gateway.ledger.flush()
    assert [r["request_id"] for r in rows(path)] == [resp.headers["x-gpupool-request-id"]]


async def test_a_refusal_or_failure_is_written_by_the_next_group_commit(
    router: tuple[Gateway, httpx.AsyncClient, FakeEngineState], tmp_path: Path
) -> None:
    """Not awaited by the response, yet not left for the 600 s flush either."""
    _, client, state = router
    state.failure, state.fail_next = "http500", 1
    resp = await client.post("/v1/chat/completions", json=BODY)
    assert resp.status_code == 502
    request_id = resp.headers["x-gpupool-request-id"]
    for _ in range(200):
        if found := rows(tmp_path / "l.sqlite", f"request_id = '{request_id}'"):
            break
        await asyncio.sleep(0.01)
    assert [(r["outcome"], r["status_code"]) for r in found] == [("engine_error", 502)]
