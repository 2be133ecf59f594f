"""The what-if simulator: the router's own admission, picking and rebalancer over modelled
engines, in simulated time."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.prompts import PromptMaker
from benchmarks.scenario import parse_scenario
from benchmarks.simulate.model import EngineModel, LatencyModel, SimSequence
from benchmarks.simulate.sim import SimResult, simulate, summarize
from benchmarks.workload import build_plan
from pools.config import DEFAULT_CPU_CONFIG, parse_config

SCENARIO: dict[str, Any] = {
    "name": "shift",
    "seed": 5,
    "duration_s": 120,
    "drain_timeout_s": 60,
    "classes": {
        "normal": {
            "kind": "chat",
            "arrivals": {
                "process": "schedule",
                "segments": [{"start_s": 0, "rate_per_s": 6.0}, {"start_s": 60, "rate_per_s": 0.5}],
            },
            "prompt_tokens": {"dist": "fixed", "value": 200},
            "output_tokens": {"dist": "fixed", "value": 64},
        },
        "agent": {
            "kind": "agent",
            "arrivals": {
                "process": "schedule",
                "segments": [
                    {"start_s": 0, "rate_per_s": 0.02},
                    {"start_s": 60, "rate_per_s": 1.0},
                ],
            },
            "steps": {"dist": "fixed", "value": 3},
            "prompt_tokens": {"dist": "fixed", "value": 1500},
            "output_tokens": {"dist": "fixed", "value": 64},
            "tool_result_tokens": {"dist": "fixed", "value": 100},
            "tool_wait_ms": {"dist": "fixed", "value": 500},
            "max_context_tokens": 3900,
        },
    },
}
SLOW = LatencyModel(tpot_intercept_s=0.01, tpot_slope_s=0.004, prefill_tokens_per_s=3000)


def config(tmp_path: Path, enabled: bool) -> Any:
    data = copy.deepcopy(DEFAULT_CPU_CONFIG)
    data["router"] = {"ledger_path": str(tmp_path / "l"), "state_path": str(tmp_path / "s.json")}
    data["rebalancer"] = {
        "enabled": enabled,
        "interval_s": 5,
        "cooldown_s": 10,
        "smoothing_window_s": 10,
        "hysteresis_frac": 0.3,
        "max_step_frac": 0.34,
    }
    return parse_config(data)


def test_engine_model_processor_sharing() -> None:
    engine = EngineModel(LatencyModel(0.01, 0.0, 1000.0), capacity_blocks=100)
    a = SimSequence(prefill_left_tokens=100, output_tokens=11, blocks=10)
    engine.add(a)
    assert engine.next_event_s() == pytest.approx(0.1)  # 100 tokens at 1000 tok/s
    assert engine.advance(0.1, 0.1) == [] and a.first_token_at_s == 0.1
    assert engine.next_event_s() == pytest.approx(0.1)  # 10 more tokens at 10 ms
    assert engine.advance(0.1, 0.2) == [a]
    assert engine.itl_count == pytest.approx(10) and engine.itl_sum_s == pytest.approx(0.1)


def test_static_vs_rebalanced_on_a_demand_shift(tmp_path: Path) -> None:
    plan = build_plan(parse_scenario(SCENARIO), PromptMaker())
    static = simulate(config(tmp_path, False), plan, SLOW, capacity_blocks=2000)
    moved = simulate(config(tmp_path, True), plan, SLOW, capacity_blocks=2000)
    s, m = summarize(static, config(tmp_path, False)), summarize(moved, config(tmp_path, True))
    # GPU-seconds held add up to 3 engines x the simulated time, in both
    for r in (static, moved):
        total = sum(r.gpu_seconds_by_pool.values())
        assert r.simulated_s > 120 and total == pytest.approx(3 * r.simulated_s)
    assert s["moves"] == []
    assert m["moves"] and m["moves"][0]["to"] == "agent" and m["moves"][0]["t_s"] > 60
    assert max(sh["agent"] for _, sh in moved.shares) > 0.6
    assert all(0.2 - 1e-9 <= sh["agent"] <= 0.67 + 1e-9 for _, sh in moved.shares)
    # the agent surge is served better with the engine the rebalancer moved
    assert m["pools"]["agent"]["ttft_p95_s"] < s["pools"]["agent"]["ttft_p95_s"]
    assert s["pools"]["normal"]["requests"] == m["pools"]["normal"]["requests"] > 300


def test_deterministic(tmp_path: Path) -> None:
    plan = build_plan(parse_scenario(SCENARIO), PromptMaker())
    a = simulate(config(tmp_path, True), plan, SLOW, capacity_blocks=2000)
    b = simulate(config(tmp_path, True), plan, SLOW, capacity_blocks=2000)
    assert a.requests == b.requests and a.decisions == b.decisions


def _digest(result: SimResult) -> str:
    """Every output of a run (each request's times, each run's completion, the ratio samples,
    the moves, GPU-seconds), canonical JSON, hashed."""
    doc = [
        result.requests,
        result.runs,
        result.shares,
        result.decisions,
        {pool: round(gpu_s, 3) for pool, gpu_s in result.gpu_seconds_by_pool.items()},
        round(result.simulated_s, 4),
    ]
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


@pytest.mark.parametrize(
    ("enabled", "moves", "queued", "digest"),
    [(False, 0, 143, "c56eb53f1841e40f"), (True, 4, 44, "bb8bf6152ab25cfc")],
)
def test_outputs_pinned(
    tmp_path: Path, enabled: bool, moves: int, queued: int, digest: str
) -> None:
    """The simulator's outputs on a small trace, pinned: an optimisation of its event loop or
    engine model must leave every request's times, every run, the ratio and the moves as they
    were. (Values recorded from the engine model of 2026-11-30; a change of the model itself
    changes them, and says why in its commit.)"""
    latency = LatencyModel(0.01, 0.004, 3000.0, overhead_s=0.05, overhead_samples_s=(0.02, 0.3))
    plan = build_plan(parse_scenario(SCENARIO), PromptMaker())
    result = simulate(config(tmp_path, enabled), plan, latency, capacity_blocks=600)
    assert len(result.requests) == 545 and not any(r["rejected"] for r in result.requests)
    assert len(result.decisions) == moves
    assert sum(1 for r in result.requests if (r["queue_s"] or 0) > 0.01) == queued
    assert _digest(result) == digest
