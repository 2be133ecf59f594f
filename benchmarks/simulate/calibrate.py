"""Calibrate the simulator against a real day-night run (`benchmarks.rebalance.day_night`).

Engine latencies are fitted from the *static* run's records only; both modes are then
simulated with the router config each real run used, and compared metric by metric: chat
TTFT p95 per phase, agent run completion p50, and (rebalanced) the agent share over time
(mean absolute difference, sampled every 5 s). The simulator's speed is reported too.

    python -m benchmarks.simulate.calibrate --run benchmarks/results/rebalance-day-night-DATE
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.prompts import PromptMaker
from benchmarks.rebalance.day_night import KEY_ENV, PHASES, scenario_path
from benchmarks.scenario import load_scenario
from benchmarks.simulate.fit import fit_latency
from benchmarks.simulate.model import LatencyModel
from benchmarks.simulate.sim import SimResult, simulate
from benchmarks.workload import build_plan
from pools.config import load_config

__all__ = ["calibrate"]

KV_BLOCKS = 511  # the dev model's engines at 64 MiB of KV report 512 (one is vLLM's null block)


def _p(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _measured(folder: Path) -> dict[str, Any]:
    records = folder.glob("records-*.jsonl")
    reqs: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    for line in next(records).read_text().splitlines():
        data = json.loads(line)
        (runs if data.get("type") == "run" else reqs).append(data)
    out: dict[str, Any] = {}
    for name, start, end in PHASES:
        ttfts = [
            r["ttft_ms"] / 1e3
            for r in reqs
            if r["class_name"] == "normal" and start <= r["scheduled_s"] < end and r["ttft_ms"]
        ]
        out[f"chat_ttft_p95_s_{name}"] = _p(ttfts, 95)
    done = [r["end_s"] - r["start_s"] for r in runs if r.get("outcome") == "completed"]
    out["agent_run_p50_s"] = _p(done, 50)
    return out


def _simulated(result: SimResult) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, start, end in PHASES:
        ttfts = [
            r["ttft_s"]
            for r in result.requests
            if r["class"] == "normal" and start <= r["arrived_s"] < end and r["ttft_s"]
        ]
        out[f"chat_ttft_p95_s_{name}"] = _p(ttfts, 95)
    done = [r["completion_s"] for r in result.runs if r["completion_s"] is not None]
    out["agent_run_p50_s"] = _p(done, 50)
    return out


def _share_error(run: Path, result: SimResult) -> float | None:
    path = run / "summary.json"
    summary = json.loads(path.read_text()).get("rebalanced") if path.exists() else None
    if summary is None:
        return None
    real = [(t["t_s"], t["agent_placed"]) for t in summary["trajectory"]]
    errors = []
    for t_s, shares in result.shares:
        if t_s > 240:
            break
        near = min(real, key=lambda r: abs(r[0] - t_s))
        if abs(near[0] - t_s) <= 1.5:
            errors.append(abs(near[1] - shares["agent"]))
    return float(np.mean(errors)) if errors else None


def calibrate(run: Path) -> dict[str, Any]:
    os.environ.setdefault(KEY_ENV, "calibration")
    latency: LatencyModel = fit_latency(next((run / "static").glob("records-*.jsonl")))
    scenario = load_scenario(scenario_path(run))
    plan = build_plan(scenario, PromptMaker(write_text=False))
    report: dict[str, Any] = {
        "fitted": {
            "tpot_intercept_ms": round(latency.tpot_intercept_s * 1e3, 3),
            "tpot_slope_ms": round(latency.tpot_slope_s * 1e3, 4),
            "prefill_tokens_per_s": round(latency.prefill_tokens_per_s, 1),
        },
        "modes": {},
    }
    for mode in ("static", "rebalanced"):
        if not (run / mode).exists():
            continue
        config = load_config(run / f"router-{mode}.yaml")
        started = time.perf_counter()
        result = simulate(config, plan, latency, capacity_blocks=KV_BLOCKS)
        wall_s = time.perf_counter() - started
        measured, simulated = _measured(run / mode), _simulated(result)
        rows = {}
        for key, real in measured.items():
            sim = simulated.get(key)
            rows[key] = {
                "measured": None if real is None else round(real, 3),
                "simulated": None if sim is None else round(sim, 3),
                "error_frac": None
                if real in (None, 0) or sim is None
                else round((sim - real) / real, 3),
            }
        report["modes"][mode] = {
            "metrics": rows,
            "agent_share_mean_abs_error": _share_error(run, result)
            if mode == "rebalanced"
            else None,
            "simulated_moves": result.decisions,
            "speed_simulated_s_per_wall_s": round(result.simulated_s / wall_s, 1),
        }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--run", required=True, help="a day-night results folder")
    args = parser.parse_args(argv)
    run = Path(args.run)
    report = calibrate(run)
    (run / "calibration.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
