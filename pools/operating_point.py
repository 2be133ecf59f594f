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
and the rest wait in the router's queue, in the router's order. Seeing that one more run with
none waiting forgets the ceiling until the engine saturates again.

Nothing learned may hold the limit down for good, because the limit decides what the router
will ever measure again. The batch sizes are the engine's (`vllm:num_requests_running`: every
sequence on it), so load this router did not send (another router on the same engines, any
other client) is learned for what it is. But that load can run batch sizes this router then
never reaches itself, in conditions that pass (its prefills, a busy machine); and a request
also waits inside vLLM when the engine is not full (not yet scheduled behind a prefill).
Either can hold a router at a handful of sequences for good: s38 saw one held at 5 on an
engine that took 21 (benchmarks/results/agent-flood-index-cpu-2026-12-02; which of the two,
the run did not record; tests/unit/test_operating_point_foreign_load.py replays both). So:
- when a sample leaves its batch size's bucket `_FASTER` times faster than the line said
  there (the engine is plainly faster now than what the line was fitted to), the other
  buckets age: their weight halves every `_HALF_LIFE_SAMPLES` such samples, and one under
  `_MIN_WEIGHT` (about one sample's worth) is forgotten, never the last two. The line is then
  fitted to what runs now; where that extrapolates too high (up to max_num_seqs, as at the
  start), the samples there bring it down. Only on such a contradiction: a busy router runs
  only the few batch sizes next to its limit, and a line fitted to those alone is too noisy
  to extrapolate (ageing on every sample swung it between 1 and 64 with ±20 % noise).
- the ceiling is forgotten as soon as the engine runs the one more that the limit lets
  through with nothing waiting (a ceiling forgotten only above that would never be).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["OperatingPoint", "TpotLine"]

_EWMA_ALPHA = 0.3  # weight of a new sample in its batch-size bucket
_MIN_TOKENS_PER_SAMPLE = 8  # a scrape interval with fewer decode steps is noise
_OUTLIER_FACTOR = 2.0  # one sample moves its bucket toward at most 2x what it expected
_FASTER = 1.5  # a batch size this much faster than the line says ages the other buckets
_HALF_LIFE_SAMPLES = 5  # ageing halves a bucket's weight in this many such samples
_AGEING = 0.5 ** (1.0 / _HALF_LIFE_SAMPLES)
_MIN_WEIGHT = 0.5  # an aged bucket lighter than this (about one sample's worth) is forgotten


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
        elif self.saturation is not None and running > self.saturation:
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
        if self._line is not None and self._line.tpot_s(n) > _FASTER * self._buckets[n].tpot_s:
            self._age(n)  # faster here than the line says: what holds the line up ages
        self.samples += 1
        self._line = self._fit()

    def _age(self, measured: int) -> None:
        """Age every bucket but `measured`'s; forget those under `_MIN_WEIGHT`, lightest
        first, while more than two remain (see the module docstring)."""
        for n, bucket in self._buckets.items():
            if n != measured:
                bucket.weight *= _AGEING
        light = sorted((b.weight, n) for n, b in self._buckets.items() if b.weight < _MIN_WEIGHT)
        for _, n in light[: max(0, len(self._buckets) - 2)]:
            del self._buckets[n]

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
