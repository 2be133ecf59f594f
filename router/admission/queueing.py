"""One bounded admission queue per pool: priority bands, then weighted fair queuing across
tenants by estimated token cost, then FIFO (or, with `order: run_las`, least attained service
per run).

Order (`order: wfq`, the default): a higher `priority` always goes first; within a band each
entry carries a virtual finish tag `F = max(V, F_tenant) + cost / weight` (start-time fair
queuing: `V` is the tag of the entry last taken out, `F_tenant` the tenant's last tag, `cost`
the estimated tokens, `weight` the tenant's), so tenants that all keep the queue busy are served
tokens in proportion to their weights; ties go by arrival. `order: fifo` drops the tags.

`order: run_las` (least attained service per run, after Autellix's PLAS): bands first and the
same tenant tags, but the tags are the tenant's turns, not its entries': when a tenant's turn
comes, the tenant's entry whose run has received the fewest GPU-seconds so far goes
(`QueueEntry.attained_gpu_s`, read when it queued; ties by arrival), unless one of the tenant's
entries has waited `aging_s` or longer: those go first, oldest first, so a long run is never
starved. Service counts up to `max_attained_gpu_s`: runs past it are "long" and keep their
arrival order among themselves (as in Autellix's lowest queue), so a new long run's first steps
overtake an old one's only until it, too, has had that much. `AttainedService` turns the
accountant's per-run counters into those numbers and forgets service a run received before
it went idle for long (halving per `idle_decay_s`).

The bound relative to FIFO (`max_slowdown`, run_las): a newcomer with `n` entries of its band
or higher ahead of it would be the (n + 1)-th dispatch under FIFO. It becomes due once
`max_slowdown x (n + 1) - 1` others have been dispatched since it queued, plus its run's
credit: what the run's earlier steps had left of their own bound when they went (negative
when they went late). Due entries go first on their tenant's turn, earliest due first, so a
run's queue position summed over its steps stays within `max_slowdown` x what FIFO would have
given it in the same queue, while short runs still overtake everything not yet due.
Counted in dispatches, not seconds, so the bound needs no rate estimate and holds at any load.
Credit lives in the run's record of the router's `RunTable` (router.runtable), per pool.

Any order: `peek(skip=...)` passes over entries that cannot go now for a reason of their own
(the shell's: a step waiting for its run's home instance), so they do not block the entries
behind them; they keep their place.

Bounds: at most `max_depth` entries. When full, an arriving entry evicts the queue's last entry
if that one has a negative (sheddable) priority lower than the newcomer's ("shed"), else it is
refused ("queue_full"). Entries leave by `pop` (dispatched), `remove` (timed out, disconnected).

The queue knows time only through `now_s` arguments, and measures its drain rate (entries
dispatched per second, smoothed) to say how long a newcomer will wait.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Collection, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

from router.runtable import RunTable

__all__ = ["ORDERS", "AttainedService", "PoolQueue", "QueueEntry", "QueueFull", "RunUsage"]

_RATE_WINDOW_S = 60.0
ORDERS = ("fifo", "wfq", "run_las")


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
    attained_gpu_s: float = 0.0  # run_las: GPU-seconds the entry's run had received when queued
    due_dispatches: float = math.inf  # run_las: the queue's dispatch count at which it is due
    run_key: Hashable | None = None  # run_las: the entry's run (None: a run of its own)


class PoolQueue:
    def __init__(
        self,
        pool: str,
        *,
        max_depth: int,
        order: str = "wfq",
        aging_s: float = math.inf,
        max_attained_gpu_s: float = math.inf,
        max_slowdown: float = math.inf,
        runs: RunTable | None = None,
    ) -> None:
        """`runs`: where each run's credit is kept (the router's one table; without one the
        queue keeps its own)."""
        if order not in ORDERS:
            raise ValueError(f"unknown queue order {order!r}")
        if not aging_s > 0:
            raise ValueError(f"aging_s must be > 0, got {aging_s}")
        if not max_attained_gpu_s > 0:
            raise ValueError(f"max_attained_gpu_s must be > 0, got {max_attained_gpu_s}")
        if not max_slowdown >= 1:
            raise ValueError(f"max_slowdown must be >= 1, got {max_slowdown}")
        self.max_slowdown = max_slowdown  # run_las: a step's wait against its FIFO wait
        self.max_attained_gpu_s = max_attained_gpu_s
        self.pool = pool
        self.max_depth = max_depth
        self.order = order
        self.aging_s = aging_s  # run_las: a step waiting this long goes ahead of its tenant's
        self._lanes: _RunLasLanes | None = _RunLasLanes() if order == "run_las" else None
        self._heap: list[tuple[tuple[float, float, int], QueueEntry]] = []
        self._live = 0
        self._seq = itertools.count()
        self._virtual_time = 0.0
        self._tenant_finish: dict[str, float] = {}
        self._pops: deque[float] = deque(maxlen=4096)  # dispatch times, for the drain rate
        self._dispatched = 0  # entries dispatched so far (run_las's relative aging counts them)
        self._band_live: dict[int, int] = {}  # live entries per priority band
        self._runs = runs if runs is not None else RunTable()

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
        if self.order != "fifo":
            start = max(self._virtual_time, self._tenant_finish.get(entry.tenant, 0.0))
            entry.start_tag = start
            entry.finish_tag = start + entry.cost_tokens / max(entry.weight, 1e-9)
            self._tenant_finish[entry.tenant] = entry.finish_tag
            if len(self._tenant_finish) > 4 * max(64, self.max_depth):
                self._forget_idle_tenants()
        if self._lanes is not None:  # run_las: order by (band, tenant turn, attained, arrival)
            entry.due_dispatches = self._due_dispatches(entry)
            served = min(entry.attained_gpu_s, self.max_attained_gpu_s)
            entry.key = (-float(entry.priority), served, entry.seq)
            self._lanes.push(entry, served)
        else:
            entry.key = (-float(entry.priority), entry.finish_tag, entry.seq)
        heapq.heappush(self._heap, (entry.key, entry))
        self._live += 1
        self._band_live[entry.priority] = self._band_live.get(entry.priority, 0) + 1
        return shed

    def _due_dispatches(self, entry: QueueEntry) -> float:
        """run_las's bound relative to FIFO: the dispatch count at which `entry` is due.

        Under FIFO a newcomer with `ahead` entries of its band or higher before it is the
        (ahead + 1)-th dispatch from now. It may be dispatched as late as the
        `max_slowdown` x (ahead + 1)-th, plus whatever its run has banked: the run's earlier
        steps that went sooner than their own bound leave the difference as credit (and
        those that went later, a debt), so the bound holds over the run's steps together.
        """
        if self.max_slowdown == math.inf:
            return math.inf
        ahead = sum(n for band, n in self._band_live.items() if band >= entry.priority)
        record = self._runs.get(entry.run_key) if entry.run_key is not None else None
        credit = record.credit.get(self.pool, 0.0) if record is not None and record.credit else 0.0
        return self._dispatched + self.max_slowdown * (ahead + 1) - 1 + credit

    def peek(
        self, now_s: float | None = None, skip: Collection[QueueEntry] = ()
    ) -> QueueEntry | None:
        """The entry to dispatch next, passing over those in `skip` (entries that cannot go
        now for a reason of their own, e.g. waiting for their run's home instance: the next
        one in the order goes instead, and they keep their place). `now_s` (run_las) lets
        entries waiting `aging_s` or longer go ahead; without it nothing counts as aged."""
        while self._heap and self._heap[0][1].removed:
            heapq.heappop(self._heap)
        if self._lanes is not None:
            aged_before_s = -math.inf if now_s is None else now_s - self.aging_s
            return self._lanes.peek(aged_before_s, self._dispatched, skip)
        return next((e for _, e in _in_order(self._heap) if not e.removed and e not in skip), None)

    def pop(self, entry: QueueEntry, now_s: float) -> None:
        """Take `entry` out because it is dispatched (advances virtual time, measures rate)."""
        turn_start = self._lanes.dispatched(entry) if self._lanes is not None else None
        self._take(entry)
        if self.order == "wfq":
            self._virtual_time = max(self._virtual_time, entry.start_tag)
        elif turn_start is not None:
            self._virtual_time = max(self._virtual_time, turn_start)
        self._pops.append(now_s)
        if entry.run_key is not None and entry.due_dispatches < math.inf:
            record = self._runs.touch(entry.run_key)
            if record.credit is None:
                record.credit = {}
            record.credit[self.pool] = entry.due_dispatches - self._dispatched
        self._dispatched += 1

    def remove(self, entry: QueueEntry) -> None:
        """Take `entry` out without dispatching it (timeout, disconnect, shed)."""
        if self._lanes is not None and not entry.removed:
            self._lanes.removed(entry)
        self._take(entry)

    def _take(self, entry: QueueEntry) -> None:
        if entry.removed:
            return
        entry.removed = True
        self._live -= 1
        left = self._band_live[entry.priority] - 1
        if left:
            self._band_live[entry.priority] = left
        else:
            del self._band_live[entry.priority]
        while self._heap and self._heap[0][1].removed:
            heapq.heappop(self._heap)

    def _last(self) -> QueueEntry | None:
        live = [e for _, e in self._heap if not e.removed]
        return max(live, key=lambda e: e.key) if live else None

    def _forget_idle_tenants(self) -> None:
        waiting = {e.tenant for _, e in self._heap if not e.removed}
        self._tenant_finish = {
            t: f for t, f in self._tenant_finish.items() if t in waiting or f > self._virtual_time
        }

    def position(self, entry: QueueEntry) -> int:
        """Entries ahead of `entry` (O(n); for diagnostics and Retry-After). Under run_las this
        ignores tenant turns, aging and the bound relative to FIFO: entries of higher bands,
        then of less attained service."""
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


@dataclass(eq=False, slots=True)
class _Lane:
    """One tenant's entries in one band (run_las): its turns, least attained first, arrivals."""

    turns: deque[tuple[float, float, int]] = field(default_factory=deque)  # (finish, start, seq)
    by_service: list[tuple[float, int, QueueEntry]] = field(default_factory=list)  # a heap
    by_due: list[tuple[float, int, QueueEntry]] = field(default_factory=list)  # a heap
    arrivals: deque[QueueEntry] = field(default_factory=deque)
    live: int = 0

    def choose(
        self, aged_before_s: float, dispatched: int, skip: Collection[QueueEntry]
    ) -> QueueEntry | None:
        """The lane's entry to go on its turn (None: all its entries are in `skip`): the
        earliest due by the bound relative to FIFO, else the oldest if it has aged, else the
        least served."""
        due = _first(self.by_due, skip)
        if due is not None and due.due_dispatches <= dispatched:
            return due
        while self.arrivals and self.arrivals[0].removed:
            self.arrivals.popleft()
        oldest = next((e for e in self.arrivals if not e.removed and e not in skip), None)
        if oldest is not None and oldest.enqueued_at_s <= aged_before_s:
            return oldest
        return _first(self.by_service, skip)


