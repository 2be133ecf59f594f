"""`Tracing`: the router's tracer and its exporter, one component (`start`/`aclose`).

Built by the gateway only when `observability.otlp_endpoint` is set. The tracer provider is
the gateway's own (never the process-global one: two routers in one process, as in tests,
keep their traces apart); its sampler is `ParentBased(TraceIdRatioBased(sample_ratio))`: a
request that continues a trace (an incoming W3C `traceparent`, or an agent run's first step)
follows its parent's decision, a new trace is kept with probability `sample_ratio`.
Spans leave through `LoopBatchProcessor` to an `OTLPSpanExporter` (HTTP, protobuf).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Tracer
from prometheus_client import CollectorRegistry, Counter

from pools.config import ObservabilityConfig
from router.ops.tracing.call_trace import CallTrace
from router.ops.tracing.export import LoopBatchProcessor
from router.ops.tracing.request_trace import (
    PresetIds,
    RequestTrace,
    RootSampling,
    TraceObserver,
    TraceSetup,
)
from router.runtable import RunTable

__all__ = ["EXPORT_TIMEOUT_S", "Tracing"]

EXPORT_TIMEOUT_S = 10.0  # one export, the OTLP exporter's retries included


class Tracing:
    """The tracer of one router; `request(headers, now_s)` starts a request's trace."""

    def __init__(
        self,
        config: ObservabilityConfig,
        *,
        runs: RunTable,
        clock: Callable[[], float] = time.monotonic,
        exporter: SpanExporter | None = None,
        version: str = "",
        registry: CollectorRegistry | None = None,
    ) -> None:
        if config.otlp_endpoint is None and exporter is None:
            raise ValueError("tracing needs observability.otlp_endpoint")
        self.config = config
        self.runs = runs
        self.clock = clock
        spans = Counter(
            "gpupool_trace_spans_total",
            "OpenTelemetry spans by what became of them: exported (the collector took them) or"
            " dropped (the queue was full, or their export failed)",
            ["result"],
            registry=registry,
        )
        for result in ("exported", "dropped"):
            spans.labels(result)
        self.processor = LoopBatchProcessor(
            exporter
            or OTLPSpanExporter(
                endpoint=config.otlp_endpoint,
                headers=dict(config.headers),
                timeout=EXPORT_TIMEOUT_S,
            ),
            interval_s=config.export_interval_s,
            timeout_s=EXPORT_TIMEOUT_S,
            on_count=lambda result, n: spans.labels(result).inc(n),
        )
        attributes: dict[str, str] = {"service.name": config.service_name}
        if version:
            attributes["service.version"] = version
        root = TraceIdRatioBased(config.sample_ratio)
        ids = PresetIds()
        self.provider = TracerProvider(
            resource=Resource.create(attributes),
            sampler=ParentBased(root),
            shutdown_on_exit=False,
            id_generator=ids,
        )
        self.provider.add_span_processor(self.processor)
        self.tracer: Tracer = self.provider.get_tracer("gpupool.router")
        # the sampler's decision taken before a span is built: a dropped request costs no SDK;
        # whether logs are JSON lines (that name the trace) is read now, once
        self._setup = TraceSetup(
            self.tracer, runs, sampling=RootSampling(root, ids), clock=clock, json_logs=None
        )
        self.observer = TraceObserver()  # the settlement's hook into each request's trace

    async def start(self) -> None:
        await self.processor.start()

    async def aclose(self) -> None:
        await self.processor.aclose()

    def call(self, headers: Mapping[str, str], now_s: float, name: str, endpoint: str) -> CallTrace:
        """An engine call's trace (count_tokens, a stored response's GET or cancel), from its
        arrival (`now_s`), its span name (`POST /v1/messages/count_tokens`) and endpoint."""
        return CallTrace(self.tracer, headers, now_s, name, endpoint, clock=self.clock)

    def request(self, headers: Mapping[str, str], now_s: float, path: str) -> RequestTrace:
        """A request's trace, from its arrival (`now_s`, on `clock`), its path and its headers
        (an incoming `traceparent`/`tracestate`; nothing else of them is read or recorded)."""
        return RequestTrace(
            self._setup, now_s, path, headers.get("traceparent"), headers.get("tracestate")
        )
