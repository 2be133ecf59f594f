"""The proxy's HTTP/1.1 client to the engines: pooled keep-alive connections, one write per
request, responses parsed by httptools (C), bodies handed over as the bytes that arrived.

It replaces aiohttp on the request path only (the scraper, governance and the engine calls that
generate nothing keep aiohttp): per request aiohttp built a URL, a multidict of headers, a
payload object, a timer context and a response with its own stream reader, ~26 % of the
router's CPU at c=64 (benchmarks/results/router_overhead.md). What the proxy needs is smaller:

- `Upstream.post(url, path, body, headers, total_s=..., connect_s=...)` returns a `Response`
  once its status line and headers have arrived;
- a connection that cannot be made (refused, unreachable, over `connect_s`) raises
  `ConnectFailed`: nothing reached the engine; a connection that fails before the response
  head (often a pooled one the engine closed) raises `UpstreamClosed`; both are
  `ConnectionError`s, and `ConnectFailed` says the engine was never reached;
- `total_s` bounds the whole exchange, connect to last byte (TimeoutError), not rounded;
- `Response.read()` is the whole body (however large: it never pauses the socket);
  `async for data in response` yields what has arrived since the last step (chunked transfer
  already decoded), pausing the engine's socket while more than `_HIGH_WATER_BYTES` wait
  unread, so a slow client never makes the router buffer a whole stream;
- `Response.splice(sink)` hands what arrives next to `sink(data)` in the connection's own
  callback, with no task woken per chunk, for as long as the sink takes it (True); the first
  chunk it declines (False) and everything after go to the iterator as before;
- `release()` hands a fully read connection back to the pool, `close()` drops it (an
  unfinished request: the engine sees the connection close and aborts the sequence).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools
from mypy_extensions import mypyc_attr

__all__ = ["ConnectFailed", "Response", "Upstream", "UpstreamClosed"]

_HIGH_WATER_BYTES = 256 * 1024  # unread response bytes before the engine's socket pauses


@mypyc_attr(native_class=False)  # mypyc: no native subclass of ConnectionError
class UpstreamClosed(ConnectionError):
    """The connection failed or closed before the response was complete."""


@mypyc_attr(native_class=False)
class ConnectFailed(UpstreamClosed):
    """No connection: refused, unreachable or over the connect timeout. Nothing was sent."""


@dataclass(frozen=True)
class _Origin:
    host: str
    port: int
    ssl: ssl.SSLContext | None
    prefix: bytes  # the request line's start up to the path: b"POST /base"
    host_header: bytes


class Response:
    """One upstream response: `status`, `content_type`, then its body through `read()` or
    `async for`. Call exactly one of `release()` or `close()` when done."""

    __slots__ = (
        "_chunks",
        "_conn",
        "_done",
        "_exc",
        "_high_water",
        "_sink",
        "_size",
        "_waiter",
        "content_type",
        "status",
    )

    def __init__(self, conn: _Conn) -> None:
        self._conn = conn
        self.status = 0
        self.content_type: str | None = None
        self._chunks: list[bytes] = []
        self._size = 0
        self._high_water = float(_HIGH_WATER_BYTES)  # read() lifts it: a whole body is wanted
        self._done = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Callable[[bytes], bool] | None = None

    # -- fed by the connection

    def _feed(self, data: bytes) -> None:
        sink = self._sink
        if sink is not None:
            if not self._chunks and sink(data):
                return
            self._sink = None  # declined: this chunk and the rest go to the iterator
        self._chunks.append(data)
        self._size += len(data)
        if self._size > self._high_water:
            self._conn.pause()
        self._wake()

    def _finish(self, exc: BaseException | None = None) -> None:
        if self._done or self._exc is not None:
            return
        if exc is None:
            self._done = True
        else:
            self._exc = exc
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # -- read by the proxy

    async def _wait(self) -> None:
        waiter = self._waiter = self._conn.loop.create_future()
        await waiter

    def _take(self) -> bytes:
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._conn.resume()  # no-op unless paused
        self._size = 0
        return data

    async def read(self) -> bytes:
        """The whole body (raises what ended the exchange early)."""
        self._high_water = float("inf")
        self._conn.resume()
        while not self._done:
            if self._exc is not None:
                raise self._exc
            await self._wait()
        return self._take()

    def __aiter__(self) -> Response:
        return self

    async def __anext__(self) -> bytes:
        while not self._chunks:
            if self._done:
                raise StopAsyncIteration
            if self._exc is not None:
                raise self._exc
            await self._wait()
        return self._take()

    def splice(self, sink: Callable[[bytes], bool]) -> None:
        """Give the body's next chunks to `sink` as they arrive (in the connection's callback,
        where it must not raise) until it answers False for one: that chunk and every later one
        are then read through the iterator, which also sees the body's end or failure as
        always."""
        self._sink = sink

    def release(self) -> None:
        """Done with it: a complete response's connection goes back to the pool."""
        self._conn.finished(reuse=self._done)

    def close(self) -> None:
        """Drop the connection (an unfinished request is aborted upstream)."""
        self._conn.finished(reuse=False)


