"""`LoopBatchProcessor`: ended spans go into a bounded queue on the event loop; a task of the
processor's own sends them in batches, in a worker thread (`asyncio.to_thread`: the OTLP
exporter's HTTP client blocks), so a slow or absent collector never holds up a request.

- a batch leaves every `interval_s`, or as soon as `batch_size` spans wait;
- past `max_queued` waiting spans, new ones are dropped and counted (`dropped`, and
  `on_count`: the gateway's `gpupool_trace_spans_total{result}`): a collector that is down
  costs memory up to that bound, nothing more;
- an export that fails is logged (once per run of failures) and its spans are dropped; the
  exporter's own retries (OTLP's backoff, within its timeout) come first;
- `aclose` stops the loop after the batch in flight, sends what is left (at most `timeout_s`
  more) and shuts the exporter down.

The SDK's `BatchSpanProcessor` does the same from a daemon thread of its own; this one lives
on the router's loop with a `start`/`aclose` lifecycle like every other component.
`on_end` must be called on the loop's thread (the router ends every span there).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from pools.tasks import cancel_and_wait

__all__ = ["LoopBatchProcessor"]

log = logging.getLogger(__name__)


class LoopBatchProcessor(SpanProcessor):
    """Batches ended spans to `exporter` from a task on the running loop (see the module)."""

    def __init__(
        self,
        exporter: SpanExporter,
        *,
        interval_s: float,
        batch_size: int = 512,
        max_queued: int = 8192,
        timeout_s: float = 10.0,
        on_count: Callable[[str, int], None] | None = None,
    ) -> None:
        if batch_size < 1 or max_queued < batch_size:
            raise ValueError("need 1 <= batch_size <= max_queued")
        self.exporter = exporter
        self.interval_s = interval_s
        self.batch_size = batch_size
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self._queue: deque[ReadableSpan] = deque()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._failing = False
        self.exported = 0  # spans the collector accepted
        self.dropped = 0  # spans never sent: the queue was full, or their export failed
        self.failures = 0  # exports that failed
        # told each change of `exported`/`dropped`: ("exported" | "dropped", how many)
        self._on_count = on_count

    # ------------------------------------------------------------------ SpanProcessor

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        if len(self._queue) >= self.max_queued:
            self._count("dropped", 1)
            return
        self._queue.append(span)
        if len(self._queue) >= self.batch_size and self._wake is not None:
            self._wake.set()

    def shutdown(self) -> None:
        """The provider's shutdown: the exporter is shut down by `aclose` instead."""

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Not supported synchronously (the queue drains on the loop): False."""
        return False

    # ------------------------------------------------------------------ lifecycle

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def start(self) -> None:
        if self._task is not None:
            return
        self._stopping = False
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="trace-export")

    async def aclose(self) -> None:
        """Send what is queued (within `timeout_s`), then shut the exporter down."""
        task, self._task = self._task, None
        if task is not None:
            self._stopping = True
            assert self._wake is not None
            self._wake.set()
            try:
                await asyncio.wait_for(asyncio.shield(task), self.timeout_s + 1.0)
            except TimeoutError:
                log.warning("traces: %d span(s) not sent at shutdown", len(self._queue))
                await cancel_and_wait(task)
            self._count("dropped", len(self._queue))
            self._queue.clear()
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.exporter.shutdown)

    async def flush(self) -> None:
        """Send everything queued now (tests, and the final drain)."""
        while self._queue:
            n = min(self.batch_size, len(self._queue))
            batch = [self._queue.popleft() for _ in range(n)]
            try:
                result = await asyncio.to_thread(self.exporter.export, batch)
            except Exception as err:  # the exporter should not raise; count it if it does
                log.debug("trace export raised", exc_info=err)
                result = SpanExportResult.FAILURE
            if result is SpanExportResult.SUCCESS:
                self._count("exported", n)
                if self._failing:
                    log.info("traces: the collector accepts spans again")
                self._failing = False
            else:
                self.failures += 1
                self._count("dropped", n)
                if not self._failing:
                    log.warning(
                        "traces: export of %d span(s) failed; dropping them (the collector is"
                        " down or refused them; next failures are not logged until one succeeds)",
                        n,
                    )
                self._failing = True

    def _count(self, what: str, n: int) -> None:
        if what == "exported":
            self.exported += n
        else:
            self.dropped += n
        if self._on_count is not None and n:
            self._on_count(what, n)

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            self._wake.clear()
            await self.flush()
            if self._stopping:
                return
