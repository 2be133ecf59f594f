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

from benchmarks.outputs import bulk_dir
from benchmarks.rebalance.day_night import KEY_ENV, PHASES, scenario_path
from pools.config import load_config
from router.simulate.fit import fit_latency
from router.simulate.model import LatencyModel
from router.simulate.prompts import PromptMaker
from router.simulate.scenario import load_scenario
from router.simulate.sim import SimResult, simulate
from router.simulate.workload import build_plan

__all__ = ["calibrate", "records_file"]

KV_BLOCKS = 511  # the dev model's engines at 64 MiB of KV report 512 (one is vLLM's null block)
KV_BLOCK_SIZE = 128  # tokens per block: vLLM's default on CPUs (16 on GPUs)


def _p(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def records_file(folder: Path) -> Path | None:
    """A run mode's harness records: under `benchmarks/out/` for a folder of
    `benchmarks/results/` (`benchmarks.outputs.bulk_dir`), else in the folder itself; None
    when there are none."""
    for where in (bulk_dir(folder), folder):
        found = next(where.glob("records-*.jsonl"), None)
        if found is not None:
            return found
    return None


def _measured(folder: Path) -> dict[str, Any]:
    records = records_file(folder)
    assert records is not None, f"no records-*.jsonl for {folder}"
    reqs: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    for line in records.read_text().splitlines():
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


def _real_summary(run: Path, mode: str) -> dict[str, Any] | None:
    path = run / "summary.json"
    summary: dict[str, Any] | None = (
        json.loads(path.read_text()).get(mode) if path.exists() else None
    )
    return summary


def _share_error(run: Path, result: SimResult) -> float | None:
    summary = _real_summary(run, "rebalanced")
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


def calibrate(run: Path, fit_from: Path | None = None, seeds: int = 5) -> dict[str, Any]:
    """Simulate `run`'s modes with latencies fitted on `fit_from`'s static run (default: the
    run's own) and compare. The simulation is run with `seeds` seeds (the picker's ties and the
    drawn overheads; the traffic is the run's own); each metric's simulated value is their
    median, with their range beside it, since one seed's p95 of 30 requests is itself noisy."""
    os.environ.setdefault(KEY_ENV, "calibration")
    fit_run = fit_from or run
    fit_records = records_file(fit_run / "static")
    if fit_records is None:
        raise FileNotFoundError(f"no records-*.jsonl for {fit_run / 'static'}")
    latency: LatencyModel = fit_latency(fit_records)
    scenario = load_scenario(scenario_path(run))
    plan = build_plan(scenario, PromptMaker(write_text=False))
    report: dict[str, Any] = {
        "fitted_on": str(fit_run),
        "fitted": {
            "tpot_intercept_ms": round(latency.tpot_intercept_s * 1e3, 3),
            "tpot_slope_ms": round(latency.tpot_slope_s * 1e3, 4),
            "prefill_tokens_per_s": round(latency.prefill_tokens_per_s, 1),
            "overhead_fixed_ms": round(latency.overhead_s * 1e3, 1),
            "overhead_p50_p95_ms": {
                name: [round(float(np.percentile(v, q)) * 1e3, 1) for q in (50, 95)]
                for name, v in latency.overhead_samples_by_class_s
            },
        },
        "seeds": seeds,
        "modes": {},
    }
    for mode in ("static", "rebalanced"):
        if records_file(run / mode) is None:
            continue
        config = load_config(run / f"router-{mode}.yaml")
        results, wall_s = [], 0.0
        for seed in range(seeds):
            started = time.perf_counter()
            results.append(
                simulate(
                    config,
                    plan,
                    latency,
                    capacity_blocks=KV_BLOCKS,
                    block_size_tokens=KV_BLOCK_SIZE,
                    seed=seed,
                )
            )
            wall_s += time.perf_counter() - started
        measured = _measured(run / mode)
        simulated = [_simulated(r) for r in results]
        rows = {}
        for key, real in measured.items():
            values = [v for s in simulated if (v := s.get(key)) is not None]
            sim = float(np.median(values)) if values else None
            rows[key] = {
                "measured": None if real is None else round(real, 3),
                "simulated": None if sim is None else round(sim, 3),
                "simulated_range": [round(min(values), 3), round(max(values), 3)]
                if values
                else None,
                "error_frac": None
                if real in (None, 0) or sim is None
                else round((sim - real) / real, 3),
            }
        share_errors = [
            e for r in results if mode == "rebalanced" and (e := _share_error(run, r)) is not None
        ]
        report["modes"][mode] = {
            "metrics": rows,
            "agent_share_mean_abs_error": round(float(np.median(share_errors)), 3)
            if share_errors
            else None,
            "simulated_moves": results[0].decisions,
            "simulated_move_counts": [len(r.decisions) for r in results],
            "measured_moves": None
            if (real := _real_summary(run, mode)) is None
            else [m["t_s"] for m in real.get("moves", [])],
            "speed_simulated_s_per_wall_s": round(sum(r.simulated_s for r in results) / wall_s, 1),
        }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--run", required=True, help="a day-night results folder")
    parser.add_argument(
        "--fit-from", help="fit the engine latencies on this run's static records instead"
    )
    parser.add_argument("--out", help="write the report here (default RUN/calibration.json)")
    parser.add_argument("--seeds", type=int, default=5, help="simulations per mode (default 5)")
    args = parser.parse_args(argv)
    run = Path(args.run)
    report = calibrate(run, Path(args.fit_from) if args.fit_from else None, args.seeds)
    out = Path(args.out) if args.out else run / "calibration.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
