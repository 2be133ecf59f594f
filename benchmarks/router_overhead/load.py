"""The load generator: closed-loop aiohttp clients against one target, the same code for every
target. Non-streaming requests are timed from send to the last body byte; streaming requests
count SSE events (`\\n\\n`-separated) as they arrive, up to a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import orjson

__all__ = ["ClosedLoopResult", "LoadClient", "StreamResult", "chat_body"]

_SEP = b"\n\n"


def chat_body(max_tokens: int, *, stream: bool) -> bytes:
    """A short chat request; every target gets the same bytes."""
    return orjson.dumps(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Say hello to the benchmark in a few words."}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": stream,
        }
    )


@dataclass
class ClosedLoopResult:
    """Latencies (s) of requests that completed; `in_window` of them ended before the deadline."""

    latencies_s: list[float] = field(default_factory=list)
    in_window: int = 0
    errors: int = 0
    first_error: str = ""
    window_s: float = 0.0


@dataclass
class StreamResult:
    """SSE events received before the deadline, and streams that ran to `[DONE]`."""

    events: int = 0
    completed: int = 0
    errors: int = 0
    first_error: str = ""
    window_s: float = 0.0


class LoadClient:
    """One keep-alive connection pool per target; `aclose()` when done."""

    def __init__(
        self, base_url: str, *, timeout_s: float = 120.0, path: str = "/v1/chat/completions"
    ) -> None:
        self.url = base_url.rstrip("/") + path
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=120)
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            auto_decompress=False,
        )
        self._headers = {"content-type": "application/json", "authorization": "Bearer bench"}

    async def aclose(self) -> None:
        await self.session.close()

    async def one(self, body: bytes) -> float:
        """Send one non-streaming request; returns its latency in seconds, raises on non-200."""
        t0 = time.perf_counter()
        async with self.session.post(self.url, data=body, headers=self._headers) as resp:
            raw = await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {raw[:200]!r}")
        return time.perf_counter() - t0

    async def sequential(self, body: bytes, n: int) -> ClosedLoopResult:
        """`n` requests one after another (concurrency 1)."""
        res = ClosedLoopResult()
        t0 = time.perf_counter()
        for _ in range(n):
            try:
                res.latencies_s.append(await self.one(body))
            except (aiohttp.ClientError, OSError, RuntimeError, TimeoutError) as err:
                res.errors += 1
                res.first_error = res.first_error or repr(err)[:300]
        res.window_s = time.perf_counter() - t0
        res.in_window = len(res.latencies_s)
        return res

    async def closed_loop(
        self,
        body: bytes,
        concurrency: int,
        duration_s: float,
        *,
        drain_s: float = 30.0,
        on_deadline: Callable[[], None] | None = None,
    ) -> ClosedLoopResult:
        """`concurrency` workers, each sending its next request when the last one ended, until
        `duration_s` passes; requests in flight then finish (up to `drain_s`) and count for
        latency, but only those ended in the window count for throughput."""
        res = ClosedLoopResult()
        t0 = time.perf_counter()
        deadline = t0 + duration_s

        async def worker() -> None:
            while time.perf_counter() < deadline:
                try:
                    lat = await self.one(body)
                except (aiohttp.ClientError, OSError, RuntimeError, TimeoutError) as err:
                    res.errors += 1
                    res.first_error = res.first_error or repr(err)[:300]
                    await asyncio.sleep(0.01)
                    continue
                res.latencies_s.append(lat)
                if time.perf_counter() <= deadline:
                    res.in_window += 1

        tasks = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
        await asyncio.sleep(duration_s)
        res.window_s = time.perf_counter() - t0
        if on_deadline is not None:
            on_deadline()
        _, pending = await asyncio.wait(tasks, timeout=drain_s)
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return res

    async def stream_window(
        self,
        body: bytes,
        concurrency: int,
        duration_s: float,
        *,
        on_deadline: Callable[[], None] | None = None,
    ) -> StreamResult:
        """`concurrency` workers streaming back to back; counts events that arrive before the
        deadline, then cancels the streams still open (closing their connections)."""
        res = StreamResult()
        t0 = time.perf_counter()

        async def one_stream() -> None:
            async with self.session.post(self.url, data=body, headers=self._headers) as resp:
                if resp.status != 200:
                    raw = await resp.read()
                    raise RuntimeError(f"HTTP {resp.status}: {raw[:200]!r}")
                tail = b""
                async for chunk in resp.content.iter_any():
                    data = tail + chunk
                    res.events += data.count(_SEP)
                    tail = data[-1:]
                    if tail == b"\n" and data.endswith(_SEP):
                        tail = b""
                res.completed += 1

        async def worker() -> None:
            while True:
                try:
                    await one_stream()
                except (aiohttp.ClientError, OSError, RuntimeError, TimeoutError) as err:
                    res.errors += 1
                    res.first_error = res.first_error or repr(err)[:300]
                    await asyncio.sleep(0.01)

        tasks = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
        await asyncio.sleep(duration_s)
        counted = res.events
        res.window_s = time.perf_counter() - t0
        if on_deadline is not None:
            on_deadline()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        res.events = counted
        return res
