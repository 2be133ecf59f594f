"""An OTLP/HTTP trace sink for the tracing targets (`gpupool-trace-1`, `gpupool-trace-0.01`):
it takes `POST /v1/traces` on the load generator's event loop (and CPU), counts the exports,
their bytes and their spans (decoded with opentelemetry-proto), and answers 200, so the
routers under test pay for their whole export path against a real collector's protocol.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

__all__ = ["SinkCounts", "otlp_sink"]


@dataclass
class SinkCounts:
    exports: int = 0
    bytes: int = 0
    spans: int = 0


@contextlib.asynccontextmanager
async def otlp_sink(port: int) -> AsyncIterator[SinkCounts]:
    """Serve the sink on 127.0.0.1:`port` until the block ends."""
    counts = SinkCounts()
    reply = ExportTraceServiceResponse().SerializeToString()

    async def traces(request: web.Request) -> web.Response:
        body = await request.read()
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        counts.exports += 1
        counts.bytes += len(body)
        counts.spans += sum(
            len(scope.spans) for rs in export.resource_spans for scope in rs.scope_spans
        )
        return web.Response(body=reply, content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield counts
    finally:
        await runner.cleanup()
