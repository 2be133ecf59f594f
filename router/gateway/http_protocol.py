"""uvicorn's httptools protocol with the two guards it lacks: a deadline for a request's head
and a cap on its size.

uvicorn has no timeout for receiving a request line and headers (its keep-alive timer stops at
the first byte; Kludex/uvicorn#157), and httptools no limit on their size. A client that
trickles its headers therefore holds a connection for as long as it likes, and
`router.max_connections` such clients lock everyone else out. Here:

- a new connection's first request head must arrive within `head_timeout_s` of the
  connection opening, and on a kept-alive connection a head must be complete within
  `head_timeout_s` of its first byte, else the connection gets a 408 and is closed. A
  kept-alive connection idle between requests is closed by the keep-alive timeout
  (`CLIENT_KEEP_ALIVE_S`, router/cli/stack.py) without an answer, as uvicorn does: a 408
  written to an idle connection can cross the client's next request on the wire, and the
  client then reads it as that request's answer (an agent whose tool ran ~10 s got one);
- a head over `max_head_bytes` gets a 431 and the connection is closed;
- uvicorn's own answers, a 400 for bytes that are not HTTP and the 503 beyond
  `limit_concurrency` (`router.max_connections`), are OpenAI-shaped JSON too instead of its
  plain text.

Every answer here is OpenAI-shaped JSON, like every other gpupool error. The body has its own
deadline on the request path (`router.body_read_timeout_s`, router/gateway/proxy.py).

Each request's scope also carries a `ClientLink` (`scope[CLIENT_LINK]`): the request path
registers its task there and is cancelled when the client's connection is lost before the
response is complete, and can ask whether the whole body has already arrived. That is what lets
it serve a request in the server's own task, with no disconnect-watching task beside it. A
stream's chunks may go through `ClientLink.write_more` (straight to the connection in uvicorn's
chunked framing) and a whole response through `ClientLink.respond` (status line, headers and
body in one write, where uvicorn's two sends make two) whenever uvicorn's `send` would write
them at once; when the client reads slowly (the transport paused writing) they answer False
and the caller `send`s, which waits.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import urllib.parse
from typing import Any, cast

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

__all__ = ["CLIENT_LINK", "ClientLink", "guarded_protocol"]

log = logging.getLogger(__name__)


def _error_body(message: str, code: str, kind: str = "invalid_request_error") -> bytes:
    return orjson.dumps({"error": {"message": message, "type": kind, "code": code, "param": None}})


_OVERLOADED = _error_body(
    "the router is at router.max_connections; retry shortly", "too_many_connections", "overloaded"
)


async def _overloaded(scope: Any, receive: Any, send: Any) -> None:
    """The ASGI answer past the connection cap (uvicorn's `service_unavailable`, as JSON)."""
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(_OVERLOADED)).encode("ascii")),
                (b"connection", b"close"),
                (b"retry-after", b"1"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": _OVERLOADED})


def _error(status: int, reason: str, message: str, code: str) -> bytes:
    body = _error_body(message, code)
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode("ascii") + body


_500 = (
    STATUS_LINE[500] + b"content-type: text/plain; charset=utf-8\r\ncontent-length: 21\r\n"
    b"connection: close\r\n\r\nInternal Server Error"
)


def _answer_500(cycle: RequestResponseCycle) -> None:
    """uvicorn's `send_500_response`, written at once: the connection then closes."""
    if cycle.disconnected:
        return
    head = b"".join(b"%b: %b\r\n" % pair for pair in cycle.default_headers)
    cycle.response_started = cycle.response_complete = True
    cycle.keep_alive = False
    cycle.transport.write(_500.replace(b"\r\n", b"\r\n" + head, 1) if head else _500)
    cycle.message_event.set()
    cycle.transport.close()
    cycle.on_response()


def _nothing() -> None:
    pass


CLIENT_LINK = "gpupool.client_link"  # the scope key of a request's ClientLink


class ClientLink:
    """One request's tie to its client connection. `task`, set by the request path while it
    serves, is cancelled when the connection is lost before the response is complete (then
    `lost` is True); `body_arrived` is True once the request's whole body has been received."""

    __slots__ = ("_cycle", "lost", "task")

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle
        self.lost = False
        self.task: asyncio.Task[Any] | None = None

    @property
    def body_arrived(self) -> bool:
        return not self._cycle.more_body

    def take_body(self) -> bytes | None:
        """The request's whole body once it has arrived, handed over as uvicorn's `receive`
        would (reading resumed, the cycle's buffer emptied) without its coroutine, event wait
        and message; None when it must be read through `receive` instead: more is to come,
        the client left, or it waits for a `100 Continue`."""
        cycle = self._cycle
        if (
            cycle.more_body
            or cycle.disconnected
            or cycle.response_complete
            or cycle.waiting_for_100_continue
        ):
            return None
        cycle.flow.resume_reading()
        body = bytes(cycle.body)
        cycle.body = bytearray()
        return body

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        """The whole response in one write, as uvicorn's `send` of a start message (`headers`,
        no content-length among them) and one body message would write it (its default
        headers, header checks, `connection: close` when the connection ends, the cycle then
        complete and the connection ready for the next request), with a content-length: True
        when written. False, having written nothing, when the caller must `send` instead: the
        response started already, the client left or reads slowly, or access logging is on."""
        cycle = self._cycle
        if (
            cycle.response_started
            or cycle.disconnected
            or cycle.flow.write_paused
            or cycle.access_log
            or cycle.scope["method"] == "HEAD"
        ):
            return False
        content = [STATUS_LINE[status]]
        for name, value in (*cycle.default_headers, *headers):
            content += (name, b": ", value, b"\r\n")
        # uvicorn's checks, on all names at once and all values at once (a character they
        # refuse is in the concatenation exactly when it is in one of them): two searches
        if HEADER_RE.search(b"".join(content[1::4])) or HEADER_VALUE_RE.search(
            b"".join(content[3::4])
        ):
            return False  # `send` raises for it, as for any response
        keep_alive = cycle.keep_alive
        if not keep_alive:
            content.append(b"connection: close\r\n")
        content += (b"content-length: %d\r\n\r\n" % len(body), body)
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        cycle.transport.write(b"".join(content))
        cycle.response_complete = True
        cycle.message_event.set()
        if not keep_alive:
            cycle.transport.close()
        cycle.on_response()
        return True

    def write_more(self, body: bytes) -> bool:
        """Write `body`, not the last, to this request's started streaming (chunked) response,
        as uvicorn's `send` of `{"type": "http.response.body", "body": body, "more_body": True}`
        would, without its per-message work (a coroutine, the message's keys, a list): True
        when written. False, having written nothing, when the caller must `send` it instead:
        the client's socket is full (`send` waits for it to drain: the slow-client bound), the
        client left, or the response is not a started chunked one."""
        cycle = self._cycle
        if (
            cycle.chunked_encoding is not True
            or cycle.flow.write_paused
            or cycle.disconnected
            or cycle.response_complete
            or not body
        ):
            return False
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True

    def _connection_lost(self) -> None:
        self.lost = True
        if self.task is not None:
            self.task.cancel()


class _GuardedHttpToolsProtocol(HttpToolsProtocol):
    head_timeout_s: float = 30.0
    max_head_bytes: int = 64 * 1024

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # the cap is checked here (on_headers_complete), so that the answer is ours, not
        # uvicorn's plain-text one: the same test as uvicorn's, on connections and tasks
        self._max_concurrency = self.limit_concurrency
        self.limit_concurrency = None
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._idle_since_s: float | None = None  # the keep-alive's start; None: a request came
        self._in_head = False
        self._start_head()

    # Both deadlines, the head's and uvicorn's keep-alive, are checked by timers that are not
    # re-armed per request: a request moves the deadline (a float), and a timer that fires
    # before it re-arms itself for it. uvicorn arms and cancels one of each per request
    # (a TimerHandle, libuv's timer start and stop, a heap entry), which is what is saved.

    def _start_head(self) -> None:
        """The next request's head is due within `head_timeout_s` from now."""
        self._in_head = True
        self._head_bytes = 0
        self._head_deadline_s = self.loop.time() + self.head_timeout_s
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
        message = f"the request head did not arrive within {self.head_timeout_s:g} s"
        self.transport.write(_error(408, "Request Timeout", message, "head_timeout"))
        self.transport.close()

    def _unset_keepalive_if_required(self) -> None:
        # uvicorn's: called on every read; the connection is no longer idle (no cancel here)
        self._idle_since_s = None

    def _keep_alive_check(self) -> None:
        self.timeout_keep_alive_task = None
        idle_since_s = self._idle_since_s
        if idle_since_s is None:
            return  # a request came: its response's end arms it again
        due_s = idle_since_s + self.timeout_keep_alive
        if self.loop.time() < due_s:
            self.timeout_keep_alive_task = self.loop.call_at(due_s, self._keep_alive_check)
            return
        self.timeout_keep_alive_handler()

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            if self._head_bytes == 0 and self._idle_since_s is not None:
                # a kept-alive connection's next request begins: its head is due from now
                self._head_deadline_s = self.loop.time() + self.head_timeout_s
                if self._head_timer is None:
                    self._head_timer = self.loop.call_at(self._head_deadline_s, self._head_check)
            room = self.max_head_bytes - self._head_bytes
            self._head_bytes += len(data)
            end = data.find(b"\r\n\r\n")
            if self._head_bytes > self.max_head_bytes and not 0 <= end <= room - 4:
                self._disarm_head_timer()
                message = f"request line and headers larger than {self.max_head_bytes} bytes"
                self.transport.write(
                    _error(431, "Request Header Fields Too Large", message, "headers_too_large")
                )
                self.transport.close()
                return
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_head:  # pipelined behind a request still being served
            self._start_head()

    def on_headers_complete(self) -> None:
        # uvicorn's, with the path read without `parse_url` when it is plain, the cap's answer
        # ours, and the request's `ClientLink` in its scope
        self._in_head = False
        self._head_bytes = 0
        parser = self.parser
        http_version = parser.get_http_version()
        scope = cast(dict[str, Any], self.scope)
        scope["method"] = parser.get_method().decode("ascii")
        if http_version != "1.1":
            scope["http_version"] = http_version
        if parser.should_upgrade() and self._should_upgrade():
            return
        url = self.url
        if url[:1] == b"/" and b"?" not in url and b"%" not in url and b"#" not in url:
            raw_path, query = url, b""  # what parse_url would find in it
            path = url.decode("ascii")
        else:
            parsed = httptools.parse_url(url)
            raw_path, query = parsed.path, parsed.query or b""
            path = raw_path.decode("ascii")
            if "%" in path:
                path = urllib.parse.unquote(path)
        root_path = self.root_path
        if root_path:
            path = root_path + path
            raw_path = root_path.encode("ascii") + raw_path
        scope["path"] = path
        scope["raw_path"] = raw_path
        scope["query_string"] = query
        cap = self._max_concurrency
        app: Any = self.app
        if cap is not None and (len(self.connections) >= cap or len(self.tasks) >= cap):
            log.warning("over router.max_connections (%d): 503", cap)
            app = _overloaded
        existing = self.cycle
        self.cycle = cycle = RequestResponseCycle(
            self.scope,
            self.transport,
            self.flow,
            self.logger,
            self.access_logger,
            self.access_log,
            self.server_state.default_headers,
            asyncio.Event(),
            self.expect_100_continue,
            http_version != "1.0" and parser.should_keep_alive(),
            self.on_response_complete,
        )
        if app is not _overloaded:
            scope[CLIENT_LINK] = ClientLink(cycle)
        if existing is None or existing.response_complete:
            self._start_asgi_task(cycle, app)
        else:  # pipelined behind a request still being served: it starts after
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, app))

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        """The request's task runs the application itself, not uvicorn's `run_asgi` wrapper
        around it, and for the gateway's generation endpoints its handler's coroutine
        (`hot_route`) instead of the application's dispatch: two coroutine frames fewer on
        every wake-up of the request. What `run_asgi` does after the application returns or
        raises is `_app_done`, the task's one done callback (which also takes it out of the
        server's tasks)."""
        coro = None
        hot_route = getattr(app, "hot_route", None)  # the gateway's (router/gateway/app.py)
        if hot_route is not None:
            coro = hot_route(cycle.scope, cycle.receive, cycle.send)
        if coro is None:
            coro = app(cycle.scope, cycle.receive, cycle.send)
        if self.config.reset_contextvars:
            task = self.loop.create_task(coro, context=contextvars.Context())
        else:
            task = self.loop.create_task(coro)
        task.add_done_callback(functools.partial(self._app_done, cycle))
        self.tasks.add(task)

    def _app_done(self, cycle: RequestResponseCycle, task: asyncio.Task[Any]) -> None:
        """uvicorn's `run_asgi` after the application: a 500 when it failed or returned before
        its response started, the connection closed when it failed or returned after that but
        before the response's end (the client cannot tell a cut response from a whole one)."""
        self.tasks.discard(task)
        error: BaseException | None
        error = asyncio.CancelledError() if task.cancelled() else task.exception()
        try:
            if error is not None:
                cycle.logger.error("Exception in ASGI application\n", exc_info=error)
                if not cycle.response_started:
                    _answer_500(cycle)
                else:
                    cycle.transport.close()
            elif task.result() is not None:
                cycle.logger.error(
                    "ASGI callable should return None, but returned '%s'.", task.result()
                )
                cycle.transport.close()
            elif not cycle.response_started and not cycle.disconnected:
                cycle.logger.error("ASGI callable returned without starting response.")
                _answer_500(cycle)
            elif not cycle.response_complete and not cycle.disconnected:
                cycle.logger.error("ASGI callable returned without completing response.")
                cycle.transport.close()
        finally:
            cycle.on_response = _nothing

    def send_400_response(self, msg: str) -> None:
        body = _error_body(f"not a valid HTTP request: {msg}", "invalid_http")
        self.transport.write(
            b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
            b"content-length: "
            + str(len(body)).encode("ascii")
            + b"\r\nconnection: close\r\n\r\n"
            + body
        )
        self.transport.close()

    def on_response_complete(self) -> None:
        # uvicorn's, with the keep-alive's deadline moved instead of a timer armed
        self.server_state.total_requests += 1
        if not self.transport.is_closing():
            self._idle_since_s = None
            self.flow.resume_reading()
            if self.pipeline:  # the next pipelined request: its head is in, no deadline
                cycle, app = self.pipeline.pop()
                self._start_asgi_task(cycle, app)
                return
            self._idle_since_s = now_s = self.loop.time()
            if self.timeout_keep_alive_task is None:
                self.timeout_keep_alive_task = self.loop.call_at(
                    now_s + self.timeout_keep_alive, self._keep_alive_check
                )
        # the next request's head on a kept-alive connection: due within head_timeout_s of
        # its first byte (data_received moves the deadline there)
        self._start_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None
        cycle = self.cycle
        super().connection_lost(exc)
        # as uvicorn marks only its current cycle disconnected (pipelined requests are rare)
        if cycle is not None and not cycle.response_complete:
            link = cast(dict[str, Any], cycle.scope).get(CLIENT_LINK)
            if isinstance(link, ClientLink):
                link._connection_lost()


def guarded_protocol(*, head_timeout_s: float, max_head_bytes: int) -> type[HttpToolsProtocol]:
    """A protocol class for `uvicorn.Config(http=...)` with these limits."""
    return type(
        "GuardedHttpToolsProtocol",
        (_GuardedHttpToolsProtocol,),
        {"head_timeout_s": head_timeout_s, "max_head_bytes": max_head_bytes},
    )
