"""Connects the request path to GPU-seconds accounting and the ledger.

`AccountingObserver` is a `RequestObserver`: at dispatch it starts the request's processor-
sharing clock on its instance, as a step of its run (tenant, run id) whose attained service
`queue.order: run_las` reads (and numbers the run's step in arrival order); when the last
usage is known it stops the clock, so the cost can go in the response (`x-gpupool-gpu-seconds`
header, `usage.gpu_seconds` with `x-gpupool-usage: 1`); it writes one `RequestRecord` per
request to the ledger and counts the GPU-seconds in Prometheus. O(1) per event.

When the record is written: `settling` runs right before a response's final bytes (the proxy
awaits it) and commits the record durably (`Ledger.commit`, a group commit), so a router killed
after the client got its answer still has its record. `finished` runs after the response (and
for every request, settled or not): a request that never settled (refused, failed, or
disconnected before its final bytes) gets its record there, queued without waiting
(`Ledger.submit`); a settled one whose outcome changed since (the client left during the final
send) has its record replaced; otherwise the settled record stands. A ledger failure never
fails or holds the response beyond `Ledger.commit`'s bound: it is logged, and retried.

It also keeps each run's span (class of its first step, first arrival, last byte out; an LRU
of `max_runs`), so when governance ends a run, `run_completed` says how long it took.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.accounting import Accountant, SequenceToken
from router.accounting_metrics import AccountingMetrics
from router.ledger import Ledger, RequestRecord
from router.request import RequestOutcome

__all__ = ["AccountingObserver"]


@dataclass(slots=True)
class _RunSpan:
    class_name: str  # of the run's first step
    first_arrival_s: float
    last_end_s: float


class AccountingObserver:
    def __init__(
        self,
        accountant: Accountant,
        ledger: Ledger,
        metrics: AccountingMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        max_runs: int = 100_000,
    ) -> None:
        self._runs: OrderedDict[tuple[str, str], _RunSpan] = OrderedDict()
        self._max_runs = max_runs
        self.accountant = accountant
        self.ledger = ledger
        self.metrics = metrics
        self._clock = clock
        self._wall_clock = wall_clock
        # request id -> (outcome, status) of its settled record, until `finished`
        self._settled: dict[str, tuple[str, int]] = {}

    def dispatched(self, outcome: RequestOutcome) -> None:
        now = self._clock()
        previous = outcome.acct_token
        if previous is not None:  # a retry after a refused connection
            outcome.gpu_seconds += self.accountant.end(previous, now)
            outcome.acct_token = None
        ctx = outcome.ctx
        if ctx.run_id is not None and outcome.step_index is None:
            outcome.step_index = self.ledger.next_step_index(ctx.tenant, ctx.run_id)
        if outcome.instance_id is not None and self.accountant.has_instance(outcome.instance_id):
            run_key = None if ctx.run_id is None else (ctx.tenant, ctx.run_id)
            outcome.acct_token = self.accountant.begin(outcome.instance_id, now, run_key)

    def _settle(self, outcome: RequestOutcome) -> float:
        token: SequenceToken | None = outcome.acct_token
        if token is not None:
            outcome.gpu_seconds += self.accountant.end(token, self._clock())
            outcome.acct_token = None
        return outcome.gpu_seconds

    def usage_extra(self, outcome: RequestOutcome) -> dict[str, Any]:
        return {"gpu_seconds": round(self._settle(outcome), 6)}

    def run_completed(self, tenant: str, run_id: str) -> tuple[str, float] | None:
        """A run ended: the class of its first step and its completion time in seconds (first
        step's arrival to the last step's last byte), or None when no step of it finished
        here. Forgets the run (its next step starts a new span)."""
        span = self._runs.pop((tenant, run_id), None)
        if span is None:
            return None
        return span.class_name, max(0.0, span.last_end_s - span.first_arrival_s)

    def _note_step(self, outcome: RequestOutcome) -> None:
        ctx = outcome.ctx
        if ctx.run_id is None:
            return
        key = (ctx.tenant, ctx.run_id)
        span = self._runs.get(key)
        if span is None:
            self._runs[key] = _RunSpan(ctx.class_name, ctx.received_at_s, outcome.ended_at_s)
            if len(self._runs) > self._max_runs:
                self._runs.popitem(last=False)
            return
        span.first_arrival_s = min(span.first_arrival_s, ctx.received_at_s)
        span.last_end_s = max(span.last_end_s, outcome.ended_at_s)
        self._runs.move_to_end(key)

    async def settling(self, outcome: RequestOutcome) -> None:
        """The response's final bytes are next: stop the clock, set the end time (the last byte
        out is now) and commit the request's record durably. Never raises for the ledger."""
        outcome.ended_at_s = self._clock()
        record = self._record(outcome)
        self._settled[outcome.ctx.request_id] = (record.outcome, record.status_code)
        await self.ledger.commit(record)

    def finished(self, outcome: RequestOutcome) -> None:
        gpu_s = self._settle(outcome)
        ctx = outcome.ctx
        settled = self._settled.pop(ctx.request_id, None)
        self._note_step(outcome)
        self.metrics.observe_request(ctx.pool, ctx.class_name, ctx.tenant, gpu_s)
        if settled != (outcome.outcome, outcome.status):
            self.ledger.submit(self._record(outcome))

    def _record(self, outcome: RequestOutcome) -> RequestRecord:
        gpu_s = self._settle(outcome)
        ctx = outcome.ctx
        offset = self._wall_clock() - self._clock()
        return RequestRecord(
            request_id=ctx.request_id,
            run_id=ctx.run_id,
            step_index=outcome.step_index,
            tenant=ctx.tenant,
            class_name=ctx.class_name,
            pool=ctx.pool,
            instance=outcome.instance_id,
            model=ctx.model,
            started_at_s=ctx.received_at_s + offset,
            ended_at_s=outcome.ended_at_s + offset,
            queue_s=outcome.queue_s,
            ttft_s=outcome.ttft_s,
            tpot_s=outcome.tpot_s,
            prompt_tokens=outcome.prompt_tokens,
            completion_tokens=outcome.completion_tokens,
            gpu_seconds=gpu_s,
            outcome=outcome.outcome,
            status_code=outcome.status,
        )