def _in_order(heap: list[tuple[Any, ...]]) -> Iterator[tuple[Any, ...]]:
    """A binary heap's items smallest first, without changing it (O(k log k) for k items)."""
    if not heap:
        return
    frontier = [(heap[0], 0)]
    while frontier:
        item, i = heapq.heappop(frontier)
        yield item
        for child in (2 * i + 1, 2 * i + 2):
            if child < len(heap):
                heapq.heappush(frontier, (heap[child], child))


def _first(
    heap: list[tuple[float, int, QueueEntry]], skip: Collection[QueueEntry]
) -> QueueEntry | None:
    """The heap's smallest live entry not in `skip` (pruning removed ones off its top)."""
    while heap and heap[0][2].removed:
        heapq.heappop(heap)
    if not skip:
        return heap[0][2] if heap else None
    return next((e for *_, e in _in_order(heap) if not e.removed and e not in skip), None)


class _RunLasLanes:
    """The run_las order: bands (higher first) of tenant lanes. Each entry adds a turn (its WFQ
    tags) to its tenant's lane; the lane whose earliest turn finishes first goes next, with
    its aged entry (oldest first) or else its least-served entry. O(tenants in the band + log
    n) per peek."""

    def __init__(self) -> None:
        self._bands: dict[int, dict[str, _Lane]] = {}

    def push(self, entry: QueueEntry, served_gpu_s: float) -> None:
        lane = self._bands.setdefault(entry.priority, {}).setdefault(entry.tenant, _Lane())
        lane.turns.append((entry.finish_tag, entry.start_tag, entry.seq))
        heapq.heappush(lane.by_service, (served_gpu_s, entry.seq, entry))
        if entry.due_dispatches < math.inf:
            heapq.heappush(lane.by_due, (entry.due_dispatches, entry.seq, entry))
        lane.arrivals.append(entry)
        lane.live += 1

    def peek(
        self, aged_before_s: float, dispatched: int, skip: Collection[QueueEntry]
    ) -> QueueEntry | None:
        for band in sorted(self._bands, reverse=True):
            lanes = self._bands[band].values()
            by_turn = (
                sorted(lanes, key=lambda ln: ln.turns[0])
                if skip
                else [min(lanes, key=lambda ln: ln.turns[0])]
            )
            for lane in by_turn:
                if (chosen := lane.choose(aged_before_s, dispatched, skip)) is not None:
                    return chosen
        return None

    def dispatched(self, entry: QueueEntry) -> float | None:
        """`entry` leaves to be served: its lane spends its earliest turn. Returns that turn's
        start tag (the queue's virtual time moves to it)."""
        if entry.removed:
            return None
        lane = self._bands[entry.priority][entry.tenant]
        _, start, _ = lane.turns.popleft()
        self._drop(entry, lane)
        return start

    def removed(self, entry: QueueEntry) -> None:
        """`entry` leaves unserved: its lane gives back its latest turn."""
        lane = self._bands[entry.priority][entry.tenant]
        lane.turns.pop()
        self._drop(entry, lane)

    def _drop(self, entry: QueueEntry, lane: _Lane) -> None:
        lane.live -= 1
        if lane.live == 0:
            band = self._bands[entry.priority]
            del band[entry.tenant]
            if not band:
                del self._bands[entry.priority]


