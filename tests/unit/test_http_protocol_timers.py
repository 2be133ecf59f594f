"""gpupool's server (router/gateway/server.py) keeps one head timer and one
keep-alive timer per connection, not one of each per request: a request moves the deadline,
and a timer that fires before the deadline it finds re-arms itself for it. Driven here on a
fake loop clock (no sockets, no sleeping): the 408 comes at the moved deadline and not before
(a new connection's from its opening, a kept-alive connection's from its next head's first
byte: an idle one gets none),
the keep-alive closes an idle connection at its moved deadline and never one in use. And
`ClientLink.respond`, which checks all header names and all values in one search each: it
refuses what uvicorn's `send` refuses and writes everything else in one write."""

from __future__ import annotations

import re
from collections.abc import Callable, Coroutine
from typing import Any

from router.gateway.server import ServerSettings, _Connection, _Exchange, _ServerState
from tests.unit.recording_transport import RecordingTransport


class _Timer:
    def __init__(self, loop: _Loop, when: float, callback: Callable[[], None]) -> None:
        self.loop, self.when, self.callback, self.cancelled = loop, when, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class _Task:
    def add_done_callback(self, callback: Callable[[_Task], None]) -> None:
        pass


class _Loop:
    """The loop's clock and timers only: what the protocol's deadlines use."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[_Timer] = []
        self.tasks: list[_Task] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], None]) -> _Timer:
        timer = _Timer(self, when, callback)
        self.timers.append(timer)
        return timer

    def call_later(self, delay: float, callback: Callable[[], None]) -> _Timer:
        return self.call_at(self.now + delay, callback)

    def advance(self, to_s: float) -> None:
        """Run the due timers in time order up to `to_s`."""
        while True:
            due = [t for t in self.timers if not t.cancelled and t.when <= to_s]
            if not due:
                break
            timer = min(due, key=lambda t: t.when)
            self.timers.remove(timer)
            self.now = max(self.now, timer.when)
            timer.callback()
        self.now = to_s

    def create_task(self, coro: Coroutine[Any, Any, None]) -> _Task:
        """A request's task, recorded and never run (its coroutine is closed)."""
        coro.close()
        task = _Task()
        self.tasks.append(task)
        return task

    def armed(self) -> int:
        return sum(1 for t in self.timers if not t.cancelled)


async def _app(scope: Any, receive: Any, send: Any) -> None:  # never run here
    raise AssertionError


def _connection(
    head_timeout_s: float, keep_alive_s: float
) -> tuple[Any, _Loop, RecordingTransport]:
    settings = ServerSettings(head_timeout_s=head_timeout_s, keep_alive_s=keep_alive_s)
    loop = _Loop()
    protocol = _Connection(_ServerState(_app, settings), loop)  # type: ignore[arg-type]
    transport = RecordingTransport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    return protocol, loop, transport


def _served(protocol: Any) -> None:
    """A request's head arrived and its response ended (what the parser and the exchange
    call)."""
    protocol._in_head = False  # on_headers_complete's part that concerns the deadline
    protocol._idle_since_s = None  # data_received's
    _response_ends(protocol)


def _response_ends(protocol: Any) -> None:
    """The current request's response ends (`_Exchange._finish`)."""
    protocol.exchange = exchange = _done(protocol)
    protocol.response_done(exchange)


def _done(protocol: Any) -> _Exchange:
    """An exchange whose response is complete."""
    exchange = _Exchange(protocol, {"method": "GET"}, keep_alive=True, expect_100=False)
    exchange.complete = True
    return exchange


def test_a_new_connection_that_sends_nothing_gets_a_408() -> None:
    _, loop, transport = _connection(head_timeout_s=10.0, keep_alive_s=1000.0)
    loop.advance(9.9)
    assert not transport.closed
    loop.advance(10.0)
    assert transport.closed
    assert transport.written.startswith(b"HTTP/1.1 408 ")


def test_the_head_deadline_moves_with_each_request_and_one_timer_serves_it() -> None:
    protocol, loop, transport = _connection(head_timeout_s=10.0, keep_alive_s=1000.0)
    loop.advance(4.0)
    _served(protocol)
    assert loop.armed() == 2  # the head's and the keep-alive's, no more after a request
    loop.advance(6.0)
    protocol.data_received(b"POST /v1/chat/completions HTTP/1.1\r\n")  # due at 16, not 10
    assert loop.armed() == 2
    loop.advance(15.9)  # the timer armed for 10 found a later deadline: re-armed, no answer
    assert not transport.closed and transport.written == b""
    loop.advance(16.0)
    assert transport.closed
    assert transport.written.startswith(b"HTTP/1.1 408 ")


