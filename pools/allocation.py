"""Pool allocations: which share of each instance each pool may use.

`plan_allocation` turns pool shares into per-instance fractions, preferring whole instances
(strong isolation) and splitting at most one instance when the shares need a fraction, which is
how a single-GPU user still gets two pools. `plan_moves` changes a running allocation as little
as possible: it resizes the split instance first and moves at most one whole instance at a
time. `PoolMap` holds the current allocation as one frozen snapshot that the router reads on
every request and the rebalancer swaps at runtime.

An instance moved whole from one pool to another *drains*: `Allocation.draining` names it, its
old pool no longer has it (no new work there at once), and its new pool gets it only when the
drain ends (`without_drain`): when the old pool's sequences there have finished, or at the
drain's deadline (they then finish where they are; nothing is cut).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["Allocation", "Drain", "PoolMap", "plan_allocation", "plan_moves"]

# A pool whose target is within this many instances of a whole number gets the whole number.
_SNAP_INSTANCES = 0.05


@dataclass(frozen=True, slots=True)
class Drain:
    """An instance on its way from `from_pool` to `to_pool` (times on the router's clock)."""

    from_pool: str
    to_pool: str
    started_at_s: float
    deadline_s: float


@dataclass(frozen=True, slots=True)
class Allocation:
    """`fracs[instance_id][pool]` in [0, 1], summing to 1 per instance. An instance in
    `draining` already belongs to its new pool in `fracs` (shares count it there) but takes
    no new work from either pool until the drain ends."""

    fracs: Mapping[str, Mapping[str, float]]
    version: int = 0
    draining: Mapping[str, Drain] = field(default_factory=lambda: MappingProxyType({}))

    def pools_of(self, instance_id: str) -> Mapping[str, float]:
        return self.fracs.get(instance_id, MappingProxyType({}))

    def instances_for(self, pool: str) -> tuple[str, ...]:
        """The instances that take new work for `pool` now (a draining one takes none)."""
        return tuple(
            i
            for i, by_pool in self.fracs.items()
            if by_pool.get(pool, 0.0) > 0.0 and i not in self.draining
        )

    def without_drain(self, instance_id: str) -> Allocation:
        """The same allocation with the instance's drain over (it joins its new pool)."""
        rest = {i: d for i, d in self.draining.items() if i != instance_id}
        return Allocation(self.fracs, self.version, MappingProxyType(rest))

    def frac(self, instance_id: str, pool: str) -> float:
        return self.fracs.get(instance_id, {}).get(pool, 0.0)

    def share_of(self, pool: str, capacity: Mapping[str, float]) -> float:
        """The pool's share of total capacity (capacity[instance] = GPUs, say)."""
        total = sum(capacity.values())
        if total <= 0:
            return 0.0
        return sum(self.frac(i, pool) * c for i, c in capacity.items()) / total


def plan_allocation(
    capacity: Mapping[str, float],
    shares: Mapping[str, float],
    version: int = 0,
    *,
    pinned: Mapping[str, str] | None = None,
) -> Allocation:
    """Place pools on instances. `capacity[instance_id]` > 0 (GPUs), `shares[pool]` sum to 1.

    Instances `pinned` to a pool (instance id -> pool) go to it whole, first. Then whole
    instances go, largest first, to the pool with the most unmet need while the need covers the
    instance (within a small snap tolerance); at most one instance is then split across the
    remaining needs; any instance still left goes whole to the neediest pool.
    """
    if not capacity:
        return Allocation({}, version)
    total = sum(capacity.values())
    share_sum = sum(shares.values()) or 1.0
    need = {p: s / share_sum * total for p, s in shares.items()}
    fracs: dict[str, dict[str, float]] = {}
    for instance_id, pool in sorted((pinned or {}).items()):
        if instance_id in capacity and pool in need:
            fracs[instance_id] = {pool: 1.0}
            need[pool] -= capacity[instance_id]
    order = sorted((i for i in capacity if i not in fracs), key=lambda i: (-capacity[i], i))
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


def _units(allocation: Allocation, capacity: Mapping[str, float], pool: str) -> float:
    return sum(allocation.frac(i, pool) * c for i, c in capacity.items())


def plan_moves(
    current: Allocation,
    capacity: Mapping[str, float],
    shares: Mapping[str, float],
    *,
    now_s: float = 0.0,
    drain_timeout_s: float = 0.0,
    pinned: Mapping[str, str] | None = None,
    whole_moves: bool = True,
) -> Allocation:
    """Move `current` toward `shares` (summing to 1) with as few changes as possible.

    Instances of `capacity` that `current` lacks are new: each joins (largest first) the pool
    its pin names, else the pool with the most unmet need, whole when that need covers it,
    else split across the unmet needs (when no instance is split yet). Instances `current`
    has that `capacity` lacks are gone. Then share goes from the pool with the most surplus to
    the one with the most need, in this order: (1) resize an instance the two pools already
    share; (2) move one whole instance of the giver (the smallest that the need covers; never
    one `pinned` to the giver) to the receiver, and only one per call: it drains
    (`Allocation.draining`, deadline `now_s + drain_timeout_s`); (3) split one of the giver's
    whole instances. With `whole_moves` False only (1) is done: no instance already placed
    changes pools (how a fleet change is placed). What one call cannot place (a second whole
    instance) waits for the next call; the returned allocation's shares are what was placed.
    Instances already draining are left alone, drain and all."""
    total = sum(capacity.values())
    if total <= 0:
        return Allocation(MappingProxyType({}), current.version)
    fracs = {i: dict(current.pools_of(i)) for i in capacity if current.pools_of(i)}
    _place_new(fracs, capacity, shares, pinned or {})
    plan = _Plan(
        fracs, capacity, {i: d for i, d in current.draining.items() if i in capacity}, pinned or {}
    )
    scratch = Allocation(MappingProxyType(fracs))
    need = {p: s * total - _units(scratch, capacity, p) for p, s in shares.items()}
    tolerance = 1e-6 * total
    whole_moved = False
    for _ in range(4 * len(capacity) + 4):
        receiver = max(need, key=lambda p: (need[p], p))
        giver = min(need, key=lambda p: (need[p], p))
        amount = min(need[receiver], -need[giver])
        if amount <= tolerance:
            break
        moved = plan.shift_on_split(giver, receiver, amount)
        if moved <= 0 and (not whole_moves or amount < _SNAP_INSTANCES * min(capacity.values())):
            break  # a sliver not worth splitting another instance for, or no moves wanted
        if moved <= 0:
            moved, whole = plan.take_whole(giver, receiver, amount, whole_moved)
            if whole is not None:
                whole_moved = True
                plan.draining[whole] = Drain(giver, receiver, now_s, now_s + drain_timeout_s)
        if moved <= 0:
            break
        need[receiver] -= moved
        need[giver] += moved
    frozen = {
        i: MappingProxyType({p: f for p, f in by_pool.items() if f > 1e-9})
        for i, by_pool in fracs.items()
    }
    return Allocation(MappingProxyType(frozen), current.version, MappingProxyType(plan.draining))


def _place_new(
    fracs: dict[str, dict[str, float]],
    capacity: Mapping[str, float],
    shares: Mapping[str, float],
    pinned: Mapping[str, str],
) -> None:
    """Give each instance of `capacity` missing from `fracs` a place (see `plan_moves`)."""
    new = sorted((i for i in capacity if i not in fracs), key=lambda i: (-capacity[i], i))
    if not new or not shares:
        return
    total = sum(capacity.values())
    scratch = Allocation(MappingProxyType(fracs))
    need = {p: s * total - _units(scratch, capacity, p) for p, s in shares.items()}
    for i in new:
        cap = capacity[i]
        pool = pinned.get(i)
        if pool not in need:
            pool = max(need, key=lambda p: (need[p], p))
        split = any(len([f for f in by.values() if f > 1e-9]) > 1 for by in fracs.values())
        positive = {p: n for p, n in need.items() if n > cap * _SNAP_INSTANCES / 2}
        if i in pinned or need[pool] >= cap * (1 - _SNAP_INSTANCES) or split or not positive:
            fracs[i] = {pool: 1.0}
            need[pool] -= cap
            continue
        weight = sum(positive.values())
        fracs[i] = {p: n / weight for p, n in positive.items()}
        for p, n in positive.items():
            need[p] -= cap * n / weight


@dataclass(slots=True)
class _Plan:
    """The allocation being changed by `plan_moves` (mutable, private to one call)."""

    fracs: dict[str, dict[str, float]]
    capacity: Mapping[str, float]
    draining: dict[str, Drain]
    pinned: Mapping[str, str]

    def movable(self, instance_id: str, giver: str) -> bool:
        return instance_id not in self.draining and self.pinned.get(instance_id) != giver

    def shift_on_split(self, giver: str, receiver: str, amount: float) -> float:
        """Shift up to `amount` GPU units from giver to receiver on an instance holding both."""
        fracs, capacity = self.fracs, self.capacity
        for i in sorted(fracs, key=lambda i: (-fracs[i].get(giver, 0.0) * capacity[i], i)):
            by_pool = fracs[i]
            if not self.movable(i, giver):
                continue
            if by_pool.get(giver, 0.0) <= 1e-9 or by_pool.get(receiver, 0.0) <= 1e-9:
                continue
            units = min(amount, by_pool[giver] * capacity[i])
            if by_pool[giver] - units / capacity[i] < _SNAP_INSTANCES:
                units = by_pool[giver] * capacity[i]  # no sliver left behind: whole again
            by_pool[giver] -= units / capacity[i]
            by_pool[receiver] += units / capacity[i]
            if by_pool[giver] <= 1e-9:
                del by_pool[giver]
            return units
        return 0.0

    def take_whole(
        self, giver: str, receiver: str, amount: float, whole_moved: bool
    ) -> tuple[float, str | None]:
        """Move a whole instance of the giver (at most one per plan), or split one. Returns
        the GPU units moved and the instance moved whole (None when it was split)."""
        capacity = self.capacity
        whole = [
            i
            for i, by_pool in self.fracs.items()
            if by_pool.get(giver, 0.0) >= 1 - 1e-9 and self.movable(i, giver)
        ]
        if not whole:
            return 0.0, None
        covered = [i for i in whole if capacity[i] * (1 - _SNAP_INSTANCES) <= amount]
        if covered and not whole_moved:
            i = max(covered, key=lambda i: (capacity[i], i))
            self.fracs[i] = {receiver: 1.0}
            return capacity[i], i
        if covered:  # a second whole instance waits for the next plan
            return 0.0, None
        i = min(whole, key=lambda i: (capacity[i], i))
        part = amount / capacity[i]
        self.fracs[i] = {giver: 1.0 - part, receiver: part}
        return amount, None


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
        self._current = Allocation(allocation.fracs, self._current.version + 1, allocation.draining)
        for listener in self._listeners:
            listener(self._current)
        return self._current
