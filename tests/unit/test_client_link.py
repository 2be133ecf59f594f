"""A client that leaves under gpupool's own server (router/gateway/http_protocol.py's
ClientLink): the request, served in the server's task with no watcher beside it, is cancelled,
counts as aborted (499, client_disconnect), releases its lease and drops the engine's
connection; the requests after it are served as usual."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson

from tests.unit.test_hostile_rig import CHAT, TENANT_KEY, LiveRouter, hostile_config, live_router


def _request(live: LiveRouter, body: dict[str, object]) -> bytes:
    raw = orjson.dumps(body)
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {live.host}:{live.port}\r\n"
        f"Authorization: Bearer {TENANT_KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n"
    ).encode() + raw


def _aborted(live: LiveRouter) -> float:
    total = 0.0
    for metric in live.gateway.metrics.registry.collect():
        for sample in metric.samples:
            if (
                sample.name == "gpupool_requests_total"
                and sample.labels.get("outcome") == "aborted"
                and sample.labels.get("reason") == "client_disconnect"
            ):
                total += sample.value
    return total


async def _leave_mid_stream(live: LiveRouter) -> bytes:
    reader, writer = await asyncio.open_connection(live.host, live.port)
    writer.write(_request(live, {**CHAT, "stream": True, "max_tokens": 2000}))
    await writer.drain()
    got = await reader.readuntil(b"data: ")  # the stream has started
    writer.close()
    await writer.wait_closed()
    return got


async def _settled(live: LiveRouter, before: float) -> tuple[float, int]:
    """Wait (in loop time, no wall-clock bound) until the abort is counted."""
    for _ in range(500):
        if _aborted(live) > before:
            break
        await asyncio.sleep(0.01)
    inflight = sum(state.inflight for state in live.gateway.fleet)
    return _aborted(live), inflight


def test_a_client_that_leaves_mid_stream_aborts_its_request(tmp_path: Path) -> None:
    with live_router(hostile_config(tmp_path), itl_s=0.005) as live:
        before = _aborted(live)
        head = live.run(_leave_mid_stream(live))
        assert head.startswith(b"HTTP/1.1 200")
        after, inflight = live.run(_settled(live, before))
        assert after == before + 1
        assert inflight == 0  # the lease went back
        # the router still serves
        status, _, body = live.asgi(
            "POST",
            "/v1/chat/completions",
            [(b"authorization", f"Bearer {TENANT_KEY}".encode())],
            orjson.dumps(CHAT),
        )
        assert status == 200, body
