"""`gpupool probe [--json]`: the GPUs this machine has, with live readings, or why there are none.

Exit 0 either way (no GPU is an answer, not a failure); `--json` prints `GpuSnapshot.to_dict()`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TextIO

from gpu_probe.nvml import NvmlApi
from gpu_probe.probe import read_snapshot
from gpu_probe.readings import GpuSnapshot

__all__ = ["format_snapshot", "register", "run"]

_GIB = 1024**3


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("probe", help="GPU inventory and live readings (NVML)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def _opt(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_snapshot(snapshot: GpuSnapshot) -> str:
    """Human-readable table of a snapshot."""
    if not snapshot.has_gpu:
        return f"no GPU: {snapshot.no_gpu_reason}\n"
    lines = [
        f"NVIDIA driver {snapshot.driver_version or 'unknown'}, {len(snapshot.devices)} GPU(s)",
        f"{'gpu':>3}  {'name':<26} {'spec':<9} {'memory used/total GiB':>21}  {'util':>5}  "
        f"{'power W':>11}  {'temp C':>6}  procs",
    ]
    readings = {r.index: r for r in snapshot.readings}
    for d in snapshot.devices:
        r = readings.get(d.index)
        if r is None:
            continue
        used = f"{r.memory_used_bytes / _GIB:.1f}/{r.memory_total_bytes / _GIB:.1f}"
        util = _opt(None if r.utilization_frac is None else r.utilization_frac * 100, ".0f")
        power = f"{_opt(r.power_watts, '.0f')}/{_opt(r.power_limit_watts, '.0f')}"
        lines.append(
            f"{d.index:>3}  {d.name[:26]:<26} {d.spec_name or '?':<9} {used:>21}  "
            f"{util + '%' if util != '-' else util:>5}  {power:>11}  "
            f"{_opt(r.temperature_celsius, '.0f'):>6}  {len(r.processes)}"
        )
        lines.extend(
            f"{'':>5}pid {p.pid}: "
            f"{'?' if p.used_memory_bytes is None else f'{p.used_memory_bytes / _GIB:.2f} GiB'}"
            for p in r.processes
        )
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, *, nvml: NvmlApi | None = None, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    snapshot = read_snapshot(nvml)
    if args.json:
        out.write(json.dumps(snapshot.to_dict(), indent=2) + "\n")
    else:
        out.write(format_snapshot(snapshot))
    return 0
