"""Settlement's fixed order (router/settlement.py): meter -> governance -> ledger -> learners,
before the final bytes and after the response, with fakes that record each call; and a run's
end handled inside it (span, ledger, run table)."""

from __future__ import annotations

import asyncio
from typing import Any

from router.admission.estimate import Estimate
from router.admission.picking import RunAffinity
from router.errors import RunStopped
from router.governance import RunEnd
from router.governance.shared import NextStep
from router.governance.speculation import DeferredStep
from router.metrics import RouterMetrics
from router.request import RequestContext, RequestOutcome
from router.runtable import RunTable
from router.settlement import ORDER, Settlement


class Calls(list[str]):
    pass


class FakeMeter:
    numbers_steps = False  # the ledger numbers no steps with its records (SQLite's)

    def __init__(self, calls: Calls) -> None:
        self.calls = calls
        self.numbered: tuple[Any, ...] | None = None

    def dispatched(self, outcome: RequestOutcome) -> None:
        self.calls.append("meter.dispatched")

    def stop(self, outcome: RequestOutcome) -> float:
        return 0.5

    def meter(self, outcome: RequestOutcome, *, final_bytes_next: bool) -> float:
        self.calls.append("meter")
        outcome.gpu_seconds = 0.5
        return 0.5

    async def commit(self, outcome: RequestOutcome) -> None:
        self.calls.append("ledger")
        outcome.committed_as = (outcome.outcome, outcome.status)

    async def commit_numbered(
        self, outcome: RequestOutcome, step_sql: str, step_params: Any
    ) -> tuple[Any, ...] | None:
        """The ledger's answer `numbered` (set by a test): None, it cannot now; a row."""
        self.calls.append(f"ledger.numbered:{step_sql}")
        if self.numbered is not None:
            outcome.committed_as = (outcome.outcome, outcome.status)
        return self.numbered

    def record(self, outcome: RequestOutcome) -> None:
        self.calls.append("ledger")

    def observe(self, outcome: RequestOutcome) -> None:
        self.calls.append("learners.gpu_seconds")

    def run_completed(self, tenant: str, run_id: str) -> tuple[str, float] | None:
        self.calls.append("span")
        return ("agent", 3.0)


class FakeGovernance:
    fold_steps = True  # settlement sets it from the meter's `numbers_steps`

    def __init__(self, calls: Calls) -> None:
        self.calls = calls
        self.deferred: DeferredStep | None = None  # a step to number with its record

    def deferred_step(self, outcome: RequestOutcome) -> DeferredStep | None:
        return self.deferred

    def dispatched(self, outcome: RequestOutcome) -> None:
        self.calls.append("governance.dispatched")

    def finished(self, outcome: RequestOutcome) -> None:
        assert outcome.gpu_seconds == 0.5  # metered first: governance charges it
        self.calls.append("governance")


class FakeLedger:
    def __init__(self, calls: Calls) -> None:
        self.calls = calls
        self.ends: list[dict[str, Any]] = []

    def submit_run_end(self, **end: Any) -> None:
        self.calls.append("ledger.run_end")
        self.ends.append(end)


class FakeLearner:
    def __init__(self, calls: Calls, name: str) -> None:
        self.calls, self.name = calls, name

    def dispatched(self, outcome: RequestOutcome) -> None:
        self.calls.append(f"{self.name}.dispatched")

    def finished(self, outcome: RequestOutcome) -> None:
        self.calls.append(f"learners.{self.name}")

    def usage_extra(self, outcome: RequestOutcome) -> dict[str, Any]:
        return {}


class FakeEstimator:
    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    def observe(self, estimate: Estimate, **kw: Any) -> float | None:
        self.calls.append("learners.estimator")
        return None


def rig(calls: Calls) -> tuple[Settlement, RunAffinity, FakeLedger, RunTable]:
    runs = RunTable()
    affinity = RunAffinity(runs=runs)
    ledger = FakeLedger(calls)
    settlement = Settlement(
        accounting=FakeMeter(calls),
        governance=FakeGovernance(calls),
        ledger=ledger,
        runs=runs,
        estimator=FakeEstimator(calls),
        affinity=affinity,
        metrics=RouterMetrics(),
        signals=FakeLearner(calls, "signals"),
        observers=[FakeLearner(calls, "extra")],
        clock=lambda: 10.0,
        wall_clock=lambda: 1000.0,
    )
    return settlement, affinity, ledger, runs


def outcome() -> RequestOutcome:
    ctx = RequestContext(
        request_id="gp-1",
        tenant="t",
        class_name="agent",
        pool="agent",
        priority=0,
        deadline_s=100.0,
        run_id="run-1",
        model="tiny",
        stream=False,
        client_wants_usage=False,
        received_at_s=1.0,
    )
    estimate = Estimate(prompt_tokens=10, output_tokens=20, source="heuristic")
    return RequestOutcome(
        ctx=ctx,
        estimate=estimate,
        instance_id="i0",
        status=200,
        prompt_tokens=10,
        completion_tokens=4,
    )


def parts(calls: Calls) -> list[str]:
    """The calls by settlement part, in order, each part once per run of consecutive calls."""
    out: list[str] = []
    for call in calls:
        part = call.split(".")[0]
        if not out or out[-1] != part:
            out.append(part)
    return out


def test_the_order_is_written_down() -> None:
    assert ORDER == ("meter", "governance", "ledger", "learners")


