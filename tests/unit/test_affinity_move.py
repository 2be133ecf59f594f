"""A run's step stays where its prefix is cached unless that costs more than recomputing it:
`move_is_faster`, the `affinity_or_move` filter in the picker, the two comparison placements,
and the admitter's inputs to it (the time a step waited, the expected wait for its home)."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import TypedDict, Unpack

import pytest

from pools.allocation import plan_allocation
from pools.fleet import Fleet
from pools.launchers.base import InstanceSpec
from pools.telemetry import InstanceReading
from pools.testing.config import config_for_test, even_pools
from router.admission.picking import (
    Candidate,
    Picker,
    PickRequest,
    RunAffinity,
    default_picker,
    expected_home_wait_s,
    move_cost_s,
    move_is_faster,
    placement_patience_s,
    uncached_prefill_tokens_per_s,
)


def test_the_uncached_prefill_rate_discounts_the_measured_hits() -> None:
    # 20,000 prompt tokens/s measured while 3 in 4 of them were cached: 5,000 computed per s
    assert uncached_prefill_tokens_per_s(20_000.0, 0.75) == pytest.approx(5_000.0)
    assert uncached_prefill_tokens_per_s(20_000.0, None) == pytest.approx(20_000.0)
    # a hit rate of 99 % counts as 90 %: 2,000 tok/s, not 200
    assert uncached_prefill_tokens_per_s(20_000.0, 0.99) == pytest.approx(2_000.0)
    assert uncached_prefill_tokens_per_s(None, 0.5) is None


def test_the_expected_wait_for_a_full_home() -> None:
    # 2 sequences of 2 s each: one ends every second; the first waiter waits 1 s
    assert expected_home_wait_s(running=2, waiting_ahead=0, step_s=2.0) == pytest.approx(1.0)
    # 3 others wait for the same home: the 4th slot to free, 4 s
    assert expected_home_wait_s(running=2, waiting_ahead=3, step_s=2.0) == pytest.approx(4.0)
    # full with nothing of ours running (KV held by others): one step's time
    assert expected_home_wait_s(running=0, waiting_ahead=0, step_s=2.0) == pytest.approx(2.0)


class _Step(TypedDict):
    context_tokens: int
    prefill_tokens_per_s: float


class _Move(_Step):
    dest_running: int
    dest_pending_prefill_tokens: int


class _Spare(_Move):
    dest_free_slots: int
    dest_awaited: int


def test_the_cost_of_a_move() -> None:
    # 3,000 tokens at 6,000 tok/s: 0.5 s for the step itself
    one: _Step = {"context_tokens": 3000, "prefill_tokens_per_s": 6000.0}
    assert move_cost_s(**one, dest_running=0) == pytest.approx(0.5)
    # one sequence decoding there stalls 0.5 s too: 1.0 s in all
    assert move_cost_s(**one, dest_running=1) == pytest.approx(1.0)
    # 1,200 tokens already pending there: 0.2 s first
    assert move_cost_s(**one, dest_running=1, dest_pending_prefill_tokens=1200) == pytest.approx(
        1.2
    )


# 3,000 tokens at 6,000 tok/s onto an instance with one sequence decoding and 1,200 tokens of
# prefill pending: the move costs 0.2 + 0.5 x 2 = 1.2 s
MOVE: _Move = {
    "context_tokens": 3000,
    "prefill_tokens_per_s": 6000.0,
    "dest_running": 1,
    "dest_pending_prefill_tokens": 1200,
}


def test_move_only_when_waiting_costs_more_than_the_move() -> None:
    spare: _Spare = {**MOVE, "dest_free_slots": 3, "dest_awaited": 0}
    assert not move_is_faster(**spare, home_wait_s=1.1, waited_s=0.0)  # 1.1 s < 1.2 s
    assert move_is_faster(**spare, home_wait_s=1.3, waited_s=0.0)  # 1.3 s > 1.2 s
    # ski rental: waited as long as the move costs, whatever the estimate
    assert move_is_faster(**spare, home_wait_s=0.5, waited_s=1.2)
    assert not move_is_faster(**spare, home_wait_s=0.5, waited_s=1.19)
    assert not move_is_faster(**spare, home_wait_s=None, waited_s=1.19)
    assert move_is_faster(**spare, home_wait_s=None, waited_s=1.2)
    # no free-slot count known: no spare-room check
    assert move_is_faster(**MOVE, home_wait_s=1.3, waited_s=0.0)


def test_never_move_onto_an_instance_without_spare_room() -> None:
    # a wait of 100 s at home would pay for the move many times over, but:
    # one free slot: this step would fill it, and the next step of a run at home there waits
    assert not move_is_faster(**MOVE, home_wait_s=100.0, waited_s=100.0, dest_free_slots=1)
    # two free slots and one step already waiting for the destination as its home
    assert not move_is_faster(
        **MOVE, home_wait_s=100.0, waited_s=0.0, dest_free_slots=2, dest_awaited=1
    )
    # two free slots, nobody waiting for them: one is spare
    assert move_is_faster(**MOVE, home_wait_s=100.0, waited_s=0.0, dest_free_slots=2)
    assert move_is_faster(
        **MOVE, home_wait_s=100.0, waited_s=0.0, dest_free_slots=3, dest_awaited=1
    )


def test_unknowns() -> None:
    # no prefill rate measured: nothing to weigh, keep the cache
    assert not move_is_faster(
        context_tokens=3000, prefill_tokens_per_s=None, home_wait_s=100.0, waited_s=100.0
    )
    # nothing cached at home: a move costs nothing
    assert move_is_faster(
        context_tokens=0, prefill_tokens_per_s=6000.0, home_wait_s=0.1, waited_s=0.0
    )


def _reading() -> InstanceReading:
    return InstanceReading(0.0, 0.1, 0, 0, 100, 16, 0, 0, 0, 0, 0, 0, 0)


def _rig(placement: str) -> tuple[Picker, RunAffinity, list[Candidate], Fleet]:
    fleet = Fleet([InstanceSpec(f"e{i}", f"http://e{i}", 1) for i in range(3)], clock=lambda: 0.0)
    # uncached prefill rates: e1 4,000 x (1 - 0.5) = 2,000 tok/s; e2 12,000 x (1 - 0.75) =
    # 3,000 tok/s, with one sequence running there
    rates = {"e0": (1000.0, 0.0), "e1": (4000.0, 0.5), "e2": (12000.0, 0.75)}
    for i in range(3):
        fleet.record_reading(f"e{i}", _reading())
        state = fleet.get(f"e{i}")
        assert state is not None
        state.prefill_tokens_per_s, state.prefix_hit_frac = rates[f"e{i}"]
        state.inflight = 1 if i == 2 else 0
    affinity = RunAffinity()
    affinity.record("run", "e0", context_tokens=6000)  # home e0; 6,000 tokens cached there
    picker = default_picker(fleet, affinity, random.Random(0), placement=placement)
    alloc = plan_allocation(fleet.capacity_gpus(), {"agent": 1.0})
    return picker, affinity, picker.candidates(alloc, "agent"), fleet


class _PickFields(TypedDict, total=False):  # PickRequest's fields these tests set
    exclude: frozenset[str]
    allowed: frozenset[str] | None
    waited_s: float
    home_wait_s: float | None
    now_s: float | None
    free_slots: Mapping[str, int] | None
    awaited: Mapping[str, int] | None


def _pick(picker: Picker, cands: list[Candidate], **kw: Unpack[_PickFields]) -> str | None:
    chosen = picker.pick(PickRequest("agent", "run", **kw), cands)
    return None if chosen is None else chosen.instance_id


ALL = frozenset({"e0", "e1", "e2"})
NOT_HOME = frozenset({"e1", "e2"})


def test_affinity_or_move_keeps_home_while_it_has_headroom() -> None:
    picker, _, cands, _ = _rig("affinity_or_move")
    assert _pick(picker, cands, allowed=ALL, home_wait_s=100.0) == "e0"


def test_affinity_or_move_weighs_the_wait_at_home_against_each_move() -> None:
    picker, _, cands, fleet = _rig("affinity_or_move")
    # home full; recomputing 6,000 tokens costs 3 s on e1 (2,000 tok/s, idle) and
    # 2 s x (1 + 1 running) = 4 s on e2 (3,000 tok/s)
    assert _pick(picker, cands, allowed=NOT_HOME, home_wait_s=2.5) is None  # wait for home
    assert _pick(picker, cands, allowed=NOT_HOME, home_wait_s=3.5) == "e1"  # e2 costs more
    assert _pick(picker, cands, allowed=frozenset({"e2"}), home_wait_s=3.5) is None
    assert _pick(picker, cands, allowed=frozenset({"e2"}), home_wait_s=4.5) == "e2"
    # ski rental: waited 3 s, the cost of the move to e1
    assert _pick(picker, cands, allowed=NOT_HOME, home_wait_s=0.1, waited_s=3.0) == "e1"
    # e1 has one free slot only (no spare room): e2, with five, is the only move
    free = {"e0": 0, "e1": 1, "e2": 5}
    assert _pick(picker, cands, allowed=NOT_HOME, home_wait_s=5.0, free_slots=free) == "e2"
    # ... unless four steps wait for e2 as their home: then none is
    assert (
        _pick(picker, cands, allowed=NOT_HOME, home_wait_s=5.0, free_slots=free, awaited={"e2": 4})
        is None
    )
    # the home is down: nothing to wait for
    fleet.record_failure("e0", "refused", immediate=True)
    assert _pick(picker, cands, allowed=NOT_HOME, home_wait_s=0.1) in NOT_HOME
    # the home was tried for this request (it refused): move
    picker, _, cands, _ = _rig("affinity_or_move")
    assert (
        _pick(picker, cands, allowed=NOT_HOME, home_wait_s=0.1, exclude=frozenset({"e0"}))
        in NOT_HOME
    )


def test_a_move_waits_behind_the_prefill_pending_there() -> None:
    picker, _, cands, fleet = _rig("affinity_or_move")
    e1 = fleet.get("e1")
    assert e1 is not None
    # 2,000 prompt tokens in prefill on e1 until t=5: 1 s more before the move's 3 s there
    fleet.acquire("e1", "agent", blocks=1, prompt_tokens=2000, prefill_s=5.0)
    assert e1.inflight == 1  # and its decode stalls for the 3 s: 1 + 3 x 2 = 7 s in all
    assert _pick(picker, cands, allowed=frozenset({"e1"}), home_wait_s=6.5, now_s=1.0) is None
    assert _pick(picker, cands, allowed=frozenset({"e1"}), home_wait_s=7.5, now_s=1.0) == "e1"


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


def test_always_affinity_stops_waiting_for_home_after_its_patience() -> None:
    """A step whose home stays full waits for it up to the pool's patience (half the queue's
    `max_wait_s` in the router), then takes an instance with room, rather than a 429 at
    `max_wait_s` while the others idle. A pool with no patience given waits for ever."""
    fleet = Fleet([InstanceSpec(f"e{i}", f"http://e{i}", 1) for i in range(2)], clock=lambda: 0.0)
    for i in range(2):
        fleet.record_reading(f"e{i}", _reading())
    affinity = RunAffinity()
    affinity.record("run", "e0", context_tokens=6000)
    picker = default_picker(
        fleet, affinity, random.Random(0), placement="always_affinity", patience_s={"agent": 60.0}
    )
    cands = picker.candidates(plan_allocation(fleet.capacity_gpus(), {"agent": 1.0}), "agent")
    not_home = frozenset({"e1"})
    assert _pick(picker, cands, allowed=not_home, waited_s=59.9) is None
    assert _pick(picker, cands, allowed=not_home, waited_s=60.0) == "e1"
    assert (
        _pick(picker, cands, allowed=frozenset({"e0", "e1"}), waited_s=90.0) == "e0"
    )  # home first
    patient = default_picker(fleet, affinity, random.Random(0), placement="always_affinity")
    assert _pick(patient, cands, allowed=not_home, waited_s=1e6) is None


def test_the_router_gives_always_affinity_half_the_queue_wait() -> None:
    pools = even_pools(
        agent={"share": {"initial_frac": 0.34}, "queue": {"max_wait_s": 40}},
        normal={"share": {"initial_frac": 0.66}},
    )
    config = config_for_test(pools=pools)
    assert placement_patience_s(config) == {"agent": 20.0, "normal": 5.0}  # default max wait 10 s
