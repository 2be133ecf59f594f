"""The fleet: every instance the router knows, its latest telemetry, its health, its
operating point, and what this router has put on it: one `Lease` per sequence in flight.

Health is a small state machine: `unhealthy_after` consecutive failed scrapes (or one refused
connection from the proxy) mark an instance unhealthy; the next good scrape brings it back.
Telemetry older than `stale_after_s` is stale, and stale telemetry counts as full.

Leases are the only way the router's view of an instance changes: `acquire` adds the
sequence's reserved KV blocks and counts it running for its pool; `Lease.release` (idempotent,
called in a `finally`) takes both back. The KV blocks in use on an instance are then

    used = max(reserved now, measured at the last scrape + reserved since − released since)

so a reservation counts at once, before any scrape can show it, and a finished sequence stops
counting at once, before the next scrape stops showing it.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pools.launchers.base import InstanceSpec
from pools.operating_point import OperatingPoint

if TYPE_CHECKING:
    from pools.telemetry import InstanceReading

__all__ = ["Fleet", "InstanceState", "Lease"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class InstanceState:
    spec: InstanceSpec
    healthy: bool = False
    reading: InstanceReading | None = None
    failures: int = 0
    last_error: str | None = None
    inflight: int = 0  # sequences this router has dispatched and not yet finished
    reserved_blocks: int = 0  # KV blocks reserved by those sequences
    running_by_pool: dict[str, int] = field(default_factory=dict)
    reserved_by_pool: dict[str, int] = field(default_factory=dict)
    leases: set[Lease] = field(default_factory=set)
    op: OperatingPoint = field(default_factory=OperatingPoint)
    preemptions_seen: float = 0.0  # preemptions counted since the router started
    prefill_tokens_per_s: float | None = None  # measured, smoothed; None until measured
    prefix_hit_frac: float | None = None  # prefix-cache hits / queries, smoothed
    # KV blocks reserved / released since the last reading (see the module docstring)
    added_since_reading: int = 0
    released_since_reading: int = 0
    # the engine left its source (Kubernetes, Ray): no new work; removed once drained
    leaving: bool = False
    # `pending_prefill_tokens` kept as leases come and go, not summed over them per call:
    # the prompt tokens of leases still counted, those leases by predicted end of prefill
    # (a heap, to uncount as time passes them) and the latest time asked about
    prefill_tokens: int = 0
    prefill_heap: list[tuple[float, int, Lease]] = field(default_factory=list)
    prefill_asked_s: float = float("-inf")
    first_token_leases: int = 0  # live leases that have sent their first token

    @property
    def instance_id(self) -> str:
        return self.spec.instance_id

    @property
    def capacity_blocks(self) -> int | None:
        """KV blocks the engine can hand out (its num_gpu_blocks less vLLM's null block);
        None until it has reported."""
        if self.reading is None or self.reading.num_gpu_blocks is None:
            return None
        return max(0, self.reading.num_gpu_blocks - 1)

    @property
    def kv_capacity(self) -> str | None:
        """ "known" when the engine reports its KV blocks (`vllm:cache_config_info`),
        "unknown" when its readings lack them (admission then goes by the operating point
        and `router.unknown_kv_max_concurrency`), None until it has reported."""
        if self.reading is None:
            return None
        return "unknown" if self.reading.num_gpu_blocks is None else "known"

    def used_blocks(self) -> float:
        """KV blocks in use: the larger of the router's reservations and the measured use
        corrected for what changed since it was measured."""
        cap = self.capacity_blocks
        if self.reading is None or cap is None:
            return float(self.reserved_blocks)
        measured = (  # vLLM: usage = 1 - free / (num_gpu_blocks - 1)
            self.reading.kv_usage_frac * cap
            + self.added_since_reading
            - self.released_since_reading
        )
        return max(float(self.reserved_blocks), measured, 0.0)

    def pending_prefill_tokens(self, now_s: float) -> int:
        """Prompt tokens of this router's sequences still expected to be in prefill (no
        first token yet, and `now_s` before the predicted end of their prefill). O(1) but
        for the leases whose predicted end `now_s` passes; a time before one already asked
        about is summed over the leases."""
        if now_s < self.prefill_asked_s:
            return sum(lease.prompt_tokens for lease in self.leases if lease.in_prefill(now_s))
        self.prefill_asked_s = now_s
        heap = self.prefill_heap
        while heap and heap[0][0] <= now_s:
            lease = heapq.heappop(heap)[2]
            lease.uncount_prefill()
        return self.prefill_tokens


class Lease:
    """One sequence on one instance, from `Fleet.acquire` until `release` (idempotent)."""

    __slots__ = (
        "_fleet",
        "acquired_at_s",
        "blocks",
        "counted_in_prefill",
        "first_token_at_s",
        "pool",
        "prefill_done_at_s",
        "prompt_tokens",
        "released",
        "state",
    )

    def __init__(
        self,
        fleet: Fleet,
        state: InstanceState,
        pool: str,
        blocks: int,
        prompt_tokens: int,
        now_s: float,
        prefill_s: float,
    ) -> None:
        self._fleet = fleet
        self.state = state
        self.pool = pool
        self.blocks = blocks
        self.prompt_tokens = prompt_tokens
        self.acquired_at_s = now_s
        self.prefill_done_at_s = now_s + prefill_s  # predicted; the first token overrides
        self.first_token_at_s: float | None = None
        self.released = False
        self.counted_in_prefill = False  # in its state's `prefill_tokens`

    @property
    def instance_id(self) -> str:
        return self.state.spec.instance_id

    def in_prefill(self, now_s: float) -> bool:
        return self.first_token_at_s is None and now_s < self.prefill_done_at_s

    def first_token(self, now_s: float) -> None:
        if self.first_token_at_s is None and not self.released:
            self.state.first_token_leases += 1
        self.first_token_at_s = now_s
        self.uncount_prefill()
        self._fleet._first_token(self)

    def uncount_prefill(self) -> None:
        """Out of its state's pending prefill (first token, released, or predicted done)."""
        if self.counted_in_prefill:
            self.counted_in_prefill = False
            self.state.prefill_tokens -= self.prompt_tokens

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self._fleet._release(self)

    def __repr__(self) -> str:
        return f"Lease({self.instance_id}, {self.pool}, {self.blocks} blocks)"


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
        self._change_listeners: list[Callable[[str], None]] = []
        self._lease_listeners: list[Callable[[Lease, str], None]] = []
        self._warned_unknown_kv: set[str] = set()  # instances already warned about
        self._lease_seq = itertools.count()  # the prefill heap's tie-break

    # -- membership at run time (engines discovered in Kubernetes or placed by Ray) ------------

    def add(self, spec: InstanceSpec) -> InstanceState:
        """A new instance: unhealthy until its first good scrape. Raises `KeyError` if known."""
        if spec.instance_id in self._states:
            raise KeyError(f"instance {spec.instance_id!r} is already in the fleet")
        state = InstanceState(spec=spec)
        self._states[spec.instance_id] = state
        log.info("%s joined the fleet (%s)", spec.instance_id, spec.url)
        return state

    def remove(self, instance_id: str) -> InstanceState | None:
        """Forget the instance. Leases still held on it release normally."""
        state = self._states.pop(instance_id, None)
        if state is not None:
            log.info(
                "%s left the fleet (%d sequences still in flight)", instance_id, state.inflight
            )
        return state

    def replace_spec(self, spec: InstanceSpec) -> None:
        """The same instance at a new address (an engine restarted elsewhere): its telemetry
        starts over and it is unhealthy until the new address answers a scrape."""
        state = self._states[spec.instance_id]
        state.spec = spec
        state.reading = None
        state.failures = 0
        state.last_error = "moved to a new address; waiting for its first scrape"
        self._set_health(state, False)

    def on_health_change(self, listener: Callable[[str, bool], None]) -> None:
        self._health_listeners.append(listener)

    def on_capacity_change(self, listener: Callable[[str], None]) -> None:
        """`listener(instance_id)` after a lease is released or a reading arrives: something
        may fit there now (admission's dispatch is driven by this, not by polling)."""
        self._change_listeners.append(listener)

    def on_lease_event(self, listener: Callable[[Lease, str], None]) -> None:
        """`listener(lease, event)` when a lease's sequence sends its first token ("first")
        and when it is released ("released", before the capacity-change listeners)."""
        self._lease_listeners.append(listener)

    def _first_token(self, lease: Lease) -> None:
        for listener in self._lease_listeners:
            listener(lease, "first")

    def _changed(self, instance_id: str) -> None:
        for listener in self._change_listeners:
            listener(instance_id)

    def acquire(
        self,
        instance_id: str,
        pool: str,
        *,
        blocks: int = 0,
        prompt_tokens: int = 0,
        prefill_s: float = 0.0,
    ) -> Lease:
        """Put one sequence of `pool` on the instance, reserving `blocks` KV blocks."""
        state = self._states[instance_id]
        lease = Lease(self, state, pool, blocks, prompt_tokens, self._clock(), prefill_s)
        state.leases.add(lease)
        if prompt_tokens:
            heap = state.prefill_heap
            if len(heap) > 2 * len(state.leases) + 64:  # released leases not yet passed
                heap[:] = [e for e in heap if e[2].counted_in_prefill]
                heapq.heapify(heap)
            lease.counted_in_prefill = True
            state.prefill_tokens += prompt_tokens
            heapq.heappush(heap, (lease.prefill_done_at_s, next(self._lease_seq), lease))
        state.inflight += 1
        state.reserved_blocks += blocks
        state.added_since_reading += blocks
        state.running_by_pool[pool] = state.running_by_pool.get(pool, 0) + 1
        state.reserved_by_pool[pool] = state.reserved_by_pool.get(pool, 0) + blocks
        return lease

    def _release(self, lease: Lease) -> None:
        state = lease.state
        state.leases.discard(lease)
        lease.uncount_prefill()
        if lease.first_token_at_s is not None:
            state.first_token_leases -= 1
        state.inflight -= 1
        state.reserved_blocks -= lease.blocks
        state.released_since_reading += lease.blocks
        state.running_by_pool[lease.pool] -= 1
        state.reserved_by_pool[lease.pool] -= lease.blocks
        for listener in self._lease_listeners:
            listener(lease, "released")
        self._changed(state.spec.instance_id)

    def instance_ids(self) -> list[str]:
        return list(self._states)

    def get(self, instance_id: str) -> InstanceState | None:
        return self._states.get(instance_id)

    def __iter__(self) -> Iterator[InstanceState]:
        return iter(self._states.values())

    def capacity_gpus(self) -> dict[str, float]:
        """GPUs per instance, leaving instances excluded."""
        return {i: float(s.spec.gpus) for i, s in self._states.items() if not s.leaving}

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
        previous = state.reading
        if previous is not None:
            self._learn(state, previous, reading)
        state.reading = reading
        if reading.num_gpu_blocks is None and instance_id not in self._warned_unknown_kv:
            self._warned_unknown_kv.add(instance_id)
            log.warning(
                "%s does not report its KV capacity (no vllm:cache_config_info in /metrics):"
                " it is admitted by its operating point and at most"
                " router.unknown_kv_max_concurrency sequences at once, without KV headroom"
                " checks",
                instance_id,
            )
        state.added_since_reading = 0
        state.released_since_reading = 0
        state.failures = 0
        state.last_error = None
        self._set_health(state, True)
        self._changed(instance_id)

    @staticmethod
    def _learn(state: InstanceState, before: InstanceReading, after: InstanceReading) -> None:
        """Preemptions and the operating point from two consecutive readings."""
        delta = after.preemptions_total - before.preemptions_total
        state.preemptions_seen += after.preemptions_total if delta < 0 else delta  # restart
        prefill_s = after.prefill_time_sum_s - before.prefill_time_sum_s
        prompt = after.prompt_tokens_sum - before.prompt_tokens_sum
        if prefill_s > 0.005 and prompt > 0:
            rate = prompt / prefill_s
            old = state.prefill_tokens_per_s
            state.prefill_tokens_per_s = rate if old is None else old + 0.3 * (rate - old)
        queries = after.prefix_cache_queries_total - before.prefix_cache_queries_total
        if queries > 0:
            hit = (after.prefix_cache_hits_total - before.prefix_cache_hits_total) / queries
            old_hit = state.prefix_hit_frac
            state.prefix_hit_frac = hit if old_hit is None else old_hit + 0.3 * (hit - old_hit)
        state.op.observe_queue(after.running, after.waiting)
        tokens = after.itl_count - before.itl_count
        if tokens > 0:
            itl_s = (after.itl_sum_s - before.itl_sum_s) / tokens
            state.op.observe((before.running + after.running) / 2, itl_s, tokens)

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
