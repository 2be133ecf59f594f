"""gpupool's own HTTP/1.1 server: httptools' parser fed from an `asyncio.Protocol` on the
running (uv)loop, each request served by a task running the ASGI application (or, for the
generation endpoints, the gateway's `hot_route` coroutine itself). It replaced uvicorn with
gpupool's protocol subclass (issue 28, step 12): 7-21 µs less CPU per request at c=64 in
`python -m benchmarks.router_overhead.servers` (benchmarks/router_overhead/notes.md).

What it serves, as uvicorn did:

- the ASGI 3 HTTP scope (method, path, raw_path, query_string, headers lower-cased, values
  without trailing whitespace), `receive` for bodies that do not arrive whole (reading paused
  past 64 KiB buffered, resumed when the application reads), `send` with uvicorn's header
  checks, content-length accounting, chunked framing when the response has no length, HEAD
  answered without a body, a `date` header, `connection: close` when the connection ends, and
  writing paused while the client's socket is full (`send` waits for it to drain: the
  slow-client bound);
- `Expect: 100-continue` answered when the application first reads the body;
- keep-alive with its idle timeout, pipelined requests served in order (reading paused behind
  the one in service), a 400 for bytes that are not HTTP, a 503 past `max_connections`, the
  500 and the closed connection for an application that fails;
- the ASGI lifespan (`Server.start` runs its startup, `Server.aclose` its shutdown) and a
  graceful shutdown: stop accepting, close idle connections, let requests in flight finish
  within the grace period (their connections close after the response), then cancel the rest.

What uvicorn lacked: a deadline for a request's head and a cap on its size. A new
connection's first request head must arrive within `head_timeout_s` of the connection opening,
and on a kept-alive connection a head must be complete within `head_timeout_s` of its first
byte, else the connection gets a 408 and is closed; a head over `max_head_bytes` gets a 431. A
kept-alive connection idle between requests is closed by the keep-alive timeout without an
answer: a 408 written to an idle connection can cross the client's next request on the wire,
and the client then reads it as that request's answer (an agent whose tool ran ~10 s got one).
Both deadlines are checked by timers that are not re-armed per request: a request moves the
deadline (a float), and a timer that fires before it re-arms itself for it. Every answer of
the server's own is OpenAI-shaped JSON (the bare 500 excepted, as uvicorn's). The body has its
own deadline on the request path (`router.body_read_timeout_s`, router/gateway/proxy.py).

Each request's exchange is its `ClientLink` (router/gateway/http_protocol.py) in
`scope[CLIENT_LINK]`: `take_body`, `respond` and `write_more` without `receive`'s and `send`'s
per-message work, and its task cancelled when the client leaves.

Beyond uvicorn: constant response headers (`Server(..., headers=...)`: the router's
`x-gpupool-replica`), written on every answer, the server's own errors included, as part of
the `date` line built once a second (no work per request); and further listening sockets
that answer only some paths of the application (`Server.start(sock, also=[PathListener(...)])`:
a router replica's metrics port), each with its own connections and tasks, through the one
lifespan, the one shutdown and the same limits.

No TLS, no WebSocket upgrade (the router serves neither: an upgrade request is served as plain
HTTP), no access log.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import http
import logging
import operator
import re
import socket
import time
import urllib.parse
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from email.utils import formatdate
from typing import Any

import httptools

from router.gateway.http_protocol import _OVERLOADED, CLIENT_LINK, ClientLink, _error, _error_body

# httptools' parsed URL's `query`: None when the URL has none ("/v1/models?", "/a#frag"), where
# its stub says bytes. Read untyped, so that the compiled module (mypyc checks a constant
# `getattr` against the stub too) does not refuse the None.
_url_query: Callable[[object], bytes | None] = operator.attrgetter("query")

__all__ = ["PathListener", "Server", "ServerSettings", "StartupFailed"]

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
App = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Any]

# what uvicorn refuses in a response header's name and value (its `send` raises)
HEADER_RE = re.compile(b'[\x00-\x1f\x7f()<>@,;:\\[\\]={} \t\\\\"]')
HEADER_VALUE_RE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %b\r\n" % (status, phrase)


STATUS_LINE = {status: _status_line(status) for status in range(100, 600)}
_HIGH_WATER_BYTES = 65536  # request body buffered before reading pauses (uvicorn's)
_ASGI = {"version": "3.0", "spec_version": "2.3"}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_500 = (
    STATUS_LINE[500] + b"content-type: text/plain; charset=utf-8\r\ncontent-length: 21\r\n"
    b"connection: close\r\n\r\nInternal Server Error"
)
_OVERLOADED_ANSWER = (
    STATUS_LINE[503] + b"content-type: application/json\r\ncontent-length: %d\r\n"
    b"connection: close\r\nretry-after: 1\r\n\r\n%b" % (len(_OVERLOADED), _OVERLOADED)
)


class StartupFailed(Exception):
    """The application's lifespan startup failed; the message is the application's."""


class ServerSettings:
    """The server's limits (each from `router.*` in `gpupool serve`)."""

    __slots__ = ("head_timeout_s", "keep_alive_s", "max_connections", "max_head_bytes")

    def __init__(
        self,
        *,
        head_timeout_s: float = 30.0,
        max_head_bytes: int = 64 * 1024,
        keep_alive_s: float = 75.0,
        max_connections: int | None = None,
    ) -> None:
        if head_timeout_s <= 0 or keep_alive_s <= 0:
            raise ValueError("head_timeout_s and keep_alive_s must be > 0")
        if max_head_bytes < 1024:
            raise ValueError("max_head_bytes must be at least 1024")
        if max_connections is not None and max_connections < 1:
            raise ValueError("max_connections must be at least 1 (or None: no cap)")
        self.head_timeout_s = head_timeout_s
        self.max_head_bytes = max_head_bytes
        self.keep_alive_s = keep_alive_s
        self.max_connections = max_connections


