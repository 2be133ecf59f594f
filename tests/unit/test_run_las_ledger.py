"""Run-level signals: where a run's wall time went (queue vs execution vs the time between its
steps), in `GET /v1/runs/{run_id}`'s totals; a run's completion time when it ends."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from router.accounting.accountant import Accountant
from router.accounting.ledger import Ledger, RequestRecord
from router.accounting.metrics import AccountingMetrics
from router.accounting.observer import AccountingObserver
from router.metrics import RouterMetrics
from router.request import RequestContext, RequestOutcome
from tests.unit.ledger_records import T0, record


def _step(start: float, end: float, queue: float, run_id: str = "run-1") -> RequestRecord:
    return record(
        run_id=run_id,
        started_at_s=T0 + start,
        ended_at_s=T0 + end,
        queue_s=queue,
        ttft_s=None,
        tpot_s=None,
        prompt_tokens=10,
        completion_tokens=5,
        gpu_seconds=0.5,
    )


async def _totals(tmp_path: Path, *records: RequestRecord) -> dict[str, float]:
    ledger = Ledger(tmp_path / "l.sqlite", clock=lambda: T0, flush_interval_s=1000.0)
    await ledger.start()
    try:
        for r in records:
            ledger.submit(r)
        summary = await ledger.run_summary(records[0].run_id or "", "team-a")
    finally:
        await ledger.aclose()
    assert summary is not None
    totals: dict[str, float] = summary["totals"]
    return totals


async def test_sequential_steps_split_the_wall_time_exactly(tmp_path: Path) -> None:
    # step 0: arrives at 0, waits 1 s, runs to 3; tool call 3..7; step 1: 7..8 (no wait);
    # tool call 8..10; step 2: arrives at 10, waits 2.5 s, ends at 14
    totals = await _totals(
        tmp_path, _step(0.0, 3.0, 1.0), _step(7.0, 8.0, 0.0), _step(10.0, 14.0, 2.5)
    )
    assert totals["wall_s"] == pytest.approx(14.0)
    assert totals["queue_s"] == pytest.approx(3.5)
    assert totals["exec_s"] == pytest.approx(2.0 + 1.0 + 1.5)
    assert totals["between_steps_s"] == pytest.approx(4.0 + 2.0)
    parts = totals["queue_s"] + totals["exec_s"] + totals["between_steps_s"]
    assert parts == pytest.approx(totals["wall_s"])


async def test_overlapping_steps_count_their_gap_once(tmp_path: Path) -> None:
    # two parallel steps 0..4 and 1..5 (the second waited 1 s), then a gap 5..9, a step 9..10
    totals = await _totals(
        tmp_path,
        _step(0.0, 4.0, 0.0, "par"),
        _step(1.0, 5.0, 1.0, "par"),
        _step(9.0, 10.0, 0.0, "par"),
    )
    assert totals["queue_s"] == pytest.approx(1.0)
    assert totals["exec_s"] == pytest.approx(4.0 + 3.0 + 1.0)  # step-seconds
    assert totals["between_steps_s"] == pytest.approx(4.0)


async def test_a_rejected_step_counts_as_queue_not_execution(tmp_path: Path) -> None:
    rejected = _step(0.0, 2.0, 2.0, "rej")  # waited its 2 s, then a 429 queue_timeout
    totals = await _totals(tmp_path, rejected, _step(3.0, 4.0, 0.0, "rej"))
    assert (totals["queue_s"], totals["exec_s"]) == pytest.approx((2.0, 1.0))
    assert totals["between_steps_s"] == pytest.approx(1.0)


# ------------------------------------------------------------------ run completion


_outcome_ids = itertools.count()


def _outcome(run_id: str | None, cls: str, received_s: float, ended_s: float) -> RequestOutcome:
    ctx = RequestContext(
        request_id=f"outcome-{next(_outcome_ids)}",
        tenant="team-a",
        class_name=cls,
        pool="agent",
        priority=0,
        deadline_s=1e9,
        run_id=run_id,
        model="tiny",
        stream=False,
        client_wants_usage=False,
        received_at_s=received_s,
    )
    return RequestOutcome(ctx=ctx, instance_id="i0", ended_at_s=ended_s)


def test_run_completion_spans_first_arrival_to_last_byte(tmp_path: Path) -> None:
    now = [0.0]
    acct = Accountant()
    acct.add_instance("i0", 1.0, {"agent": 1.0}, 0.0)
    registry = CollectorRegistry()
    observer = AccountingObserver(
        acct,
        Ledger(tmp_path / "l.sqlite", clock=lambda: T0),
        AccountingMetrics(registry),
        clock=lambda: now[0],
        wall_clock=lambda: T0 + now[0],
    )
    steps = [
        ("run-a", "agent", 1.0, 4.0),
        ("run-b", "normal", 2.0, 3.0),
        ("run-a", "chat", 9.0, 12.5),
    ]
    for run_id, cls, received_s, ended_s in steps:
        out = _outcome(run_id, cls, received_s, ended_s)
        now[0] = received_s
        observer.dispatched(out)
        now[0] = ended_s
        observer.finished(out)
    observer.finished(_outcome(None, "agent", 0.0, 1.0))  # not a run: no span
    completed = observer.run_completed("team-a", "run-a")
    assert completed is not None
    assert completed[0] == "agent" and completed[1] == pytest.approx(11.5)
    assert observer.run_completed("team-a", "run-a") is None  # forgotten once reported
    assert observer.run_completed("team-b", "run-b") is None  # another tenant's key
    completed = observer.run_completed("team-a", "run-b")
    assert completed is not None
    assert completed[0] == "normal" and completed[1] == pytest.approx(1.0)
    metrics = RouterMetrics()
    metrics.observe_run_completion("agent", 11.5)
    metrics.observe_run_completion("agent", 0.5)
    assert (
        metrics.registry.get_sample_value(
            "gpupool_run_completion_seconds_bucket", {"class": "agent", "le": "10.0"}
        )
        == 1.0
    )
    assert (
        metrics.registry.get_sample_value(
            "gpupool_run_completion_seconds_count", {"class": "agent"}
        )
        == 2.0
    )
