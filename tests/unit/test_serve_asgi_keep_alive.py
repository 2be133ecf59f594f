"""`serve_asgi` keeps idle keep-alive connections open `keep_alive_s` seconds (default 75,
above an aiohttp client's 15 s pool timeout, so the client closes idle connections first)."""

from __future__ import annotations

import asyncio

from pools.testing.fake_engine import FakeEngineState, make_fake_engine
from pools.testing.serve import serve_asgi


async def _open_after_idle(url: str, idle_s: float) -> bool:
    """One keep-alive GET on a raw connection, `idle_s` of silence, then: is it still open?"""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
        assert head.startswith(b"HTTP/1.1 200")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
        await asyncio.sleep(idle_s)
        writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        await writer.drain()
        again = await asyncio.wait_for(reader.read(12), timeout=5)
        return again.startswith(b"HTTP/1.1")
    except (ConnectionError, asyncio.IncompleteReadError):
        return False
    finally:
        writer.close()


async def test_idle_connection_outlives_uvicorns_default_only_when_asked() -> None:
    app = make_fake_engine(FakeEngineState())
    async with serve_asgi(app, keep_alive_s=1) as url:
        assert not await _open_after_idle(url, 1.6)  # closed by the server after 1 s idle
    async with serve_asgi(app, keep_alive_s=3) as url:
        assert await _open_after_idle(url, 1.6)
