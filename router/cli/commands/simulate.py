"""`gpupool simulate`: what-if runs of a scenario against several configs, in simulated time.

    gpupool simulate --config FILE [--config FILE ...] --trace SCENARIO.yaml --out DIR
                     [--fit RECORDS.jsonl | --tpot-intercept-ms A --tpot-slope-ms B
                      --prefill-tokens-per-s R] [--kv-blocks N] [--kv-block-size T] [--seed S]
                     [--prefix-cache]

`--trace` is a scenario YAML (router.simulate.scenario; the harness's are in
benchmarks/scenarios/, and one may itself replay a trace file). Each config runs the same
workload through gpupool's own fleet, admission, picking and rebalancer code, built by
router.core.build_core as the router builds them, over modelled engines (router/simulate/).
Prints per pool SLO attainment, TTFT and queue-wait p95, rejections and GPU-seconds, agent run
completion, and the moves, for the configs side by side; writes `DIR/simulation.json`.

Exit codes: 0; 2 bad input (a config or scenario that does not load).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from pools.config import ConfigError, load_config
from router.simulate.fit import fit_latency
from router.simulate.model import LatencyModel
from router.simulate.prompts import PromptMaker
from router.simulate.scenario import ScenarioError, load_scenario
from router.simulate.sim import simulate, summarize
from router.simulate.workload import build_plan

__all__ = ["register", "simulate_command"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("simulate", help="what-if: replay a scenario against configs")
    p.add_argument("--config", action="append", required=True, metavar="FILE")
    p.add_argument("--trace", required=True, metavar="SCENARIO", help="harness scenario YAML")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--fit", metavar="RECORDS", help="fit engine latencies from a real run")
    p.add_argument("--tpot-intercept-ms", type=float, default=4.0)
    p.add_argument("--tpot-slope-ms", type=float, default=0.6)
    p.add_argument("--prefill-tokens-per-s", type=float, default=6000.0)
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=511,
        help="KV blocks per engine (default: the dev model's CPU engines at 64 MiB)",
    )
    p.add_argument(
        "--kv-block-size",
        type=int,
        default=128,
        help="tokens per KV block (default 128, vLLM's on CPUs; 16 on GPUs)",
    )
    p.add_argument("--seed", type=int, default=None, help="override the scenario's seed")
    p.add_argument(
        "--prefix-cache",
        action="store_true",
        help="model each engine's prefix cache: a config with engines.kv_events on places"
        " and admits by it (router/simulate/prefix.py; scenarios' shared_prefix)",
    )
    p.set_defaults(func=simulate_command)


def simulate_command(args: argparse.Namespace) -> int:
    try:
        scenario = load_scenario(args.trace)
        configs = [load_config(path) for path in args.config]
    except ScenarioError as err:
        print(f"gpupool simulate: {err}", file=sys.stderr)
        return 2
    except ConfigError as err:
        print(
            f"gpupool simulate: invalid config {err.source}: {'; '.join(err.problems)}",
            file=sys.stderr,
        )
        return 2
    if args.fit:
        latency = fit_latency(Path(args.fit))
    else:
        latency = LatencyModel(
            args.tpot_intercept_ms / 1e3, args.tpot_slope_ms / 1e3, args.prefill_tokens_per_s
        )
    plan = build_plan(scenario, PromptMaker(write_text=False), args.seed)
    results = []
    for config in configs:
        started = time.perf_counter()
        result = simulate(
            config,
            plan,
            latency,
            capacity_blocks=args.kv_blocks,
            block_size_tokens=args.kv_block_size,
            prefix_cache=args.prefix_cache,
        )
        result.wall_s = time.perf_counter() - started
        results.append(summarize(result, config))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "scenario": scenario.name,
        "latency": {
            "tpot_intercept_ms": round(latency.tpot_intercept_s * 1e3, 3),
            "tpot_slope_ms": round(latency.tpot_slope_s * 1e3, 4),
            "prefill_tokens_per_s": round(latency.prefill_tokens_per_s, 1),
        },
        "kv_blocks": args.kv_blocks,
        "kv_block_size_tokens": args.kv_block_size,
        "prefix_cache": args.prefix_cache,
        "results": results,
    }
    (out / "simulation.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(_table(doc))
    return 0


def _f(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _table(doc: dict[str, Any]) -> str:
    lat = doc["latency"]
    lines = [
        f"scenario {doc['scenario']}; engines: TPOT {lat['tpot_intercept_ms']} ms +"
        f" {lat['tpot_slope_ms']} ms x batch, prefill {lat['prefill_tokens_per_s']} tok/s,"
        f" {doc['kv_blocks']} KV blocks of {doc['kv_block_size_tokens']} tokens",
        f"{'config':<36}{'pool':<10}{'reqs':>6}{'SLO':>8}{'TTFT p95':>10}{'queue p95':>11}"
        f"{'429':>6}{'GPU-s':>9}",
    ]
    for r in doc["results"]:
        for pool, p in r["pools"].items():
            lines.append(
                f"{r['config'][-35:]:<36}{pool:<10}{p['requests']:>6}"
                f"{_f(p['slo_attainment'], '.1%'):>8}{_f(p['ttft_p95_s'], '.2f'):>10}"
                f"{_f(p['queue_wait_p95_s'], '.2f'):>11}{p['rejected']:>6}{p['gpu_seconds']:>9}"
            )
        runs = r["agent_runs"]
        lines.append(
            f"{'':<36}agent runs {runs['completed']}/{runs['runs']} completed, p50"
            f" {_f(runs['completion_p50_s'], '.1f')} s; moves {len(r['moves'])}; simulated"
            f" {r['simulated_s']:g} s in {r['wall_s']} s ({r['speed_x']}x)"
        )
    return "\n".join(lines)
