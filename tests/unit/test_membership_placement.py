"""Fleet changes (Kubernetes/Ray discovery) are placed from the current allocation through
`plan_moves`: a joining engine goes where the target shares need it, a leaving one is dropped,
the engines that stay keep their pools, and a drain in progress goes on."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from prometheus_client import CollectorRegistry

from pools.allocation import Allocation, Drain, PoolMap, plan_allocation
from pools.fleet import Fleet
from pools.launchers.base import InstanceSpec
from router.accounting.accountant import Accountant
from router.admission.membership import Membership


class Clock:
    def __init__(self, now_s: float) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


HALF = {"agent": 0.5, "normal": 0.5}


def spec(i: int) -> InstanceSpec:
    return InstanceSpec(f"e{i}", f"http://127.0.0.1:{8400 + i}", 1)


def rig(
    fracs: Mapping[str, Mapping[str, float]],
    shares: Mapping[str, float],
    draining: Mapping[str, Drain] | None = None,
) -> tuple[Membership, PoolMap, Clock]:
    clock = Clock(100.0)
    specs = [spec(int(i[1:])) for i in sorted(fracs)]
    fleet = Fleet(specs, clock=clock)
    accountant = Accountant()
    for s in specs:
        accountant.add_instance(s.instance_id, 1.0, {}, clock())
    pool_map = PoolMap(Allocation(fracs, 0, draining or {}))
    membership = Membership(
        fleet,
        pool_map,
        accountant,
        target_shares=lambda: dict(shares),
        drain_timeout_s=30.0,
        registry=CollectorRegistry(),
        clock=clock,
    )
    return membership, pool_map, clock


def test_adding_an_engine_moves_no_existing_one() -> None:
    """One agent engine and two normal ones at 1/3 : 2/3; a fourth joins. 4 x 1/3 = 1.33
    engines for agent and 2.67 for normal: the new engine takes the missing 1/3 and 2/3, and the
    three engines that were there keep their pools (planning from scratch would put e0, the
    agent engine, into normal: a swap under live traffic)."""
    before = {"e0": {"agent": 1.0}, "e1": {"normal": 1.0}, "e2": {"normal": 1.0}}
    shares = {"agent": 1 / 3, "normal": 2 / 3}
    membership, pool_map, _ = rig(before, shares)
    membership.reconcile([spec(0), spec(1), spec(2), spec(3)])
    after = pool_map.current
    for instance_id, by_pool in before.items():
        assert dict(after.pools_of(instance_id)) == by_pool
    assert dict(after.pools_of("e3")) == pytest.approx({"agent": 1 / 3, "normal": 2 / 3})
    assert not after.draining
    capacity = {f"e{i}": 1.0 for i in range(4)}
    scratch = plan_allocation(capacity, shares)
    assert any(dict(scratch.pools_of(i)) != by for i, by in before.items())  # what it replaced


def test_a_fleet_change_during_a_drain_keeps_the_drain() -> None:
    """e1 is draining from normal to agent when e3 leaves the fleet: the drain goes on (same
    deadline), e0, e1 and e2 keep their places, and nothing else starts to drain."""
    drain = Drain("normal", "agent", 90.0, 120.0)
    before = {
        "e0": {"agent": 1.0},
        "e1": {"agent": 1.0},  # on its way from normal
        "e2": {"normal": 1.0},
        "e3": {"normal": 1.0},
    }
    membership, pool_map, _ = rig(before, {"agent": 0.5, "normal": 0.5}, {"e1": drain})
    membership.reconcile([spec(0), spec(1), spec(2)])
    after = pool_map.current
    assert dict(after.draining) == {"e1": drain}
    assert "e3" not in after.fracs
    for instance_id in ("e0", "e1", "e2"):
        assert dict(after.pools_of(instance_id)) == before[instance_id]
    # and a join during the drain: the drain still goes on
    membership.reconcile([spec(0), spec(1), spec(2), spec(4)])
    assert dict(pool_map.current.draining) == {"e1": drain}
    assert dict(pool_map.current.pools_of("e1")) == {"agent": 1.0}


def test_a_pool_left_without_engines_gets_a_part_of_one() -> None:
    """The only agent engine leaves: the agent pool's 1/3 of the two engines left is 2/3 of
    one engine, so one normal engine is split 2/3 agent, 1/3 normal (a split applies at once,
    no drain), and the other stays whole in normal."""
    before = {"e0": {"agent": 1.0}, "e1": {"normal": 1.0}, "e2": {"normal": 1.0}}
    membership, pool_map, _ = rig(before, {"agent": 1 / 3, "normal": 2 / 3})
    membership.reconcile([spec(1), spec(2)])
    after = pool_map.current
    assert "e0" not in after.fracs
    split = [i for i in ("e1", "e2") if len(after.pools_of(i)) == 2]
    whole = [i for i in ("e1", "e2") if dict(after.pools_of(i)) == {"normal": 1.0}]
    assert len(split) == 1 and len(whole) == 1
    assert dict(after.pools_of(split[0])) == pytest.approx({"agent": 2 / 3, "normal": 1 / 3})
    assert not after.draining


def test_a_pool_left_without_engines_gets_a_whole_one_by_a_drain() -> None:
    """Half and half on four engines; both agent engines leave: agent's half of the two left
    is one whole engine, which moves to agent draining its chat first (deadline now +
    drain_timeout_s); the other stays in normal."""
    before = {
        "e0": {"agent": 1.0},
        "e1": {"agent": 1.0},
        "e2": {"normal": 1.0},
        "e3": {"normal": 1.0},
    }
    membership, pool_map, _ = rig(before, {"agent": 0.5, "normal": 0.5})
    membership.reconcile([spec(2), spec(3)])
    after = pool_map.current
    assert sorted(after.fracs) == ["e2", "e3"]
    [(moved, drain)] = after.draining.items()
    assert dict(after.pools_of(moved)) == {"agent": 1.0}
    assert (drain.from_pool, drain.to_pool, drain.deadline_s) == ("normal", "agent", 130.0)
    [stays] = [i for i in ("e2", "e3") if i != moved]
    assert dict(after.pools_of(stays)) == {"normal": 1.0}


def test_scaling_up_from_one_split_engine_leaves_no_sliver() -> None:
    """One engine split 0.34 / 0.66 (the only way one engine serves two pools); two more join.
    1.02 engines for agent and 1.98 for normal: the newcomers go whole where the need is, the
    split engine gives the rest, and the 0.02 of an engine it would keep for agent is not worth
    a split, so every engine ends whole: one agent, two normal (the Kubernetes integration
    test's scale-up)."""
    before = {"e0": {"agent": 0.34, "normal": 0.66}}
    membership, pool_map, _ = rig(before, {"agent": 0.34, "normal": 0.66})
    membership.reconcile([spec(0), spec(1), spec(2)])
    after = pool_map.current
    assert sorted(dict(after.pools_of(i)).popitem()[0] for i in ("e0", "e1", "e2")) == [
        "agent",
        "normal",
        "normal",
    ]
    assert all(len(after.pools_of(i)) == 1 for i in ("e0", "e1", "e2"))
    assert not after.draining


def test_an_engine_that_leaves_and_returns_goes_back_to_its_pool() -> None:
    """Half and half on two engines; the agent engine leaves (the normal one is split to keep
    agent served) and comes back under its id: it rejoins agent, and the split engine is whole
    in normal again (with ties in need, the neediest-pool rule alone could swap them)."""
    membership, pool_map, _ = rig({"e0": {"agent": 1.0}, "e1": {"normal": 1.0}}, HALF)
    membership.reconcile([spec(1)])
    assert dict(pool_map.current.pools_of("e1")) == pytest.approx({"agent": 0.5, "normal": 0.5})
    membership.reconcile([spec(0), spec(1)])
    after = pool_map.current
    assert dict(after.pools_of("e0")) == {"agent": 1.0}
    assert dict(after.pools_of("e1")) == {"normal": 1.0}
