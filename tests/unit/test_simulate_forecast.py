"""The simulator runs `admission.reserve: forecast` and the prefill hold through the router's
own admitter (built by `build_core`): on one engine split between the pools, under the
`kv_pressure` benchmark's workload, the agent pool borrows the chat pool's idle half and its
runs finish sooner than under `reserve: share`, while chat is served as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pools.testing.config import config_for_test, even_pools
from router.simulate.model import LatencyModel
from router.simulate.prompts import PromptMaker
from router.simulate.scenario import load_scenario
from router.simulate.sim import simulate, summarize
from router.simulate.workload import build_plan

ROOT = Path(__file__).resolve().parents[2]
# the dev model's CPU engine, roughly: 10 ms + 1 ms per sequence a token, 15k prompt tokens/s
ENGINE = LatencyModel(tpot_intercept_s=0.01, tpot_slope_s=0.001, prefill_tokens_per_s=15_000)


def _run(tmp_path: Path, **admission: Any) -> dict[str, Any]:
    config = config_for_test(
        tmp_path,
        pools=even_pools(
            agent={"slo": {"ttft_p95_ms": 3000, "tpot_p95_ms": 150}},
            normal={"slo": {"ttft_p95_ms": 800, "tpot_p95_ms": 80}},
        ),
        engines={"local": {"count": 1, "cpu_affinity": None}},
        admission=admission,
    )
    plan = build_plan(
        load_scenario(ROOT / "benchmarks/admission/kv-pressure.yaml"),
        PromptMaker(write_text=False),
    )
    # 8 MiB of the dev model's KV: 64 blocks of 128 tokens, as the benchmark's engine
    result = simulate(config, plan, ENGINE, capacity_blocks=63, block_size_tokens=128)
    return summarize(result, config)


def test_forecast_lends_the_idle_half_to_the_agents(tmp_path: Path) -> None:
    share = _run(tmp_path)
    forecast = _run(tmp_path, reserve="forecast")
    held = _run(tmp_path, reserve="forecast", prefill_hold_min_tokens=512)
    for s in (share, forecast, held):
        assert s["pools"]["normal"]["rejected"] == 0
        assert s["agent_runs"]["runs"] == 12
    # the agents' runs finish sooner when they may borrow chat's idle half
    assert forecast["agent_runs"]["completion_p50_s"] < share["agent_runs"]["completion_p50_s"]
    # chat keeps its SLO in the model (which has no prefill/decode interference: the hold
    # shows only its cost here, not the chat TTFT it buys on a real engine)
    assert forecast["pools"]["normal"]["slo_attainment"] >= 0.99
    assert held["pools"]["normal"]["slo_attainment"] >= 0.99
