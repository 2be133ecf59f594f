"""The what-if simulator: the router's own admission, picking and rebalancer over modelled
engines, in simulated time."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from benchmarks.simulate.matrix import summary_markdown
from pools.fleet import Lease
from pools.launchers.base import InstanceSpec
from pools.testing.config import config_data, config_for_test
from router.admission.decision import Need
from router.admission.estimate import Estimate
from router.cli import main as cli_main
from router.core import build_core
from router.errors import CapacityExceeded
from router.request import RequestContext
from router.simulate.fit import fit_latency
from router.simulate.model import EngineModel, LatencyModel, SimSequence
from router.simulate.prompts import PromptMaker
from router.simulate.scenario import parse_scenario
from router.simulate.sim import SimResult, simulate, summarize
from router.simulate.workload import build_plan
from tests.unit.test_rebalance_borrow import ctx as borrow_ctx
from tests.unit.test_rebalance_shell import reading

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
    rebalancer = {
        "enabled": enabled,
        "interval_s": 5,
        "cooldown_s": 10,
        "smoothing_window_s": 10,
        "hysteresis_frac": 0.3,
        "max_step_frac": 0.34,
    }
    return config_for_test(tmp_path, rebalancer=rebalancer)


def test_engine_model_processor_sharing() -> None:
    engine = EngineModel(LatencyModel(0.01, 0.0, 1000.0), capacity_blocks=100)
    a = SimSequence(prefill_left_tokens=100, output_tokens=11, blocks=10)
    assert engine.add(a, 0.0) == ([], []) and engine.used_blocks == 10
    assert engine.next_event_at_s == pytest.approx(0.1)  # 100 tokens at 1000 tok/s
    assert engine.sync(0.1) == ([a], []) and a.first_token_at_s == 0.1
    assert engine.next_event_at_s == pytest.approx(0.2)  # 10 more tokens at 10 ms
    # a second sequence joins at 0.15: its 50-token prefill runs beside a's decoding
    b = SimSequence(prefill_left_tokens=50, output_tokens=3, blocks=5)
    engine.add(b, 0.15)
    assert engine.running == 2 and engine.next_event_at_s == pytest.approx(0.2)
    assert engine.sync(0.2) == ([b], [a]) and a.done_at_s == 0.2
    assert engine.itl_count == pytest.approx(10) and engine.itl_sum_s == pytest.approx(0.1)
    # b decodes its 2 remaining tokens alone: 20 ms
    assert engine.next_event_at_s == pytest.approx(0.22)
    assert engine.sync(0.22) == ([], [b]) and engine.running == 0 and engine.used_blocks == 0
    assert engine.next_event_at_s == math.inf


def test_engine_model_shares_decode_among_the_batch() -> None:
    """TPOT = a + b·n: two sequences decoding together each get a token per a + 2b."""
    engine = EngineModel(LatencyModel(0.01, 0.005, 1e9), capacity_blocks=100)
    x = SimSequence(prefill_left_tokens=1, output_tokens=11, blocks=1)
    y = SimSequence(prefill_left_tokens=1, output_tokens=21, blocks=1)
    engine.add(x, 0.0)
    engine.add(y, 0.0)
    engine.sync(engine.next_event_at_s)
    engine.sync(engine.next_event_at_s)  # both prefilled (instantly), 10 and 20 tokens left
    t0 = engine.next_event_at_s - 10 * 0.02
    assert engine.sync(engine.next_event_at_s)[1] == [x]  # 10 tokens at 20 ms each
    assert x.done_at_s is not None
    assert x.done_at_s == pytest.approx(t0 + 0.2, abs=1e-6)
    assert engine.next_event_at_s == pytest.approx(x.done_at_s + 10 * 0.015)  # alone: 15 ms


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
    # the agent surge at 60 s draws share to agent (other moves, e.g. to a pool's floor while
    # it is idle, are the decision function's business)
    assert any(move["to"] == "agent" and move["t_s"] > 60 for move in m["moves"])
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
    the moves, GPU-seconds), canonical JSON, hashed. Shares to 9 decimals: the rebalancer's
    step comes from float percentiles of request times, whose last bits depend on how the
    engines' progress is summed (the lazy engine sums fewer, longer pieces)."""
    shares = [(t_s, {p: round(f, 9) for p, f in by_pool.items()}) for t_s, by_pool in result.shares]
    doc = [
        result.requests,
        result.runs,
        shares,
        result.decisions,
        {pool: round(gpu_s, 3) for pool, gpu_s in result.gpu_seconds_by_pool.items()},
        round(result.simulated_s, 4),
    ]
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


