"""What one target accumulates in one phase across rounds, and its summary (the figures the report
prints). Latencies stay per round so added latency can also be read round by round."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from benchmarks.router_overhead.stats import (
    added_latency_ms,
    cpu_us_per_unit,
    median,
    per_round_added_ms,
    rate_per_s,
    summarize,
)

__all__ = ["Meter", "summarize_phase"]


@dataclass
class Meter:
    """`units` are requests (non-streaming phases) or SSE events (streaming), counted in the
    measurement windows; `cpu_s` is the proxy tree's CPU over the same windows."""

    rounds: list[list[float]] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    units: int = 0
    window_s: float = 0.0
    cpu_s: float = 0.0
    engine_cpu_s: float = 0.0
    errors: int = 0
    first_error: str = ""
    completed_streams: int = 0

    def add_errors(self, count: int, first: str) -> None:
        self.errors += count
        self.first_error = self.first_error or first

    def all_latencies(self) -> list[float]:
        return [x for r in self.rounds for x in r]


def summarize_phase(
    meter: Meter, direct: Meter | None, *, proxy: bool, idle_s_per_s: float = 0.0
) -> dict[str, Any]:
    """The phase's figures for one target. `direct` is the engine's meter in the same phase
    (None for the direct target itself); `proxy` says whether CPU belongs to a proxy process;
    `idle_s_per_s` is its CPU at rest, taken off for the `net` per-unit figure."""
    out: dict[str, Any] = {
        "units": meter.units,
        "window_s": round(meter.window_s, 3),
        # the median round: other jobs on a shared machine only ever slow a round down
        "rate_per_s": median(meter.rates) if meter.rates else math.nan,
        "rate_per_s_pooled": rate_per_s(meter.units, meter.window_s),
        "rate_per_s_rounds": [round(r, 1) for r in meter.rates],
        "errors": meter.errors,
        "first_error": meter.first_error,
        "engine_cpu_us_per_unit": cpu_us_per_unit(meter.engine_cpu_s, meter.units),
    }
    if proxy:
        out["cpu_s"] = round(meter.cpu_s, 4)
        out["cpu_us_per_unit"] = cpu_us_per_unit(meter.cpu_s, meter.units)
        net_s = max(0.0, meter.cpu_s - idle_s_per_s * meter.window_s)
        out["cpu_us_per_unit_net_of_idle"] = cpu_us_per_unit(net_s, meter.units)
    if meter.rounds:
        lat = meter.all_latencies()
        out["latency"] = summarize(lat).as_dict()
        if direct is not None and direct.rounds:
            dl = direct.all_latencies()
            out["added_p50_ms"] = added_latency_ms(lat, dl, 50)
            out["added_p99_ms"] = added_latency_ms(lat, dl, 99)
            rounds50 = per_round_added_ms(meter.rounds, direct.rounds, 50)
            out["added_p50_ms_rounds"] = [round(x, 4) for x in rounds50]
            out["added_p50_ms_median_of_rounds"] = median(rounds50)
    if meter.completed_streams:
        out["completed_streams"] = meter.completed_streams
    return out
