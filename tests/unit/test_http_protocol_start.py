"""gpupool's server (router/gateway/server.py) starts each request itself: the scope's path
read without `parse_url` when it is plain, the request's task running the application (or the
gateway's hot route) directly, and what uvicorn's `run_asgi` wrapper did after the application
in the task's done callback. Driven on a real event loop with bytes fed to a connection and a
transport that records what is written: the scope a request line gives, the 500 and the closed
connection a failed application gets (as under uvicorn), pipelined requests served in order,
the `ClientLink` in every served request's scope and none in the 503 past the connection cap.
(The `date` header every response carries is taken out before comparing bytes.)"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import pytest

from router.gateway.http_protocol import CLIENT_LINK, ClientLink
from router.gateway.server import ServerSettings, _Connection, _ServerState
from tests.unit.recording_transport import RecordingTransport


async def _settle() -> None:
    for _ in range(5):  # the task's steps and its done callback
        await asyncio.sleep(0)


def _connect(app: Any, *, max_connections: int | None = None) -> tuple[Any, RecordingTransport]:
    state = _ServerState(app, ServerSettings(max_connections=max_connections))
    protocol = _Connection(state, asyncio.get_running_loop())
    transport = RecordingTransport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    return protocol, transport


_DATE = re.compile(rb"date: [^\r]*\r\n")


def _written(transport: RecordingTransport) -> bytes:
    """What was written, without the `date` header lines."""
    return _DATE.sub(b"", transport.written)


def _ok(body: bytes = b"ok") -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    return app


@pytest.mark.parametrize(
    ("target", "path", "raw_path", "query"),
    [
        (b"/v1/chat/completions", "/v1/chat/completions", b"/v1/chat/completions", b""),
        (b"/v1/runs/a%20b?x=1&y=2", "/v1/runs/a b", b"/v1/runs/a%20b", b"x=1&y=2"),
        (b"/v1/models?", "/v1/models", b"/v1/models", b""),
        (b"/v1/models#frag", "/v1/models", b"/v1/models", b""),
        (b"http://router:8000/v1/models?k=v", "/v1/models", b"/v1/models", b"k=v"),
    ],
)
async def test_the_scope_has_the_request_lines_path_and_query(
    target: bytes, path: str, raw_path: bytes, query: bytes
) -> None:
    seen: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope)
        await _ok()(scope, receive, send)

    protocol, transport = _connect(app)
    protocol.data_received(b"GET " + target + b" HTTP/1.1\r\nhost: router\r\n\r\n")
    await _settle()
    scope = seen[0]
    assert (scope["method"], scope["path"], scope["raw_path"], scope["query_string"]) == (
        "GET",
        path,
        raw_path,
        query,
    )
    assert scope["headers"] == [(b"host", b"router")]
    assert isinstance(scope[CLIENT_LINK], ClientLink)
    assert (
        _written(transport)
        == b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"
    )
    assert not transport.closed and not protocol.state.tasks


_500 = (
    b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: 21\r\nconnection: close\r\n\r\nInternal Server Error"
)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def test_an_application_that_fails_before_its_response_gets_a_500_and_a_close() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("boom")

    protocol, transport = _connect(app)
    records = _Records()
    logger = logging.getLogger("router.gateway.server")
    logger.addHandler(records)
    try:
        protocol.data_received(b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 0\r\n\r\n")
        await _settle()
    finally:
        logger.removeHandler(records)
    assert transport.written == _500 and transport.closed
    assert not protocol.state.tasks
    (record,) = records.records
    assert record.getMessage() == "Exception in ASGI application"
    assert record.exc_info is not None and str(record.exc_info[1]) == "boom"


async def test_an_application_that_returns_without_a_response_gets_a_500() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        return None

    protocol, transport = _connect(app)
    protocol.data_received(b"GET /health HTTP/1.1\r\n\r\n")
    await _settle()
    assert transport.written == _500 and transport.closed


async def test_an_application_that_fails_mid_response_has_its_connection_closed() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"part", "more_body": True})
        raise RuntimeError("boom")

    protocol, transport = _connect(app)
    protocol.data_received(b"GET /stream HTTP/1.1\r\n\r\n")
    await _settle()
    # the client sees a cut chunked response (no last chunk), never a 500 after a 200
    assert (
        _written(transport) == b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4\r\npart\r\n"
    )
    assert transport.closed and not protocol.state.tasks


async def test_a_cancelled_request_task_before_its_response_gets_a_500() -> None:
    started = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        started.set()
        await asyncio.sleep(3600)

    protocol, transport = _connect(app)
    protocol.data_received(b"GET /slow HTTP/1.1\r\n\r\n")
    await started.wait()
    (task,) = protocol.state.tasks
    task.cancel()
    await _settle()
    assert transport.written == _500 and transport.closed and not protocol.state.tasks


async def test_pipelined_requests_are_answered_in_order() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await asyncio.sleep(0.01 if scope["path"] == "/first" else 0)
        await _ok(scope["path"].encode())(scope, receive, send)

    protocol, transport = _connect(app)
    protocol.data_received(b"GET /first HTTP/1.1\r\n\r\nGET /second HTTP/1.1\r\n\r\n")
    for _ in range(100):
        if _written(transport).count(b"0\r\n\r\n") == 2:
            break
        await asyncio.sleep(0.005)
    one = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    assert _written(transport) == (
        one + b"6\r\n/first\r\n0\r\n\r\n" + one + b"7\r\n/second\r\n0\r\n\r\n"
    )


async def test_past_the_connection_cap_a_request_gets_the_503_without_a_client_link() -> None:
    seen: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope)
        await _ok()(scope, receive, send)

    protocol, transport = _connect(app, max_connections=1)  # this connection is the one
    protocol.data_received(b"GET /health HTTP/1.1\r\n\r\n")
    await _settle()
    assert seen == []
    assert transport.written.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert b'"code":"too_many_connections"' in transport.written


class _Routed:
    """An application with a hot route, as the gateway has (router/gateway/app.py)."""

    def __init__(self) -> None:
        self.dispatched: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.dispatched.append(scope["path"])
        await _ok(b"dispatched")(scope, receive, send)

    def hot_route(self, scope: Any, receive: Any, send: Any) -> Any:
        if scope["path"] != "/hot":
            return None
        return _ok(b"hot")(scope, receive, send)


async def test_a_hot_route_is_the_request_task_and_the_rest_is_dispatched() -> None:
    app = _Routed()
    protocol, transport = _connect(app)
    assert protocol.state.app is app  # as `gpupool serve` runs it: nothing wraps it
    protocol.data_received(b"POST /hot HTTP/1.1\r\ncontent-length: 0\r\n\r\n")
    await _settle()
    protocol.data_received(b"POST /cold HTTP/1.1\r\ncontent-length: 0\r\n\r\n")
    await _settle()
    one = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    assert _written(transport) == (
        one + b"3\r\nhot\r\n0\r\n\r\n" + one + b"a\r\ndispatched\r\n0\r\n\r\n"
    )
    assert app.dispatched == ["/cold"]