@pytest.mark.coin  # the picker's tie-breaks and overhead draws of `random.Random(seed)`
@pytest.mark.parametrize(
    ("enabled", "moves", "queued", "digest"),
    [(False, 0, 143, "539ec6ace26a6c51")],
)
def test_outputs_pinned(
    tmp_path: Path, enabled: bool, moves: int, queued: int, digest: str
) -> None:
    """The simulator's outputs on a small trace, pinned: an optimisation of its event loop or
    engine model must leave every request's times, every run, the ratio and the moves as they
    were. The simulator runs the router's own admission and picking code, so a change there
    (or in the engine model) changes them too: re-record them then, and say why in the commit.
    (Static ratio only: the rebalancer's decision is being reworked; the lazy engine was
    checked equal to the eager one on the rebalanced runs too, see the commit.)"""
    latency = LatencyModel(0.01, 0.004, 3000.0, overhead_s=0.05, overhead_samples_s=(0.02, 0.3))
    plan = build_plan(parse_scenario(SCENARIO), PromptMaker())
    result = simulate(config(tmp_path, enabled), plan, latency, capacity_blocks=600)
    assert len(result.requests) == 545 and not any(r["rejected"] for r in result.requests)
    assert len(result.decisions) == moves
    assert sum(1 for r in result.requests if (r["queue_s"] or 0) > 0.01) == queued
    assert _digest(result) == digest


def test_plan_without_text_has_the_same_sizes_and_times() -> None:
    """The simulator's plans write no words but draw the same random numbers: every arrival,
    size and tool wait is the one the harness would send."""
    scenario = parse_scenario(SCENARIO)
    full = build_plan(scenario, PromptMaker())
    bare = build_plan(scenario, PromptMaker(write_text=False))
    assert full.chat[0].prompt_text and not bare.chat[0].prompt_text
    assert [(c.t_s, c.prompt_tokens, c.output_tokens) for c in full.chat] == [
        (c.t_s, c.prompt_tokens, c.output_tokens) for c in bare.chat
    ]
    assert len(full.runs) == len(bare.runs) > 50
    for a, b in zip(full.runs, bare.runs, strict=True):
        assert (a.t_s, a.prompt_tokens) == (b.t_s, b.prompt_tokens)
        assert [(s.output_tokens, s.tool_result_tokens, s.tool_wait_s) for s in a.steps] == [
            (s.output_tokens, s.tool_result_tokens, s.tool_wait_s) for s in b.steps
        ]


class _EagerEngine:
    """The engine model written the plain way, as a reference: every sequence keeps its own
    counts and every sync walks the batch (the simulator's engine before it became lazy)."""

    def __init__(self, latency: LatencyModel) -> None:
        self.latency = latency
        self.seqs: list[list[float]] = []  # [prefill left, decoded, output, id]
        self.now_s = 0.0

    def add(self, now_s: float, prefill: float, output: int, ident: int) -> list[tuple[str, int]]:
        changes = self.sync(now_s)
        self.seqs.append([prefill, 0.0, float(output), float(ident)])
        return changes

    def next_event_at_s(self) -> float:
        best = math.inf
        head = next((s for s in self.seqs if s[0] > 0), None)
        if head is not None:
            best = head[0] / self.latency.prefill_tokens_per_s
        decoding = [s for s in self.seqs if s[0] <= 0]
        if decoding:
            left = min(s[2] - s[1] for s in decoding)
            best = min(best, left * self.latency.tpot_s(len(self.seqs)))
        return self.now_s + best

    def sync(self, now_s: float) -> list[tuple[str, int]]:
        dt_s, self.now_s = now_s - self.now_s, now_s
        if not self.seqs or dt_s <= 0:
            return []
        tokens = dt_s / self.latency.tpot_s(len(self.seqs))
        changes = []
        head = next((s for s in self.seqs if s[0] > 0), None)
        for s in self.seqs:
            if s[0] <= 0:
                s[1] = min(s[2], s[1] + tokens)
        if head is not None:
            head[0] -= min(head[0], dt_s * self.latency.prefill_tokens_per_s)
            if head[0] <= 1e-6:
                head[0], head[1] = 0.0, 1.0
                changes.append(("first", int(head[3])))
        for s in list(self.seqs):
            if s[0] <= 0 and s[1] >= s[2] - 1e-6:
                self.seqs.remove(s)
                changes.append(("end", int(s[3])))
        return changes


