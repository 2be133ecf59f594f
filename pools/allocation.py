"""Pool allocations: which share of each instance each pool may use.

`plan_allocation` turns pool shares into per-instance fractions, preferring whole instances
(strong isolation) and splitting at most one instance when the shares need a fraction, which is
how a single-GPU user still gets two pools. `PoolMap` holds the current allocation as one
frozen snapshot that the router reads on every request and the rebalancer swaps at runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["Allocation", "PoolMap", "plan_allocation"]

# A pool whose target is within this many instances of a whole number gets the whole number.
_SNAP_INSTANCES = 0.05


@dataclass(frozen=True, slots=True)
class Allocation:
    """`fracs[instance_id][pool]` in [0, 1], summing to 1 per instance."""

    fracs: Mapping[str, Mapping[str, float]]
    version: int = 0

    def pools_of(self, instance_id: str) -> Mapping[str, float]:
        return self.fracs.get(instance_id, MappingProxyType({}))

    def instances_for(self, pool: str) -> tuple[str, ...]:
        return tuple(i for i, by_pool in self.fracs.items() if by_pool.get(pool, 0.0) > 0.0)

    def frac(self, instance_id: str, pool: str) -> float:
        return self.fracs.get(instance_id, {}).get(pool, 0.0)

    def share_of(self, pool: str, capacity: Mapping[str, float]) -> float:
        """The pool's share of total capacity (capacity[instance] = GPUs, say)."""
        total = sum(capacity.values())
        if total <= 0:
            return 0.0
        return sum(self.frac(i, pool) * c for i, c in capacity.items()) / total


def plan_allocation(
    capacity: Mapping[str, float], shares: Mapping[str, float], version: int = 0
) -> Allocation:
    """Place pools on instances. `capacity[instance_id]` > 0 (GPUs), `shares[pool]` sum to 1.

    Whole instances go, largest first, to the pool with the most unmet need while the need
    covers the instance (within a small snap tolerance); at most one instance is then split
    across the remaining needs; any instance still left goes whole to the neediest pool.
    """
    if not capacity:
        return Allocation({}, version)
    total = sum(capacity.values())
    share_sum = sum(shares.values()) or 1.0
    need = {p: s / share_sum * total for p, s in shares.items()}
    fracs: dict[str, dict[str, float]] = {}
    order = sorted(capacity, key=lambda i: (-capacity[i], i))
    leftover: list[str] = []
    for instance_id in order:
        cap = capacity[instance_id]
        pool = max(need, key=lambda p: (need[p], p))
        if need[pool] >= cap * (1 - _SNAP_INSTANCES):
            fracs[instance_id] = {pool: 1.0}
            need[pool] -= cap
        else:
            leftover.append(instance_id)
    if leftover:
        split = leftover.pop(0)
        cap = capacity[split]
        positive = {p: n for p, n in need.items() if n > cap * _SNAP_INSTANCES / 2}
        if not positive:
            positive = {max(need, key=lambda p: (need[p], p)): 1.0}
        weight = sum(positive.values())
        fracs[split] = {p: n / weight for p, n in positive.items()}
        for p, n in positive.items():
            need[p] -= cap * n / weight
        for instance_id in leftover:
            pool = max(need, key=lambda p: (need[p], p))
            fracs[instance_id] = {pool: 1.0}
            need[pool] -= capacity[instance_id]
    frozen = {i: MappingProxyType(dict(by_pool)) for i, by_pool in fracs.items()}
    return Allocation(MappingProxyType(frozen), version)


class PoolMap:
    """The one mutable holder of the current allocation. Readers take `.current` (a frozen
    snapshot, consistent for the whole request); writers `replace()` it atomically."""

    def __init__(self, allocation: Allocation) -> None:
        self._current = allocation
        self._listeners: list[Callable[[Allocation], None]] = []

    @property
    def current(self) -> Allocation:
        return self._current

    def on_change(self, listener: Callable[[Allocation], None]) -> None:
        """Call `listener(new_allocation)` after every `replace` (accounting follows shares)."""
        self._listeners.append(listener)

    def replace(self, allocation: Allocation) -> Allocation:
        self._current = Allocation(allocation.fracs, self._current.version + 1)
        for listener in self._listeners:
            listener(self._current)
        return self._current
