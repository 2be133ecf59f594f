"""The operating point of one engine: the largest number of running sequences whose predicted
TPOT still meets a target, learned online from what the engine reports.

Model: TPOT(n) = a + b·n for n running sequences (a decode step reads the weights once and
each sequence's KV; on a GPU the roofline prior in `kvcache_model.LatencyPrior` has this shape,
on a CPU the measured steps do). Observations come from consecutive `/metrics` scrapes: the
mean inter-token latency over the interval (Δ sum / Δ count of vLLM's histogram) against the
mean running count at its two ends, so every scrape with decode activity is a sample, for
streaming and non-streaming requests alike, without touching the request path.

Samples are kept per batch size (rounded) as an exponentially weighted mean; the fit is a
weighted least-squares line over those buckets. One sample may move its bucket toward at most
twice what the bucket (or the line, for a new batch size) expected, so one stall of the machine
cannot collapse the limit; a lasting slowdown still gets through in a few samples. The limit is
never below the largest batch size whose own bucket meets the target (measured to work, and
re-measured whenever it runs, so a real slowdown there takes it away). Until two distinct
batch sizes have been seen
the line is the prior's (when there is one), else the limit stays at the seed, lowered to one
below the only batch size seen if that one already missed the target. The limit is clamped to
[1, max_num_seqs]. Pure: no clock, no I/O.

The engine's own ceiling is learned too, because the router may not know the engine's flags
(static engines) and its KV may bind first: the most sequences seen running while the engine
also had requests waiting is where it stops taking more (`saturation`). The limit is then at
most one above it, so at most one request waits inside the engine, in the engine's FIFO order,
and the rest wait in the router's queue, in the router's order. Seeing more running than that
(with none waiting) forgets the ceiling until the engine saturates again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["OperatingPoint", "TpotLine"]

_EWMA_ALPHA = 0.3  # weight of a new sample in its batch-size bucket
_MIN_TOKENS_PER_SAMPLE = 8  # a scrape interval with fewer decode steps is noise
_OUTLIER_FACTOR = 2.0  # one sample moves its bucket toward at most 2x what it expected


@dataclass(frozen=True, slots=True)
class TpotLine:
    """TPOT(n) = intercept_s + slope_s * n."""

    intercept_s: float
    slope_s: float

    def tpot_s(self, running: float) -> float:
        return self.intercept_s + self.slope_s * running

    def max_running(self, target_s: float, cap: int) -> int:
        if self.slope_s <= 0:
            return cap if self.intercept_s <= target_s else 1
        n = math.floor((target_s - self.intercept_s) / self.slope_s)
        return max(1, min(cap, n))


@dataclass(slots=True)
class _Bucket:
    tpot_s: float
    weight: float


@dataclass(slots=True)
class OperatingPoint:
    """Per instance. `observe` feeds scrape deltas, `limit(target_s)` answers the operating
    point: an integer in [1, max_num_seqs]."""

    max_num_seqs: int = 256
    seed_limit: int | None = None  # None: max_num_seqs
    prior: TpotLine | None = None
    _buckets: dict[int, _Bucket] = field(default_factory=dict)
    _line: TpotLine | None = None
    samples: int = 0
    saturation: int | None = None  # most running seen while the engine had requests waiting

    def observe_queue(self, running: int, waiting: int) -> None:
        """One scrape's running and waiting counts."""
        if waiting > 0 and running > 0:
            self.saturation = max(self.saturation or 0, running)
        elif self.saturation is not None and running > self.saturation + 1:
            self.saturation = None  # it took more than it used to: the ceiling moved

    def observe(self, running_mean: float, itl_s: float, tokens: float) -> None:
        """One scrape interval: mean ITL `itl_s` over `tokens` decode steps at a mean of
        `running_mean` running sequences."""
        if tokens < _MIN_TOKENS_PER_SAMPLE or itl_s <= 0 or running_mean < 0.5:
            return
        n = max(1, round(running_mean))
        bucket = self._buckets.get(n)
        if bucket is None:
            if self._line is not None:
                itl_s = min(itl_s, _OUTLIER_FACTOR * max(self._line.tpot_s(n), 1e-6))
            self._buckets[n] = _Bucket(itl_s, 1.0)
        else:
            itl_s = min(itl_s, _OUTLIER_FACTOR * bucket.tpot_s)
            bucket.tpot_s += _EWMA_ALPHA * (itl_s - bucket.tpot_s)
            bucket.weight = min(bucket.weight + 1.0, 20.0)
        self.samples += 1
        self._line = self._fit()

    def _fit(self) -> TpotLine | None:
        if len(self._buckets) < 2:
            return None
        sw = sx = sy = sxx = sxy = 0.0
        for n, b in self._buckets.items():
            w = b.weight
            sw += w
            sx += w * n
            sy += w * b.tpot_s
            sxx += w * n * n
            sxy += w * n * b.tpot_s
        denom = sw * sxx - sx * sx
        if denom <= 1e-12:
            return None
        slope = max(0.0, (sw * sxy - sx * sy) / denom)
        intercept = (sy - slope * sx) / sw
        return TpotLine(max(0.0, intercept), slope)

    @property
    def line(self) -> TpotLine | None:
        """The fitted line, or the prior while there is too little data."""
        return self._line or self.prior

    def tpot_estimate_s(self, running: int) -> float | None:
        """TPOT at `running` sequences: the line (fitted, else the prior), else the nearest
        measured batch size's TPOT, else None."""
        line = self.line
        if line is not None:
            return line.tpot_s(running)
        if not self._buckets:
            return None
        nearest = min(self._buckets, key=lambda n: abs(n - running))
        return self._buckets[nearest].tpot_s

    @property
    def source(self) -> str:
        if self._line is not None:
            return "measured"
        if self.prior is not None:
            return "prior"
        return "seed"

    def limit(self, target_s: float) -> int:
        line = self.line
        if line is not None:
            limit = line.max_running(target_s, self.max_num_seqs)
            proven = [n for n, b in self._buckets.items() if b.tpot_s <= target_s]
            if proven:
                limit = max(limit, max(proven))
        else:
            limit = self.seed_limit if self.seed_limit is not None else self.max_num_seqs
            if len(self._buckets) == 1:
                ((n, bucket),) = self._buckets.items()
                if bucket.tpot_s > target_s:
                    limit = min(limit, max(1, n - 1))
        if self.saturation is not None:
            limit = min(limit, self.saturation + 1)
        return max(1, min(limit, self.max_num_seqs))
