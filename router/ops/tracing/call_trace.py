"""The trace of an engine call that generates nothing (router.gateway.engine_calls):
`POST /v1/messages/count_tokens`, and a stored response's `GET /v1/responses/{id}` and
`POST /v1/responses/{id}/cancel`.

    POST /v1/messages/count_tokens   SERVER  arrival -> last byte; tenant, pool, class, endpoint,
    │                                        instance, status, code (a refused call: its code)
    └─ gpupool.engine                CLIENT  the forward to the engine; its id is the
                                             `traceparent` sent upstream

These calls skip admission and settlement, so their tree is the server span and the engine
call. They are few (a client counts tokens before a request, or polls a background response),
so they go through the SDK's own sampler (`ParentBased(TraceIdRatioBased(sample_ratio))`):
an incoming `traceparent` decides, else the ratio. Attributes never hold a prompt, a header,
a key or the response id's body.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = ["CallTrace"]

_PROPAGATOR = TraceContextTextMapPropagator()


class CallTrace:
    """One engine call's spans: `engine_started` before the forward (it returns the
    `traceparent` to send), `engine_ended` after its last byte, `end` once answered."""

    __slots__ = ("_clock", "_engine", "_offset_ns", "_server", "_tracer", "recording")

    def __init__(
        self,
        tracer: Tracer,
        headers: Mapping[str, str],
        received_s: float,
        name: str,
        endpoint: str,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tracer = tracer
        self._clock = clock
        # the request path's clock as epoch nanoseconds (as router.ops.tracing.request_trace)
        self._offset_ns = time.time_ns() - int(clock() * 1e9)
        carrier = {k: v for k in ("traceparent", "tracestate") if (v := headers.get(k))}
        method, _, path = name.partition(" ")
        self._server: Span = tracer.start_span(
            name,
            context=_PROPAGATOR.extract(carrier) if carrier else None,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": method,
                "url.path": path,  # the route's template: no response id
                "gpupool.endpoint": endpoint,
            },
            start_time=self._ns(received_s),
        )
        self.recording = self._server.is_recording()
        self._engine: Span | None = None

    def _ns(self, t_s: float) -> int:
        return self._offset_ns + int(t_s * 1e9)

    def classified(self, tenant: str, pool: str, class_name: str) -> None:
        if self.recording:
            self._server.set_attributes(
                {"gpupool.tenant": tenant, "gpupool.pool": pool, "gpupool.class": class_name}
            )

    def engine_started(self, instance_id: str) -> str:
        """The forward to `instance_id` starts now: the `traceparent` it sends upstream."""
        self._engine = span = self._tracer.start_span(
            "gpupool.engine",
            context=set_span_in_context(self._server),
            kind=SpanKind.CLIENT,
            attributes={"gpupool.instance": instance_id},
            start_time=self._ns(self._clock()),
        )
        self._server.set_attribute("gpupool.instance", instance_id)
        sc = span.get_span_context()
        return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"

    def engine_ended(self, status: int | None, error: str | None = None) -> None:
        """The engine's last byte is in (`status`), or the call failed (`error`)."""
        span, self._engine = self._engine, None
        if span is None:
            return
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if error is not None or (status is not None and status >= 500):
            span.set_status(Status(StatusCode.ERROR, error or str(status)))
        span.end(end_time=self._ns(self._clock()))

    def end(self, status: int, code: str | None) -> None:
        """The call was answered with `status` (`code`: a refusal's or failure's code)."""
        self.engine_ended(None, code or "aborted")  # still open: the forward did not finish
        attributes: dict[str, Any] = {"http.response.status_code": status}
        if code is not None:
            attributes["gpupool.code"] = code
        server = self._server
        if self.recording:
            server.set_attributes(attributes)
            if status >= 500:
                server.set_status(Status(StatusCode.ERROR, code or str(status)))
        server.end(end_time=self._ns(self._clock()))