def _lazy_changes(first: list[SimSequence], ended: list[SimSequence]) -> list[tuple[str, int]]:
    return [("first", s.payload) for s in first] + [("end", s.payload) for s in ended]


@pytest.mark.parametrize("seed", range(6))
def test_lazy_engine_matches_the_eager_reference(seed: int) -> None:
    """Random arrivals on one engine: every first token and every end comes at the same time
    and in the same order from the lazy engine as from the plain per-sequence one."""
    rng = np.random.default_rng(seed)
    latency = LatencyModel(0.004, 0.0015, 2000.0)
    lazy, eager = EngineModel(latency, capacity_blocks=10**6), _EagerEngine(latency)
    arrivals = sorted(float(t) for t in rng.uniform(0, 20, size=60))
    sizes = [(float(rng.integers(1, 3000)), int(rng.integers(1, 200))) for _ in arrivals]
    seen_lazy: list[tuple[float, str, int]] = []
    seen_eager: list[tuple[float, str, int]] = []
    i = 0
    while i < len(arrivals) or lazy.running:
        t_next = arrivals[i] if i < len(arrivals) else math.inf
        t = min(t_next, lazy.next_event_at_s)
        assert eager.next_event_at_s() == pytest.approx(lazy.next_event_at_s, abs=1e-9)
        if t == t_next:
            prefill, output = sizes[i]
            seq = SimSequence(prefill_left_tokens=prefill, output_tokens=output, blocks=1)
            seq.payload = i
            seen_lazy += [(t, *c) for c in _lazy_changes(*lazy.add(seq, t))]
            seen_eager += [(t, *c) for c in eager.add(t, prefill, output, i)]
            i += 1
        else:
            seen_lazy += [(t, *c) for c in _lazy_changes(*lazy.sync(t))]
            seen_eager += [(t, *c) for c in eager.sync(t)]
    assert len(seen_lazy) == 2 * len(arrivals)
    assert [c[1:] for c in seen_lazy] == [c[1:] for c in seen_eager]
    assert [c[0] for c in seen_lazy] == pytest.approx([c[0] for c in seen_eager], abs=1e-9)


