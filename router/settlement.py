"""The one owner of a request's settlement once it is dispatched, and of a run's end.

The request path (router.gateway.proxy) calls only this after dispatch:

    dispatched(outcome)        each upstream attempt: governance counts the step (with a
                               shared store it numbers it), the meter starts (numbering the
                               step when governance did not), the rebalancer its wait
    answered(outcome)          the engine answered: the run's home is where it went
    usage_extra(outcome)       the usage is known: the meter stops; what goes in the usage
    await settle(outcome)      right before the response's final bytes, at most once; returns
                               the refusal the client gets instead of them (a run's step
                               numbered with its record, below), else None
    finish(outcome)            after the response, exactly once per classified request

Settling runs in one fixed order, `ORDER`, in both `settle` and `finish` (each part runs once
per request, in the first of the two that reaches it):

    1. meter       stop the request's GPU-seconds clock; note the step in its run's span
    2. governance  settle the tenant's reservation and the run's counters; may end the run
    3. ledger      the request's record: committed durably before the final bytes, or queued
    4. learners    estimator, affinity, router metrics, GPU-seconds counter, rebalancer
                   signals, then any extra observers (after the response: its outcome is final)

GPU-seconds come first because governance charges them to the tenant and the run; governance
before the ledger and the learners because it may end the run, and a run's end (`run_ended`,
also what governance's idle sweep calls) is handled here: its completion time from its span,
its end in the ledger, its record marked ended in the run table (forgotten first).

One exception to that order (s44): an agent step that governance sent on with no statement
(`Governor.deferred_step`: a known run's non-streaming step on a PostgreSQL store) is numbered
by the statement that commits its record (`commit_numbered`), so there the ledger comes
before governance, which then reads the store's answer: the step's number and home, or a
refusal (a stop or `max_steps` reached on another replica), which `settle` returns for the
client instead of the response (the record then replaced by the refusal's in `finish`);
governance settles such a step in `finish`, after the final bytes (s47).
When the ledger cannot take it now (another commit in flight), the step's own statement
goes beside the record's commit (the known number), and a renumbered step's record is
written again in `finish`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from router.admission.estimate import Estimate
from router.admission.picking import RunAffinity
from router.errors import GpupoolError
from router.governance import RunEnd
from router.governance.speculation import DeferredStep
from router.metrics import RouterMetrics
from router.request import RequestObserver, RequestOutcome
from router.runtable import RunTable

__all__ = ["ORDER", "Governance", "Learner", "Meter", "RunEndLog", "Settlement", "outcome_of"]

log = logging.getLogger(__name__)

ORDER = ("meter", "governance", "ledger", "learners")


class Meter(Protocol):
    """GPU-seconds and the request's record (router.accounting.observer.AccountingObserver)."""

    def dispatched(self, outcome: RequestOutcome) -> None: ...

    def stop(self, outcome: RequestOutcome) -> float: ...

    def meter(self, outcome: RequestOutcome, *, final_bytes_next: bool) -> float: ...

    def commit(self, outcome: RequestOutcome) -> Awaitable[object]: ...

    @property
    def numbers_steps(self) -> bool: ...

    def commit_numbered(
        self, outcome: RequestOutcome, step_sql: str, step_params: Sequence[Any]
    ) -> Awaitable[tuple[Any, ...] | None]: ...

    def record(self, outcome: RequestOutcome) -> None: ...

    def observe(self, outcome: RequestOutcome) -> None: ...

    def run_completed(self, tenant: str, run_id: str) -> tuple[str, float] | None: ...


class RunEndLog(Protocol):
    """Where a run's end is recorded (router.accounting.ledger.Ledger)."""

    def submit_run_end(
        self,
        *,
        tenant: str,
        run_id: str,
        reason: str,
        ended_at_s: float,
        steps: int,
        tokens: int,
        gpu_seconds: float,
    ) -> None: ...


