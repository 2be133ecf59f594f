"""One request's span tree, built from the times the request path records anyway.

The request path (router.gateway.proxy) calls four things, each behind one `is None` check:
`Tracing.request(headers, now_s, path)` on arrival, `begin(ctx, estimate, now_s)` once the
request is classified and estimated (or `refused(...)` when it is answered before that), reads
`traceparent` for the engine call's headers, and `Settlement.settle` marks `settling`/`settled`.
The rest comes from `RequestOutcome` through `TraceObserver` (`dispatched`, `finished`).

The tree (children tile the server span: each starts where the one before ended):

    POST /v1/chat/completions     SERVER  arrival -> last byte; pool, class, tenant, run, step,
    │                                     endpoint, instance, tokens, TTFT, GPU-seconds, outcome
    ├─ gpupool.classify                   arrival -> classified: body read, parse, classify,
    │                                     the run guards' check, the token estimate
    ├─ gpupool.governance                 -> asked admission: the tenant's budget wait
    ├─ gpupool.admission.queue            -> lease granted: the pool's queue wait (or the 429)
    ├─ gpupool.placement                  -> dispatched: instance, cached tokens expected there
    ├─ gpupool.engine             CLIENT  -> last byte from the engine (one per attempt); its id
    │                                     is the `traceparent` sent upstream, so vLLM's own
    │                                     spans (`--otlp-traces-endpoint`) hang below it
    └─ gpupool.settle                     meter, governance, ledger: the GPU-seconds

The server span continues an incoming `traceparent`; otherwise a later step of an agent run
continues its run's first step's trace (kept in the run's `RunRecord`), so a run reads as one
trace; a step that has its own incoming trace links to its run's first step instead.
Attributes never hold a prompt, a completion, a header or a key.

Times: the router's monotonic clock, turned into epoch nanoseconds by one offset taken when
its first span is built, so a span's length is exactly the monotonic difference.

A request the sampler drops (most of them at a low `sample_ratio`) never reaches the SDK: the
sampler's own rule is applied here (`RootSampling`) and gives the ids and flags the SDK would,
so the engine still gets its `traceparent`; a span context is made of them only where one is
read (an agent run's first step, which its later steps continue; JSON logs, whose lines name
the current trace); only kept requests pay for attributes and SDK spans. The commonest request
(a new trace, no agent run, text logs) costs one random draw and one formatted string
(`RootSampling.new_trace`): inside the router, among everything else a request does, the
hooks' few microseconds in a tight loop were ~30 us a request, so the path is kept short, not
only cheap (benchmarks/tracing_paired.py measures it end to end).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    Tracer,
    get_current_span,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from router.ops.tracing.logs import json_logs_on
from router.request import RequestContext, RequestOutcome
from router.runtable import RunTable

if TYPE_CHECKING:
    from router.admission.estimate import Estimate

__all__ = [
    "CHILD_SPANS",
    "Dropped",
    "PresetIds",
    "RequestTrace",
    "RootSampling",
    "TraceObserver",
    "TraceSetup",
    "dropped_context",
]

# a served request's children, in the order they tile its server span
CHILD_SPANS = (
    "gpupool.classify",
    "gpupool.governance",
    "gpupool.admission.queue",
    "gpupool.placement",
    "gpupool.engine",
    "gpupool.settle",
)

_PROPAGATOR = TraceContextTextMapPropagator()
# a dropped new trace's `traceparent`: trace id, span id, the flags the SDK gives it
_NEW_DROPPED = f"00-%032x-%016x-{int(TraceFlags.RANDOM_TRACE_ID):02x}"


class PresetIds(RandomIdGenerator):
    """The tracer provider's id generator: random ids, except that the next trace id may be
    drawn ahead (`preset`), so that a root span the sampler was seen to keep gets that id."""

    def __init__(self) -> None:
        self._next_trace_id: int | None = None

    def preset(self, trace_id: int) -> None:
        self._next_trace_id = trace_id

    def generate_trace_id(self) -> int:
        trace_id, self._next_trace_id = self._next_trace_id, None
        return trace_id if trace_id is not None else super().generate_trace_id()


# a dropped span: trace id, span id, trace flags, trace state (as the SDK would give them)
Dropped = tuple[int, int, int, Any]


class RootSampling:
    """The provider's sampler, `ParentBased(root)`, applied before any span is built: `drop`
    returns the ids, flags and trace state the SDK would give a span it drops (`Dropped`), or
    None when the span is kept (then the SDK starts it, with the trace id this decision was
    taken on)."""

    __slots__ = ("_bits", "_bound", "_ids", "_limit")

    def __init__(self, root: TraceIdRatioBased, ids: PresetIds) -> None:
        self._bound = root.bound
        self._limit = root.TRACE_ID_LIMIT
        self._ids = ids
        self._bits = random.getrandbits  # the SDK's RandomIdGenerator draws from it too

    def new_trace(self) -> str | None:
        """`drop(None)` as the engine's `traceparent`, with nothing else built: a new trace's
        id is drawn and kept when under the ratio's bound (None: the SDK's next span gets that
        id), else its `traceparent` (a fresh span id, the SDK's flags) is returned."""
        trace_id = self._bits(128) or 1
        if trace_id & self._limit < self._bound:
            self._ids.preset(trace_id)
            return None
        return _NEW_DROPPED % (trace_id, self._bits(64) or 1)

    def drop(self, parent: Any) -> Dropped | None:
        ids = self._ids
        if parent is None:  # a new trace: kept when its id is under the ratio's bound
            trace_id = ids.generate_trace_id()
            if trace_id & self._limit < self._bound:
                ids.preset(trace_id)
                return None
            flags = TraceFlags.RANDOM_TRACE_ID
            state = None
        else:  # the parent's decision
            sc = get_current_span(parent).get_span_context()
            if sc.trace_flags.sampled:
                return None
            trace_id = sc.trace_id
            flags = TraceFlags.RANDOM_TRACE_ID if sc.trace_flags.random_trace_id else 0
            state = sc.trace_state
        return trace_id, ids.generate_span_id(), flags, state


def dropped_context(dropped: Dropped) -> SpanContext:
    """The span context of a dropped span (`RootSampling.drop`)."""
    trace_id, span_id, flags, state = dropped
    return SpanContext(
        trace_id, span_id, is_remote=False, trace_flags=TraceFlags(flags), trace_state=state
    )


def _traceparent(span: Span) -> str:
    sc = span.get_span_context()
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


class TraceSetup:
    """What every request's trace shares: the tracer, the run table (an agent run's first
    step), the sampling decision taken before the SDK, the clock the request path's times are
    on, and whether log lines name the current trace (JSON logs, read once when built)."""

    __slots__ = ("clock", "json_logs", "runs", "sampling", "tracer")

    def __init__(
        self,
        tracer: Tracer,
        runs: RunTable,
        *,
        sampling: RootSampling | None = None,
        clock: Callable[[], float] = time.monotonic,
        json_logs: bool | None = None,
    ) -> None:
        self.tracer = tracer
        self.runs = runs
        self.sampling = sampling  # None: every span goes through the SDK
        self.clock = clock
        self.json_logs = json_logs_on() if json_logs is None else json_logs


class RequestTrace:
    """One request's spans; see the module's docstring for the tree and who calls what.

    A dropped request sets three attributes; the rest keep these class-level defaults."""

    server: Span | None = None
    recording = False
    traceparent: str | None = None  # sent upstream with the engine call
    cached_tokens = 0
    settle_started_s: float | None = None
    settle_ended_s: float | None = None
    _offset_ns = 0  # epoch ns minus the clock's ns, taken when spans are first built
    _ctx: Any = None  # the server span's context: every child's parent
    _token: Any = None  # the attached context, detached when the request ends
    _engine: Span | None = None
    _first_dispatch_s: float | None = None

    def __init__(
        self,
        setup: TraceSetup,
        received_s: float,
        path: str,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> None:
        self._setup = setup
        self.received_s = self.prepared_s = received_s
        self._path = path
        self._incoming_tp = traceparent  # the client's, never recorded
        self._incoming_ts = tracestate

    def _ns(self, t_s: float) -> int:
        return self._offset_ns + int(t_s * 1e9)

    def _take_offset(self) -> None:
        """The epoch offset of the request path's clock, before this request's first span."""
        self._offset_ns = time.time_ns() - int(self._setup.clock() * 1e9)

    def _incoming(self) -> Any:
        """The incoming trace's context, None without a valid `traceparent`."""
        if not self._incoming_tp:
            return None
        carrier = {"traceparent": self._incoming_tp}
        if self._incoming_ts:
            carrier["tracestate"] = self._incoming_ts
        parent = _PROPAGATOR.extract(carrier)
        return parent if get_current_span(parent).get_span_context().is_valid else None

    # ------------------------------------------------------------------ the request path

    def begin(self, ctx: RequestContext, estimate: Estimate, now_s: float) -> None:
        """The request is classified and estimated: its server span starts (at its arrival),
        under the incoming trace, else its run's first step; it becomes the current span."""
        self.prepared_s = now_s
        setup = self._setup
        run_key = ctx.run_key
        parent: Any = None
        links: list[Link] = []
        first: SpanContext | None = None
        sampling = setup.sampling
        if (
            sampling is not None
            and run_key is None
            and not self._incoming_tp
            and not setup.json_logs
        ):
            # the commonest request: a new trace whose span context nothing reads
            self.traceparent = sampling.new_trace()
            if self.traceparent is not None:
                return
        else:
            parent = self._incoming()
            if run_key is not None:
                record = setup.runs.get(run_key)
                first = record.trace_first_step if record is not None else None
                if first is not None:
                    if parent is None:
                        parent = set_span_in_context(NonRecordingSpan(first))
                    else:
                        links.append(Link(first, {"gpupool.link": "run_first_step"}))
            dropped = None if sampling is None else sampling.drop(parent)
            if dropped is not None:  # no span to build: what is read of it, and only that
                trace_id, span_id, flags, _ = dropped
                self.traceparent = f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"
                first_step = run_key is not None and first is None
                if first_step or setup.json_logs:
                    context = dropped_context(dropped)
                    if run_key is not None and first_step:
                        setup.runs.touch(run_key).trace_first_step = context
                    if setup.json_logs:  # the request's log lines name its trace
                        self._ctx = set_span_in_context(NonRecordingSpan(context))
                        self._token = otel_context.attach(self._ctx)
                return
        self._take_offset()
        attributes: dict[str, Any] = {
            "http.request.method": "POST",
            "url.path": self._path,
            "gpupool.request_id": ctx.request_id,
            "gpupool.tenant": ctx.tenant,
            "gpupool.class": ctx.class_name,
            "gpupool.pool": ctx.pool,
            "gpupool.priority": ctx.priority,
            "gpupool.stream": ctx.stream,
        }
        if ctx.run_id is not None:
            attributes["gpupool.run_id"] = ctx.run_id
        span = self._setup.tracer.start_span(
            f"POST {self._path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes=attributes,
            links=links,
            start_time=self._ns(self.received_s),
        )
        if run_key is not None and first is None:
            self._setup.runs.touch(run_key).trace_first_step = span.get_span_context()
        self.server = span
        self.recording = span.is_recording()
        self.traceparent = _traceparent(span)
        self._ctx = set_span_in_context(span)
        self._token = otel_context.attach(self._ctx)  # the request's log lines name it
        if self.recording:
            span.set_attribute("gpupool.estimate.prompt_tokens", estimate.prompt_tokens)

    def refused(self, status: int, code: str, tenant: str | None, now_s: float) -> None:
        """The request was answered before classification finished (auth, a bad body, a
        guard, a prompt over the context): a server span and the classify span that refused
        it, both carrying the code."""
        attributes: dict[str, Any] = {
            "http.request.method": "POST",
            "url.path": self._path,
            "http.response.status_code": status,
            "gpupool.outcome": "refused",
            "gpupool.code": code,
        }
        if tenant is not None:
            attributes["gpupool.tenant"] = tenant
        self._take_offset()
        span = self._setup.tracer.start_span(
            f"POST {self._path}",
            context=self._incoming(),
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=self._ns(self.received_s),
        )
        if not span.is_recording():
            return
        self._ctx = set_span_in_context(span)
        self._child("gpupool.classify", self.received_s, now_s, {"gpupool.code": code}, code)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR, code))
        span.end(end_time=self._ns(now_s))

    def settling(self, now_s: float) -> None:
        """Settlement starts (the engine's last byte is in)."""
        self.settle_started_s = now_s

    def settled(self, now_s: float) -> None:
        self.settle_ended_s = now_s

    # ------------------------------------------------------------------ from the observer

    def dispatched(self, outcome: RequestOutcome) -> None:
        """An engine call starts (again, after a failed attempt: that one's span ends here)."""
        if not self.recording:
            return
        now_s = outcome.dispatched_at_s
        assert now_s is not None
        if self._engine is not None:
            self._engine.set_status(Status(StatusCode.ERROR, "retried"))
            self._engine.end(end_time=self._ns(now_s))
        else:
            self._first_dispatch_s = now_s
            home_key = outcome.ctx.home_key
            record = self._setup.runs.get(home_key) if home_key is not None else None
            if record is not None and record.home == outcome.instance_id:
                self.cached_tokens = record.context_tokens
        attributes: dict[str, Any] = {"gpupool.instance": outcome.instance_id or ""}
        if outcome.step_index is not None:
            attributes["gpupool.run_step"] = outcome.step_index
        self._engine = self._setup.tracer.start_span(
            "gpupool.engine",
            context=self._ctx,
            kind=SpanKind.CLIENT,
            attributes=attributes,
            start_time=self._ns(now_s),
        )
        self.traceparent = _traceparent(self._engine)

    def finished(self, outcome: RequestOutcome) -> None:
        """The request is over: every span but the engine's is written now, from the
        outcome's times, and the server span ends at the last byte."""
        if self._token is not None:
            otel_context.detach(self._token)
            self._token = None
        server = self.server
        if server is None or not self.recording:
            return
        self.recording = False  # once
        ctx, end_s = outcome.ctx, outcome.ended_at_s
        code = outcome.reason
        failed = outcome.outcome != "ok"
        error = code if failed else None
        self._child("gpupool.classify", self.received_s, self.prepared_s, {})
        asked_s = outcome.admission_started_at_s
        governed_until = asked_s if asked_s is not None else end_s
        self._child(
            "gpupool.governance",
            self.prepared_s,
            governed_until,
            {"gpupool.governance.wait_ms": _ms(governed_until - self.prepared_s)},
            error if asked_s is None else None,
        )
        granted_s = outcome.admitted_at_s
        if asked_s is not None:
            queued_until = granted_s if granted_s is not None else end_s
            self._child(
                "gpupool.admission.queue",
                asked_s,
                queued_until,
                {"gpupool.pool": ctx.pool, "gpupool.queue.wait_ms": _ms(queued_until - asked_s)},
                error if granted_s is None else None,
            )
        if granted_s is not None:
            self._child(
                "gpupool.placement",
                granted_s,
                self._first_dispatch_s if self._first_dispatch_s is not None else end_s,
                {
                    "gpupool.instance": outcome.instance_id or "",
                    "gpupool.placement.cached_tokens": self.cached_tokens,
                },
            )
        results: dict[str, Any] = {
            "http.response.status_code": outcome.status,
            "gpupool.outcome": outcome.outcome,
            "gpupool.code": code,
            "gpupool.endpoint": outcome.endpoint,
            "gen_ai.usage.input_tokens": outcome.prompt_tokens,
            "gen_ai.usage.output_tokens": outcome.completion_tokens,
        }
        if (ttft_s := outcome.ttft_s) is not None:
            results["gpupool.ttft_ms"] = _ms(ttft_s)
        if (engine := self._engine) is not None:
            engine.set_attributes(results)
            if error is not None:
                engine.set_status(Status(StatusCode.ERROR, error))
            settle_s = self.settle_started_s
            engine.end(end_time=self._ns(settle_s if settle_s is not None else end_s))
        if self.settle_started_s is not None:
            self._child(
                "gpupool.settle",
                self.settle_started_s,
                self.settle_ended_s if self.settle_ended_s is not None else end_s,
                {"gpupool.gpu_seconds": outcome.gpu_seconds},
            )
        results["gpupool.gpu_seconds"] = outcome.gpu_seconds
        results["gpupool.queue.wait_ms"] = _ms(outcome.queue_s)
        if outcome.instance_id is not None:
            results["gpupool.instance"] = outcome.instance_id
        if outcome.step_index is not None:
            results["gpupool.run_step"] = outcome.step_index
        server.set_attributes(results)
        if outcome.status >= 500:
            server.set_status(Status(StatusCode.ERROR, code))
        server.end(end_time=self._ns(end_s))

    def _child(
        self,
        name: str,
        start_s: float,
        end_s: float,
        attributes: dict[str, Any],
        error: str | None = None,
    ) -> None:
        span = self._setup.tracer.start_span(
            name, context=self._ctx, attributes=attributes, start_time=self._ns(start_s)
        )
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=self._ns(max(start_s, end_s)))


class TraceObserver:
    """Hands a traced request's dispatch and end to its `RequestTrace` (a
    `router.request.RequestObserver`, registered with the settlement when tracing is on)."""

    def dispatched(self, outcome: RequestOutcome) -> None:
        if isinstance(trace := outcome.trace, RequestTrace):
            trace.dispatched(outcome)

    def finished(self, outcome: RequestOutcome) -> None:
        if isinstance(trace := outcome.trace, RequestTrace):
            trace.finished(outcome)

    def usage_extra(self, outcome: RequestOutcome) -> dict[str, Any]:
        return {}
