"""The placement benchmark's arithmetic (benchmarks/placement.py): the prefix-cache hit rate
between two scrapes of the engines' token counters, how often a run's step moved, and what
`affinity_or_move` weighed when a run's home was full (from the picker's debug records)."""

from __future__ import annotations

import logging
import random

import pytest

from benchmarks.placement import (
    DecisionLog,
    hit_rate,
    moved_steps,
    scenario,
    stayed_waits,
    summarize_decisions,
)
from pools.allocation import plan_allocation
from pools.fleet import Fleet
from pools.launchers.base import InstanceSpec
from pools.telemetry import InstanceReading
from router.admission.picking import PickRequest, RunAffinity, default_picker


def test_hit_rate_is_hit_tokens_over_queried_tokens_summed_over_engines() -> None:
    before = {"e0": (100.0, 1000.0), "e1": (0.0, 0.0), "e2": (5.0, 50.0)}
    after = {"e0": (700.0, 2000.0), "e1": (300.0, 1000.0), "e2": (5.0, 50.0)}
    overall, per = hit_rate(before, after)
    # (600 + 300 + 0) / (1000 + 1000 + 0)
    assert overall == pytest.approx(0.45)
    assert per == {"e0": pytest.approx(0.6), "e1": pytest.approx(0.3), "e2": None}
    assert hit_rate(before, before)[0] is None


def test_moved_steps_counts_a_step_elsewhere_than_its_runs_previous_one() -> None:
    steps = [("a", "e0"), ("b", "e1"), ("a", "e0"), ("a", "e2"), ("b", "e1"), ("a", "e2")]
    # a: e0 -> e0 (stay), e0 -> e2 (move), e2 -> e2 (stay); b: e1 -> e1 (stay)
    assert moved_steps(steps) == (1, 4)
    assert moved_steps([]) == (0, 0)


def test_the_workload_is_agent_floods_runs_at_the_scaled_surge_rate() -> None:
    plan = scenario(0.5, 60.0)
    assert [c.name for c in plan.classes] == ["agent"]
    assert plan.duration_s == 60.0


def test_the_decisions_of_a_full_home_are_collected_from_the_pickers_debug_records() -> None:
    fleet = Fleet([InstanceSpec(f"e{i}", f"http://e{i}", 1) for i in range(2)], clock=lambda: 0.0)
    for i in range(2):
        fleet.record_reading(f"e{i}", InstanceReading(0.0, 0.1, 0, 0, 100, 16, 0, 0, 0, 0, 0, 0, 0))
        state = fleet.get(f"e{i}")
        assert state is not None
        state.prefill_tokens_per_s = 1000.0  # 2,000 tokens: a 2 s move onto idle e1
    affinity = RunAffinity()
    affinity.record("run", "e0", context_tokens=2000)
    picker = default_picker(fleet, affinity, random.Random(0), placement="affinity_or_move")
    cands = picker.candidates(plan_allocation(fleet.capacity_gpus(), {"agent": 1.0}), "agent")
    log = logging.getLogger("router.admission.picking")
    collected = DecisionLog()
    log.addHandler(collected)
    log.setLevel(logging.DEBUG)
    try:
        for home_wait_s in (1.0, 3.0, None):
            picker.pick(
                PickRequest("agent", "run", allowed=frozenset({"e1"}), home_wait_s=home_wait_s),
                cands,
            )
    finally:
        log.removeHandler(collected)
        log.setLevel(logging.NOTSET)
    summary = summarize_decisions(collected.decisions)
    assert summary["weighed"] == 3
    assert summary["moves"] == 1  # only a 3 s wait beats the 2 s move
    assert summary["home_wait_unknown"] == 1
    assert summary["home_wait_s"] == {"p5": 1.0, "p50": 3.0, "p95": 3.0, "max": 3.0}
    assert summarize_decisions([])["home_wait_s"] is None


def test_stayed_waits_pairs_a_steps_first_estimate_with_the_wait_that_followed() -> None:
    def d(run: str, est: float | None, waited: float, moves: bool = False) -> dict[str, object]:
        return {
            "run": run,
            "moves": moves,
            "home_wait_s": est,
            "waited_s": waited,
            "context_tokens": 2000,
        }

    decisions = [
        d("a", 1.0, 0.0),
        d("b", 2.0, 0.0),
        d("a", 0.8, 0.4),
        d("c", None, 0.0),
        d("b", 1.0, 0.5, moves=True),  # b's step moved: nothing to compare
        d("a", 0.5, 0.9),  # a's step: expected 1.0 s, then waited 0.9 s more (at least)
        d("c", None, 1.0),  # no estimate
        d("a", 0.3, 0.0),  # a's next step, weighed once
    ]
    assert stayed_waits(decisions) == [(1.0, 0.9)]
    summary = summarize_decisions(decisions)
    assert summary["stayed_steps"] == 1
    assert summary["moves"] == 1
