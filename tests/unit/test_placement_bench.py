"""The placement benchmark's arithmetic (benchmarks/placement.py): the prefix-cache hit rate
between two scrapes of the engines' token counters, and how often a run's step moved."""

from __future__ import annotations

import pytest

from benchmarks.placement import hit_rate, moved_steps, scenario


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