class _Date:
    """The `date` header, formatted once a second, followed by the server's constant
    headers (`extra`: whole lines, CRLF-ended)."""

    __slots__ = ("extra", "line", "second")

    def __init__(self, extra: bytes = b"") -> None:
        self.second = -1
        self.line = b""
        self.extra = extra

    def now(self) -> bytes:
        second = int(time.time())
        if second != self.second:
            self.second = second
            date = formatdate(second, usegmt=True).encode("ascii")
            self.line = b"date: %b\r\n%b" % (date, self.extra)
        return self.line


def _header_lines(headers: Sequence[tuple[bytes, bytes]]) -> bytes:
    """`headers` as response header lines; ValueError for what `send` would refuse."""
    lines = []
    for name, value in headers:
        if not name or HEADER_RE.search(name) or HEADER_VALUE_RE.search(value):
            raise ValueError(f"not a valid response header: {name!r}: {value!r}")
        lines.append(b"%b: %b\r\n" % (name.lower(), value))
    return b"".join(lines)


def _with_lines(answer: bytes, lines: bytes) -> bytes:
    """A whole answer (status line first) with header `lines` after its status line."""
    if not lines:
        return answer
    end = answer.index(b"\r\n") + 2
    return answer[:end] + lines + answer[end:]


class _Exchange(ClientLink):
    """One request and its response on a connection: the ASGI `receive` and `send`, and the
    request's `ClientLink` (the scope carries the exchange itself)."""

    __slots__ = (  # ClientLink's: lost, task
        "_conn",
        "_final_given",
        "_remaining",
        "_waiter",
        "body",
        "chunked",
        "complete",
        "disconnected",
        "expect_100",
        "keep_alive",
        "more_body",
        "scope",
        "started",
    )

    def __init__(self, conn: _Connection, scope: Scope, keep_alive: bool, expect_100: bool):
        super().__init__()
        self._conn = conn
        self.scope = scope
        self.keep_alive = keep_alive
        self.expect_100 = expect_100
        self.body = bytearray()
        self.more_body = True
        self.disconnected = False
        self.started = False
        self.complete = False
        self.chunked: bool | None = None
        self._remaining = 0  # bytes the response's content-length still owes
        self._final_given = False  # `receive` has handed over the body's last part
        self._waiter: asyncio.Future[None] | None = None

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # ---------------------------------------------------------------- ClientLink

    @property
    def body_arrived(self) -> bool:
        return not self.more_body

    def take_body(self) -> bytes | None:
        if self.more_body or self.disconnected or self.complete or self.expect_100:
            return None
        self._conn.resume_reading()
        body = bytes(self.body)
        self.body = bytearray()
        return body

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        conn = self._conn
        if self.started or self.disconnected or conn.write_paused or self.scope["method"] == "HEAD":
            return False
        content = [STATUS_LINE[status], conn.date.now()]
        for name, value in headers:
            content += (name, b": ", value, b"\r\n")
        # uvicorn's checks, on all names at once and all values at once
        if HEADER_RE.search(b"".join(content[2::4])) or HEADER_VALUE_RE.search(
            b"".join(content[4::4])
        ):
            return False  # `send` raises for it, as for any response
        keep_alive = self.keep_alive
        if not keep_alive:
            content.append(b"connection: close\r\n")
        content += (b"content-length: %d\r\n\r\n" % len(body), body)
        self.started = True
        self.expect_100 = False
        conn.transport.write(b"".join(content))
        self._finish(keep_alive)
        return True

    def write_more(self, body: bytes) -> bool:
        if (
            self.chunked is not True
            or self._conn.write_paused
            or self.disconnected
            or self.complete
            or not body
        ):
            return False
        self._conn.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True

    # ---------------------------------------------------------------- ASGI

    async def receive(self) -> Message:
        conn = self._conn
        if self.expect_100 and not conn.transport.is_closing():
            conn.transport.write(_CONTINUE)
            self.expect_100 = False
        if not self.disconnected and not self.complete:
            conn.resume_reading()
            if not self.body and (self.more_body or self._final_given):
                # nothing new: the next part, or (all given) the client leaving or the end
                self._waiter = waiter = conn.loop.create_future()
                await waiter
        if self.disconnected or self.complete:
            return {"type": "http.disconnect"}
        more = self.more_body
        self._final_given = not more
        message = {"type": "http.request", "body": bytes(self.body), "more_body": more}
        self.body = bytearray()
        return message

    async def send(self, message: Message) -> None:
        conn = self._conn
        if conn.write_paused and not self.disconnected:
            await conn.drain()
        if self.disconnected:
            return
        if not self.started:
            if message["type"] != "http.response.start":
                raise RuntimeError(
                    f"Expected ASGI message 'http.response.start', but got '{message['type']}'."
                )
            self._start(message["status"], message.get("headers", ()))
        elif not self.complete:
            if message["type"] != "http.response.body":
                raise RuntimeError(
                    f"Expected ASGI message 'http.response.body', but got '{message['type']}'."
                )
            self._body(message.get("body", b""), message.get("more_body", False))
        else:
            raise RuntimeError(
                f"Unexpected ASGI message '{message['type']}' sent, after response already "
                "completed."
            )

    def _start(self, status: int, headers: Any) -> None:
        self.started = True
        self.expect_100 = False
        content = [STATUS_LINE[status], self._conn.date.now()]
        has_close = False
        for name, value in headers:
            if HEADER_RE.search(name):
                raise RuntimeError("Invalid HTTP header name.")
            if HEADER_VALUE_RE.search(value):
                raise RuntimeError("Invalid HTTP header value.")
            name = name.lower()
            if name == b"content-length" and self.chunked is None:
                self._remaining = int(value.decode())
                self.chunked = False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self._remaining = 0
                self.chunked = True
            elif name == b"connection" and b"close" in [
                token.lower().strip() for token in value.split(b",")
            ]:
                self.keep_alive = False
                has_close = True
            content += (name, b": ", value, b"\r\n")
        if not self.keep_alive and not has_close:
            content.append(b"connection: close\r\n")
        if self.chunked is None and self.scope["method"] != "HEAD" and status not in (204, 304):
            self.chunked = True
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        self._conn.transport.write(b"".join(content))

    def _body(self, body: bytes, more_body: bool) -> None:
        transport = self._conn.transport
        if self.scope["method"] == "HEAD":
            self._remaining = 0
        elif self.chunked:
            if more_body:
                if body:
                    transport.write(b"%x\r\n%b\r\n" % (len(body), body))
            elif body:
                transport.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body))
            else:
                transport.write(b"0\r\n\r\n")
        else:
            if len(body) > self._remaining:
                raise RuntimeError("Response content longer than Content-Length")
            self._remaining -= len(body)
            transport.write(body)
        if not more_body:
            if self._remaining != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self._finish(self.keep_alive)

    def _finish(self, keep_alive: bool) -> None:
        self.complete = True
        self.wake()
        conn = self._conn
        if not keep_alive:
            conn.transport.close()
        conn.response_done(self)