def _records(path: Path, rng: np.random.Generator, queued_frac: float) -> None:
    """Harness-style records from a known engine: TTFT = 20 ms + prompt / 40,000 tok/s plus a
    small jitter, and for `queued_frac` of the requests a router queue wait of 1-3 s on top;
    TPOT 3 ms whatever the batch."""
    lines = []
    for i in range(400):
        send_s = i * 0.5
        prompt = int(rng.integers(50, 4000))
        ttft_s = 0.02 + prompt / 40_000 + float(rng.uniform(0, 0.01))
        if rng.random() < queued_frac:
            ttft_s += float(rng.uniform(1, 3))
        out = 50 if i % 3 else 800  # long ones overlap the next few on their instance
        e2e_s = ttft_s + (out - 1) * 0.003
        lines.append(
            json.dumps(
                {
                    "type": "request",
                    "class_name": "agent" if i % 4 == 0 else "normal",
                    "send_s": send_s,
                    "status": 200,
                    "ttft_ms": ttft_s * 1e3,
                    "e2e_ms": e2e_s * 1e3,
                    "output_tokens": out,
                    "prompt_tokens": prompt,
                    "instance": f"engine-{i % 2}",
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("queued_frac", [0.0, 0.15])
def test_fit_recovers_the_prefill_rate_past_queue_waits(tmp_path: Path, queued_frac: float) -> None:
    """The prefill rate comes from TTFT's lower quartile, so router queue waits in a share of
    the requests (which the simulator adds itself) do not leak into it; least squares would
    fit a rate several times too low here."""
    path = tmp_path / "records.jsonl"
    _records(path, np.random.default_rng(3), queued_frac)
    latency = fit_latency(path)
    assert latency.prefill_tokens_per_s == pytest.approx(40_000, rel=0.1)
    assert 0.015 <= latency.overhead_s <= 0.03
    # TPOT: 3 ms per token at one running sequence
    assert latency.tpot_s(1) == pytest.approx(0.003, rel=0.05)
    agent = latency.overhead_samples("agent")
    normal = latency.overhead_samples("normal")
    assert len(agent) == 100 and len(normal) == 300
    assert latency.overhead_samples("unknown") == latency.overhead_samples_s
    if queued_frac:  # the waits stay in the drawn overheads' tail, per class
        assert max(normal) > 1.0


def test_cli_runs_configs_side_by_side(tmp_path: Path) -> None:
    scenario = copy.deepcopy(SCENARIO)
    scenario["duration_s"] = 30
    (tmp_path / "scenario.yaml").write_text(yaml.safe_dump(scenario))
    for name, enabled in (("static", False), ("moving", True)):
        data = config_data(tmp_path, rebalancer={"enabled": enabled})
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    argv = ["simulate", "--trace", str(tmp_path / "scenario.yaml"), "--out", str(out)]
    argv += ["--config", str(tmp_path / "static.yaml"), "--config", str(tmp_path / "moving.yaml")]
    assert cli_main(argv) == 0
    doc = json.loads((out / "simulation.json").read_text())
    assert doc["kv_block_size_tokens"] == 128 and doc["kv_blocks"] == 511
    names = [r["config"] for r in doc["results"]]
    assert names[0].endswith("static.yaml") and names[1].endswith("moving.yaml")
    for result in doc["results"]:
        assert result["pools"]["normal"]["requests"] > 100
        assert result["simulated_s"] >= 30
    (tmp_path / "bad.yaml").write_text("pools: 3\n")
    bad = ["simulate", "--trace", str(tmp_path / "scenario.yaml"), "--out", str(out)]
    assert cli_main([*bad, "--config", str(tmp_path / "bad.yaml")]) == 2


def test_engine_keeps_moving_late_in_a_long_simulation() -> None:
    """A day in, the clock's resolution (15 ps at 86,400 s) is close to the float slivers of
    work the sums leave: each event happens at its time, one sync each, not in extra
    sliver-sized steps."""
    engine = EngineModel(LatencyModel(0.0021, 0.00077, 66_094.0), capacity_blocks=10**6)
    rng = np.random.default_rng(1)
    t = 86_400.123456789
    for i in range(40):
        seq = SimSequence(float(rng.integers(16, 3000)), int(rng.integers(1, 200)), blocks=1)
        engine.add(seq, t + i * 0.0137)
    events = 0
    while engine.running and events < 1000:
        engine.sync(engine.next_event_at_s)
        events += 1
    assert engine.running == 0 and events <= 80  # 40 prefills, 40 ends


def _cell(run: str, fitted_on: str, static: float, rebalanced: float, moves: list[float]) -> Any:
    def metrics(value: float) -> dict[str, Any]:
        keys = ["chat_ttft_p95_s_day", "chat_ttft_p95_s_evening", "chat_ttft_p95_s_night"]
        keys += ["chat_ttft_p95_s_morning", "agent_run_p50_s"]
        return {k: {"measured": value, "simulated": value * 1.1, "error_frac": 0.1} for k in keys}

    mode = {"agent_share_mean_abs_error": None, "simulated_move_counts": [1, 2]}
    return {
        "run": run,
        "fitted_on": fitted_on,
        "report": {
            "fitted": {"overhead_p50_p95_ms": {"normal": [40.0, 300.0]}},
            "modes": {
                "static": {**mode, "metrics": metrics(static), "measured_moves": []},
                "rebalanced": {**mode, "metrics": metrics(rebalanced), "measured_moves": moves},
            },
        },
    }


def test_calibration_matrix_summary_names_the_replicate_gap() -> None:
    """A rebalanced run that made no move ran the same system as its static run: the gap
    between their measured values is the testbed's noise, and the summary says it; a run
    whose loop moved is no replicate."""
    doc = {
        "runs": ["quiet", "moved"],
        "seeds": 3,
        "cells": [
            _cell("quiet", "quiet", 0.4, 0.3, []),
            _cell("moved", "quiet", 0.4, 0.2, [170.0]),
        ],
    }
    text = summary_markdown(doc)
    assert "- quiet: chat p95 day 25%" in text  # |0.3 - 0.4| / 0.4
    assert "- moved" not in text
    assert text.count("| quiet | quiet | ") == 2 and text.count("| moved | quiet | ") == 2
    assert "quiet: normal 40 ms" in text


@dataclasses.dataclass(eq=False)
class _SyncWaiter:
    """A queued request with no future and no event loop: `Admitter.dispatch_once` answers it
    directly, as it answers the simulator's requests."""

    ctx: RequestContext
    need: Need
    exclude: frozenset[str] = frozenset()
    lease: Lease | None = None
    error: CapacityExceeded | None = None

    def gone(self) -> bool:
        return self.lease is not None or self.error is not None

    def admitted(self, lease: Lease) -> None:
        self.lease = lease

    def refused(self, err: CapacityExceeded) -> None:
        self.error = err


def test_the_dispatch_core_waits_for_home_then_moves_after_patience(tmp_path: Path) -> None:
    """The simulator's admission is the router's synchronous core (build_core, admit_now,
    enqueue, dispatch_once), no event loop: a run's step waits for its full home while another
    instance has room, and moves once it has waited `always_affinity`'s patience (half the
    queue's `max_wait_s`). Before the simulator ran this core, it called the decision without
    the time waited, so the patience never ran out there."""
    pools = {"agent": {"classes": ["agent", "normal"], "share": {"initial_frac": 1.0}}}
    cfg = config_for_test(tmp_path, pools=pools, router={"kv_margin_frac": 0.05})
    now = [1000.0]
    specs = [InstanceSpec(f"engine-{i}", f"sim://engine-{i}", 1) for i in range(2)]
    core = build_core(cfg, specs, lambda: now[0], random.Random(0))
    for spec in specs:
        core.fleet.record_reading(spec.instance_id, reading(now[0]))
    admitter = core.admitter
    big = Estimate(prompt_tokens=6000, output_tokens=400, source="heuristic")  # 2 per engine
    held: dict[str, list[Lease]] = {"engine-0": [], "engine-1": []}
    for i in range(4):
        lease = admitter.admit_now(
            borrow_ctx("agent", i), admitter.need(borrow_ctx("agent", i), big), now[0]
        )
        assert lease is not None
        held[lease.instance_id].append(lease)
    assert [len(v) for v in held.values()] == [2, 2]
    core.affinity.record(("t", "A"), "engine-0", context_tokens=6000)
    ctx = dataclasses.replace(borrow_ctx("agent", 9), run_id="A")
    waiter = _SyncWaiter(ctx, admitter.need(ctx, big))
    assert admitter.admit_now(ctx, waiter.need, now[0]) is None
    admitter.enqueue(waiter, now[0])
    assert admitter.homebound("agent") == {"engine-0": 1}
    held["engine-1"].pop().release()  # room elsewhere, not at home
    patience_s = 0.5 * cfg.pools[0].queue.max_wait_s
    now[0] += patience_s - 0.1
    admitter.dispatch_once(now[0])
    assert waiter.lease is None and len(admitter.queues["agent"]) == 1
    now[0] += 0.1
    admitter.dispatch_once(now[0])
    assert waiter.lease is not None and waiter.lease.instance_id == "engine-1"
    assert admitter.homebound("agent") == {} and len(admitter.queues["agent"]) == 0