class Learner(Protocol):
    """What settlement needs of the token estimator (router.admission.estimate.TokenEstimator):
    a Protocol, so a compiled build accepts any object that learns from usage."""

    def observe(
        self,
        estimate: Estimate,
        *,
        class_name: str,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> float | None: ...


class Governance(Protocol):
    """What settlement needs of the governor (router.governance.Governor)."""

    fold_steps: bool  # the ledger numbers a known run's step with its record (set here)

    def dispatched(self, outcome: RequestOutcome) -> None: ...

    def deferred_step(self, outcome: RequestOutcome) -> DeferredStep | None: ...

    def finished(self, outcome: RequestOutcome) -> None: ...


class Settlement:
    """Settles each request in `ORDER` (see the module's docstring); handles runs' ends."""

    def __init__(
        self,
        *,
        accounting: Meter,
        governance: Governance | None,
        ledger: RunEndLog,
        runs: RunTable,
        estimator: Learner,
        affinity: RunAffinity,
        metrics: RouterMetrics,
        signals: RequestObserver,
        observers: list[RequestObserver] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.accounting = accounting
        self.ledger = ledger
        self.governance = governance
        self.runs = runs
        self.estimator = estimator
        self.affinity = affinity
        self.metrics = metrics
        self.signals = signals
        self.observers = observers or []
        self._clock = clock
        self._wall_clock = wall_clock
        if governance is not None:
            governance.fold_steps = accounting.numbers_steps
        # settled requests whose governance part has not run (cancelled while their step
        # was numbered): `finish` runs it
        self._ungoverned: set[str] = set()

    # ------------------------------------------------------------------ dispatch

    def dispatched(self, outcome: RequestOutcome) -> None:
        """An upstream attempt starts (a retry after a refused connection calls it again)."""
        if self.governance is not None:  # first: a shared store's step number
            self.governance.dispatched(outcome)
        self.accounting.dispatched(outcome)
        self.signals.dispatched(outcome)
        for obs in self.observers:
            obs.dispatched(outcome)

    def answered(self, outcome: RequestOutcome) -> None:
        """The engine answered the attempt: the run's (or session's) home is that instance."""
        if outcome.instance_id is not None:
            self.affinity.record(outcome.ctx.home_key, outcome.instance_id, step=outcome.step_index)

    def usage_extra(self, outcome: RequestOutcome) -> dict[str, Any]:
        """What goes in the response's usage (GPU-seconds, ...), once its tokens are known."""
        extra: dict[str, Any] = {"gpu_seconds": round(self.accounting.stop(outcome), 6)}
        for obs in self.observers:
            extra.update(obs.usage_extra(outcome))
        return extra

    # ------------------------------------------------------------------ settling

    async def settle(self, outcome: RequestOutcome) -> BaseException | None:
        """The response's final bytes are next: meter, governance, ledger (a durable commit).
        The learners wait for `finish` (the client may still leave during the final send).
        Never raises: a failing part is logged and the response still ends. Returns the
        refusal the client gets instead of the final bytes (a step numbered with its record
        that the store's answer refused, see the module's docstring), else None."""
        if outcome.settled:
            return None
        outcome.settled = True
        if (trace := outcome.trace) is not None:
            trace.settling(self._clock())
        step = None if self.governance is None else self.governance.deferred_step(outcome)
        refusal = None
        if step is None:
            # ORDER's first three parts, each on its own (a failing one is logged, the rest run)
            self._meter_and_govern(outcome, final_bytes_next=True)
            await self._commit(outcome)
        else:
            refusal = await self._settle_numbered(outcome, step)
        if trace is not None:
            trace.settled(self._clock())
        return refusal

    async def _commit(self, outcome: RequestOutcome) -> None:
        try:
            await self.accounting.commit(outcome)
        except Exception:
            self._failed(outcome, "ledger")

    async def _settle_numbered(
        self, outcome: RequestOutcome, step: DeferredStep
    ) -> BaseException | None:
        """Meter, the record committed with its step's number (or, when the ledger cannot
        now, the step numbered, then the record committed), the store's answer read (the
        refusal, if any). Governance settles the step in `finish`, after the final bytes:
        nothing in them waits for it (s47: ~25 us off a step's path at c=1)."""
        governance = self.governance
        assert governance is not None
        request_id = outcome.ctx.request_id
        try:
            self.accounting.meter(outcome, final_bytes_next=True)
        except Exception:
            self._failed(outcome, "meter")
        self._ungoverned.add(request_id)  # until governance runs in `finish`
        row: tuple[Any, ...] | None = ()
        try:
            row = await self.accounting.commit_numbered(outcome, step.sql, step.params)
        except Exception:
            self._failed(outcome, "ledger")
        if row is None:  # not now: the step's statement beside the commit (the known number)
            numbering = asyncio.ensure_future(step.read())
            await self._commit(outcome)
            try:
                refusal = await numbering
            except Exception:
                self._failed(outcome, "governance")
                refusal = None
            if step.step != step.predicted:  # renumbered: `finish` writes the record again
                outcome.committed_as = None
        else:
            refusal = step.read_row(row)
        if refusal is not None:
            _refused(outcome, refusal)
        return refusal

    def finish(self, outcome: RequestOutcome) -> None:
        """After the response, exactly once: what `settle` did not do, then the learners."""
        if outcome.outcome == "ok" and outcome.status != 200:
            outcome.outcome = outcome_of(outcome.status)
            outcome.reason = str(outcome.status)
        # ORDER, each part on its own (a failing one is logged, the rest run)
        if not outcome.settled:
            self._meter_and_govern(outcome, final_bytes_next=False)
        elif self._ungoverned and outcome.ctx.request_id in self._ungoverned:
            self._ungoverned.discard(outcome.ctx.request_id)  # numbered with its record
            if self.governance is not None:
                try:
                    self.governance.finished(outcome)
                except Exception:
                    self._failed(outcome, "governance")
        try:
            self.accounting.record(outcome)
        except Exception:
            self._failed(outcome, "ledger")
        try:
            self._learn(outcome)
        except Exception:
            self._failed(outcome, "learners")

    def _meter_and_govern(self, outcome: RequestOutcome, *, final_bytes_next: bool) -> None:
        """ORDER's first two parts: stop the clock, then governance charges what it metered."""
        try:
            self.accounting.meter(outcome, final_bytes_next=final_bytes_next)
        except Exception:
            self._failed(outcome, "meter")
        if self.governance is not None:
            try:
                self.governance.finished(outcome)
            except Exception:
                self._failed(outcome, "governance")

    @staticmethod
    def _failed(outcome: RequestOutcome, part: str) -> None:
        log.exception("settling %s (%s) failed", outcome.ctx.request_id, part)

    def _learn(self, outcome: RequestOutcome) -> None:
        ctx = outcome.ctx
        self.metrics.request_done(
            ctx.pool,
            ctx.class_name,
            outcome.outcome,
            outcome.reason,
            outcome.ended_at_s - ctx.received_at_s,
            outcome.endpoint,
        )
        if outcome.outcome == "ok":
            if (ttft := outcome.ttft_s) is not None:
                self.metrics.observe_ttft(ctx.class_name, ttft)
            if (tpot := outcome.tpot_s) is not None:
                self.metrics.observe_tpot(ctx.class_name, tpot)
            if ctx.home_key is not None and outcome.instance_id is not None:
                self.affinity.record(
                    ctx.home_key,
                    outcome.instance_id,
                    outcome.prompt_tokens + outcome.completion_tokens,
                    step=outcome.step_index,
                )
            if outcome.estimate is not None and outcome.prompt_tokens > 0:
                error = self.estimator.observe(
                    outcome.estimate,
                    class_name=ctx.class_name,
                    prompt_tokens=outcome.prompt_tokens,
                    completion_tokens=outcome.completion_tokens,
                )
                if error is not None:
                    self.metrics.observe_estimate_error(outcome.estimate.source, error)
        self.accounting.observe(outcome)
        self.signals.finished(outcome)
        for obs in self.observers:
            try:
                obs.finished(outcome)
            except Exception:
                log.exception("request observer failed for %s", ctx.request_id)

    # ------------------------------------------------------------------ a run's end

    def run_ended(self, end: RunEnd) -> None:
        """Governance ended a run (client_end, idle_timeout, or a guard's code): its completion
        time (first arrival to last byte) in the metrics, why it ended in the ledger, its
        record marked ended in the run table (forgotten first)."""
        completed = self.accounting.run_completed(end.tenant, end.run_id)
        if completed is not None:
            self.metrics.observe_run_completion(*completed)
        self.ledger.submit_run_end(
            tenant=end.tenant,
            run_id=end.run_id,
            reason=end.reason,
            ended_at_s=self._wall_clock() - (self._clock() - end.ended_at_s),
            steps=end.steps,
            tokens=end.tokens,
            gpu_seconds=end.gpu_seconds,
        )
        self.runs.set_ended((end.tenant, end.run_id))


def _refused(outcome: RequestOutcome, refusal: BaseException) -> None:
    """The outcome of a step the store's answer refused after the engine's work: the
    refusal's, as a step refused before dispatch (no instance, no step number, no tokens
    served; its GPU-seconds stay metered)."""
    status = refusal.status if isinstance(refusal, GpupoolError) else 500
    outcome.status = status
    outcome.outcome = outcome_of(status)
    outcome.reason = refusal.code if isinstance(refusal, GpupoolError) else "internal_error"
    outcome.error_type = refusal.type if isinstance(refusal, GpupoolError) else None
    outcome.instance_id = outcome.step_index = outcome.dispatched_at_s = None
    outcome.prompt_tokens = outcome.completion_tokens = 0


def outcome_of(status: int) -> str:
    """A response status's outcome label (ok, rejected, timeout, aborted, client_error,
    engine_error)."""
    if status == 429:
        return "rejected"
    if status == 504:
        return "timeout"
    if status == 499:
        return "aborted"
    if 400 <= status < 500:
        return "client_error"
    if status >= 500:
        return "engine_error"
    return "ok"
