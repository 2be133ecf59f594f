"""Serve an ASGI app over real HTTP on a free local port, inside the running event loop.

For tests and benchmarks that need a real socket (the router's upstream client speaks HTTP):
`async with serve_asgi(app) as url: ...`.

Idle keep-alive connections stay open `keep_alive_s` (default 75 s), longer than an aiohttp
client keeps them in its pool (15 s by default): the client then always closes an idle
connection first. With uvicorn's default of 5 s the server closed connections the client was
about to reuse, and a benchmark's request on one failed with `ServerDisconnectedError` or a
connection reset (1-3 of ~154 runs per mode in the run_las benchmark at 2x load).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import uvicorn

__all__ = ["serve_asgi"]


class _QuietServer(uvicorn.Server):
    """uvicorn without its signal handling: the test or benchmark owns the process."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def serve_asgi(
    app: Any, host: str = "127.0.0.1", keep_alive_s: int = 75
) -> AsyncIterator[str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(512)
    sock.setblocking(False)
    port = sock.getsockname()[1]
    server = _QuietServer(
        uvicorn.Config(
            app,
            log_level="error",
            access_log=False,
            lifespan="off",
            http="httptools",
            timeout_keep_alive=keep_alive_s,
        )
    )
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        server.force_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=5)
        sock.close()