class _ServerState:
    """What every connection of one listener shares (the lifespan's state: with the
    server's other listeners too)."""

    __slots__ = (
        "answer_500",
        "answer_overloaded",
        "app",
        "app_state",
        "connections",
        "date",
        "settings",
        "tasks",
    )

    def __init__(
        self,
        app: App,
        settings: ServerSettings,
        header_lines: bytes = b"",
        app_state: dict[str, Any] | None = None,
    ) -> None:
        self.app = app
        self.settings = settings
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Task[Any]] = set()
        self.app_state: dict[str, Any] = {} if app_state is None else app_state
        self.date = _Date(header_lines)
        self.answer_500 = _with_lines(_500, header_lines)
        self.answer_overloaded = _with_lines(_OVERLOADED_ANSWER, header_lines)

    def with_headers(self, answer: bytes) -> bytes:
        """One of the server's own whole answers with the constant headers."""
        return _with_lines(answer, self.date.extra)


class _Connection(asyncio.Protocol):
    """One client connection: the parser's callbacks build each request's exchange; its
    task runs the application. Both deadlines, the head's and the keep-alive's, are checked
    by timers that are not re-armed per request (as in http_protocol)."""

    def __init__(self, state: _ServerState, loop: asyncio.AbstractEventLoop) -> None:
        self.state = state
        self.settings = state.settings
        self.date = state.date
        self.loop = loop  # its clock and timers (a test's own)
        self.parser = httptools.HttpRequestParser(self)
        # a response may be written to the first of pipelined requests after the client's close
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.exchange: _Exchange | None = None
        self.pipeline: collections.deque[tuple[_Exchange, App | None]] = collections.deque()
        self.read_paused = False
        self.write_paused = False
        self._writable: asyncio.Event | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._expect_100 = False
        self._server: Any = None
        self._client: Any = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._keep_alive_timer: asyncio.TimerHandle | None = None
        self._idle_since_s: float | None = None  # the keep-alive's start; None: busy
        self._in_head = False
        self._head_bytes = 0
        self._head_deadline_s = 0.0

    # ---------------------------------------------------------------- transport events

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport
        self.state.connections.add(self)
        self._server = _address(transport.get_extra_info("sockname"))
        self._client = _address(transport.get_extra_info("peername"))
        self._start_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self.state.connections.discard(self)
        for timer in (self._head_timer, self._keep_alive_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._keep_alive_timer = None
        exchange = self.exchange
        if exchange is not None:
            if not exchange.complete:
                exchange.disconnected = True
                exchange._connection_lost()
            exchange.wake()
        for waiting, _ in self.pipeline:
            waiting.disconnected = True
        self.resume_writing()
        if exc is None:
            self.transport.close()

    def eof_received(self) -> None:
        pass  # the transport closes itself (False)

    def pause_writing(self) -> None:
        if not self.write_paused:
            self.write_paused = True
            if self._writable is not None:
                self._writable.clear()

    def resume_writing(self) -> None:
        if self.write_paused:
            self.write_paused = False
            if self._writable is not None:
                self._writable.set()

    async def drain(self) -> None:
        """Wait until the client's socket takes writes again (or the connection is lost)."""
        if self._writable is None:
            self._writable = asyncio.Event()
        if self.write_paused:
            await self._writable.wait()

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            if self._head_bytes == 0 and self._idle_since_s is not None:
                # a kept-alive connection's next request begins: its head is due from now
                self._head_deadline_s = self.loop.time() + self.settings.head_timeout_s
                if self._head_timer is None:
                    self._head_timer = self.loop.call_at(self._head_deadline_s, self._head_check)
            max_head = self.settings.max_head_bytes
            room = max_head - self._head_bytes
            self._head_bytes += len(data)
            end = data.find(b"\r\n\r\n")
            if self._head_bytes > max_head and not 0 <= end <= room - 4:
                self._disarm_head_timer()
                message = f"request line and headers larger than {max_head} bytes"
                reason = "Request Header Fields Too Large"
                answer = _error(431, reason, message, "headers_too_large")
                self.transport.write(self.state.with_headers(answer))
                self.transport.close()
                return
        self._idle_since_s = None
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # no upgrade is served: the request was served as plain HTTP
        except httptools.HttpParserError as err:
            log.warning("not a valid HTTP request: %s", err)
            self._answer_400(str(err))

    # ---------------------------------------------------------------- parser callbacks

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._expect_100 = False
        if not self._in_head:  # pipelined behind a request still being served
            self._start_head()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        # llhttp keeps trailing whitespace, which RFC 9110 5.5 excludes from the value
        value = value.rstrip(b" \t")
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect_100 = True
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        parser = self.parser
        url = self._url
        if url[:1] == b"/" and b"?" not in url and b"%" not in url and b"#" not in url:
            raw_path, query = url, b""  # what parse_url would find in it
            path = url.decode("ascii")
        else:
            parsed = httptools.parse_url(url)
            raw_path, query = parsed.path, _url_query(parsed) or b""
            path = raw_path.decode("ascii")
            if "%" in path:
                path = urllib.parse.unquote(path)
        http_version = parser.get_http_version()
        state = self.state
        scope = {
            "type": "http",
            "asgi": _ASGI,
            "http_version": http_version,
            "server": self._server,
            "client": self._client,
            "scheme": "http",
            "root_path": "",
            "headers": self._headers,
            "state": state.app_state.copy(),
            "method": parser.get_method().decode("ascii"),
            "path": path,
            "raw_path": raw_path,
            "query_string": query,
        }
        keep_alive = http_version != "1.0" and parser.should_keep_alive()
        exchange = _Exchange(self, scope, keep_alive, self._expect_100)
        app: App | None = state.app
        cap = self.settings.max_connections
        if cap is not None and (len(state.connections) >= cap or len(state.tasks) >= cap):
            log.warning("over router.max_connections (%d): 503", cap)
            app = None  # answered at its turn, not served
        else:
            scope[CLIENT_LINK] = exchange
        current = self.exchange
        if current is None or current.complete:
            self.exchange = exchange
            self._serve(exchange, app)
        else:  # pipelined behind a request still being served: it starts after
            self.pause_reading()
            self.pipeline.append((exchange, app))

    def on_body(self, body: bytes) -> None:
        exchange = self._receiving()
        if exchange is None:
            return
        exchange.body += body
        if len(exchange.body) > _HIGH_WATER_BYTES:
            self.pause_reading()
        exchange.wake()

    def on_message_complete(self) -> None:
        exchange = self._receiving()
        if exchange is None:
            return
        exchange.more_body = False
        exchange.wake()

    def _receiving(self) -> _Exchange | None:
        """The exchange whose request the parser is reading: the last pipelined one, else
        the current one; None when its response is complete (the rest is dropped)."""
        exchange = self.pipeline[-1][0] if self.pipeline else self.exchange
        if exchange is None or exchange.complete:
            return None
        return exchange

    # ---------------------------------------------------------------- serving

    def _serve(self, exchange: _Exchange, app: App | None) -> None:
        """Run the request's task: the gateway's `hot_route` coroutine where it answers, else
        the application; what uvicorn's `run_asgi` did after it is `_app_done`."""
        if app is None:
            self._answer_overloaded(exchange)
            return
        scope = exchange.scope
        coro = None
        hot_route = getattr(app, "hot_route", None)  # the gateway's (router/gateway/app.py)
        if hot_route is not None:
            coro = hot_route(scope, exchange.receive, exchange.send)
        if coro is None:
            coro = app(scope, exchange.receive, exchange.send)
        task = self.loop.create_task(coro)
        task.add_done_callback(functools.partial(self._app_done, exchange))
        self.state.tasks.add(task)

    def _app_done(self, exchange: _Exchange, task: asyncio.Task[Any]) -> None:
        """A 500 when the application failed or returned before its response started, the
        connection closed when it failed or returned after that but before the response's
        end (the client cannot tell a cut response from a whole one)."""
        self.state.tasks.discard(task)
        error = asyncio.CancelledError() if task.cancelled() else task.exception()
        if error is not None:
            if not isinstance(error, asyncio.CancelledError) or not exchange.disconnected:
                log.error("Exception in ASGI application", exc_info=error)
            if not exchange.started:
                self._answer_500(exchange)
            else:
                self.transport.close()
        elif task.result() is not None:
            log.error("ASGI callable should return None, but returned %r.", task.result())
            self.transport.close()
        elif not exchange.started and not exchange.disconnected:
            log.error("ASGI callable returned without starting response.")
            self._answer_500(exchange)
        elif not exchange.complete and not exchange.disconnected:
            log.error("ASGI callable returned without completing response.")
            self.transport.close()

    def _answer_500(self, exchange: _Exchange) -> None:
        if exchange.disconnected:
            return
        exchange.started = True
        self.transport.write(self.state.answer_500)
        exchange._finish(False)

    def _answer_overloaded(self, exchange: _Exchange) -> None:
        exchange.started = True
        self.transport.write(self.state.answer_overloaded)
        exchange._finish(False)

    def response_done(self, exchange: _Exchange) -> None:
        """The response of the current exchange is complete: the next pipelined request, or
        the keep-alive's idle time."""
        if exchange is not self.exchange or self.transport.is_closing():
            return
        self.resume_reading()
        if self.pipeline:  # the next pipelined request: its head is in, no deadline
            self.exchange, app = self.pipeline.popleft()
            self._serve(self.exchange, app)
            return
        self._idle_after_response()

    def _idle_after_response(self) -> None:
        """Idle from now: the keep-alive's time runs, and the next head is due within
        `head_timeout_s` of its first byte."""
        self._idle_since_s = now_s = self.loop.time()
        if self._keep_alive_timer is None:
            self._keep_alive_timer = self.loop.call_at(
                now_s + self.settings.keep_alive_s, self._keep_alive_check
            )
        self._start_head()

    # ---------------------------------------------------------------- deadlines

    def _start_head(self) -> None:
        """The next request's head is due within `head_timeout_s` from now."""
        self._in_head = True
        self._head_bytes = 0
        self._head_deadline_s = self.loop.time() + self.settings.head_timeout_s
        if self._head_timer is None:
            self._head_timer = self.loop.call_at(self._head_deadline_s, self._head_check)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_check(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return  # the head came: the response's end starts the next one's deadline
        if self.loop.time() < self._head_deadline_s:  # a later head's deadline
            self._head_timer = self.loop.call_at(self._head_deadline_s, self._head_check)
            return
        if self._head_bytes == 0 and self._idle_since_s is not None:
            return  # idle between requests: the keep-alive's timer closes it, quietly
        message = f"the request head did not arrive within {self.settings.head_timeout_s:g} s"
        answer = _error(408, "Request Timeout", message, "head_timeout")
        self.transport.write(self.state.with_headers(answer))
        self.transport.close()

    def _keep_alive_check(self) -> None:
        self._keep_alive_timer = None
        idle_since_s = self._idle_since_s
        if idle_since_s is None:
            return  # a request came: its response's end arms it again
        due_s = idle_since_s + self.settings.keep_alive_s
        if self.loop.time() < due_s:
            self._keep_alive_timer = self.loop.call_at(due_s, self._keep_alive_check)
            return
        self.transport.close()

    def _answer_400(self, reason: str) -> None:
        body = _error_body(f"not a valid HTTP request: {reason}", "invalid_http")
        self.transport.write(
            STATUS_LINE[400] + self.state.date.extra + b"content-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%b" % (len(body), body)
        )
        self.transport.close()

    def shutdown(self) -> None:
        """Graceful shutdown: an idle connection closes now, a busy one after its response."""
        exchange = self.exchange
        if exchange is None or exchange.complete:
            self.transport.close()
        else:
            exchange.keep_alive = False
            self.pipeline.clear()


def _address(address: Any) -> tuple[str, int] | None:
    if isinstance(address, tuple) and len(address) >= 2:
        return str(address[0]), int(address[1])
    return None


@dataclass(frozen=True, slots=True)
class PathListener:
    """A further listening socket (bound and listening) on which the server answers only the
    paths in `paths`: an entry ending in "/" takes every path under it, any other only
    itself. Any other path gets a 404 (OpenAI-shaped, code `not_on_this_port`)."""

    sock: socket.socket
    paths: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.paths or not all(p.startswith("/") for p in self.paths):
            raise ValueError(f"paths must be absolute paths, at least one: {self.paths!r}")


class _PathsOnly:
    """The application, for the paths of a `PathListener` only (no `hot_route`: the generation
    endpoints are not among them, and the main listener's hot path is not touched)."""

    __slots__ = ("_app", "_exact", "_prefixes")

    def __init__(self, app: App, paths: tuple[str, ...]) -> None:
        self._app = app
        self._exact = frozenset(p for p in paths if not p.endswith("/"))
        self._prefixes = tuple(p for p in paths if p.endswith("/"))

    async def __call__(
        self, scope: Scope, receive: Callable[[], Awaitable[Message]], send: Any
    ) -> None:
        path = scope["path"]
        if path in self._exact or path.startswith(self._prefixes):
            await self._app(scope, receive, send)
            return
        body = _error_body(
            f"{path[:200]} is not served on this port (the router's metrics and admin port:"
            " the client API is on router.port)",
            "not_on_this_port",
        )
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 404, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class Server:
    """The application served on a listening socket: `await start(sock)` (the lifespan's
    startup, then accepting), `await aclose()` (graceful shutdown, then the lifespan's).
    `headers`: name/value pairs written on every response of every listener (built once;
    ValueError for a name or value `send` would refuse)."""

    def __init__(
        self,
        app: App,
        settings: ServerSettings,
        *,
        shutdown_grace_s: float = 30.0,
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        self._app = app
        self._settings = settings
        self._header_lines = _header_lines(headers)
        self._state = _ServerState(app, settings, self._header_lines)
        self._states = [self._state]  # the main listener's, then each PathListener's
        self._grace_s = shutdown_grace_s
        self._listeners: list[asyncio.Server] = []
        self._lifespan: asyncio.Task[None] | None = None
        self._to_app: asyncio.Queue[Message] = asyncio.Queue()
        self._from_app: asyncio.Queue[Message] = asyncio.Queue()

    @property
    def connections(self) -> int:
        return sum(len(state.connections) for state in self._states)

    async def start(self, sock: socket.socket, *, also: Sequence[PathListener] = ()) -> None:
        """The lifespan's startup (raises `StartupFailed` with the application's reason),
        then accept on `sock` (bound and listening) and on each of `also`."""
        await self._startup()
        log.info("Application startup complete")
        loop = asyncio.get_running_loop()
        state = self._state
        self._listeners.append(
            await loop.create_server(lambda: _Connection(state, loop), sock=sock)
        )
        for listener in also:
            side = _ServerState(
                _PathsOnly(self._app, listener.paths),
                self._settings,
                self._header_lines,
                app_state=state.app_state,  # the one lifespan's
            )
            self._states.append(side)
            self._listeners.append(
                await loop.create_server(
                    functools.partial(_Connection, side, loop), sock=listener.sock
                )
            )

    def stop_accepting(self) -> None:
        for listener in self._listeners:
            listener.close()

    async def aclose(self) -> None:
        """Stop accepting, close idle connections, let requests in flight finish within the
        grace period (then cancel them), and run the lifespan's shutdown."""
        self.stop_accepting()
        for state in self._states:
            for conn in list(state.connections):
                conn.shutdown()
        # a busy connection closes after its response (no keep-alive, nothing pipelined
        # started): once the tasks are done, no request is left in flight
        tasks = {task for state in self._states for task in state.tasks}
        if tasks:
            await asyncio.wait(tasks, timeout=self._grace_s)
        tasks = {task for state in self._states for task in state.tasks}
        if tasks:
            log.error("cancelling %d request(s) after the shutdown grace", len(tasks))
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for state in self._states:
            for conn in list(state.connections):
                conn.transport.close()
        await self._shutdown()
        log.info("Application shutdown complete")

    # ---------------------------------------------------------------- lifespan

    async def _startup(self) -> None:
        scope = {"type": "lifespan", "asgi": _ASGI, "state": self._state.app_state}
        self._lifespan = asyncio.ensure_future(
            self._state.app(scope, self._to_app.get, self._from_app.put)
        )
        await self._to_app.put({"type": "lifespan.startup"})
        answer = await self._answer()
        if answer["type"] == "lifespan.startup.failed":
            raise StartupFailed(str(answer.get("message", "")))
        if answer["type"] != "lifespan.startup.complete":
            raise StartupFailed(f"unexpected lifespan message {answer['type']!r}")

    async def _answer(self) -> Message:
        """The application's next lifespan message; its failure as a failed startup."""
        assert self._lifespan is not None
        getting = asyncio.ensure_future(self._from_app.get())
        await asyncio.wait({getting, self._lifespan}, return_when=asyncio.FIRST_COMPLETED)
        if getting.done():
            return getting.result()
        getting.cancel()
        error = None if self._lifespan.cancelled() else self._lifespan.exception()
        return {"type": "lifespan.startup.failed", "message": str(error or "lifespan ended")}

    async def _shutdown(self) -> None:
        lifespan = self._lifespan
        if lifespan is None or lifespan.done():
            return
        await self._to_app.put({"type": "lifespan.shutdown"})
        answer = await self._answer()
        if answer["type"] == "lifespan.shutdown.failed":
            log.error("the application's shutdown failed: %s", answer.get("message", ""))
        if not lifespan.done():
            lifespan.cancel()
