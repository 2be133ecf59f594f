"""Arrival processes: when requests (or agent runs) start, as offsets in seconds from the start
of a benchmark. All are open-loop: arrivals never wait for completions.

- `RenewalArrivals`: a renewal process over a piecewise-constant rate schedule. Gaps are gamma
  with coefficient of variation `cv` (1: Poisson; > 1: bursty; 0: evenly spaced), drawn in
  "operational time" (unit rate) and mapped back through the cumulative rate Λ(t), so a rate
  step (an agent surge at minute 2) changes the rate without resetting the process. The
  burstiness knob of `vllm bench serve` is 1/cv².
- `TraceArrivals`: replay of a recorded trace (Azure LLM inference CSV or Mooncake JSONL, see
  `router.simulate.traces`), sped up by `speedup`, starting `offset_s` into the trace; each arrival
  carries the trace's prompt and output token counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from router.simulate.traces import TraceRow

__all__ = ["Arrival", "ArrivalProcess", "RateSegment", "RenewalArrivals", "TraceArrivals"]


@dataclass(frozen=True)
class Arrival:
    """One arrival: its offset from the benchmark start, and token counts when a trace gave them."""

    t_s: float
    prompt_tokens: int | None = None
    output_tokens: int | None = None


class ArrivalProcess(Protocol):
    def arrivals(self, rng: np.random.Generator, duration_s: float) -> list[Arrival]:
        """Every arrival in [0, duration_s), sorted by time."""
        ...

    def expected_count(self, duration_s: float) -> float: ...

    def scaled(self, factor: float) -> ArrivalProcess:
        """The same process with every rate multiplied by `factor` (schedule times kept)."""
        ...


@dataclass(frozen=True)
class RateSegment:
    """From `start_s` on (until the next segment), arrivals come at `rate_per_s`."""

    start_s: float
    rate_per_s: float


@dataclass(frozen=True)
class RenewalArrivals:
    segments: tuple[RateSegment, ...]  # sorted by start_s; the first starts at 0
    cv: float = 1.0  # coefficient of variation of the gaps: 1 Poisson, >1 bursty, 0 regular

    @staticmethod
    def poisson(rate_per_s: float) -> RenewalArrivals:
        return RenewalArrivals((RateSegment(0.0, rate_per_s),), 1.0)

    def scaled(self, factor: float) -> RenewalArrivals:
        segs = tuple(RateSegment(s.start_s, s.rate_per_s * factor) for s in self.segments)
        return RenewalArrivals(segs, self.cv)

    def _unit_gaps(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.cv == 0:
            return np.ones(n)
        if self.cv == 1:
            return rng.exponential(1.0, size=n)
        shape = 1.0 / (self.cv * self.cv)
        return rng.gamma(shape, 1.0 / shape, size=n)

    def _bounds(self, duration_s: float) -> list[tuple[float, float, float, float]]:
        """Per segment: (start_s, end_s, rate_per_s, Λ at start)."""
        out = []
        cumulative = 0.0
        for i, seg in enumerate(self.segments):
            end_s = self.segments[i + 1].start_s if i + 1 < len(self.segments) else duration_s
            end_s = min(end_s, duration_s)
            if end_s <= seg.start_s:
                continue
            out.append((seg.start_s, end_s, seg.rate_per_s, cumulative))
            cumulative += seg.rate_per_s * (end_s - seg.start_s)
        return out

    def expected_count(self, duration_s: float) -> float:
        return sum(rate * (end - start) for start, end, rate, _ in self._bounds(duration_s))

    def arrivals(self, rng: np.random.Generator, duration_s: float) -> list[Arrival]:
        bounds = self._bounds(duration_s)
        total = self.expected_count(duration_s)
        if total <= 0:
            return []
        # Operational-time arrival points u_k = sum of unit-mean gaps; a uniform random phase
        # for the first keeps a regular (cv=0) process from always firing at t=0.
        times: list[float] = []
        u = 0.0
        first = True
        seg_index = 0
        while True:
            batch = self._unit_gaps(rng, 256)
            if first:
                batch[0] *= rng.uniform()
                first = False
            for gap in batch:
                u += float(gap)
                if u >= total:
                    return [Arrival(t) for t in times]
                while seg_index + 1 < len(bounds) and bounds[seg_index + 1][3] <= u:
                    seg_index += 1
                start_s, _end_s, rate, lam0 = bounds[seg_index]
                times.append(start_s + (u - lam0) / rate)


@dataclass(frozen=True)
class TraceArrivals:
    rows: tuple[TraceRow, ...]  # sorted by t_s, first at 0
    speedup: float = 1.0  # 2.0 replays twice as fast
    offset_s: float = 0.0  # skip this much of the trace (trace time)
    length_scale: float = 1.0  # multiply the trace's token counts (fit a small model)

    def scaled(self, factor: float) -> TraceArrivals:
        return TraceArrivals(self.rows, self.speedup * factor, self.offset_s, self.length_scale)

    def _scaled(self, tokens: int) -> int:
        return max(1, math.floor(tokens * self.length_scale + 0.5))

    def arrivals(self, rng: np.random.Generator, duration_s: float) -> list[Arrival]:
        out = []
        for row in self.rows:
            if row.t_s < self.offset_s:
                continue
            t_s = (row.t_s - self.offset_s) / self.speedup
            if t_s >= duration_s:
                break
            out.append(
                Arrival(t_s, self._scaled(row.prompt_tokens), self._scaled(row.output_tokens))
            )
        return out

    def expected_count(self, duration_s: float) -> float:
        return float(len(self.arrivals(np.random.default_rng(0), duration_s)))
