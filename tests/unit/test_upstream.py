"""The proxy's upstream client (router/gateway/upstream.py) against a fake engine over real
HTTP, on asyncio's loop and on uvloop's (the one `gpupool serve` runs): bodies, streams,
keep-alive reuse, refused connections, the total deadline, a connection dropped mid-stream and
closing a response before its end."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
import pytest
import uvloop

from pools.testing.fake_engine import FakeEngineState, make_fake_engine
from pools.testing.serve import serve_asgi
from router.gateway.upstream import ConnectFailed, Upstream, UpstreamClosed, _Conn, _Origin

_HEADERS = [("content-type", "application/json")]


def _body(stream: bool, max_tokens: int = 4) -> bytes:
    return orjson.dumps(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens,
            "stream": stream,
        }
    )


def _on_both_loops(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[str], None]:
    @pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
    def run(loop: str) -> None:
        if loop == "uvloop":
            uvloop.run(test())
        else:
            asyncio.run(test())

    run.__name__ = test.__name__
    run.__doc__ = test.__doc__
    return run


async def _whole_body_and_reuse() -> None:
    """A body read whole; the connection goes back to the pool and serves the next one."""
    state = FakeEngineState()
    async with serve_asgi(make_fake_engine(state)) as url:
        client = Upstream()
        conns = set()
        for _ in range(3):
            resp = await client.post(
                url, "/v1/chat/completions", _body(False), _HEADERS, total_s=10, connect_s=2
            )
            conns.add(id(resp._conn))
            assert resp.status == 200
            assert resp.content_type == "application/json"
            data = orjson.loads(await resp.read())
            assert data["usage"]["completion_tokens"] == 4
            resp.release()
        await client.aclose()
    assert len(conns) == 1  # one keep-alive connection for all three
    assert state.served == 3


test_a_whole_body_and_a_reused_connection = _on_both_loops(_whole_body_and_reuse)


async def _stream() -> None:
    """A chunked SSE stream arrives whole, event by event, ending with [DONE]."""
    state = FakeEngineState(itl_s=0.001)
    async with serve_asgi(make_fake_engine(state)) as url:
        client = Upstream()
        resp = await client.post(
            url, "/v1/chat/completions", _body(True, 8), _HEADERS, total_s=10, connect_s=2
        )
        assert resp.status == 200
        data = b""
        steps = 0
        async for chunk in resp:
            data += chunk
            steps += 1
        resp.release()
        await client.aclose()
    assert data.endswith(b"data: [DONE]\n\n")
    assert data.count(b"data: ") >= 9
    assert steps > 1  # handed over as it arrived, not at the end


test_a_stream_arrives_as_it_is_sent = _on_both_loops(_stream)


async def _splice() -> None:
    """A sink given the chunks in the connection's callback takes them until it declines one;
    that chunk and the rest come through the iterator, which sees the end; nothing is lost,
    doubled or reordered."""
    state = FakeEngineState(itl_s=0.001)
    async with serve_asgi(make_fake_engine(state)) as url:
        client = Upstream()
        resp = await client.post(
            url, "/v1/chat/completions", _body(True, 40), _HEADERS, total_s=10, connect_s=2
        )
        data = await resp.__anext__()
        taken: list[bytes] = []

        def sink(chunk: bytes) -> bool:
            if len(taken) == 5:
                return False
            taken.append(chunk)
            return True

        resp.splice(sink)
        rest = b"".join([chunk async for chunk in resp])
        resp.release()
        await client.aclose()
    assert len(taken) == 5  # each a chunk as it arrived, none through the iterator
    whole = data + b"".join(taken) + rest
    assert whole.endswith(b"data: [DONE]\n\n")
    assert whole.count(b"data: ") == 40 + 1  # 40 tokens (no usage asked for), [DONE]
    assert rest.startswith(b"data: ")  # the declined chunk came first, whole


test_a_splice_takes_chunks_until_it_declines_one = _on_both_loops(_splice)


async def _refused() -> None:
    """Nothing listening: ConnectFailed (the proxy retries elsewhere)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = Upstream()
    with pytest.raises(ConnectFailed):
        await client.post(
            f"http://127.0.0.1:{port}", "/v1/completions", b"{}", _HEADERS, total_s=5, connect_s=2
        )
    await client.aclose()


