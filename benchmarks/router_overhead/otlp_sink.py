"""An OTLP/HTTP trace sink for the tracing targets (`gpupool-trace-*`): a process of its own
(`python -m benchmarks.router_overhead.otlp_sink --port N`) that takes `POST /v1/traces`,
counts the exports, their bytes and their spans (decoded with opentelemetry-proto), and
answers 200, so the routers under test pay for their whole export path against a real
collector's protocol, while decoding their exports costs the load generator's event loop
nothing (it would otherwise land inside the latency the load generator measures).

`otlp_sink(port, cpus=..., nice=...)` starts it (pinned where the load generator is, as a
collector would sit off the router's CPU), waits until it listens, and at the block's end
stops it with SIGTERM and reads its counts (one JSON line on its stdout).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass

__all__ = ["SinkCounts", "otlp_sink"]

_READY = "listening"
_START_TIMEOUT_S = 30.0


@dataclass
class SinkCounts:
    exports: int = 0
    bytes: int = 0
    spans: int = 0


@contextlib.asynccontextmanager
async def otlp_sink(
    port: int, *, cpus: frozenset[int] | None = None, nice: int = 0
) -> AsyncIterator[SinkCounts]:
    """Run the sink process on 127.0.0.1:`port` until the block ends; the counts it yields
    are filled in when it has stopped."""
    counts = SinkCounts()
    argv = [sys.executable, "-m", "benchmarks.router_overhead.otlp_sink", "--port", str(port)]
    if cpus:
        argv += ["--cpus", ",".join(map(str, sorted(cpus)))]
    proc = await asyncio.create_subprocess_exec(
        *argv, "--nice", str(nice), stdout=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL
    )
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), _START_TIMEOUT_S)
        if line.decode().strip() != _READY:
            raise RuntimeError(f"the OTLP sink did not start (said {line!r})")
        yield counts
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), 10.0)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        else:
            with contextlib.suppress(ValueError):
                for key, value in json.loads(out.decode().strip().splitlines()[-1]).items():
                    setattr(counts, key, int(value))


async def _serve(port: int) -> SinkCounts:
    from aiohttp import web
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

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
    await web.TCPSite(runner, "127.0.0.1", port).start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print(_READY, flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.router_overhead.otlp_sink")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--cpus", help="comma-separated CPUs to pin the sink to")
    p.add_argument("--nice", type=int, default=0)
    args = p.parse_args(argv)
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    with contextlib.suppress(PermissionError):
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)
    counts = asyncio.run(_serve(args.port))
    print(json.dumps(asdict(counts)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