def test_a_request_settled_before_its_final_bytes_keeps_the_order() -> None:
    calls = Calls()
    settlement, affinity, _, _ = rig(calls)
    out = outcome()
    settlement.dispatched(out)
    # governance first at dispatch: with a shared store it numbers the run's step
    assert calls == ["governance.dispatched", "meter.dispatched", "signals.dispatched",
                     "extra.dispatched"]  # fmt: skip
    calls.clear()
    asyncio.run(settlement.settle(out))
    assert calls == ["meter", "governance", "ledger"]  # the learners wait for the response
    settlement.finish(out)
    assert parts(calls) == list(ORDER)
    assert calls[3:] == ["ledger", "learners.estimator", "learners.gpu_seconds",
                         "learners.signals", "learners.extra"]  # fmt: skip
    assert affinity.get(("t", "run-1")) == "i0"
    assert affinity.context_tokens(("t", "run-1")) == 14


def test_a_request_that_never_settled_keeps_the_order_after_the_response() -> None:
    calls = Calls()
    settlement, _, _, _ = rig(calls)
    out = outcome()
    out.outcome, out.status = "aborted", 499
    settlement.finish(out)
    assert parts(calls) == list(ORDER)
    assert "learners.estimator" not in calls  # learned only from a request that ended ok


def test_a_run_end_is_handled_inside_settlement() -> None:
    calls = Calls()
    settlement, affinity, ledger, runs = rig(calls)
    affinity.record(("t", "run-1"), "i0")
    settlement.run_ended(RunEnd("t", "run-1", "client_end", 9.0, 1.0, 3, 42, 1.5))
    assert calls == ["span", "ledger.run_end"]
    (end,) = ledger.ends
    assert end["reason"] == "client_end" and end["ended_at_s"] == 999.0
    record = runs.get(("t", "run-1"))
    assert record is not None and record.ended


def _deferred(
    calls: Calls, refusal: BaseException | None = None, stored_step: int = 3
) -> DeferredStep:
    """A step sent on as number 3 whose answer is read by a fake governor (`refusal`: what
    it refuses with); numbered on its own (`read`) as `stored_step`."""

    async def number() -> NextStep | None:
        calls.append("governance.statement")
        await asyncio.sleep(0)
        return NextStep(stored_step)

    def on_answer(stored: NextStep | None, failed: bool) -> BaseException | None:
        calls.append(f"governance.read:{None if stored is None else stored.step}:{failed}")
        return refusal

    return DeferredStep("STEP SQL", ("t", "run-1", 1000.0), 3, number, on_answer)


STEP_ROW = (4, "i0", 2, 30, 0, 0.0, None, 0.0)  # NEXT_STEP_SQL's row: step 3, home i0


def test_a_step_numbered_with_its_record_is_committed_before_governance_reads_it() -> None:
    calls = Calls()
    settlement, _, _, _ = rig(calls)
    governance = settlement.governance
    assert isinstance(governance, FakeGovernance) and governance.fold_steps is False
    governance.deferred = _deferred(calls)
    meter = settlement.accounting
    assert isinstance(meter, FakeMeter)
    meter.numbered = STEP_ROW
    out = outcome()
    assert asyncio.run(settlement.settle(out)) is None
    # the ledger before governance: its statement numbers the step; governance settles it
    # after the final bytes (s47: nothing in them waits for it)
    assert calls == ["meter", "ledger.numbered:STEP SQL", "governance.read:3:False"]
    calls.clear()
    settlement.finish(out)  # governance once, then the record as committed: not written again
    assert calls[0] == "governance" and calls.count("governance") == 1
    assert calls.count("ledger") == 1


def test_a_step_its_record_refuses_gets_the_refusal_and_its_record_replaced() -> None:
    calls = Calls()
    settlement, _, _, _ = rig(calls)
    governance = settlement.governance
    assert isinstance(governance, FakeGovernance)
    stop = RunStopped("stopped on another router replica", "run_loop")
    governance.deferred = _deferred(calls, refusal=stop)
    meter = settlement.accounting
    assert isinstance(meter, FakeMeter)
    meter.numbered = STEP_ROW
    out = outcome()
    assert asyncio.run(settlement.settle(out)) is stop
    # as a step refused before dispatch: no instance, no number, nothing served
    assert (out.status, out.outcome, out.reason) == (403, "client_error", "run_loop")
    assert (out.instance_id, out.step_index, out.dispatched_at_s) == (None, None, None)
    assert (out.prompt_tokens, out.completion_tokens, out.gpu_seconds) == (0, 0, 0.5)
    # committed as served: `record` (AccountingObserver's) writes the refusal's over it
    assert out.committed_as == ("ok", 200) != (out.outcome, out.status)
    assert "governance" not in calls  # after the refusal is sent
    settlement.finish(out)
    assert calls.count("governance") == 1


def test_a_step_the_ledger_cannot_number_now_is_numbered_beside_its_commit() -> None:
    calls = Calls()
    settlement, _, _, _ = rig(calls)
    governance = settlement.governance
    assert isinstance(governance, FakeGovernance)
    governance.deferred = step = _deferred(calls, stored_step=5)
    out = outcome()
    out.step_index = 3  # the known number, given at dispatch
    assert asyncio.run(settlement.settle(out)) is None  # `numbered` None: it cannot now
    assert calls == ["meter", "ledger.numbered:STEP SQL", "ledger", "governance.statement",
                     "governance.read:5:False"]  # fmt: skip
    assert step.step == 5  # renumbered: the record, committed as 3, is written again
    assert out.committed_as is None
