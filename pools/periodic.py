"""`Periodic`: a component's background loop, run `tick` every `interval_s` until `aclose`.

The one loop skeleton for the router's and the pools' background work (history samples,
engine discovery, per-instance telemetry scrapes, the governance sweep, response placements
and the ledger's flush). What every one of them needs, written once:

- the first tick comes one interval after `start`, or `first_delay_s` after it when given
  (0: at once, without a sleep). History and discovery take their first tick in their own
  `start`, before the loop starts;
- without `clock`, the loop sleeps `interval_s` after each tick; with `clock`, ticks are
  `interval_s` apart start to start (the sleep is shortened by the tick's own time, never
  below 0);
- a tick that raises is logged and counted (`failures`) and the loop goes on;
- `active()`, when given, is asked before each tick; once false, the loop ends by itself;
- `aclose` ends the loop and returns once its task has ended. A tick in progress is cancelled
  with it, unless `interrupt_tick=False`: then the tick finishes (a flush that was writing
  writes its rows) and the loop ends after it.

Time is injected (`sleep`, `clock`), so a test steps the loop without waiting.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable

from pools.tasks import cancel_and_wait

__all__ = ["Periodic"]

log = logging.getLogger(__name__)


class Periodic:
    """Runs `tick` (sync, or returning an awaitable) every `interval_s` on one task named
    `name`. `ticks` counts the ticks run, `failures` those that raised."""

    def __init__(
        self,
        name: str,
        tick: Callable[[], object],
        interval_s: float,
        *,
        first_delay_s: float | None = None,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        active: Callable[[], bool] | None = None,
        interrupt_tick: bool = True,
    ) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self.name = name
        self.interval_s = interval_s
        self.first_delay_s = first_delay_s
        self._tick = tick
        self._clock = clock
        self._sleep = sleep
        self._active = active
        self._interrupt_tick = interrupt_tick
        self._task: asyncio.Task[None] | None = None
        self._ticking = False
        self._stopping = False
        self.ticks = 0
        self.failures = 0

    @property
    def running(self) -> bool:
        """True from `start` until the loop has ended (by `aclose`, or `active()` false)."""
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start the loop; no-op while it runs."""
        if self.running:
            return
        self._stopping = False
        self._task = asyncio.create_task(self._run(), name=self.name)

    async def aclose(self) -> None:
        """End the loop and wait for its task. Idempotent."""
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping = True
        if self._ticking and not self._interrupt_tick:
            await asyncio.wait([task])  # the loop ends after this tick
        await cancel_and_wait(task)  # a no-op for a task already ended

    async def _run(self) -> None:
        if self.first_delay_s is None:
            await self._sleep(self.interval_s)
        elif self.first_delay_s > 0:
            await self._sleep(self.first_delay_s)
        while self._active is None or self._active():
            started_s = self._clock() if self._clock is not None else 0.0
            await self._tick_once()
            if self._stopping:
                return
            delay_s = self.interval_s
            if self._clock is not None:
                delay_s = max(0.0, delay_s - (self._clock() - started_s))
            await self._sleep(delay_s)

    async def _tick_once(self) -> None:
        self._ticking = True
        self.ticks += 1
        try:
            result = self._tick()
            if inspect.isawaitable(result):
                await result
        except Exception:  # one bad tick must not end the loop
            self.failures += 1
            log.exception("%s: tick failed (again in %.3g s)", self.name, self.interval_s)
        finally:
            self._ticking = False
