"""One bounded admission queue per pool: priority bands, then weighted fair queuing across
tenants by estimated token cost, then FIFO.

Order (`order: wfq`, the default): a higher `priority` always goes first; within a band each
entry carries a virtual finish tag `F = max(V, F_tenant) + cost / weight` (start-time fair
queuing: `V` is the tag of the entry last taken out, `F_tenant` the tenant's last tag, `cost`
the estimated tokens, `weight` the tenant's), so tenants that all keep the queue busy are served
tokens in proportion to their weights; ties go by arrival. `order: fifo` drops the tags.

Bounds: at most `max_depth` entries. When full, an arriving entry evicts the queue's last entry
if that one has a negative (sheddable) priority lower than the newcomer's ("shed"), else it is
refused ("queue_full"). Entries leave by `pop` (dispatched), `remove` (timed out, disconnected).

The queue knows time only through `now_s` arguments, and measures its drain rate (entries
dispatched per second, smoothed) to say how long a newcomer will wait.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PoolQueue", "QueueEntry", "QueueFull"]

_RATE_WINDOW_S = 60.0


class QueueFull(Exception):
    """The queue is at `max_depth` and the newcomer may not evict anyone."""


@dataclass(eq=False, slots=True)
class QueueEntry:
    """One waiting request. `payload` is the shell's (the request and its waiter)."""

    tenant: str
    priority: int
    cost_tokens: float
    weight: float
    enqueued_at_s: float
    payload: Any = None
    seq: int = 0
    start_tag: float = 0.0
    finish_tag: float = 0.0
    removed: bool = False
    key: tuple[float, float, int] = field(default=(0.0, 0.0, 0))


class PoolQueue:
    def __init__(self, pool: str, *, max_depth: int, order: str = "wfq") -> None:
        if order not in ("wfq", "fifo"):
            raise ValueError(f"unknown queue order {order!r}")
        self.pool = pool
        self.max_depth = max_depth
        self.order = order
        self._heap: list[tuple[tuple[float, float, int], QueueEntry]] = []
        self._live = 0
        self._seq = itertools.count()
        self._virtual_time = 0.0
        self._tenant_finish: dict[str, float] = {}
        self._pops: deque[float] = deque(maxlen=4096)  # dispatch times, for the drain rate

    def __len__(self) -> int:
        return self._live

    @property
    def virtual_time(self) -> float:
        return self._virtual_time

    def push(self, entry: QueueEntry) -> QueueEntry | None:
        """Add `entry`. Returns an entry shed to make room (already removed), or None.
        Raises `QueueFull` when the queue is full and nothing may be shed."""
        shed: QueueEntry | None = None
        if self._live >= self.max_depth:
            last = self._last()
            if last is None or last.priority >= 0 or last.priority >= entry.priority:
                raise QueueFull(self.pool)
            self.remove(last)
            shed = last
        entry.seq = next(self._seq)
        if self.order == "wfq":
            start = max(self._virtual_time, self._tenant_finish.get(entry.tenant, 0.0))
            entry.start_tag = start
            entry.finish_tag = start + entry.cost_tokens / max(entry.weight, 1e-9)
            self._tenant_finish[entry.tenant] = entry.finish_tag
            if len(self._tenant_finish) > 4 * max(64, self.max_depth):
                self._forget_idle_tenants()
        entry.key = (-float(entry.priority), entry.finish_tag, entry.seq)
        heapq.heappush(self._heap, (entry.key, entry))
        self._live += 1
        return shed

    def peek(self) -> QueueEntry | None:
        while self._heap and self._heap[0][1].removed:
            heapq.heappop(self._heap)
        return self._heap[0][1] if self._heap else None

    def pop(self, entry: QueueEntry, now_s: float) -> None:
        """Take `entry` out because it is dispatched (advances virtual time, measures rate)."""
        self._take(entry)
        if self.order == "wfq":
            self._virtual_time = max(self._virtual_time, entry.start_tag)
        self._pops.append(now_s)

    def remove(self, entry: QueueEntry) -> None:
        """Take `entry` out without dispatching it (timeout, disconnect, shed)."""
        self._take(entry)

    def _take(self, entry: QueueEntry) -> None:
        if entry.removed:
            return
        entry.removed = True
        self._live -= 1
        self.peek()

    def _last(self) -> QueueEntry | None:
        live = [e for _, e in self._heap if not e.removed]
        return max(live, key=lambda e: e.key) if live else None

    def _forget_idle_tenants(self) -> None:
        waiting = {e.tenant for _, e in self._heap if not e.removed}
        self._tenant_finish = {
            t: f for t, f in self._tenant_finish.items() if t in waiting or f > self._virtual_time
        }

    def position(self, entry: QueueEntry) -> int:
        """Entries ahead of `entry` (O(n); for diagnostics and Retry-After)."""
        return sum(1 for _, e in self._heap if not e.removed and e.key < entry.key)

    def drain_rate_per_s(self, now_s: float) -> float:
        """Dispatches per second over the last `_RATE_WINDOW_S` (0: unknown)."""
        pops = self._pops
        while pops and pops[0] < now_s - _RATE_WINDOW_S:
            pops.popleft()
        if len(pops) < 2:
            return 0.0
        return len(pops) / max(now_s - pops[0], 1.0)

    def expected_wait_s(self, ahead: int, now_s: float, default_s: float) -> float:
        """Time for `ahead` entries to drain at the measured rate (`default_s` if unknown)."""
        rate = self.drain_rate_per_s(now_s)
        if rate <= 0:
            return default_s if ahead else 0.0
        return ahead / rate