@dataclass(frozen=True, slots=True)
class RunUsage:
    """A run's service so far, as the accountant reports it."""

    gpu_seconds: float  # ended steps plus the in-flight steps' share up to now
    in_flight: int  # steps executing now
    last_active_s: float  # when a step last ended (or began); the run is idle since then


@dataclass(slots=True)
class _Forgiven:
    idle_since_s: float  # the idle period the amount below was computed for
    before_gpu_s: float  # attained (less earlier forgiveness) when that idle period began
    gpu_s: float  # service forgiven in total


class AttainedService:
    """Each run's attained GPU-seconds as run_las orders by them: the accountant's counter
    (`source(run_key, now_s)`, None for a run it does not know) less what idle decay forgave.

    A run idle (no step in flight) for `idle_decay_s` or less keeps all its service (tool
    calls between steps are short); past that, what it had halves per further
    `idle_decay_s` idle, and stays forgiven when the run comes back. What was forgiven is kept
    in the run's record of `runs` (the router's one `RunTable`), under `pool`; it goes when
    the record goes.
    """

    def __init__(
        self,
        source: Callable[[Hashable, float], RunUsage | None],
        *,
        idle_decay_s: float,
        pool: str = "",
        runs: RunTable | None = None,
    ) -> None:
        if not idle_decay_s > 0:
            raise ValueError(f"idle_decay_s must be > 0, got {idle_decay_s}")
        self._source = source
        self.idle_decay_s = idle_decay_s
        self.pool = pool
        self._runs = runs if runs is not None else RunTable()

    def attained_gpu_s(self, run_key: Hashable, now_s: float) -> float:
        usage = self._source(run_key, now_s)
        record = self._runs.get(run_key)
        if usage is None:  # the accountant forgot the run (or never saw it): so does LAS
            if record is not None and record.forgiven:
                record.forgiven.pop(self.pool, None)
            return 0.0
        known: _Forgiven | None = None
        if record is not None and record.forgiven:
            known = record.forgiven.get(self.pool)
        forgiven_gpu_s = known.gpu_s if known is not None else 0.0
        current = max(0.0, usage.gpu_seconds - forgiven_gpu_s)
        idle_s = 0.0 if usage.in_flight else now_s - usage.last_active_s
        if idle_s <= self.idle_decay_s:
            return current
        if known is None or known.idle_since_s != usage.last_active_s:
            known = _Forgiven(usage.last_active_s, current, forgiven_gpu_s)
            record = self._runs.touch(run_key)
            if record.forgiven is None:
                record.forgiven = {}
            record.forgiven[self.pool] = known
        halvings = (idle_s - self.idle_decay_s) / self.idle_decay_s
        decayed = known.before_gpu_s * math.pow(0.5, halvings)
        known.gpu_s = usage.gpu_seconds - decayed
        return decayed
