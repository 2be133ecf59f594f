"""A client that leaves under gpupool's own server (router/gateway/server.py, the request's
ClientLink): the request, served in the server's task with no watcher beside it, is cancelled,
counts as aborted (499, client_disconnect), releases its lease and drops the engine's
connection; the requests after it are served as usual."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import orjson
import pytest

from router.gateway.proxy import _final_finder, _Splice
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


def _dechunk(raw: bytes) -> tuple[bytes, bytes]:
    """An HTTP/1.1 chunked response: its head and its body."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    body = b""
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        body, rest = body + rest[:size], rest[size + 2 :]
    return head, body


async def _whole_stream(live: LiveRouter, body: dict[str, object], pause_s: float) -> bytes:
    """A stream read to its end; with `pause_s`, nothing is read for that long first (with a
    small receive buffer, so the router's writes to this client pause meanwhile)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((live.host, live.port))
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 24)
    writer.write(_request(live, body))
    await writer.drain()
    if pause_s:
        await asyncio.sleep(pause_s)
    raw = await reader.readuntil(b"\r\n0\r\n\r\n")
    writer.close()
    await writer.wait_closed()
    return raw


def _events(body: bytes) -> list[dict[str, Any] | str]:
    """The stream's events: each `data:` JSON object, and "[DONE]"."""
    out: list[dict[str, Any] | str] = []
    for event in body.split(b"\n\n"):
        if event.startswith(b"data: [DONE]"):
            out.append("[DONE]")
        elif event.startswith(b"data: "):
            out.append(orjson.loads(event[6:]))
    return out


@pytest.mark.parametrize("pause_s", [0.0, 0.5])
@pytest.mark.parametrize("usage", [False, True])
def test_a_stream_reaches_its_client_whole(tmp_path: Path, usage: bool, pause_s: float) -> None:
    """Every event of a stream, in order, once, through the server's connection (its events
    after the first token go out from the engine connection's callback while nothing in them
    needs reading; a client that reads nothing for a while gets the same, later); the usage
    event only when asked for, before [DONE]."""
    body: dict[str, object] = {**CHAT, "stream": True, "max_tokens": 1500}
    if usage:
        body["stream_options"] = {"include_usage": True}
    with live_router(hostile_config(tmp_path)) as live:
        raw = live.run(_whole_stream(live, body, pause_s))
    head, data = _dechunk(raw)
    assert head.startswith(b"HTTP/1.1 200")
    events = _events(data)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict) and e.get("choices")]
    assert "".join(str(c["choices"][0]["delta"].get("content", "")) for c in chunks) == (
        " tok" * 1500
    )
    usages = [e for e in events[:-1] if isinstance(e, dict) and not e.get("choices")]
    if usage:
        assert len(usages) == 1 and usages[0]["usage"]["completion_tokens"] == 1500
        assert events[-2] is usages[0]
    else:
        assert usages == []


class _Client:
    """What `_Splice` needs of a ClientLink: `write_more`, here answering `accept`."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.accept = True

    def write_more(self, body: bytes) -> bool:
        if self.accept:
            self.written.append(body)
        return self.accept


def test_a_splice_writes_whole_events_and_declines_what_needs_reading() -> None:
    client = _Client()
    splice = _Splice(client, b'"usage"', _final_finder((b"data: [DONE]",)))
    assert splice(b"data: a\n\ndata: b")  # the whole event goes, the half is held
    assert splice(b"b\n\n")
    assert splice(b"data: c")  # no whole event: nothing written
    assert client.written == [b"data: a\n\n", b"data: bb\n\n"]
    assert splice.pending == b"data: c"
    client.accept = False  # the client reads slowly: declined, nothing written or taken
    assert not splice(b"\n\n")
    assert splice.pending == b"data: c" and len(client.written) == 2
    client.accept = True
    assert not splice(b'\n\ndata: {"usage": 1}\n\n')  # the usage event is read by the relay
    assert splice(b"\n\ndata: [DO")  # a final marker split across chunks: held, then seen
    assert client.written[-1] == b"data: c\n\n" and splice.pending == b"data: [DO"
    assert not splice(b"NE]\n\n")
    assert splice.pending == b"data: [DO" and len(client.written) == 3
