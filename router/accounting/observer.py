"""GPU-seconds metering and the request's ledger record, for `router.settlement.Settlement`.

`AccountingObserver` meters a request: at dispatch it starts the request's processor-sharing
clock on its instance, as a step of its run (tenant, run id) whose attained service
`queue.order: run_las` reads (and numbers the run's step in arrival order); when the last
usage is known it stops the clock, so the cost can go in the response (`x-gpupool-gpu-seconds`
header, `usage.gpu_seconds` with `x-gpupool-usage: 1`). It writes one `RequestRecord` per
request to the ledger and counts the GPU-seconds in Prometheus. O(1) per event.

The settlement calls its parts in its fixed order (meter, governance, ledger, learners):
`meter` (stop the clock, note the run's span), `commit` (right before a response's final
bytes: the record committed durably, `Ledger.commit`, a group commit, so a router killed after
the client got its answer still has its record), `record` (after the response, for every
request: a request that never settled, refused, failed, or disconnected before its final
bytes, gets its record queued without waiting, `Ledger.submit`; a settled one whose outcome
changed since, the client left during the final send, has its record replaced) and `observe`
(the Prometheus counter). A ledger failure never fails or holds the response beyond
`Ledger.commit`'s bound: it is logged, and retried. `settling` and `finished` run those parts
in that order for a caller without a settlement.

Each run's span (class of its first step, first arrival, last byte out) is kept in the run's
record of the router's `RunTable` (the accountant's), so when governance ends a run,
`run_completed` says how long it took.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from router.accounting.accountant import Accountant, SequenceToken
from router.accounting.ledger import Ledger, RequestRecord
from router.accounting.metrics import AccountingMetrics
from router.request import RequestOutcome

__all__ = ["AccountingObserver"]


class AccountingObserver:
    def __init__(
        self,
        accountant: Accountant,
        ledger: Ledger,
        metrics: AccountingMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.runs = accountant.runs  # the spans, in the run table the accountant meters into
        self.accountant = accountant
        self.ledger = ledger
        self.metrics = metrics
        metrics.watch_ledger(ledger)
        self._clock = clock
        self._wall_clock = wall_clock

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

    def stop(self, outcome: RequestOutcome) -> float:
        """Stop the request's clock (once; later calls change nothing); its GPU-seconds."""
        token: SequenceToken | None = outcome.acct_token
        if token is not None:
            outcome.gpu_seconds += self.accountant.end(token, self._clock())
            outcome.acct_token = None
        return outcome.gpu_seconds

    def usage_extra(self, outcome: RequestOutcome) -> dict[str, Any]:
        return {"gpu_seconds": round(self.stop(outcome), 6)}

    def run_completed(self, tenant: str, run_id: str) -> tuple[str, float] | None:
        """A run ended: the class of its first step and its completion time in seconds (first
        step's arrival to the last step's last byte), or None when no step of it finished
        here. Forgets the run (its next step starts a new span)."""
        span = self.runs.get((tenant, run_id))
        if span is None or span.class_name is None:
            return None
        completed = span.class_name, max(0.0, span.last_end_s - span.first_arrival_s)
        span.class_name, span.first_arrival_s, span.last_end_s = None, math.inf, -math.inf
        return completed

    def note_step(self, outcome: RequestOutcome) -> None:
        """A step of the request's run finished (its last byte is out at `ended_at_s`)."""
        ctx = outcome.ctx
        if ctx.run_id is None:
            return
        span = self.runs.touch((ctx.tenant, ctx.run_id))
        if span.class_name is None:
            span.class_name = ctx.class_name
        span.first_arrival_s = min(span.first_arrival_s, ctx.received_at_s)
        span.last_end_s = max(span.last_end_s, outcome.ended_at_s)

    def meter(self, outcome: RequestOutcome, *, final_bytes_next: bool) -> float:
        """Stop the request's clock and note its step in its run's span; its GPU-seconds.
        `final_bytes_next`: the response's final bytes are next, so its end is now."""
        if final_bytes_next:
            outcome.ended_at_s = self._clock()
        gpu_s = self.stop(outcome)
        self.note_step(outcome)
        return gpu_s

    def commit(self, outcome: RequestOutcome) -> Awaitable[bool]:
        """Commit the request's record durably (the response's final bytes are next): the
        ledger's commit, for the caller to await (one coroutine fewer in the await chain a
        group commit resumes). Never raises for the ledger."""
        record = self._record(outcome)
        outcome.committed_as = (record.outcome, record.status_code)
        companion, outcome.with_record = outcome.with_record, None
        return self.ledger.commit(record, companion)

    @property
    def numbers_steps(self) -> bool:
        """The ledger can commit a record with its step's statement (`commit_numbered`)."""
        return self.ledger.numbers_steps

    def commit_numbered(
        self, outcome: RequestOutcome, step_sql: str, step_params: Sequence[Any]
    ) -> Awaitable[tuple[Any, ...] | None]:
        """`commit`, the record and its run's step number in one statement
        (`Ledger.commit_numbered`: None, nothing written, when it cannot now)."""
        record = self._record(outcome)
        outcome.committed_as = (record.outcome, record.status_code)
        if (companion := outcome.with_record) is not None:  # not in this statement
            outcome.with_record = None
            companion.declined()
        return self.ledger.commit_numbered(record, step_sql, step_params)

    def record(self, outcome: RequestOutcome) -> None:
        """After the response: queue the record of a request that was not committed, or whose
        outcome changed since it was."""
        settled, outcome.committed_as = outcome.committed_as, None
        if settled != (outcome.outcome, outcome.status):
            self.ledger.submit(self._record(outcome))

    def observe(self, outcome: RequestOutcome) -> None:
        """The request's GPU-seconds in Prometheus."""
        ctx = outcome.ctx
        self.metrics.observe_request(ctx.pool, ctx.class_name, ctx.tenant, outcome.gpu_seconds)

    async def settling(self, outcome: RequestOutcome) -> None:
        """Without a settlement: the response's final bytes are next (meter, commit)."""
        self.meter(outcome, final_bytes_next=True)
        outcome.metered = True
        await self.commit(outcome)

    def finished(self, outcome: RequestOutcome) -> None:
        """Without a settlement: after the response (meter unless settled, record, observe)."""
        if outcome.metered:
            outcome.metered = False
        else:
            self.meter(outcome, final_bytes_next=False)
        self.record(outcome)
        self.observe(outcome)

    def _record(self, outcome: RequestOutcome) -> RequestRecord:
        gpu_s = self.stop(outcome)
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