test_a_refused_connection_is_connect_failed = _on_both_loops(_refused)


async def _deadline() -> None:
    """An engine that never answers: TimeoutError at the total deadline, and the engine sees
    the connection close (it aborts the sequence)."""
    state = FakeEngineState(failure="hang", fail_next=-1)
    async with serve_asgi(make_fake_engine(state)) as url:
        client = Upstream()
        with pytest.raises(TimeoutError):
            await client.post(
                url, "/v1/chat/completions", _body(False), _HEADERS, total_s=0.3, connect_s=2
            )
        assert not any(c.open for pool in client._idle.values() for c in pool)
        await client.aclose()


test_the_total_deadline_raises_timeout = _on_both_loops(_deadline)


async def _dropped() -> None:
    """The engine drops the connection mid-stream: UpstreamClosed after what had arrived."""
    state = FakeEngineState(failure="drop_midstream", fail_next=1, itl_s=0.001)
    async with serve_asgi(make_fake_engine(state)) as url:
        client = Upstream()
        resp = await client.post(
            url, "/v1/chat/completions", _body(True, 8), _HEADERS, total_s=10, connect_s=2
        )
        got = b""
        with pytest.raises(UpstreamClosed):
            async for chunk in resp:
                got += chunk
        resp.close()
        assert got.startswith(b"data: ")
        # the next request gets a fresh connection and succeeds
        resp = await client.post(
            url, "/v1/chat/completions", _body(False), _HEADERS, total_s=10, connect_s=2
        )
        assert resp.status == 200 and b"usage" in await resp.read()
        resp.release()
        await client.aclose()


test_a_connection_dropped_mid_stream_is_upstream_closed = _on_both_loops(_dropped)


async def _close_early() -> None:
    """Closing a response before its end drops its connection: never reused, closed (a real
    engine aborts the sequence then: tests/integration/test_faults_real.py)."""
    state = FakeEngineState(itl_s=0.01)
    async with serve_asgi(make_fake_engine(state)) as url:
        client = Upstream()
        resp = await client.post(
            url, "/v1/chat/completions", _body(True, 200), _HEADERS, total_s=10, connect_s=2
        )
        first = await resp.__anext__()
        assert first.startswith(b"data: ")
        conn = resp._conn
        resp.close()
        assert not conn.open
        assert conn.transport is not None and conn.transport.is_closing()
        assert not any(client._idle.values())
        await client.aclose()


test_closing_a_response_early_aborts_it = _on_both_loops(_close_early)


def _big_app(size: int, step: int) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for start in range(0, size, step):
            body = b"x" * min(step, size - start)
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


async def _big_body() -> None:
    """A whole body far over the stream's high-water mark is read whole (never paused for
    good), and one read slowly as a stream arrives whole too (paused and resumed)."""
    size = 3 * 1024 * 1024
    async with serve_asgi(_big_app(size, 64 * 1024)) as url:
        client = Upstream()
        resp = await client.post(url, "/x", b"{}", _HEADERS, total_s=20, connect_s=2)
        assert len(await resp.read()) == size
        resp.release()
        resp = await client.post(url, "/x", b"{}", _HEADERS, total_s=20, connect_s=2)
        got = 0
        async for chunk in resp:
            got += len(chunk)
            await asyncio.sleep(0.01)  # a slow client: the engine's socket pauses meanwhile
        assert got == size
        resp.release()
        await client.aclose()


test_a_body_over_the_high_water_mark_arrives_whole = _on_both_loops(_big_body)