class _Conn(asyncio.Protocol):
    """One keep-alive connection to an engine and the response it is reading.

    The exchange's deadline (`total_s`) is checked by one timer per connection, not one per
    request: `start` moves `deadline_s`, and the timer, when it fires before the deadline it
    finds (the previous exchange's, on a reused connection), re-arms itself for it. A timer per
    request (a TimerHandle, libuv's timer start and stop) was among the request path's costs.
    """

    def __init__(self, pool: deque[_Conn], loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.head: asyncio.Future[None] | None = None
        self.keep_alive = True
        self.open = False
        self.idle_since_s = 0.0
        self._paused = False
        self._to_eof = False
        self.deadline_s = float("inf")  # the exchange's end (loop time)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self.transport = cast(asyncio.Transport, transport)
        self.open = True

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as err:
            self._fail(UpstreamClosed(f"invalid HTTP from the engine: {err}"))
            self.drop()

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        self._disarm()
        if self.response is None and self in self.pool:
            self.pool.remove(self)  # an idle one the engine closed: not kept until next use
        head = self.head
        if exc is None and self._to_eof and head is not None and head.done():
            # no content-length, not chunked: the body is what came before the close
            if self.response is not None:
                self.response._finish()
            return
        self._fail(UpstreamClosed(f"the engine closed the connection{f': {exc}' if exc else ''}"))

    # -- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-type" and self.response is not None:
            self.response.content_type = value.decode("latin-1")
        elif name in (b"content-length", b"transfer-encoding"):
            self._to_eof = False

    def on_headers_complete(self) -> None:
        response = self.response
        if response is None:
            return
        response.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        head = self.head
        if head is not None and not head.done():
            head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        if self.response is not None:
            self.response._finish()

    # -- the exchange

    def _fail(self, exc: BaseException) -> None:
        head = self.head
        if head is not None and not head.done():
            head.set_exception(exc)
        if self.response is not None:
            self.response._finish(exc)

    def start(self, request: bytes, response: Response, deadline_s: float) -> None:
        """Send `request`; `response` reads the answer, all of it by `deadline_s` (loop time)
        or it fails with TimeoutError and the connection is dropped."""
        assert self.transport is not None
        self.response = response
        self.head = self.loop.create_future()
        self._to_eof = True  # until a header gives the body's length or its chunking
        self.deadline_s = deadline_s
        if self._timer_at > deadline_s:  # none armed, or armed for later
            self._disarm()
            self._timer_at = deadline_s
            self._timer = self.loop.call_at(deadline_s, self._check_deadline)
        self.transport.write(request)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = float("inf")

    def _check_deadline(self) -> None:
        self._timer = None
        self._timer_at = float("inf")
        response = self.response
        if response is None or response._done or response._exc is not None:
            return  # no exchange, or it ended: the next `start` arms the timer again
        if self.loop.time() < self.deadline_s:  # a later exchange's deadline
            self._timer_at = self.deadline_s
            self._timer = self.loop.call_at(self.deadline_s, self._check_deadline)
            return
        # the exchange's total time is up: fail it and drop the connection
        self._fail(TimeoutError())
        self.drop()

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    def finished(self, *, reuse: bool) -> None:
        self.response = None
        self.head = None
        if reuse and self.keep_alive and self.open and not self._paused:
            self.idle_since_s = time.monotonic()
            self.pool.append(self)
        else:
            self.drop()

    def drop(self) -> None:
        self.open = False
        self._disarm()
        if self.transport is not None:
            self.transport.close()


# the tests subclass it (a recording client); calls from compiled code stay native
@mypyc_attr(allow_interpreted_subclasses=True)
class Upstream:
    """Pooled HTTP/1.1 connections to the engines, per origin; idle ones are closed after
    `keepalive_s`. `aclose()` closes them all."""

    def __init__(self, *, keepalive_s: float = 60.0) -> None:
        self.keepalive_s = keepalive_s
        self._origins: dict[str, _Origin] = {}
        self._idle: dict[_Origin, deque[_Conn]] = {}
        self._closed = False

    def _origin(self, url: str, path: str) -> _Origin:
        key = url + "\0" + path
        origin = self._origins.get(key)
        if origin is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConnectFailed(f"not an http(s) URL: {url!r}")
            tls = ssl.create_default_context() if parts.scheme == "https" else None
            port = parts.port or (443 if tls else 80)
            base = parts.path.rstrip("/")
            origin = _Origin(
                host=parts.hostname,
                port=port,
                ssl=tls,
                prefix=f"POST {base}{path} HTTP/1.1\r\nhost: {parts.netloc}\r\n".encode("latin-1"),
                host_header=parts.netloc.encode("latin-1"),
            )
            self._origins[key] = origin
        return origin

    def _pooled(self, origin: _Origin) -> _Conn | None:
        """An idle pooled connection to `origin` (the most recently used: the least likely to
        be stale), None when there is none; the stale ones met on the way are closed."""
        pool = self._idle.get(origin)
        if pool:
            now_s = time.monotonic()
            while pool:
                conn = pool.pop()
                if conn.open and now_s - conn.idle_since_s < self.keepalive_s:
                    return conn
                conn.drop()
        return None

    async def _connect(self, origin: _Origin, connect_s: float) -> _Conn:
        """A new connection to `origin`."""
        pool = self._idle.setdefault(origin, deque())
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_s):
                _, proto = await loop.create_connection(
                    lambda: _Conn(pool, loop),
                    origin.host,
                    origin.port,
                    ssl=origin.ssl,
                    server_hostname=origin.host if origin.ssl is not None else None,
                )
        except TimeoutError:
            raise ConnectFailed(
                f"connect to {origin.host}:{origin.port} took over {connect_s:g} s"
            ) from None
        except OSError as err:
            raise ConnectFailed(f"cannot connect to {origin.host}:{origin.port}: {err}") from None
        assert isinstance(proto, _Conn)
        return proto

    async def post(
        self,
        url: str,
        path: str,
        body: bytes,
        headers: Iterable[tuple[str, str]] | bytes,
        *,
        total_s: float,
        connect_s: float,
    ) -> Response:
        """POST `body` (JSON) to `url` + `path`; returns once the response head has arrived.
        `headers`: name-value pairs, or their lines already encoded (`name: value` and CRLF
        each, in latin-1: what the proxy builds once per request). `total_s` bounds everything
        from here to the body's last byte."""
        if self._closed:
            raise ConnectFailed("the upstream client is closed")
        origin = self._origin(url, path)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + total_s
        conn = self._pooled(origin)
        if conn is None:
            try:
                conn = await self._connect(origin, min(connect_s, total_s))
            except ConnectFailed:
                if loop.time() >= deadline:
                    raise TimeoutError from None
                raise
        if isinstance(headers, bytes):
            head = headers
        else:
            head = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers)
        request = b"%b%bcontent-length: %d\r\n\r\n%b" % (origin.prefix, head, len(body), body)
        response = Response(conn)
        conn.start(request, response, deadline)
        assert conn.head is not None
        try:
            await conn.head
        except BaseException:
            response.close()
            raise
        return response

    async def aclose(self) -> None:
        self._closed = True
        for pool in self._idle.values():
            while pool:
                pool.pop().drop()
        await asyncio.sleep(0)  # let the transports finish closing
