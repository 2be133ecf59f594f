"""The per-request contracts every stage of the request path shares.

One typed object per request travels the request path (`router.gateway`; README, "Where
things live"):

    RequestContext  what classification decided (tenant, class, pool, priority, deadline, run)
    RequestOutcome  what happened to it: the lease's instance, status, timings, tokens, cost

and the seams between stages:

    RequestObserver hooks around the upstream call, called by router.settlement.Settlement
    TraceHooks      a traced request's span tree (router.ops.tracing), when tracing is on

plus the ASGI aliases the raw handlers use. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from router.frozen import fast_init

if TYPE_CHECKING:
    from router.accounting.accountant import SequenceToken
    from router.admission.estimate import Estimate

__all__ = [
    "Message",
    "Receive",
    "RecordCompanion",
    "RequestContext",
    "RequestObserver",
    "RequestOutcome",
    "Scope",
    "Send",
    "TraceHooks",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


@fast_init
@dataclass(frozen=True, slots=True)
class RequestContext:
    """Everything the router decided about one request before admitting it."""

    request_id: str
    tenant: str
    class_name: str
    pool: str
    priority: int  # higher first; below 0 means sheddable
    deadline_s: float  # absolute, on the router's monotonic clock
    run_id: str | None
    model: str
    stream: bool
    client_wants_usage: bool  # the client asked for the streaming usage chunk
    received_at_s: float
    want_gpu_usage: bool = False  # x-gpupool-usage: 1 -> usage gains gpu_seconds
    tenant_weight: float = 1.0  # the tenant's share in weighted fair queuing
    # a session identity (not x-gpupool-run-id): run_id is then one of its runs, `<session>:<n>`
    session_id: str | None = None
    # the key of the user message the step belongs to (router.governance.boundary); None: none
    session_turn: str | None = None

    @property
    def run_key(self) -> tuple[str, str] | None:
        """The run's identity, (tenant, run id): two tenants may use the same run id. None
        for a request without a run."""
        return None if self.run_id is None else (self.tenant, self.run_id)

    @property
    def home_key(self) -> tuple[str, str] | None:
        """What run affinity follows: the session (its runs share a conversation, so its
        prefix is cached where its last step ran), else the run."""
        if self.session_id is not None:
            return (self.tenant, self.session_id)
        return self.run_key


@dataclass(slots=True)
class RequestOutcome:
    """What happened to one request, handed to observers (accounting, ledger) at the end.

    Times are on the router's monotonic clock. `first_token_at_s` is set only where the first
    token is observed, i.e. for streaming responses: a non-streaming response arrives whole, so
    its TTFT and TPOT are unknown (None), never its whole latency in disguise. The first token
    is the first generated one of any kind: text, a tool call's arguments, or reasoning.
    """

    ctx: RequestContext
    estimate: Estimate | None = None
    endpoint: str = "chat"  # chat | completions | responses | messages (router.gateway.protocols)
    instance_id: str | None = None
    status: int = 0
    outcome: str = "ok"  # ok | client_error | engine_error | rejected | aborted | timeout
    reason: str = "200"
    error_type: str | None = None  # the refusal's error type (capacity_exceeded, ...), if any
    # asked admission for a lease, after governance (the pool's queue wait starts); None: it
    # never got that far (refused or answered before: governance, a bad request, auth)
    admission_started_at_s: float | None = None
    admitted_at_s: float | None = None  # the lease was granted (queue wait ends)
    dispatched_at_s: float | None = None  # the (last) upstream request was sent
    first_token_at_s: float | None = None  # streaming only
    ended_at_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    response_started: bool = False  # the status line went to the client
    response_id: str | None = None  # a stored response's id (the Responses API)
    response_kept: bool = True  # the engine keeps it (not `store: false`): remember its place
    # started by SSE wait comments (router/gateway/wait_comments.py); no relay has written since
    wait_stream_open: bool = False
    # accounting (router.accounting.observer)
    acct_token: SequenceToken | None = None
    gpu_seconds: float = 0.0
    step_index: int | None = None
    # its span tree (router.ops.tracing.RequestTrace); None: tracing is off
    trace: TraceHooks | None = None
    # settlement's marks, kept here rather than in tables keyed by request id:
    # settled before its final bytes (router.settlement), and the (outcome, status) of the
    # record committed then, and metered by `AccountingObserver.settling` (router.accounting)
    settled: bool = False
    committed_as: tuple[str, int] | None = None
    metered: bool = False
    # a statement to commit in the same statement as the record (a stored response's
    # placement, router/gateway/response_placement.py); the ledger says whether it did
    with_record: RecordCompanion | None = None

    @property
    def queue_s(self) -> float:
        """Time spent waiting for admission (0 when admitted at once or never admitted)."""
        if self.admitted_at_s is None:
            return max(0.0, self.ended_at_s - self.ctx.received_at_s) if self.rejected else 0.0
        return max(0.0, self.admitted_at_s - self.ctx.received_at_s)

    @property
    def rejected(self) -> bool:
        return self.outcome == "rejected"

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_at_s is None:
            return None
        return self.first_token_at_s - self.ctx.received_at_s

    @property
    def tpot_s(self) -> float | None:
        if self.first_token_at_s is None or self.completion_tokens < 2:
            return None
        return (self.ended_at_s - self.first_token_at_s) / (self.completion_tokens - 1)


class RecordCompanion(Protocol):
    """A write that may ride in the statement that commits a request's ledger record
    (`Ledger.commit`): `sql`, one data-modifying statement (`?` placeholders, no rows
    returned), and its `params`. The ledger calls exactly one of `carried` (committed with the
    record) or `declined` (not with it: its owner writes it otherwise, at once)."""

    sql: str
    params: Sequence[Any]

    def carried(self) -> None: ...

    def declined(self) -> None: ...


class TraceHooks(Protocol):
    """What the request path tells a traced request's span tree beyond the outcome's own
    times (router.ops.tracing.RequestTrace): the `traceparent` its engine call sends upstream,
    and when settlement starts and ends."""

    traceparent: str | None

    def settling(self, now_s: float) -> None: ...

    def settled(self, now_s: float) -> None: ...


class RequestObserver(Protocol):
    """Hooks around the upstream call (the rebalancer's signals, a gateway's extra observers),
    called by `router.settlement.Settlement` among its learners.

    `dispatched` runs once per upstream attempt (a retry after a refused connection calls it
    again), `usage_extra` when the final usage is known (its items go into the response),
    `finished` exactly once per request that was classified, after the response.
    """

    def dispatched(self, outcome: RequestOutcome) -> None: ...

    def finished(self, outcome: RequestOutcome) -> None: ...

    def usage_extra(self, outcome: RequestOutcome) -> dict[str, Any]: ...
