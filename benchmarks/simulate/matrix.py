"""The simulator's calibration across real runs: latencies fitted on each run's static records,
checked against every run (its own, and the others: a fit that only matches its own run is
fitting the test set). Writes `calibration-matrix.json` and `summary.md` into `--out`.

    python -m benchmarks.simulate.matrix --out benchmarks/results/simulator-calibration-DATE \\
        --runs benchmarks/results/rebalance-day-night-2026-11-30 \\
               benchmarks/results/rebalance-day-night-agents-x3-2026-11-30 ...

Beside the errors it writes the measurement's own noise where a run holds a replicate: a
rebalanced run whose loop made no move ran the same system as its static run, so the gap
between their measured values is what the testbed alone varies (a shared 2-core machine).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.simulate.calibrate import calibrate

__all__ = ["matrix", "summary_markdown"]

_SHORT = {
    "chat_ttft_p95_s_day": "chat p95 day",
    "chat_ttft_p95_s_evening": "chat p95 evening",
    "chat_ttft_p95_s_night": "chat p95 night",
    "chat_ttft_p95_s_morning": "chat p95 morning",
    "agent_run_p50_s": "agent run p50",
}


def matrix(runs: list[Path], seeds: int) -> dict[str, Any]:
    cells = []
    for check in runs:
        for fit in runs:
            report = calibrate(check, fit, seeds)
            cells.append({"run": check.name, "fitted_on": fit.name, "report": report})
    return {"runs": [r.name for r in runs], "seeds": seeds, "cells": cells}


def _replicate_gap(cells: list[dict[str, Any]], run: str) -> dict[str, float] | None:
    """|rebalanced − static| / static of the measured values, where the rebalanced run made no
    move (then both ran the same system)."""
    cell = next(c for c in cells if c["run"] == run)
    modes = cell["report"]["modes"]
    if "static" not in modes or "rebalanced" not in modes:
        return None
    if modes["rebalanced"]["measured_moves"] not in ([], None):
        return None
    gaps = {}
    for key, row in modes["static"]["metrics"].items():
        a, b = row["measured"], modes["rebalanced"]["metrics"][key]["measured"]
        if a and b is not None:
            gaps[key] = abs(b - a) / a
    return gaps


def summary_markdown(doc: dict[str, Any]) -> str:
    lines = [
        "# Simulator calibration across real day-night runs",
        "",
        f"Each row: the simulator with latencies fitted on one run's static records, against"
        f" another run's measured values (median of {doc['seeds']} seeds; error ="
        " simulated / measured − 1). Chat |err| is the mean over the four phases.",
        "",
        "| checked on | fitted on | mode | "
        + " | ".join(_SHORT.values())
        + " | chat mean abs err | share MAE | moves sim / real |",
        "| --- | --- | --- | " + " | ".join("---" for _ in _SHORT) + " | --- | --- | --- |",
    ]
    for cell in doc["cells"]:
        for mode, m in cell["report"]["modes"].items():
            errs = []
            row = []
            for key in _SHORT:
                r = m["metrics"][key]
                if r["error_frac"] is None:
                    row.append("-")
                    continue
                row.append(f"{r['measured']:.3g} / {r['simulated']:.3g} ({r['error_frac']:+.0%})")
                if key.startswith("chat"):
                    errs.append(abs(r["error_frac"]))
            mae = m["agent_share_mean_abs_error"]
            counts = m["simulated_move_counts"]
            real = m["measured_moves"]
            lines.append(
                f"| {cell['run']} | {cell['fitted_on']} | {mode} | "
                + " | ".join(row)
                + f" | {np.mean(errs):.0%} | {'-' if mae is None else f'{mae:.3f}'}"
                + f" | {min(counts)}-{max(counts)} / {'-' if real is None else len(real)} |"
            )
    own = [c for c in doc["cells"] if c["run"] == c["fitted_on"]]
    overheads = "; ".join(
        f"{c['run']}: "
        + ", ".join(
            f"{name} {p50_p95[0]:.0f} ms"
            for name, p50_p95 in c["report"]["fitted"].get("overhead_p50_p95_ms", {}).items()
        )
        for c in own
    )
    lines += [
        "",
        "A run whose router queued heavily is a poor source for a fit: the harness's TTFT"
        " includes the router's queue wait, the fit keeps it in the overhead drawn per request,"
        f" and the simulator queues as well. Drawn overhead p50 per class: {overheads}.",
        "",
        "Measured replicate gap (no move in the rebalanced run: the same system twice):",
        "",
    ]
    for run in doc["runs"]:
        gaps = _replicate_gap(doc["cells"], run)
        if gaps:
            text = ", ".join(f"{_SHORT[k]} {v:.0%}" for k, v in gaps.items())
            lines.append(f"- {run}: {text}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", nargs="+", required=True, help="day-night results folders")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args(argv)
    doc = matrix([Path(r) for r in args.runs], args.seeds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration-matrix.json").write_text(json.dumps(doc, indent=1) + "\n")
    text = summary_markdown(doc)
    (out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
