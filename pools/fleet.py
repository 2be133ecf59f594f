"""The fleet: every instance the router knows, its latest telemetry, its health, and the
router-side count of sequences in flight on it.

Health is a small state machine: `unhealthy_after` consecutive failed scrapes (or one refused
connection from the proxy) mark an instance unhealthy; the next good scrape brings it back.
Telemetry older than `stale_after_s` is stale, and stale telemetry counts as full.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pools.launchers.base import InstanceSpec

if TYPE_CHECKING:
    from pools.telemetry import InstanceReading

__all__ = ["Fleet", "InstanceState"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class InstanceState:
    spec: InstanceSpec
    healthy: bool = False
    reading: InstanceReading | None = None
    failures: int = 0
    last_error: str | None = None
    inflight: int = 0  # sequences this router has dispatched and not yet finished


class Fleet:
    def __init__(
        self,
        specs: list[InstanceSpec],
        *,
        stale_after_s: float = 5.0,
        unhealthy_after: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._states = {s.instance_id: InstanceState(spec=s) for s in specs}
        self._stale_after_s = stale_after_s
        self._unhealthy_after = unhealthy_after
        self._clock = clock
        self._health_listeners: list[Callable[[str, bool], None]] = []

    def on_health_change(self, listener: Callable[[str, bool], None]) -> None:
        self._health_listeners.append(listener)

    def instance_ids(self) -> list[str]:
        return list(self._states)

    def get(self, instance_id: str) -> InstanceState | None:
        return self._states.get(instance_id)

    def __iter__(self) -> Iterator[InstanceState]:
        return iter(self._states.values())

    def capacity_gpus(self) -> dict[str, float]:
        return {i: float(s.spec.gpus) for i, s in self._states.items()}

    def _set_health(self, state: InstanceState, healthy: bool) -> None:
        if state.healthy == healthy:
            return
        state.healthy = healthy
        if healthy:
            log.info("%s is healthy", state.spec.instance_id)
        else:
            log.warning("%s is unhealthy: %s", state.spec.instance_id, state.last_error)
        for listener in self._health_listeners:
            listener(state.spec.instance_id, healthy)

    def record_reading(self, instance_id: str, reading: InstanceReading) -> None:
        state = self._states.get(instance_id)
        if state is None:
            return
        state.reading = reading
        state.failures = 0
        state.last_error = None
        self._set_health(state, True)

    def record_failure(self, instance_id: str, error: str, *, immediate: bool = False) -> None:
        """A failed scrape, or (immediate=True) a refused connection seen by the proxy."""
        state = self._states.get(instance_id)
        if state is None:
            return
        state.failures += 1
        state.last_error = error
        if immediate or state.failures >= self._unhealthy_after:
            self._set_health(state, False)

    def is_fresh(self, state: InstanceState) -> bool:
        return (
            state.reading is not None
            and self._clock() - state.reading.taken_at_s <= self._stale_after_s
        )

    def kv_usage_frac(self, state: InstanceState) -> float:
        """Measured KV use in [0, 1]; stale or missing telemetry counts as full (1.0)."""
        if state.reading is None or not self.is_fresh(state):
            return 1.0
        return state.reading.kv_usage_frac

    def age_s(self, state: InstanceState) -> float | None:
        if state.reading is None:
            return None
        return self._clock() - state.reading.taken_at_s
