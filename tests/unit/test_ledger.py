"""The durable ledger (router/accounting/ledger.py): batching, durability across close, restart
and a hard kill, retention in simulated time, tenant scoping and the run queries."""

from __future__ import annotations

import asyncio
import inspect
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from router.accounting.accountant import Accountant, ConservationReport
from router.accounting.ledger import (
    SCHEMA_VERSION,
    Ledger,
    LedgerError,
    open_readonly,
    run_summary,
)
from tests.unit.ledger_records import T0, record

DAY_S = 86_400.0


class FakeClock:
    def __init__(self, now_s: float = T0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


rec = record


def count_rows(path: Path, where: str = "1") -> int:
    with sqlite3.connect(path) as conn:
        return int(conn.execute(f"SELECT COUNT(*) FROM requests WHERE {where}").fetchone()[0])


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "state" / "ledger.sqlite"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def make_ledger(db: Path, clock: FakeClock) -> AsyncIterator[Callable[..., Any]]:
    started: list[Ledger] = []

    async def make(**kwargs: Any) -> Ledger:
        kwargs.setdefault("flush_interval_s", 1000.0)  # flush by hand unless a test says not
        ledger = Ledger(db, clock=clock, **kwargs)
        await ledger.start()
        started.append(ledger)
        return ledger

    yield make
    for ledger in started:
        await ledger.aclose()
    tasks = [t for t in asyncio.all_tasks() if t.get_name() == "gpupool-ledger-flush"]
    assert not tasks, "a flush task leaked"


# --- batching and durability ------------------------------------------------------------------


async def test_submit_only_buffers_and_flush_writes_one_batch(
    make_ledger: Callable[..., Any], db: Path
) -> None:
    ledger: Ledger = await make_ledger(durable=False)  # the batched ledger
    assert not inspect.iscoroutinefunction(Ledger.submit)  # nothing to await on the hot path
    for _ in range(3):
        ledger.submit(rec())
    assert ledger.buffered == 3
    assert count_rows(db) == 0
    assert await ledger.flush() == 3
    assert ledger.buffered == 0
    assert count_rows(db) == 3
    assert await ledger.flush() == 0


def test_submit_needs_no_open_file(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "never-opened.sqlite")
    ledger.submit(rec())
    assert ledger.buffered == 1
    assert not (tmp_path / "never-opened.sqlite").exists()


async def test_background_task_flushes_every_interval(
    make_ledger: Callable[..., Any], db: Path
) -> None:
    ledger: Ledger = await make_ledger(flush_interval_s=0.02)
    ledger.submit(rec())
    for _ in range(40):
        await asyncio.sleep(0.01)
        if count_rows(db) == 1:
            break
    assert count_rows(db) == 1
    assert ledger.written_records == 1


async def test_graceful_close_keeps_everything_and_reopen_carries_on(
    db: Path, clock: FakeClock
) -> None:
    first = Ledger(db, clock=clock, flush_interval_s=1000.0)
    await first.start()
    for _ in range(500):
        first.submit(rec())
    await first.aclose()
    await first.aclose()  # idempotent
    assert count_rows(db) == 500

    second = Ledger(db, clock=clock, flush_interval_s=1000.0)
    await second.start()
    second.submit(rec())
    summary = await second.run_summary("run-1", "team-a")
    await second.aclose()
    assert summary is not None
    assert summary["totals"]["requests"] == 501
    assert [r["step_index"] for r in summary["requests"]] == list(range(501))
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


HARD_KILL_SCRIPT = """
import asyncio, os, signal, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from tests.unit.test_ledger import rec
from router.accounting.ledger import Ledger

async def main() -> None:
    ledger = Ledger(Path({db!r}), flush_interval_s=1000.0, durable={durable})
    await ledger.start()
{body}
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


def run_then_kill(db: Path, body: str, *, durable: bool) -> None:
    """Run `body` (indented, `ledger` in scope) in a process that then kills itself with
    SIGKILL; check the file it leaves is intact."""
    root = str(Path(__file__).resolve().parents[2])
    script = HARD_KILL_SCRIPT.format(
        root=root, db=str(db), durable=durable, body=textwrap.indent(textwrap.dedent(body), "    ")
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == -9, proc.stderr.decode()
    conn = open_readonly(db)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        conn.close()


def test_hard_kill_loses_only_the_unflushed_batch(db: Path) -> None:
    body = """
        for i in range(50):
            ledger.submit(rec(request_id=f"flushed-{i}"))
        await ledger.flush()
        for i in range(7):
            ledger.submit(rec(request_id=f"lost-{i}"))
    """
    run_then_kill(db, body, durable=False)  # the batched ledger
    assert count_rows(db, "request_id LIKE 'flushed-%'") == 50
    assert count_rows(db, "request_id LIKE 'lost-%'") == 0


async def test_queries_see_records_still_in_the_buffer(make_ledger: Callable[..., Any]) -> None:
    ledger: Ledger = await make_ledger()
    ledger.submit(rec(run_id="fresh"))
    summary = await ledger.run_summary("fresh", "team-a")
    assert summary is not None and summary["totals"]["requests"] == 1
    assert ledger.buffered == 0


async def test_full_buffer_drops_and_counts(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "l.sqlite", max_buffered_records=2)
    for _ in range(5):
        ledger.submit(rec())
    assert (ledger.buffered, ledger.dropped_records) == (2, 3)


async def test_a_malformed_record_is_skipped_not_retried_forever(
    make_ledger: Callable[..., Any], db: Path
) -> None:
    ledger: Ledger = await make_ledger(durable=False)
    ledger.submit(rec(request_id="good-1"))
    ledger.submit(rec(request_id="bad", prompt_tokens=object()))
    ledger.submit(rec(request_id="good-2"))
    assert await ledger.flush() == 2
    assert ledger.dropped_records == 1
    assert count_rows(db) == 2


async def test_a_failed_flush_keeps_the_rows_and_the_task_retries(
    make_ledger: Callable[..., Any], db: Path
) -> None:
    calls = 0

    def flaky_snapshot() -> ConservationReport:
        nonlocal calls
        calls += 1
        if calls <= 2:
            raise RuntimeError("accountant hiccup")
        return Accountant().conservation(0.0)

    ledger: Ledger = await make_ledger(
        flush_interval_s=0.01, snapshot_source=flaky_snapshot, durable=False
    )
    ledger.submit(rec())
    with pytest.raises(RuntimeError):
        await ledger.flush()
    assert ledger.buffered == 1
    for _ in range(40):
        await asyncio.sleep(0.01)
        if count_rows(db) == 1:
            break
    assert count_rows(db) == 1 and calls >= 3


async def test_newer_schema_is_refused(db: Path) -> None:
    db.parent.mkdir(parents=True)
    with sqlite3.connect(db) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(LedgerError, match="newer"):
        await Ledger(db).start()


def test_open_readonly_refuses_missing_and_foreign_files(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match="no ledger"):
        open_readonly(tmp_path / "missing.sqlite")
    (tmp_path / "junk.sqlite").write_bytes(b"not sqlite at all" * 100)
    with pytest.raises(LedgerError):
        open_readonly(tmp_path / "junk.sqlite")


# --- step numbering ---------------------------------------------------------------------------


async def test_steps_number_per_tenant_and_run_in_arrival_order(
    make_ledger: Callable[..., Any],
) -> None:
    ledger: Ledger = await make_ledger()
    first = ledger.next_step_index("team-a", "run-1")  # reserved at arrival
    ledger.submit(rec())  # arrived later, finished first: numbered on submit
    ledger.submit(rec(step_index=first))
    ledger.submit(rec(tenant="team-b"))
    ledger.submit(rec(run_id=None))  # not part of a run: no step
    summary = await ledger.run_summary("run-1", "team-a")
    assert summary is not None
    assert [r["step_index"] for r in summary["requests"]] == [0, 1]
    other = await ledger.run_summary("run-1", "team-b")
    assert other is not None and other["requests"][0]["step_index"] == 0


async def test_a_run_request_that_never_reached_an_engine_takes_no_step_number(
    make_ledger: Callable[..., Any],
) -> None:
    ledger: Ledger = await make_ledger()
    ledger.submit(rec())  # step 0
    refused = rec(instance=None, outcome="rejected", status_code=429)
    ledger.submit(refused)  # refused before any engine: not a step of the run
    ledger.submit(rec())  # the retry, served: step 1, not 2
    summary = await ledger.run_summary("run-1", "team-a")
    assert summary is not None
    steps = {r["request_id"]: r["step_index"] for r in summary["requests"]}
    assert steps.pop(refused.request_id) is None
    assert sorted(steps.values()) == [0, 1]


# --- retention --------------------------------------------------------------------------------


async def test_retention_at_start_and_periodically(
    db: Path, clock: FakeClock, make_ledger: Callable[..., Any]
) -> None:
    writer = Ledger(db, clock=clock)
    await writer.start()
    writer.submit(rec(request_id="old", ended_at_s=T0 - 31 * DAY_S))
    writer.submit(rec(request_id="aging", ended_at_s=T0 - 29.5 * DAY_S))
    writer.submit(rec(request_id="new", ended_at_s=T0))
    await writer.aclose()
    assert count_rows(db) == 3

    ledger: Ledger = await make_ledger(
        retention_days=30, flush_interval_s=0.01, maintenance_interval_s=3600
    )
    assert count_rows(db) == 2  # "old" went at start
    clock.now_s += 0.6 * DAY_S  # "aging" is now past 30 days; the hourly pass is due
    for _ in range(40):
        await asyncio.sleep(0.01)
        if count_rows(db) == 1:
            break
    assert count_rows(db, "request_id = 'new'") == count_rows(db) == 1
    assert ledger.written_records == 0


# --- idle snapshots ---------------------------------------------------------------------------


async def test_idle_and_capacity_survive_a_restart(db: Path, clock: FakeClock) -> None:
    mono = FakeClock(0.0)
    acc = Accountant()
    acc.add_instance("i0", 2.0, {"agent": 0.25, "normal": 0.75}, now_s=0.0)
    ledger = Ledger(db, clock=clock, snapshot_source=lambda: acc.conservation(mono()))
    await ledger.start()
    mono.now_s = 10.0
    await ledger.flush()
    tok = acc.begin("i0", 10.0)
    mono.now_s = 14.0
    ledger.submit(rec(pool="agent", gpu_seconds=acc.end(tok, 14.0)))
    clock.now_s += 3600.0  # next hour bucket
    mono.now_s = 20.0
    await ledger.aclose()

    again = Ledger(db, clock=clock)
    await again.start()
    totals = await again.totals()
    await again.aclose()
    assert totals["capacity_gpu_seconds"] == pytest.approx(40.0)
    assert totals["by_pool"]["agent"]["idle_gpu_seconds"] == pytest.approx(0.25 * 32.0)
    assert totals["by_pool"]["normal"]["idle_gpu_seconds"] == pytest.approx(0.75 * 32.0)
    assert totals["by_pool"]["normal"]["requests"] == 0
    assert totals["gpu_seconds"] + totals["idle_gpu_seconds"] == pytest.approx(40.0)


# --- queries ----------------------------------------------------------------------------------


async def test_run_summary_totals_and_distributions(make_ledger: Callable[..., Any]) -> None:
    ledger: Ledger = await make_ledger()
    for i in range(5):
        ledger.submit(
            rec(
                started_at_s=T0 + 10 * i,
                ended_at_s=T0 + 10 * i + 4,
                ttft_s=0.1 * (i + 1),
                tpot_s=None if i == 4 else 0.02,
                gpu_seconds=2.0,
                queue_s=0.5,
                outcome="engine_error" if i == 3 else "ok",
            )
        )
    summary = await ledger.run_summary("run-1", "team-a")
    assert summary is not None
    totals = summary["totals"]
    assert totals["requests"] == 5
    assert totals["outcomes"] == {"ok": 4, "engine_error": 1}
    assert totals["gpu_seconds"] == pytest.approx(10.0)
    assert totals["queue_s"] == pytest.approx(2.5)
    assert totals["wall_s"] == pytest.approx(44.0)
    assert (totals["prompt_tokens"], totals["completion_tokens"]) == (500, 100)
    assert summary["ttft_s"]["p50"] == pytest.approx(0.3)
    assert summary["ttft_s"]["p95"] == pytest.approx(0.48)
    assert summary["ttft_s"]["max"] == pytest.approx(0.5)
    assert summary["tpot_s"]["count"] == 4
    assert summary["first_seen_s"] == T0 and summary["last_seen_s"] == T0 + 44
    assert summary["tenants"] == ["team-a"]
    assert set(summary["requests"][0]) >= {"request_id", "step_index", "gpu_seconds", "outcome"}


async def test_runs_are_tenant_scoped(make_ledger: Callable[..., Any]) -> None:
    ledger: Ledger = await make_ledger()
    ledger.submit(rec(run_id="shared", tenant="team-a", gpu_seconds=1.0))
    ledger.submit(rec(run_id="shared", tenant="team-b", gpu_seconds=5.0))
    ledger.submit(rec(run_id="mine", tenant="team-a"))
    assert await ledger.run_summary("mine", "team-b") is None
    assert await ledger.run_summary("nope", "team-a") is None
    a = await ledger.run_summary("shared", "team-a")
    assert a is not None and a["totals"]["gpu_seconds"] == pytest.approx(1.0)
    everyone = await ledger.run_summary("shared", None)
    assert everyone is not None and everyone["tenants"] == ["team-a", "team-b"]
    runs_b = await ledger.list_runs("team-b")
    assert [(r["run_id"], r["tenant"]) for r in runs_b] == [("shared", "team-b")]


async def test_list_runs_filters(make_ledger: Callable[..., Any]) -> None:
    ledger: Ledger = await make_ledger()
    for k in range(4):  # run-k ends at T0 + 100k, costs k + 1
        ledger.submit(
            rec(
                run_id=f"run-{k}",
                started_at_s=T0 + 100 * k - 5,
                ended_at_s=T0 + 100 * k,
                gpu_seconds=k + 1.0,
                class_name="agent" if k % 2 else "normal",
            )
        )
    ledger.submit(rec(run_id="run-0", class_name="agent", ended_at_s=T0 + 1, gpu_seconds=0.5))
    newest = await ledger.list_runs("team-a")
    assert [r["run_id"] for r in newest] == ["run-3", "run-2", "run-1", "run-0"]
    assert newest[-1]["requests"] == 2 and newest[-1]["classes"] == ["agent", "normal"]
    since = await ledger.list_runs("team-a", since_s=T0 + 150)
    assert [r["run_id"] for r in since] == ["run-3", "run-2"]
    assert [r["run_id"] for r in await ledger.list_runs("team-a", limit=1)] == ["run-3"]
    assert await ledger.list_runs("team-a", limit=0) == []
    agent = await ledger.list_runs("team-a", class_name="agent")
    assert [r["run_id"] for r in agent] == ["run-3", "run-1", "run-0"]
    costly = await ledger.list_runs(None, order_by="gpu_seconds", limit=2)
    assert [(r["run_id"], r["gpu_seconds"]) for r in costly] == [("run-3", 4.0), ("run-2", 3.0)]


async def test_totals_and_admin_report(make_ledger: Callable[..., Any]) -> None:
    ledger: Ledger = await make_ledger()
    ledger.submit(rec(pool="agent", class_name="agent", tenant="a", gpu_seconds=3.0))
    ledger.submit(
        rec(
            pool="normal",
            class_name="normal",
            tenant="b",
            run_id=None,
            gpu_seconds=1.0,
            prompt_tokens=7,
            completion_tokens=3,
        )
    )
    ledger.submit(
        rec(
            pool="normal",
            class_name="normal",
            tenant="b",
            run_id=None,
            instance=None,
            gpu_seconds=0.0,
            outcome="rejected",
            status_code=429,
        )
    )
    totals = await ledger.totals()
    assert totals["requests"] == 3
    assert totals["gpu_seconds"] == pytest.approx(4.0)
    assert totals["outcomes"] == {"ok": 2, "rejected": 1}
    assert totals["by_pool"]["normal"]["requests"] == 2
    assert totals["by_class"]["agent"]["gpu_seconds"] == pytest.approx(3.0)
    assert totals["by_tenant"]["b"]["prompt_tokens"] == 107
    assert totals["by_tenant"]["a"]["runs"] == 1
    assert (await ledger.totals(since_s=T0 + 10))["requests"] == 0

    acc = Accountant()
    acc.add_instance("i0", 1.0, {"agent": 1.0}, now_s=0.0)
    report = await ledger.admin_report(top_n=5, live=acc.conservation(3.0))
    assert report["ledger"]["requests"] == 3
    assert [r["run_id"] for r in report["top_runs"]] == ["run-1"]
    assert report["live"]["capacity_gpu_seconds"] == pytest.approx(3.0)


def test_sync_queries_read_a_closed_file(db: Path) -> None:
    async def write() -> None:
        ledger = Ledger(db)
        await ledger.start()
        ledger.submit(rec())
        await ledger.aclose()

    asyncio.run(write())
    conn = open_readonly(db)
    try:
        summary = run_summary(conn, "run-1", None)
    finally:
        conn.close()
    assert summary is not None and summary["totals"]["requests"] == 1
