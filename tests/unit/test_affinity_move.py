"""A run's step stays where its prefix is cached unless that costs more than recomputing it:
`move_is_faster`, the `affinity_or_move` filter in the picker, the two comparison placements,
and the admitter's inputs to it (the time a step waited, the expected wait for its home)."""

from __future__ import annotations

import random

import pytest

from pools.allocation import plan_allocation
from pools.fleet import Fleet
from pools.launchers.base import InstanceSpec
from pools.telemetry import InstanceReading
from router.picking import (
    Candidate,
    Picker,
    PickRequest,
    RunAffinity,
    default_picker,
    move_is_faster,
)


def test_move_only_when_recomputing_is_faster_than_waiting() -> None:
    # 2,000 cached tokens at 1,000 tok/s elsewhere: moving costs 2 s
    args = {"context_tokens": 2000, "prefill_tokens_per_s": 1000.0}
    assert not move_is_faster(**args, home_wait_s=1.5, waited_s=0.0)  # wait 1.5 s < 2 s
    assert move_is_faster(**args, home_wait_s=2.5, waited_s=0.0)  # wait 2.5 s > 2 s
    # waited 2 s already: as long as the prefill would have taken; stop waiting
    assert move_is_faster(**args, home_wait_s=1.5, waited_s=2.0)
    assert not move_is_faster(**args, home_wait_s=1.5, waited_s=1.9)
    # nothing to weigh: behave as without affinity
    assert move_is_faster(
        context_tokens=2000, prefill_tokens_per_s=None, home_wait_s=1.0, waited_s=0.0
    )
    assert move_is_faster(**args, home_wait_s=None, waited_s=0.0)
    assert move_is_faster(
        context_tokens=0, prefill_tokens_per_s=1000.0, home_wait_s=0.1, waited_s=0.0
    )


def _reading() -> InstanceReading:
    return InstanceReading(0.0, 0.1, 0, 0, 100, 16, 0, 0, 0, 0, 0, 0, 0)


def _rig(placement: str) -> tuple[Picker, RunAffinity, list[Candidate], Fleet]:
    fleet = Fleet([InstanceSpec(f"e{i}", f"http://e{i}", 1) for i in range(3)], clock=lambda: 0.0)
    for i in range(3):
        fleet.record_reading(f"e{i}", _reading())
        state = fleet.get(f"e{i}")
        assert state is not None
        state.prefill_tokens_per_s = 1000.0 * (i + 1)  # e2 prefills fastest: 3,000 tok/s
    affinity = RunAffinity()
    affinity.record("run", "e0", context_tokens=6000)  # home e0; 6,000 tokens cached there
    picker = default_picker(fleet, affinity, random.Random(0), placement=placement)
    alloc = plan_allocation(fleet.capacity_gpus(), {"agent": 1.0})
    return picker, affinity, picker.candidates(alloc, "agent"), fleet


def _pick(picker: Picker, cands: list[Candidate], **kw: object) -> str | None:
    chosen = picker.pick(PickRequest("agent", "run", **kw), cands)  # type: ignore[arg-type]
    return None if chosen is None else chosen.instance_id


ALL = frozenset({"e0", "e1", "e2"})
NOT_HOME = frozenset({"e1", "e2"})


def test_affinity_or_move_keeps_home_while_it_has_headroom() -> None:
    picker, _, cands, _ = _rig("affinity_or_move")
    assert _pick(picker, cands, allowed=ALL, home_wait_s=100.0) == "e0"


def test_affinity_or_move_weighs_the_wait_at_home_against_prefill_elsewhere() -> None:
    picker, _, cands, fleet = _rig("affinity_or_move")
    # home full; recomputing 6,000 tokens at e2's 3,000 tok/s takes 2 s
    assert _pick(picker, cands, allowed=NOT_HOME, home_wait_s=1.0) is None  # wait for home
    assert _pick(picker, cands, allowed=NOT_HOME, home_wait_s=3.0) in NOT_HOME  # move
    assert _pick(picker, cands, allowed=NOT_HOME, home_wait_s=1.0, waited_s=2.0) in NOT_HOME
    # only e1 (2,000 tok/s: 3 s of prefill) is granted: waiting 2.5 s wins
    assert _pick(picker, cands, allowed=frozenset({"e1"}), home_wait_s=2.5) is None
    # the home is down: nothing to wait for
    fleet.record_failure("e0", "refused", immediate=True)
    assert _pick(picker, cands, allowed=NOT_HOME, home_wait_s=0.1) in NOT_HOME
    # the home was tried for this request (it refused): move
    picker, _, cands, _ = _rig("affinity_or_move")
    assert (
        _pick(picker, cands, allowed=NOT_HOME, home_wait_s=0.1, exclude=frozenset({"e0"}))
        in NOT_HOME
    )


def test_a_moved_runs_affinity_follows_it() -> None:
    picker, affinity, cands, _ = _rig("affinity_or_move")
    moved = _pick(picker, cands, allowed=NOT_HOME, home_wait_s=10.0)
    assert moved in NOT_HOME
    affinity.record("run", moved, context_tokens=6100)  # what the proxy does at the step's end
    assert _pick(picker, cands, allowed=ALL, home_wait_s=10.0) == moved


@pytest.mark.parametrize(
    ("placement", "expected"),
    [("always_affinity", None), ("least_loaded", "e1"), ("affinity_or_move", "e1")],
)
def test_comparison_placements(placement: str, expected: str | None) -> None:
    picker, _, cands, _ = _rig(placement)
    # home full and a long wait there: always_affinity still waits, the others move
    assert _pick(picker, cands, allowed=frozenset({"e1"}), home_wait_s=60.0) == expected
    if placement == "least_loaded":  # home has room but is the most loaded: not chosen
        for c in cands:
            c.state.inflight = 3 if c.instance_id == "e0" else 0
        assert _pick(picker, cands, allowed=ALL) != "e0"
    else:
        assert _pick(picker, cands, allowed=ALL) == "e0"


def test_unknown_placement_is_refused() -> None:
    fleet = Fleet([], clock=lambda: 0.0)
    with pytest.raises(ValueError, match="unknown placement"):
        default_picker(fleet, RunAffinity(), random.Random(0), placement="sticky")
