"""Statistics for the router-overhead benchmark: percentiles, added latency against the direct
engine measured in the same run, and per-unit CPU cost. Pure functions, no I/O.

Added latency is a difference of percentiles, not a percentile of differences: requests through
a proxy and straight to the engine are different requests, so there is no pairing to subtract.
Targets are measured in interleaved rounds; `added_latency_ms` pools every round's samples, and
`per_round_added_ms` gives the per-round differences so their spread shows the drift and noise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "LatencySummary",
    "added_latency_ms",
    "cpu_us_per_unit",
    "median",
    "per_round_added_ms",
    "percentile",
    "rate_per_s",
    "summarize",
]


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (q in [0, 100]) with linear interpolation between closest ranks, the
    same as numpy's default. NaN for no samples."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not samples:
        return math.nan
    ordered = sorted(samples)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    frac = pos - lo
    return ordered[lo] + (ordered[hi] - ordered[lo]) * frac


def median(samples: Sequence[float]) -> float:
    return percentile(samples, 50.0)


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """Latency percentiles in milliseconds over `count` samples."""

    count: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float

    def as_dict(self) -> dict[str, float | int]:
        return {
            "count": self.count,
            "p50_ms": self.p50_ms,
            "p90_ms": self.p90_ms,
            "p99_ms": self.p99_ms,
            "mean_ms": self.mean_ms,
        }


def summarize(samples_s: Sequence[float]) -> LatencySummary:
    """Summarize latencies given in seconds."""
    ms = [s * 1e3 for s in samples_s]
    mean = sum(ms) / len(ms) if ms else math.nan
    return LatencySummary(len(ms), percentile(ms, 50), percentile(ms, 90), percentile(ms, 99), mean)


def added_latency_ms(target_s: Sequence[float], direct_s: Sequence[float], q: float) -> float:
    """What the proxy adds at the q-th percentile: target's percentile minus the direct
    engine's, both in ms, from samples in seconds. NaN when either side has no samples."""
    return (percentile(target_s, q) - percentile(direct_s, q)) * 1e3


def per_round_added_ms(
    target_rounds: Sequence[Sequence[float]], direct_rounds: Sequence[Sequence[float]], q: float
) -> list[float]:
    """Added latency at the q-th percentile computed round by round (rounds pair up by index:
    round k of the target against round k of the direct engine)."""
    if len(target_rounds) != len(direct_rounds):
        raise ValueError("target and direct must have the same number of rounds")
    return [
        added_latency_ms(t, d, q)
        for t, d in zip(target_rounds, direct_rounds, strict=True)
        if t and d
    ]


def rate_per_s(count: int, elapsed_s: float) -> float:
    """Events per second; NaN for an empty window."""
    return count / elapsed_s if elapsed_s > 0 else math.nan


def cpu_us_per_unit(cpu_s: float, units: int) -> float:
    """CPU microseconds per unit (request, chunk); NaN when nothing was served."""
    return cpu_s * 1e6 / units if units > 0 else math.nan
