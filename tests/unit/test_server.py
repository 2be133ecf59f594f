"""gpupool's own HTTP/1.1 server (router/gateway/server.py), driven with bytes fed to a
connection on a real event loop and a transport that records what is written: the headers
and addresses in the scope, bodies through `receive` (whole and in parts, `100 Continue`
first when asked, reading paused past 64 KiB), responses through `send` (content-length,
chunked, HEAD without a body, `connection: close`, HTTP/1.0), writing paused for a slow
reader, `ClientLink.write_more`, pipelined requests with bodies served in order, the 400/431
for bad heads, a client that leaves; and on a real socket the lifespan and a graceful shutdown
that lets a request in flight finish. The request's start, the 500s and the cap are in
test_http_protocol_start.py, the deadlines and `respond` in test_http_protocol_timers.py."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import orjson
import pytest

from router.gateway.http_protocol import CLIENT_LINK
from router.gateway.server import Server, ServerSettings, StartupFailed, _Connection, _ServerState
from tests.unit.recording_transport import RecordingTransport


class _Transport(RecordingTransport):
    def __init__(self) -> None:
        super().__init__()
        self.reading = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


async def _settle() -> None:
    for _ in range(8):  # the task's steps and its done callback
        await asyncio.sleep(0)


def _connect(
    app: Any, *, max_connections: int | None = None, loop: Any = None
) -> tuple[_Connection, _Transport]:
    settings = ServerSettings(max_connections=max_connections, keep_alive_s=5.0)
    state = _ServerState(app, settings)
    conn = _Connection(state, loop or asyncio.get_running_loop())
    transport = _Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn, transport


def _ok(body: bytes = b"ok", headers: list[tuple[bytes, bytes]] | None = None) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": headers or []})
        await send({"type": "http.response.body", "body": body})

    return app


def _responses(written: bytes) -> list[bytes]:
    """The status lines of the responses written, in order."""
    return [line for line in written.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]


async def test_the_scope_has_lowercase_trimmed_headers_and_the_addresses() -> None:
    seen: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope)
        await _ok()(scope, receive, send)

    conn, transport = _connect(app)
    conn.data_received(b"GET /x HTTP/1.1\r\nHost: router\r\nX-A: v \t\r\n\r\n")
    await _settle()
    scope = seen[0]
    assert scope["headers"] == [(b"host", b"router"), (b"x-a", b"v")]
    assert scope["http_version"] == "1.1" and scope["type"] == "http"
    assert scope["client"] == ("127.0.0.1", 50000) and scope["server"] == ("127.0.0.1", 8000)
    assert transport.written.startswith(b"HTTP/1.1 200 OK\r\ndate: ")
    assert not transport.closed


async def test_a_body_in_parts_through_receive_and_100_continue_first() -> None:
    parts: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            parts.append(message)
            if not message["more_body"]:
                break
        body = b"".join(m["body"] for m in parts)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    conn, transport = _connect(app)
    conn.data_received(
        b"POST /x HTTP/1.1\r\nhost: r\r\nexpect: 100-continue\r\ncontent-length: 6\r\n\r\n"
    )
    await _settle()
    assert transport.written == b"HTTP/1.1 100 Continue\r\n\r\n"
    conn.data_received(b"abc")
    await _settle()
    conn.data_received(b"def")
    await _settle()
    assert [m["body"] for m in parts] == [b"abc", b"def"]
    assert [m["more_body"] for m in parts] == [True, False]
    assert transport.written.endswith(b"6\r\nabcdef\r\n0\r\n\r\n")


async def test_receive_after_the_body_waits_for_the_end_then_says_disconnect() -> None:
    said: list[str] = []
    done = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()

        async def listen() -> None:
            said.append((await receive())["type"])
            done.set()

        listener = asyncio.ensure_future(listen())
        await asyncio.sleep(0)
        assert not said  # nothing more to say while the response goes on
        await _ok()(scope, receive, send)
        await listener

    conn, _ = _connect(app)
    conn.data_received(b"POST /x HTTP/1.1\r\nhost: r\r\ncontent-length: 1\r\n\r\na")
    await asyncio.wait_for(done.wait(), 1)
    assert said == ["http.disconnect"]


async def test_a_large_body_pauses_reading_until_the_application_reads() -> None:
    got = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await got.wait()
        body = b""
        more = True
        while more:
            message = await receive()
            body += message["body"]
            more = message["more_body"]
        await _ok(str(len(body)).encode())(scope, receive, send)

    conn, transport = _connect(app)
    size = 200_000
    conn.data_received(b"POST /x HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\n\r\n" % size)
    conn.data_received(b"x" * 100_000)
    assert not transport.reading  # over 64 KiB buffered, nobody reading
    got.set()
    await _settle()
    assert transport.reading
    conn.data_received(b"x" * 100_000)
    await _settle()
    assert transport.written.endswith(b"6\r\n200000\r\n0\r\n\r\n")


async def test_content_length_head_and_connection_close() -> None:
    conn, transport = _connect(_ok(b"hello", [(b"content-length", b"5")]))
    conn.data_received(b"HEAD /x HTTP/1.1\r\nhost: r\r\n\r\n")
    await _settle()
    assert transport.written.endswith(b"content-length: 5\r\n\r\n")  # no body for HEAD
    assert not transport.closed
    transport.written = b""
    conn.data_received(b"GET /x HTTP/1.1\r\nhost: r\r\nconnection: close\r\n\r\n")
    await _settle()
    assert transport.written.endswith(b"content-length: 5\r\nconnection: close\r\n\r\nhello")
    assert transport.closed


async def test_http_1_0_closes_after_the_response() -> None:
    conn, transport = _connect(_ok(b"hi", [(b"content-length", b"2")]))
    conn.data_received(b"GET /x HTTP/1.0\r\n\r\n")
    await _settle()
    assert b"connection: close\r\n" in transport.written and transport.closed


async def test_send_waits_while_the_client_reads_slowly() -> None:
    sent = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        await send({"type": "http.response.body", "body": b"b"})
        sent.set()

    conn, transport = _connect(app)
    conn.pause_writing()  # the client's socket is full
    conn.data_received(b"GET /x HTTP/1.1\r\nhost: r\r\n\r\n")
    await _settle()
    assert transport.written == b"" and not sent.is_set()
    conn.resume_writing()
    await asyncio.wait_for(sent.wait(), 1)
    assert transport.written.endswith(b"1\r\na\r\n1\r\nb\r\n0\r\n\r\n")


async def test_the_link_writes_a_whole_response_and_stream_chunks_at_once() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        link = scope[CLIENT_LINK]
        assert link.body_arrived and link.take_body() == b"q"
        assert link.respond(200, [(b"content-type", b"application/json")], b"{}")

    conn, transport = _connect(app)
    conn.data_received(b"POST /x HTTP/1.1\r\nhost: r\r\ncontent-length: 1\r\n\r\nq")
    await _settle()
    assert transport.written.startswith(b"HTTP/1.1 200 OK\r\ndate: ")
    assert transport.written.endswith(
        b"content-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
    )

    async def stream(scope: Any, receive: Any, send: Any) -> None:
        link = scope[CLIENT_LINK]
        assert not link.write_more(b"x")  # not started
        await send({"type": "http.response.start", "status": 200, "headers": []})
        assert link.write_more(b"data: 1\n\n")
        conn.pause_writing()
        assert not link.write_more(b"data: 2\n\n")  # the caller `send`s: it waits
        conn.resume_writing()
        await send({"type": "http.response.body", "body": b"data: 2\n\n"})

    conn, transport = _connect(stream)
    conn.data_received(b"GET /s HTTP/1.1\r\nhost: r\r\n\r\n")
    await _settle()
    assert transport.written.endswith(b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n")


async def test_respond_refuses_bad_header_bytes_and_send_raises() -> None:
    errors: list[BaseException] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        link = scope[CLIENT_LINK]
        assert not link.respond(200, [(b"x-a", b"v\r\nx-b: injected")], b"{}")
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [(b"x-a", b"\n")]})
        except RuntimeError as err:
            errors.append(err)
            raise

    conn, transport = _connect(app)
    conn.data_received(b"GET /x HTTP/1.1\r\nhost: r\r\n\r\n")
    await _settle()
    assert errors and "header value" in str(errors[0])
    # as uvicorn: the response counts as started, so the connection is cut, nothing written
    assert transport.written == b"" and transport.closed


async def test_pipelined_requests_are_served_in_order() -> None:
    release = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["path"] == "/first":
            await release.wait()
        body = scope["path"].encode()
        await _ok(body, [(b"content-length", b"%d" % len(body))])(scope, receive, send)

    conn, transport = _connect(app)
    conn.data_received(
        b"GET /first HTTP/1.1\r\nhost: r\r\n\r\nGET /second HTTP/1.1\r\nhost: r\r\n\r\n"
        b"POST /third HTTP/1.1\r\nhost: r\r\ncontent-length: 1\r\n\r\nz"
    )
    await _settle()
    assert transport.written == b"" and not transport.reading  # reading paused behind
    release.set()
    await _settle()
    bodies = [part.rsplit(b"\r\n\r\n", 1)[-1] for part in transport.written.split(b"HTTP/1.1")]
    assert bodies[1:] == [b"/first", b"/second", b"/third"]
    assert transport.reading and not transport.closed


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"NOT HTTP AT ALL\r\n\r\n", 400),
        (b"GET /x HTTP/1.1\r\nhost: r\r\nx-big: " + b"a" * 70_000 + b"\r\n\r\n", 431),
    ],
)
async def test_bad_heads_get_json_errors_and_a_close(data: bytes, status: int) -> None:
    conn, transport = _connect(_ok())
    conn.data_received(data)
    await _settle()
    assert transport.written.startswith(b"HTTP/1.1 %d " % status) and transport.closed
    body = orjson.loads(transport.written.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["type"] == "invalid_request_error"


async def test_a_lost_client_cancels_the_task_it_registered() -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        link = scope[CLIENT_LINK]
        link.task = asyncio.current_task()
        started.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    conn, transport = _connect(app)
    conn.data_received(b"GET /x HTTP/1.1\r\nhost: r\r\n\r\n")
    await started.wait()
    conn.connection_lost(None)
    await asyncio.wait_for(cancelled.wait(), 1)
    await _settle()
    assert transport.written == b""  # nothing to a client that left


# -------------------------------------------------------------------- a real socket


def _listener() -> tuple[socket.socket, int]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    sock.setblocking(False)
    return sock, sock.getsockname()[1]


async def test_lifespan_and_a_graceful_shutdown_that_finishes_the_request_in_flight() -> None:
    events: list[str] = []
    in_flight = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                events.append(message["type"])
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        in_flight.set()
        await asyncio.sleep(0.3)
        await _ok(b"done", [(b"content-length", b"4")])(scope, receive, send)

    sock, port = _listener()
    server = Server(app, ServerSettings(), shutdown_grace_s=5.0)
    await server.start(sock)
    assert events == ["lifespan.startup"]
    async with httpx.AsyncClient() as client:
        request = asyncio.ensure_future(client.get(f"http://127.0.0.1:{port}/slow"))
        await in_flight.wait()
        await server.aclose()
        response = await request
    assert response.status_code == 200 and response.text == "done"
    assert response.headers["connection"] == "close"
    assert events == ["lifespan.startup", "lifespan.shutdown"]
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient() as client:
            await client.get(f"http://127.0.0.1:{port}/")
    sock.close()


async def test_shutdown_cancels_what_outlasts_the_grace() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            message = await receive()
            await send({"type": "lifespan.startup.complete"})
            message = await receive()
            assert message["type"] == "lifespan.shutdown"
            await send({"type": "lifespan.shutdown.complete"})
            return
        await asyncio.sleep(60)

    sock, port = _listener()
    server = Server(app, ServerSettings(), shutdown_grace_s=0.2)
    await server.start(sock)
    async with httpx.AsyncClient() as client:
        request = asyncio.ensure_future(client.get(f"http://127.0.0.1:{port}/"))
        await asyncio.sleep(0.1)
        await asyncio.wait_for(server.aclose(), 2)
        response = await request
    assert response.status_code == 500 and response.headers["connection"] == "close"
    sock.close()


async def test_a_failed_startup_raises_with_the_applications_reason() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "lifespan.startup.failed", "message": "store unreachable"})

    sock, _ = _listener()
    with pytest.raises(StartupFailed, match="store unreachable"):
        await Server(app, ServerSettings()).start(sock)
    sock.close()


def test_settings_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="head_timeout_s"):
        ServerSettings(head_timeout_s=0)
    with pytest.raises(ValueError, match="max_connections"):
        ServerSettings(max_connections=0)
