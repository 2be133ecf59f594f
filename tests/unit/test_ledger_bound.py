"""The ledger's per-run step counter is bounded: random run ids cannot grow the router's memory,
and a run whose counter was evicted continues its numbering from what the ledger stored."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from router.accounting.ledger import Ledger, RequestRecord
from tests.unit.ledger_records import T0, record


def rec(run_id: str | None, **changes: Any) -> RequestRecord:
    small = {"ended_at_s": T0 + 1.0, "queue_s": 0.0, "ttft_s": None, "tpot_s": None}
    return record(
        run_id=run_id,
        **{**small, "prompt_tokens": 10, "completion_tokens": 2, "gpu_seconds": 0.5, **changes},
    )


@pytest.fixture
async def make_ledger(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    started: list[Ledger] = []

    async def make(**kwargs: Any) -> Ledger:
        kwargs.setdefault("flush_interval_s", 1000.0)  # flush by hand
        ledger = Ledger(tmp_path / "ledger.sqlite", clock=lambda: T0 + 10.0, **kwargs)
        await ledger.start()
        started.append(ledger)
        return ledger

    yield make
    for ledger in started:
        await ledger.aclose()


async def steps_of(ledger: Ledger, run_id: str, tenant: str = "team-a") -> list[int]:
    summary = await ledger.run_summary(run_id, tenant)
    assert summary is not None
    return sorted(r["step_index"] for r in summary["requests"])


def _churn(ledger: Ledger, n: int, prefix: str = "random") -> None:
    for i in range(n):
        ledger.next_step_index("team-a", f"{prefix}-{i}")


async def test_random_run_ids_keep_memory_bounded(make_ledger: Callable[..., Any]) -> None:
    ledger: Ledger = await make_ledger(max_tracked_runs=500)

    async def churn(round_: int) -> None:
        _churn(ledger, 10_000, f"r{round_}")
        for i in range(1_000):  # requests that finish, numbered on submit
            ledger.submit(rec(f"s{round_}-{i}"))
        await ledger.flush()

    tracemalloc.start()
    try:
        await churn(0)  # the counters held from here on are all traced
        gc.collect()
        before, _ = tracemalloc.get_traced_memory()
        for round_ in range(1, 5):
            await churn(round_)
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ledger.tracked_runs == 500
    assert ledger.evicted_runs == 5 * 11_000 - 500
    # 44,000 more run ids: a counter per run would hold ~10 MB; what may differ between the
    # two readings is the last batch written (~200 kB, held by the worker thread's frames)
    assert after - before < 1_000_000, (before, after)


async def test_an_evicted_run_continues_from_the_stored_steps(
    make_ledger: Callable[..., Any],
) -> None:
    ledger: Ledger = await make_ledger(max_tracked_runs=50)
    for _ in range(3):
        ledger.submit(rec("run-a"))
    await ledger.flush()
    _churn(ledger, 200)
    assert ledger.tracked_runs == 50
    step = ledger.next_step_index("team-a", "run-a")
    assert step == 3
    ledger.submit(rec("run-a", step_index=step))
    ledger.submit(rec("run-a"))
    assert await steps_of(ledger, "run-a") == [0, 1, 2, 3, 4]


async def test_an_evicted_run_whose_steps_are_not_written_yet(
    make_ledger: Callable[..., Any],
) -> None:
    ledger: Ledger = await make_ledger(max_tracked_runs=50)
    reserved = ledger.next_step_index("team-a", "run-b")
    ledger.submit(rec("run-b"))  # numbered at submit: 1; nothing on disk yet
    ledger.submit(rec("run-b", step_index=reserved))
    _churn(ledger, 200)
    ledger.submit(rec("run-b"))  # evicted and back before any flush
    assert await steps_of(ledger, "run-b") == [0, 1, 2]
    _churn(ledger, 200, "again")
    ledger.submit(rec("run-b"))  # evicted again, now after the flush
    assert await steps_of(ledger, "run-b") == [0, 1, 2, 3]


async def test_tenants_do_not_share_steps_after_eviction(make_ledger: Callable[..., Any]) -> None:
    ledger: Ledger = await make_ledger(max_tracked_runs=10)
    ledger.submit(rec("shared"))
    ledger.submit(rec("shared"))
    _churn(ledger, 50)
    ledger.submit(rec("shared", tenant="team-b"))
    ledger.submit(rec("shared"))
    assert await steps_of(ledger, "shared", "team-b") == [0]
    assert await steps_of(ledger, "shared") == [0, 1, 2]


async def test_a_restart_remembers_only_the_most_recent_runs_yet_numbers_all(
    make_ledger: Callable[..., Any],
) -> None:
    first: Ledger = await make_ledger(max_tracked_runs=1_000)
    for i in range(30):
        for _ in range(i % 4 + 1):
            first.submit(rec(f"run-{i}", ended_at_s=T0 + i))
    await first.aclose()

    second: Ledger = await make_ledger(max_tracked_runs=5)
    assert second.tracked_runs == 5  # the five most recent
    for i in (0, 13, 29):
        second.submit(rec(f"run-{i}"))
        assert await steps_of(second, f"run-{i}") == list(range(i % 4 + 2))
