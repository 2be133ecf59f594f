"""GPU-seconds accounting by processor sharing: pure arithmetic, no I/O, no clock, no asyncio.

On an instance with `g` GPUs and `n` sequences in flight, each sequence accrues `g·dt/n`; with
none in flight the time is idle, charged to the pools holding the instance in proportion to
their allocation shares of it. Every method takes `now_s` (any monotonic clock, in seconds)
so the caller owns time and tests run in simulated time.

Each instance keeps a cumulative counter `C(t) = ∫ g/n dt` over the time `n > 0`; a sequence's
cost is `C(end) - C(begin)`, so begin and end are O(1) whatever the concurrency. The counter
restarts at 0 whenever the instance empties (no sequence holds an older reading), which keeps
it small and the differences precise.

Conservation (exact up to float rounding, checked by `conservation`):

    ended costs + in-flight partial costs + idle == Σ_instances g × (wall time since added)

Instances removed while sequences are still in flight stop accruing at removal: those
sequences are charged up to the removal time, the time after it is nobody's capacity.

Per run (a sequence begun with a `run_key`), the accountant also keeps the run's attained
service: its ended steps' GPU-seconds plus its in-flight steps' share so far
(`run_usage`, what `queue.order: run_las` orders by), in the run's record of the router's one
`RunTable` (router.runtable: one cap and eviction for everything kept per run; a run with a step
in flight is never forgotten). Without one it keeps its own, of `max_runs`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mypy_extensions import mypyc_attr

from router.admission.queueing import RunUsage
from router.runtable import RunRecord, RunTable

__all__ = [
    "UNALLOCATED_POOL",
    "Accountant",
    "AccountingError",
    "ConservationReport",
    "SequenceToken",
    "UnknownInstanceError",
    "with_restored",
]

# Idle time of an instance that no pool holds (empty or all-zero shares) is charged here.
UNALLOCATED_POOL = "unallocated"


@mypyc_attr(native_class=False)  # its subclass below cannot be native
class AccountingError(ValueError):
    """A call the accountant cannot honour (bad numbers, unknown or duplicate instance)."""


@mypyc_attr(native_class=False)  # mypyc: no native class with two builtin bases
class UnknownInstanceError(AccountingError, KeyError):
    """No instance with this id is registered."""


@dataclass(slots=True, eq=False)
class _Instance:
    instance_id: str
    gpus: float
    shares_frac: dict[str, float]  # normalised: values sum to 1
    added_s: float
    last_s: float  # time up to which everything below is accrued
    removed_s: float = math.inf
    in_flight: int = 0
    counter_gpu_s: float = 0.0  # C(last_s): ∫ g/n dt since the instance last emptied
    start_counter_sum_gpu_s: float = 0.0  # Σ C(begin) over the sequences in flight


@dataclass(slots=True, eq=False)
class SequenceToken:
    """One sequence in flight, from `Accountant.begin`. Hand it back to `Accountant.end`."""

    instance_id: str
    begun_s: float
    _instance: _Instance = field(repr=False)
    _start_counter_gpu_s: float = field(repr=False)
    cost_gpu_seconds: float | None = None  # set by `end`
    _run: RunRecord | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class ConservationReport:
    """Where every GPU-second of capacity went, at `at_s`.

    `attributed_gpu_seconds + idle_gpu_seconds == capacity_gpu_seconds` up to float rounding;
    `rel_error` is `|difference| / capacity` (0 when there is no capacity yet).
    """

    at_s: float
    instances: int
    in_flight_sequences: int
    capacity_gpu_seconds: float
    ended_gpu_seconds: float
    in_flight_gpu_seconds: float
    attributed_gpu_seconds: float
    idle_gpu_seconds: float
    idle_by_pool_gpu_seconds: Mapping[str, float]
    abs_error_gpu_seconds: float
    rel_error: float

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the `live` part of `GET /admin/accounting`)."""
        return {
            "at_s": self.at_s,
            "instances": self.instances,
            "in_flight_sequences": self.in_flight_sequences,
            "capacity_gpu_seconds": self.capacity_gpu_seconds,
            "ended_gpu_seconds": self.ended_gpu_seconds,
            "in_flight_gpu_seconds": self.in_flight_gpu_seconds,
            "attributed_gpu_seconds": self.attributed_gpu_seconds,
            "idle_gpu_seconds": self.idle_gpu_seconds,
            "idle_by_pool_gpu_seconds": dict(self.idle_by_pool_gpu_seconds),
            "abs_error_gpu_seconds": self.abs_error_gpu_seconds,
            "rel_error": self.rel_error,
        }