def test_an_idle_kept_alive_connection_gets_no_408_and_a_later_head_its_full_time() -> None:
    """An agent's tool ran longer than head_timeout_s between two steps on one connection:
    no 408 is written to the idle connection (it could cross the next request on the wire
    and be read as its answer); the next head, begun at 25, has until 35."""
    protocol, loop, transport = _connection(head_timeout_s=10.0, keep_alive_s=75.0)
    loop.advance(1.0)
    _served(protocol)  # idle from 1
    loop.advance(25.0)
    assert not transport.closed and transport.written == b""
    protocol.data_received(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
    loop.advance(34.9)
    assert not transport.closed and transport.written == b""
    loop.advance(35.0)  # a head trickled for 10 s: the slowloris guard still answers
    assert transport.closed
    assert transport.written.startswith(b"HTTP/1.1 408 ")


def test_an_idle_kept_alive_connection_is_closed_quietly_by_the_keep_alive() -> None:
    protocol, loop, transport = _connection(head_timeout_s=10.0, keep_alive_s=75.0)
    _served(protocol)  # idle from 0
    loop.advance(74.9)
    assert not transport.closed
    loop.advance(75.0)
    assert transport.closed
    assert transport.written == b""


def test_many_requests_arm_no_more_timers() -> None:
    protocol, loop, transport = _connection(head_timeout_s=10.0, keep_alive_s=5.0)
    for i in range(100):
        loop.advance(i * 0.5)
        _served(protocol)
    assert loop.armed() == 2
    assert len(loop.timers) <= 4  # fired ones re-armed themselves, none piled up
    assert not transport.closed


def test_keep_alive_closes_an_idle_connection_at_its_moved_deadline() -> None:
    protocol, loop, transport = _connection(head_timeout_s=1000.0, keep_alive_s=5.0)
    _served(protocol)  # idle from 0: due at 5
    loop.advance(3.0)
    _served(protocol)  # idle from 3: due at 8
    loop.advance(7.9)
    assert not transport.closed
    loop.advance(8.0)
    assert transport.closed
    assert transport.written == b""  # closed quietly, as uvicorn's keep-alive does


def test_keep_alive_never_closes_a_connection_in_use() -> None:
    protocol, loop, transport = _connection(head_timeout_s=1000.0, keep_alive_s=5.0)
    _served(protocol)
    loop.advance(1.0)
    protocol._idle_since_s = None  # bytes of the next request came (data_received)
    loop.advance(60.0)  # served for a long time
    assert not transport.closed
    _response_ends(protocol)
    loop.advance(64.9)
    assert not transport.closed
    loop.advance(65.0)
    assert transport.closed


def test_a_lost_connection_cancels_both_timers() -> None:
    protocol, loop, _ = _connection(head_timeout_s=10.0, keep_alive_s=5.0)
    _served(protocol)
    protocol.connection_lost(None)
    assert loop.armed() == 0


_DATE = rb"date: [A-Z][a-z]{2}, \d{2} [A-Z][a-z]{2} \d{4} \d{2}:\d{2}:\d{2} GMT\r\n"


def _exchange(method: str = "POST") -> tuple[_Exchange, RecordingTransport, Callable[[], bool]]:
    """The current exchange of a connection that is serving it, and whether its response
    ended (the connection went idle: `response_done` ran). Observed, not replaced: the
    server's classes are compiled (router/_compiled.py), their methods cannot be swapped."""
    protocol, _, transport = _connection(head_timeout_s=10.0, keep_alive_s=75.0)
    exchange = _Exchange(protocol, {"method": method}, keep_alive=True, expect_100=False)
    protocol._in_head = False  # its head arrived (on_headers_complete)...
    protocol._idle_since_s = None  # ...the connection is busy (data_received)...
    protocol.exchange = exchange  # ...serving it
    return exchange, transport, lambda: protocol._idle_since_s is not None


def test_respond_refuses_what_uvicorn_refuses_and_writes_the_rest_at_once() -> None:
    for bad in ([(b"x-bad name", b"v")], [(b"x-ok", b"line\r\nbreak")], [(b"x:y", b"v")]):
        exchange, transport, _ = _exchange()
        assert not exchange.respond(200, [(b"x-fine", b"1"), *bad], b"{}")
        assert transport.written == b"" and not exchange.started
    exchange, transport, ended = _exchange()
    headers = [(b"content-type", b"application/json"), (b"x-tab", b"a\tb")]
    assert not ended()
    assert exchange.respond(200, headers, b"{}")
    assert re.fullmatch(
        b"HTTP/1\\.1 200 OK\r\n"
        + _DATE
        + re.escape(
            b"content-type: application/json\r\nx-tab: a\tb\r\ncontent-length: 2\r\n\r\n{}"
        ),
        transport.written,
    ), transport.written
    assert exchange.complete and ended()
    exchange, transport, _ = _exchange("HEAD")  # `send` answers HEAD (no body)
    assert not exchange.respond(200, headers, b"{}") and transport.written == b""


def test_a_pipelined_request_being_served_is_not_timed_out_as_a_head() -> None:
    """Request 2 arrived whole while request 1 was served: when 1's response ends, 2 is served
    from the pipeline, and however long that takes the connection gets no 408; the next head's
    deadline starts when 2's response ends."""
    protocol, loop, transport = _connection(head_timeout_s=10.0, keep_alive_s=1000.0)
    protocol._in_head = False  # request 1's head
    protocol._start_head()  # request 2's message began (on_message_begin, pipelined)...
    protocol._in_head = False  # ...and its head completed: it waits in the pipeline
    two = _Exchange(protocol, {"method": "GET"}, keep_alive=True, expect_100=False)
    protocol.pipeline.append((two, _app))
    protocol.exchange = one = _done(protocol)
    protocol.response_done(one)  # request 1's response ends; request 2's task starts
    assert protocol.exchange is two and not protocol.pipeline
    assert len(loop.tasks) == 1  # `_serve` started its task on the loop
    loop.advance(60.0)  # request 2 is served for a long time
    assert not transport.closed and transport.written == b""
    two.complete = True
    protocol.response_done(two)  # request 2's response ends: idle, no head due
    loop.advance(70.0)
    assert not transport.closed and transport.written == b""
    protocol.data_received(b"GET /health HTTP/1.1\r\n")  # the next head: due at 80
    loop.advance(79.9)
    assert not transport.closed
    loop.advance(80.0)
    assert transport.closed and transport.written.startswith(b"HTTP/1.1 408 ")
