"""What one request's trace costs the router's CPU, alone: `RequestTrace` driven through a
request's hooks (arrival, classified, dispatched, settled, finished) with a null exporter, not
sampled (ratio 0) and sampled (ratio 1), so the span work is measured without the export.

    python -m benchmarks.tracing_cost [--requests 20000]

Not sampled, two kinds: a request that is an agent run's step (its run's first step keeps a
span context) and a plain one (a new trace: the shortest path). The export (protobuf encoding
and the HTTP post, in the exporter's worker thread) comes on top for sampled requests. Inside
the router the same hooks cost several times more than in this loop;
`python -m benchmarks.tracing_paired` measures the whole router, request by request.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from pools.config import ObservabilityConfig
from router.admission.estimate import Estimate
from router.ops.tracing.tracer import Tracing
from router.request import RequestContext, RequestOutcome
from router.runtable import RunTable


class _Null(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def per_request_us(ratio: float, requests: int, *, runs: bool = True) -> float:
    """Mean µs of one request's tracing hooks at `ratio`, spans built and queued, not sent;
    `runs`: each request a step of one of 100 agent runs, else a plain request."""
    tracing = Tracing(
        ObservabilityConfig(otlp_endpoint="http://127.0.0.1:4318", sample_ratio=ratio),
        runs=RunTable(),
        exporter=_Null(),
    )
    estimate = Estimate(prompt_tokens=100, output_tokens=16, source="heuristic")
    started = time.perf_counter()
    for i in range(requests):
        now = time.monotonic()
        ctx = RequestContext(
            request_id=f"gp-{i}",
            tenant="t",
            class_name="agent",
            pool="agent",
            priority=0,
            deadline_s=now + 60,
            run_id=f"run-{i % 100}" if runs else None,
            model="tiny",
            stream=True,
            client_wants_usage=False,
            received_at_s=now,
        )
        trace = tracing.request({}, now, "/v1/chat/completions")
        trace.begin(ctx, estimate, time.monotonic())
        outcome = RequestOutcome(ctx=ctx, estimate=estimate, trace=trace)
        outcome.admission_started_at_s = outcome.admitted_at_s = time.monotonic()
        outcome.dispatched_at_s = outcome.first_token_at_s = time.monotonic()
        outcome.instance_id, outcome.status = "engine-0", 200
        tracing.observer.dispatched(outcome)
        trace.settling(time.monotonic())
        trace.settled(time.monotonic())
        outcome.ended_at_s = time.monotonic()
        tracing.observer.finished(outcome)
        tracing.processor._queue.clear()  # never sent: the export is not measured here
    return (time.perf_counter() - started) / requests * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tracing_cost")
    parser.add_argument("--requests", type=int, default=20_000)
    args = parser.parse_args(argv)
    for ratio, runs in ((0.0, False), (0.0, True), (1.0, True)):
        us = per_request_us(ratio, args.requests, runs=runs)
        kind = "agent run steps" if runs else "plain requests"
        print(f"sample_ratio {ratio:g}, {kind}: {us:.1f} µs per request ({args.requests})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
