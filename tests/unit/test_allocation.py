"""Pool placement: whole instances first, at most one split, shares honoured."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pools.allocation import PoolMap, plan_allocation


def test_default_three_instances_one_agent_two_normal() -> None:
    alloc = plan_allocation({"e0": 1, "e1": 1, "e2": 1}, {"agent": 0.34, "normal": 0.66})
    assert len(alloc.instances_for("agent")) == 1
    assert len(alloc.instances_for("normal")) == 2
    assert all(len(p) == 1 for p in alloc.fracs.values()), "no split needed"


def test_single_gpu_is_split() -> None:
    alloc = plan_allocation({"e0": 1}, {"agent": 0.25, "normal": 0.75})
    assert dict(alloc.pools_of("e0")) == {"agent": 0.25, "normal": 0.75}


def test_fraction_needs_exactly_one_split() -> None:
    alloc = plan_allocation({"e0": 1, "e1": 1, "e2": 1}, {"agent": 0.25, "normal": 0.75})
    split = [i for i, p in alloc.fracs.items() if len(p) > 1]
    assert len(split) == 1
    assert abs(alloc.share_of("agent", {"e0": 1, "e1": 1, "e2": 1}) - 0.25) < 1e-9


def test_pool_map_notifies_on_replace() -> None:
    seen = []
    pm = PoolMap(plan_allocation({"e0": 1}, {"a": 1.0}))
    pm.on_change(lambda a: seen.append(a.version))
    pm.replace(plan_allocation({"e0": 1}, {"a": 0.5, "b": 0.5}))
    assert seen == [1] and pm.current.frac("e0", "b") == 0.5


@given(
    n=st.integers(min_value=1, max_value=12),
    agent=st.floats(min_value=0.0, max_value=1.0),
)
def test_invariants(n: int, agent: float) -> None:
    capacity = {f"e{i}": 1.0 for i in range(n)}
    alloc = plan_allocation(capacity, {"agent": agent, "normal": 1 - agent})
    assert set(alloc.fracs) == set(capacity)
    for by_pool in alloc.fracs.values():
        assert abs(sum(by_pool.values()) - 1) < 1e-9
        assert all(0 < f <= 1 for f in by_pool.values())
    assert sum(1 for p in alloc.fracs.values() if len(p) > 1) <= 1
    assert abs(alloc.share_of("agent", capacity) - agent) <= 0.05 / n + 1e-9 or n == 1