async def _to_eof() -> None:
    """An answer with neither content-length nor chunking (HTTP/1.0 style): its body is what
    came before the close, not a failure; a close inside a content-length body is one."""

    async def eof_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n" + b'{"a": 1}')
        await writer.drain()
        writer.close()

    async def short_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b'{"a": 1}')
        await writer.drain()
        writer.close()

    client = Upstream()
    for handler, whole in ((eof_server, True), (short_server, False)):
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        resp = await client.post(url, "/x", b"{}", _HEADERS, total_s=10, connect_s=2)
        assert resp.status == 200
        if whole:
            assert await resp.read() == b'{"a": 1}'
            resp.release()
        else:
            with pytest.raises(UpstreamClosed):
                await resp.read()
            resp.close()
        server.close()
        await server.wait_closed()
    await client.aclose()


test_a_body_to_the_close_is_whole_and_a_short_one_fails = _on_both_loops(_to_eof)


async def _idle_closed() -> None:
    """An idle pooled connection the engine closes leaves the pool at once (an engine that
    is gone for good leaves nothing behind)."""
    state = FakeEngineState()
    async with serve_asgi(make_fake_engine(state), keep_alive_s=1) as url:
        client = Upstream()
        resp = await client.post(
            url, "/v1/chat/completions", _body(False), _HEADERS, total_s=10, connect_s=2
        )
        await resp.read()
        resp.release()
        (pool,) = client._idle.values()
        assert len(pool) == 1
        for _ in range(300):  # the engine closes it after its 1 s keep-alive
            if not pool:
                break
            await asyncio.sleep(0.02)
        assert not pool
        await client.aclose()


test_an_idle_connection_the_engine_closes_leaves_the_pool = _on_both_loops(_idle_closed)


async def _shorter_deadline_on_a_reused_connection() -> None:
    """A reused connection's timer, armed for the previous exchange's later deadline, is moved
    up for a request with a shorter one: TimeoutError at 0.3 s, not at 20."""
    state = FakeEngineState()
    async with serve_asgi(make_fake_engine(state)) as url:
        client = Upstream()
        resp = await client.post(
            url, "/v1/chat/completions", _body(False), _HEADERS, total_s=20, connect_s=2
        )
        await resp.read()
        resp.release()
        state.failure, state.fail_next = "hang", -1
        started = asyncio.get_running_loop().time()
        with pytest.raises(TimeoutError):
            await client.post(
                url, "/v1/chat/completions", _body(False), _HEADERS, total_s=0.3, connect_s=2
            )
        assert asyncio.get_running_loop().time() - started < 10
        await client.aclose()


test_a_shorter_deadline_on_a_reused_connection = _on_both_loops(
    _shorter_deadline_on_a_reused_connection
)


class _Recording(Upstream):
    """An upstream client that keeps the connections it makes (a subclass: no patching)."""

    def __init__(self) -> None:
        super().__init__()
        self.conns: list[_Conn] = []
        self.connected = asyncio.Event()

    async def _connect(self, origin: _Origin, connect_s: float) -> _Conn:
        self.conns.append(await super()._connect(origin, connect_s))
        self.connected.set()
        return self.conns[-1]


async def _timer_before_a_later_deadline() -> None:
    """The connection's timer, firing before the deadline of the exchange it finds (a later
    one than it was armed for), re-arms for it and fails nothing; at the deadline it fails
    the exchange with TimeoutError and drops the connection."""
    state = FakeEngineState(failure="hang", fail_next=-1)
    async with serve_asgi(make_fake_engine(state)) as url:
        client = _Recording()
        conns, connected = client.conns, client.connected
        loop = asyncio.get_running_loop()
        post = asyncio.ensure_future(
            client.post(
                url, "/v1/chat/completions", _body(False), _HEADERS, total_s=1e3, connect_s=2
            )
        )
        await connected.wait()
        await asyncio.sleep(0)  # `post` sends the request
        (conn,) = conns
        conn._check_deadline()  # early: re-armed for the deadline, nothing failed
        assert conn._timer is not None and conn._timer_at == conn.deadline_s
        await asyncio.sleep(0.05)
        assert not post.done()
        conn.deadline_s = loop.time() - 1.0
        conn._check_deadline()  # due
        with pytest.raises(TimeoutError):
            await post
        assert not conn.open
        await client.aclose()


test_the_timer_re_arms_for_a_later_deadline = _on_both_loops(_timer_before_a_later_deadline)
