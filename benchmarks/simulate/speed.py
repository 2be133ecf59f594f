"""How fast the simulator runs: the committed day-night scenario's rates, its four phases
stretched to an hour and to a day (each phase a quarter of it), through the committed
day-night run's router configs, engines fitted on its static run. Reports, per length and
config, the requests simulated, the wall and CPU seconds (the plan drawn, and the simulation),
and simulated seconds per wall second; writes `--out` as JSON.

    python -m benchmarks.simulate.speed --out benchmarks/results/simulator-speed-DATE.json

CPU seconds are the process's own (`time.process_time`): on a shared machine the wall time
also counts what others run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.rebalance.day_night import KEY_ENV, SCENARIO
from benchmarks.simulate.calibrate import KV_BLOCK_SIZE, KV_BLOCKS, records_file
from pools.config import load_config
from router.simulate.fit import fit_latency
from router.simulate.prompts import PromptMaker
from router.simulate.scenario import parse_scenario
from router.simulate.sim import simulate
from router.simulate.workload import build_plan

__all__ = ["stretched_scenario"]

RUN = Path("benchmarks/results/rebalance-day-night-2026-11-30")
LENGTHS_S = {"hour": 3600.0, "day": 86400.0}


def stretched_scenario(path: Path, duration_s: float) -> dict[str, Any]:
    """The scenario with its schedule's times scaled to last `duration_s` (rates unchanged)."""
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    factor = duration_s / float(data["duration_s"])
    data["duration_s"] = duration_s
    for spec in data["classes"].values():
        for segment in spec["arrivals"].get("segments", []):
            segment["start_s"] = segment["start_s"] * factor
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--lengths", nargs="+", default=list(LENGTHS_S), choices=list(LENGTHS_S))
    parser.add_argument("--modes", nargs="+", default=["static", "rebalanced"])
    args = parser.parse_args(argv)
    os.environ.setdefault(KEY_ENV, "speed")
    records = records_file(RUN / "static")
    if records is None:
        raise SystemExit(f"no records-*.jsonl for {RUN / 'static'}: run the day-night benchmark")
    latency = fit_latency(records)
    rows = []
    for length in args.lengths:
        wall0, cpu0 = time.perf_counter(), time.process_time()
        scenario = parse_scenario(stretched_scenario(Path(SCENARIO), LENGTHS_S[length]))
        plan = build_plan(scenario, PromptMaker(write_text=False))
        plan_wall_s, plan_cpu_s = time.perf_counter() - wall0, time.process_time() - cpu0
        for mode in args.modes:
            config = load_config(RUN / f"router-{mode}.yaml")
            wall0, cpu0 = time.perf_counter(), time.process_time()
            result = simulate(
                config, plan, latency, capacity_blocks=KV_BLOCKS, block_size_tokens=KV_BLOCK_SIZE
            )
            wall_s, cpu_s = time.perf_counter() - wall0, time.process_time() - cpu0
            row = {
                "length": length,
                "mode": mode,
                "requests": len(result.requests),
                "simulated_s": round(result.simulated_s, 1),
                "plan_wall_s": round(plan_wall_s, 2),
                "plan_cpu_s": round(plan_cpu_s, 2),
                "sim_wall_s": round(wall_s, 2),
                "sim_cpu_s": round(cpu_s, 2),
                "simulated_s_per_wall_s": round(result.simulated_s / wall_s),
                "simulated_s_per_cpu_s": round(result.simulated_s / cpu_s),
                "moves": len(result.decisions),
                "load_avg_1m": round(os.getloadavg()[0], 2),
            }
            rows.append(row)
            print(json.dumps(row))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"scenario": SCENARIO, "fitted_on": str(RUN), "rows": rows}, indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
