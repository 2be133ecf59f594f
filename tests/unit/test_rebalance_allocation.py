"""Placement as moves from the current allocation: the split instance first, one whole
instance at a time, a whole move drains, pinned instances stay."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pools.allocation import Allocation, Drain, plan_allocation, plan_moves

THREE = {"e0": 1.0, "e1": 1.0, "e2": 1.0}


def changed(before: Allocation, after: Allocation) -> set[str]:
    return {
        i
        for i in before.fracs
        if {p: round(f, 9) for p, f in before.pools_of(i).items()}
        != {p: round(f, 9) for p, f in after.pools_of(i).items()}
    }


def test_issue_example_045_to_060_resizes_only_the_split_instance() -> None:
    before = plan_allocation(THREE, {"agent": 0.45, "normal": 0.55})
    after = plan_moves(before, THREE, {"agent": 0.60, "normal": 0.40})
    assert after.share_of("agent", THREE) == pytest.approx(0.60)
    assert len(changed(before, after)) == 1
    (split,) = changed(before, after)
    # agent had 1.35 GPUs: one whole instance + 0.35 of the split one; now 0.8 of it
    assert dict(after.pools_of(split)) == pytest.approx({"agent": 0.8, "normal": 0.2})
    assert not after.draining


def test_from_scratch_planning_would_have_moved_more() -> None:
    """The reason for plan_moves: re-planning 0.60 from scratch changes more instances."""
    before = plan_allocation(THREE, {"agent": 0.45, "normal": 0.55})
    scratch = plan_allocation(THREE, {"agent": 0.60, "normal": 0.40})
    assert len(changed(before, scratch)) > 1


def test_a_whole_instance_moves_and_drains() -> None:
    before = plan_allocation(THREE, {"agent": 1 / 3, "normal": 2 / 3})
    (agent_i,) = before.instances_for("agent")
    after = plan_moves(
        before, THREE, {"agent": 2 / 3, "normal": 1 / 3}, now_s=100.0, drain_timeout_s=30.0
    )
    assert after.share_of("agent", THREE) == pytest.approx(2 / 3)
    (moved,) = after.draining
    assert after.draining[moved] == Drain("normal", "agent", 100.0, 130.0)
    assert dict(after.pools_of(moved)) == {"agent": 1.0}
    # during the drain neither pool gives it new work
    assert moved not in after.instances_for("agent")
    assert moved not in after.instances_for("normal")
    assert after.instances_for("agent") == (agent_i,)
    done = after.without_drain(moved)
    assert set(done.instances_for("agent")) == {agent_i, moved}


def test_one_whole_instance_per_plan() -> None:
    five = {f"e{i}": 1.0 for i in range(5)}
    before = plan_allocation(five, {"agent": 0.2, "normal": 0.8})
    after = plan_moves(before, five, {"agent": 0.8, "normal": 0.2})
    assert len(after.draining) == 1
    assert after.share_of("agent", five) == pytest.approx(0.4)
    again = plan_moves(after, five, {"agent": 0.8, "normal": 0.2})
    assert len(again.draining) == 2
    assert again.share_of("agent", five) == pytest.approx(0.6)


def test_a_fraction_beyond_the_split_splits_one_more_instance() -> None:
    before = plan_allocation(THREE, {"agent": 0.3, "normal": 0.7})  # split {0.9 a, 0.1 n}
    after = plan_moves(before, THREE, {"agent": 0.5, "normal": 0.5})
    assert after.share_of("agent", THREE) == pytest.approx(0.5)
    assert sum(1 for p in after.fracs.values() if len(p) > 1) == 1
    assert not after.draining


def test_pinned_instance_never_leaves_its_pool() -> None:
    before = plan_allocation(THREE, {"agent": 1 / 3, "normal": 2 / 3}, pinned={"e2": "agent"})
    assert dict(before.pools_of("e2")) == {"agent": 1.0}
    after = plan_moves(before, THREE, {"agent": 0.0, "normal": 1.0}, pinned={"e2": "agent"})
    assert dict(after.pools_of("e2")) == {"agent": 1.0}


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=8),
    start=st.floats(0.0, 1.0),
    targets=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6),
)
def test_moves_keep_the_invariants(n: int, start: float, targets: list[float]) -> None:
    capacity = {f"e{i}": 1.0 for i in range(n)}
    alloc = plan_allocation(capacity, {"agent": start, "normal": 1 - start})
    for k, target in enumerate(targets):
        before = alloc
        alloc = plan_moves(alloc, capacity, {"agent": target, "normal": 1 - target}, now_s=k)
        alloc = Allocation(alloc.fracs)  # drains end between steps
        for by_pool in alloc.fracs.values():
            assert sum(by_pool.values()) == pytest.approx(1.0)
            assert all(0 < f <= 1 + 1e-9 for f in by_pool.values())
        assert sum(1 for p in alloc.fracs.values() if len(p) > 1) <= 1
        # at most one instance changes pools wholly per plan
        whole_moves = [
            i
            for i in capacity
            if len(before.pools_of(i)) == 1
            and len(alloc.pools_of(i)) == 1
            and set(before.pools_of(i)) != set(alloc.pools_of(i))
        ]
        assert len(whole_moves) <= 1
    # repeated plans (one whole instance each) reach the last target, up to a sliver
    for _ in range(n):
        alloc = Allocation(
            plan_moves(alloc, capacity, {"agent": target, "normal": 1 - target}).fracs
        )
    assert alloc.share_of("agent", capacity) == pytest.approx(target, abs=0.05 / n + 1e-6)
