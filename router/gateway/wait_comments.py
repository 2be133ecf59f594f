"""SSE comment lines while a streaming request waits for its tenant's budget or an engine slot.

A client that asked for them (`x-gpupool-wait-comments: N`, seconds) and waits longer than N
gets its response started (200, `text/event-stream`, the headers known so far: request id, pool,
class; not `x-gpupool-instance`, which is chosen later) and then a comment line every second:

    : gpupool waiting: queue, 3.0 s

SSE clients skip lines that start with `:` (the official `openai` client does), so the stream
reads as any other once tokens arrive. Deferral becomes visible, and proxies with idle timeouts
see bytes. The cost: once the status line is out, a later refusal (a 429 from the queue, a
deadline) can only be an OpenAI-shaped `data: {"error": ...}` event followed by `data: [DONE]`,
not a status code with `Retry-After`; the event's body still carries `retry_after_seconds`.

One task per waiting request, stopped (never cancelled mid-send) before the relay writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from router.errors import BadRequest
from router.request import Send

__all__ = ["MAX_WAIT_COMMENTS_S", "WaitComments", "wait_comments_after_s"]

MAX_WAIT_COMMENTS_S = 3600.0
HEADER = "x-gpupool-wait-comments"


def wait_comments_after_s(raw: str | None) -> float | None:
    """The header's value in seconds, None when absent. Raises `BadRequest` when it is not a
    number from 0 to `MAX_WAIT_COMMENTS_S`."""
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value <= MAX_WAIT_COMMENTS_S:
        raise BadRequest(
            f"{HEADER} must be a number of seconds from 0 to {MAX_WAIT_COMMENTS_S:g}, "
            f"got {raw[:40]!r}",
            "invalid_header",
            param=HEADER,
        )
    return value


class WaitComments:
    """Starts the SSE response after `after_s` of waiting and writes a comment every
    `every_s` until `stop()`. `started` says whether the status line went out."""

    def __init__(
        self,
        send: Send,
        headers: list[tuple[bytes, bytes]],
        after_s: float,
        *,
        every_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._send = send
        self._headers = headers
        self._after_s = after_s
        self._every_s = every_s
        self._clock = clock
        self._since_s = clock()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.reason = "queue"  # what it waits for, in the comment: budget | queue
        self.started = False
        self.comments = 0

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Stop writing; returns once the task has finished its last write."""
        self._stop.set()
        if self._task is not None:
            await self._task

    def cancel(self) -> None:
        """The request is over (cancelled, or failed before `stop`): end the task."""
        self._stop.set()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def _stopped_within(self, seconds: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)
            return True
        return False

    async def _run(self) -> None:
        if await self._stopped_within(self._after_s):
            return
        self.started = True
        await self._send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream"),
                    (b"cache-control", b"no-cache"),
                    *self._headers,
                ],
            }
        )
        while True:
            waited_s = self._clock() - self._since_s
            line = f": gpupool waiting: {self.reason}, {waited_s:.1f} s\n\n".encode()
            await self._send({"type": "http.response.body", "body": line, "more_body": True})
            self.comments += 1
            if await self._stopped_within(self._every_s):
                return