def _normalised_shares(shares_frac: Mapping[str, float]) -> dict[str, float]:
    for pool, frac in shares_frac.items():
        if not (math.isfinite(frac) and frac >= 0.0):
            raise AccountingError(f"share of pool {pool!r} must be finite and >= 0, got {frac}")
    total = math.fsum(shares_frac.values())
    if total <= 0.0:
        return {UNALLOCATED_POOL: 1.0}
    return {pool: frac / total for pool, frac in shares_frac.items() if frac > 0.0}


class Accountant:
    """Processor-sharing GPU-seconds over a changing set of instances.

    Not thread-safe: own it from one event loop. All times are `now_s` on one monotonic
    clock; a `now_s` earlier than the last one seen for an instance counts as no time passing.
    """

    def __init__(self, *, max_runs: int = 100_000, runs: RunTable | None = None) -> None:
        if max_runs < 1:
            raise AccountingError(f"max_runs must be >= 1, got {max_runs}")
        self.runs = runs if runs is not None else RunTable(max_runs)
        self._instances: dict[str, _Instance] = {}
        self._draining: set[_Instance] = set()  # removed, sequences still in flight
        self._retired_capacity_gpu_s = 0.0  # capacity of removed instances
        self._ended_gpu_s = 0.0
        self._idle_gpu_s: dict[str, float] = {}

    # -- the fleet -----------------------------------------------------------------------------

    def add_instance(
        self, instance_id: str, gpus: float, shares_frac: Mapping[str, float], now_s: float
    ) -> None:
        """Start accounting `gpus` (> 0; a CPU engine counts as configured) from `now_s`.

        `shares_frac` maps pool -> allocation of this instance; it is normalised to sum to 1,
        and an empty or all-zero map charges idle time to `UNALLOCATED_POOL`.
        """
        if instance_id in self._instances:
            raise AccountingError(f"instance {instance_id!r} is already registered")
        if not (math.isfinite(gpus) and gpus > 0.0):
            raise AccountingError(f"gpus of instance {instance_id!r} must be > 0, got {gpus}")
        shares = _normalised_shares(shares_frac)
        self._instances[instance_id] = _Instance(instance_id, gpus, shares, now_s, now_s)

    def set_shares(self, instance_id: str, shares_frac: Mapping[str, float], now_s: float) -> None:
        """From `now_s` on, split this instance's idle time by `shares_frac` (see add)."""
        inst = self._get(instance_id)
        shares = _normalised_shares(shares_frac)
        self._advance(inst, now_s)
        inst.shares_frac = shares

    def remove_instance(self, instance_id: str, now_s: float) -> None:
        """Stop accounting the instance at `now_s`. Sequences still in flight on it are charged
        up to `now_s` and can still be ended. The id may be added again later."""
        inst = self._get(instance_id)
        self._advance(inst, now_s)
        inst.removed_s = inst.last_s
        del self._instances[instance_id]
        self._retired_capacity_gpu_s += inst.gpus * (inst.removed_s - inst.added_s)
        if inst.in_flight:
            self._draining.add(inst)

    def has_instance(self, instance_id: str) -> bool:
        return instance_id in self._instances

    def in_flight(self, instance_id: str) -> int:
        """Sequences in flight on the instance (0 when unknown)."""
        inst = self._instances.get(instance_id)
        return inst.in_flight if inst else 0

    # -- sequences -----------------------------------------------------------------------------

    def begin(
        self, instance_id: str, now_s: float, run_key: Hashable | None = None
    ) -> SequenceToken:
        """A sequence starts occupying the instance at `now_s`, as a step of run `run_key`
        when given. O(1)."""
        inst = self._get(instance_id)
        self._advance(inst, now_s)
        start = inst.counter_gpu_s
        inst.in_flight += 1
        inst.start_counter_sum_gpu_s += start
        token = SequenceToken(instance_id, now_s, inst, start)
        if run_key is not None:
            run = self.runs.touch(run_key)
            run.metered = True
            if run.ended:  # a step of it again: active (governance may end it again)
                self.runs.set_ended(run_key, False)
            run.in_flight.append(token)
            run.last_active_s = now_s
            token._run = run
        return token

    def end(self, token: SequenceToken, now_s: float) -> float:
        """The sequence stops at `now_s`; returns its GPU-seconds (>= 0). O(1).

        Ending a token twice returns the first answer and changes nothing.
        """
        if token.cost_gpu_seconds is not None:
            return token.cost_gpu_seconds
        inst = token._instance
        self._advance(inst, now_s)
        cost = inst.counter_gpu_s - token._start_counter_gpu_s
        inst.in_flight -= 1
        if inst.in_flight == 0:
            # Nobody holds an older reading: restart the counter to keep it small.
            inst.counter_gpu_s = 0.0
            inst.start_counter_sum_gpu_s = 0.0
            self._draining.discard(inst)
        else:
            inst.start_counter_sum_gpu_s -= token._start_counter_gpu_s
        token.cost_gpu_seconds = cost
        self._ended_gpu_s += cost
        run = token._run
        if run is not None:
            run.in_flight.remove(token)
            run.ended_gpu_s += cost
            run.last_active_s = max(run.last_active_s, now_s)
        return cost

    def run_usage(self, run_key: Hashable, now_s: float) -> RunUsage | None:
        """A run's attained service up to `now_s` (None: no step of it seen, or forgotten).
        O(steps in flight)."""
        run = self.runs.get(run_key)
        if run is None or not run.metered:
            return None
        partial = 0.0
        for token in run.in_flight:
            inst = token._instance
            self._advance(inst, now_s)
            partial += inst.counter_gpu_s - token._start_counter_gpu_s
        return RunUsage(run.ended_gpu_s + partial, len(run.in_flight), run.last_active_s)

    # -- totals --------------------------------------------------------------------------------

    def idle_gpu_seconds(self, now_s: float) -> dict[str, float]:
        """Cumulative idle GPU-seconds per pool up to `now_s` (brings every instance to now)."""
        for inst in self._instances.values():
            self._advance(inst, now_s)
        return dict(self._idle_gpu_s)

    def capacity_gpu_seconds(self, now_s: float) -> float:
        """Σ g × wall time over every instance since it was added (until removed)."""
        live = math.fsum(
            inst.gpus * max(0.0, max(now_s, inst.last_s) - inst.added_s)
            for inst in self._instances.values()
        )
        return self._retired_capacity_gpu_s + live

    def attributed_gpu_seconds(self, now_s: float) -> float:
        """GPU-seconds charged to sequences: those ended plus the in-flight ones up to now."""
        return self._ended_gpu_s + self._in_flight_gpu_s(now_s)

    def conservation(self, now_s: float) -> ConservationReport:
        """Attributed + idle against capacity at `now_s`. O(instances)."""
        idle = self.idle_gpu_seconds(now_s)
        in_flight_gpu_s = self._in_flight_gpu_s(now_s)
        attributed = self._ended_gpu_s + in_flight_gpu_s
        idle_total = math.fsum(idle.values())
        capacity = self.capacity_gpu_seconds(now_s)
        abs_error = abs(attributed + idle_total - capacity)
        return ConservationReport(
            at_s=now_s,
            instances=len(self._instances),
            in_flight_sequences=sum(
                inst.in_flight for inst in (*self._instances.values(), *self._draining)
            ),
            capacity_gpu_seconds=capacity,
            ended_gpu_seconds=self._ended_gpu_s,
            in_flight_gpu_seconds=in_flight_gpu_s,
            attributed_gpu_seconds=attributed,
            idle_gpu_seconds=idle_total,
            idle_by_pool_gpu_seconds=idle,
            abs_error_gpu_seconds=abs_error,
            rel_error=abs_error / capacity if capacity > 0.0 else 0.0,
        )

    # -- internals -----------------------------------------------------------------------------

    def _get(self, instance_id: str) -> _Instance:
        try:
            return self._instances[instance_id]
        except KeyError:
            raise UnknownInstanceError(f"instance {instance_id!r} is not registered") from None

    def _in_flight_gpu_s(self, now_s: float) -> float:
        total = 0.0
        for inst in (*self._instances.values(), *self._draining):
            if inst.in_flight:
                self._advance(inst, now_s)
                total += inst.in_flight * inst.counter_gpu_s - inst.start_counter_sum_gpu_s
        return total

    def _advance(self, inst: _Instance, now_s: float) -> None:
        """Accrue the instance's time from `last_s` to `now_s` (never past its removal)."""
        to_s = min(now_s, inst.removed_s)
        dt_s = to_s - inst.last_s
        if dt_s <= 0.0:
            return
        inst.last_s = to_s
        gpu_s = inst.gpus * dt_s
        if inst.in_flight:
            inst.counter_gpu_s += gpu_s / inst.in_flight
        else:
            idle = self._idle_gpu_s
            for pool, frac in inst.shares_frac.items():
                idle[pool] = idle.get(pool, 0.0) + gpu_s * frac


def with_restored(live: RunUsage | None, restored: tuple[float, float] | None) -> RunUsage | None:
    """A run's attained service across a router restart: what the accountant has seen since
    (`live`) plus what the run had settled before it (`restored`: GPU-seconds, and when the run
    was last seen, both from the governance store). A run not seen since the restart is idle
    from its last sighting."""
    if restored is None:
        return live
    gpu_s, last_seen_s = restored
    if live is None:
        return RunUsage(gpu_s, 0, last_seen_s)
    return RunUsage(live.gpu_seconds + gpu_s, live.in_flight, live.last_active_s)
