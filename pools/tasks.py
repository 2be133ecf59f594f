"""Stopping a component's background task: the one helper every start/aclose pair uses,
through `pools.periodic.Periodic` (the loops that run every N seconds) or directly (the
rebalancer's decision loop, the trace exporter)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

__all__ = ["cancel_and_wait"]

log = logging.getLogger(__name__)


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel the tasks and wait until each has ended. Unlike `suppress(CancelledError)`
    around `await task`, a cancellation of the caller itself still propagates; a task that had
    already failed is logged, not raised (a stopping component has nobody to raise it to)."""
    running = [t for t in tasks if t is not None]
    for task in running:
        task.cancel()
    if not running:
        return
    await asyncio.wait(running)
    for task in running:
        if not task.cancelled() and (err := task.exception()) is not None:
            log.error("background task %s had failed: %r", task.get_name(), err)
