"""How much of a split instance a pool will need soon: a demand forecast per (pool, instance),
pure (no clock, no I/O: every call takes `now_s`).

`DemandForecaster` is fed the pool's own sequences on one instance: `arrived(now_s, blocks)`
when one is placed there, `departed(now_s, blocks, arrived_at_s)` when it ends. From the last
`window_s` of them it measures the arrival rate λ (sequences/s: the larger of the rates over
the window and over its last `SHORT_WINDOW_S`, so a surge shows within seconds and a lull
lowers it only slowly), the service time E[S] (the time the sequences held their leases,
those still running counted at their age so far, over the ones that ended: the exponential
distribution's estimate with censored samples, so sequences that grow longer raise it before
they end) and the distribution of KV blocks per sequence, and `forecast(now_s)`
answers how much the pool will hold *beyond what it holds now* at any moment of the next
`horizon_s`, at the `quantile` (e.g. 0.99):

- **Count.** Arrivals are taken as Poisson and service as exponential with the measured mean
  (M/M/∞; the mean is what matters for the new sequences, M/G/∞). At time now + t the new
  sequences in flight number Poisson(m(t)), m(t) = λ·E[S]·(1 − e^(−t/E[S])), and of the n
  sequences the pool runs now at least D(t) have ended, D(t) the (1 − `quantile`) quantile of
  Binomial(n, 1 − e^(−t/E[S])) (normal approximation, floored). What the pool needs *beyond
  what it holds now* is then at most Q(m(t)) − D(t), Q the Poisson `quantile`
  (`poisson_quantile`); the forecast count K is its largest value over the horizon (checked at
  `_GRID` points of [0, `horizon_s`]). The sequences running now are in the instance's used
  blocks already, so only K is kept free: a pool that holds as much as it will need keeps
  only its floor (below).
- **Blocks.** K sequences with sizes drawn from the measured distribution (mean μ, standard
  deviation σ) hold about K·μ + z·√K·σ blocks at the quantile (z the normal quantile; the
  sum's central limit), and at least one sequence of the sizes' own `quantile` when K ≥ 1.
- **Slots** (batch places) are K.
- **A floor of one sequence.** A pool that had any sequence in the window keeps at least one
  sequence of its quantile size and one slot, so its next request is not queued behind a
  borrower while its rate is low (at 0.5 req/s and a 0.2 s service time m = 0.1 and the p99
  count is 1 anyway; below ~0.01, it would be 0).

- **Capped by the measured peak.** The model above is for a pool whose traffic it fits; for
  one whose measured need is far below it (chat: its p99 over a 10 s horizon took its whole
  half of a split engine while it never held a quarter of it) the reserve is also capped by
  what the pool was *seen* to need: the peak of the blocks (slots) it held on the instance
  over the window, plus one sequence of its quantile size (one slot), less what it holds now,
  and at least that one sequence. `Forecast.need_blocks` / `need_slots` are the smaller of
  the model and the cap, what admission keeps free. The cap counts once the pool has been
  seen on the instance for one horizon (before, the model alone: a peak over a few arrivals
  says little). A surge the window has not seen is covered by the owner's queue: a pool with
  requests waiting lends nothing (the shell keeps its whole unused share).

Before any sequence was seen the forecast is 0 (`Forecast.measured` False): the shell decides
what an unmeasured pool gets (admission keeps its whole share for the first `window_s`).

Forecast error: once per horizon, the forecast made at its start (`need_blocks`, what is kept)
is compared with the peak, during it, of the blocks the pool's sequences on the instance held
beyond what they held at its start (its need beyond its holding, what the forecast is of);
`on_error(measured - forecast)`
(blocks; positive: the forecast was short) is called when the horizon has passed, at the next
call. This is the `gpupool_headroom_forecast_error_blocks` histogram. The forecast is the
largest over the horizon of a per-moment quantile, not the quantile of the horizon's peak, so
it is short somewhat more often than 1 − `quantile` of the horizons.

Limits (docs/admission.md, "Forecast reserve"): Poisson arrivals (a wave of agent runs
starting together is burstier; the windowed rate lags a surge by up to `window_s`, which the
owner's queue covers: a pool with requests waiting lends nothing); sequences counted when
placed, not when they arrived (a request that waited in the queue arrives late); sizes and
service times independent of each other and of the load.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist

__all__ = ["FORECAST_WINDOW_S", "DemandForecaster", "Forecast", "poisson_quantile"]

# the measurements a forecast is made from: the last minute of the pool's sequences
FORECAST_WINDOW_S = 60.0

# arrivals and service times kept (the newest), whatever the window
_MAX_SAMPLES = 512
# the arrival rate is also measured over this last stretch of the window (the larger wins)
SHORT_WINDOW_S = 10.0
# above this Poisson mean, the quantile comes from the normal approximation
_NORMAL_ABOVE = 400.0
# moments of the horizon at which the need beyond the present holding is checked
_GRID = 16


def poisson_quantile(mean: float, quantile: float) -> int:
    """The smallest k with P(N ≤ k) ≥ `quantile` for N ~ Poisson(`mean`) (0 for mean ≤ 0).
    Summed term by term in log space up to a mean of 400; above, the normal approximation
    with a continuity correction (within one of the exact value there)."""
    if mean <= 0:
        return 0
    if mean > _NORMAL_ABOVE:
        z = NormalDist().inv_cdf(quantile)
        return max(0, math.ceil(mean + z * math.sqrt(mean) - 0.5))
    log_p = -mean  # log P(N = 0)
    cdf = math.exp(log_p)
    k = 0
    while cdf < quantile:
        k += 1
        log_p += math.log(mean) - math.log(k)
        cdf += math.exp(log_p)
        if k > 10 * mean + 100:  # float rounding keeps cdf under a quantile near 1
            break
    return k


@dataclass(frozen=True, slots=True)
class Forecast:
    """What a pool's new sequences will hold on one instance during the horizon, at the
    quantile. `blocks` and `slots` are 0 when nothing was measured."""

    blocks: int  # KV blocks
    slots: int  # sequences in the batch
    rate_per_s: float  # measured arrivals per second (λ)
    service_s: float  # measured mean time a sequence holds its lease (E[S]; 0: none ended)
    mean_in_flight: float  # m = λ · E[S]: the pool's mean sequences in flight
    measured: bool  # any sequence seen in the window
    running: int = 0  # the pool's sequences on the instance when it was made (n)
    # the measured cap: the window's peak held plus one sequence (slot), less the holding now
    # (None: not seen for a horizon yet, the model alone)
    measured_blocks: int | None = None
    measured_slots: int | None = None

    @property
    def need_blocks(self) -> int:
        """What is kept free: the model's blocks, capped by the measured need."""
        cap = self.measured_blocks
        return self.blocks if cap is None else min(self.blocks, cap)

    @property
    def need_slots(self) -> int:
        cap = self.measured_slots
        return self.slots if cap is None else min(self.slots, cap)


_NONE = Forecast(0, 0, 0.0, 0.0, 0.0, False)


class DemandForecaster:
    """One pool's demand on one instance (see the module docstring)."""

    def __init__(
        self,
        *,
        horizon_s: float,
        quantile: float,
        window_s: float,
        started_at_s: float,
        on_error: Callable[[float], None] = lambda _error: None,
    ) -> None:
        if horizon_s <= 0 or window_s <= 0 or not 0.5 <= quantile < 1:
            raise ValueError("horizon_s and window_s must be > 0, quantile in [0.5, 1)")
        self.horizon_s = horizon_s
        self.quantile = quantile
        self.window_s = window_s
        self.started_at_s = started_at_s
        self._z = NormalDist().inv_cdf(quantile)
        self._on_error = on_error
        self._arrivals: deque[tuple[float, int]] = deque()  # (at_s, blocks), oldest first
        self._services: deque[tuple[float, float]] = deque()  # (ended_at_s, held_s)
        self._running = 0  # sequences arrived and not departed
        self._running_since_sum_s = 0.0  # the sum of their arrival times
        self._cached: tuple[float, Forecast] | None = None
        # the horizon being checked: its start, its forecast, and the blocks held by sequences
        # that arrived since (now and at their peak)
        self._check_start_s: float | None = None
        self._check_forecast = 0
        self._held_blocks = 0  # what the pool's running sequences hold (their leases)
        self._check_base = 0  # _held_blocks at the checked horizon's start
        self._check_peak = 0
        # (at_s, blocks held, sequences running) after each change, oldest first; the entry
        # in effect at the window's start is kept
        self._history: deque[tuple[float, int, int]] = deque()
        self._first_seen_s: float | None = None

    # ------------------------------------------------------------------ what happened

    def arrived(self, now_s: float, blocks: int) -> None:
        """One of the pool's sequences was placed on the instance, holding `blocks`."""
        self._settle(now_s)
        self._arrivals.append((now_s, blocks))
        self._running += 1
        self._running_since_sum_s += now_s
        if len(self._arrivals) > _MAX_SAMPLES:
            self._arrivals.popleft()
        self._cached = None
        self._held_blocks += blocks
        if self._check_start_s is not None:
            self._check_peak = max(self._check_peak, self._held_blocks - self._check_base)
        if self._first_seen_s is None:
            self._first_seen_s = now_s
        self._record(now_s)

    def departed(self, now_s: float, blocks: int, arrived_at_s: float) -> None:
        """A sequence `arrived` at `arrived_at_s` ended (its lease released)."""
        self._settle(now_s)
        self._services.append((now_s, max(0.0, now_s - arrived_at_s)))
        if self._running > 0:
            self._running -= 1
            self._running_since_sum_s -= arrived_at_s
        if len(self._services) > _MAX_SAMPLES:
            self._services.popleft()
        self._cached = None
        self._held_blocks = max(0, self._held_blocks - blocks)
        self._record(now_s)

    def _record(self, now_s: float) -> None:
        history = self._history
        history.append((now_s, self._held_blocks, self._running))
        since = now_s - self.window_s
        while len(history) > 1 and (history[1][0] <= since or len(history) > 4 * _MAX_SAMPLES):
            history.popleft()  # the next entry was in effect at the window's start already

    # ------------------------------------------------------------------ the forecast

    def forecast(self, now_s: float) -> Forecast:
        """The forecast for [now_s, now_s + horizon_s]. Cached until something arrives or
        ends, or a tenth of a second passes (the rate's window slides)."""
        self._settle(now_s)
        cached = self._cached
        if cached is not None and now_s - cached[0] < 0.1:
            return cached[1]
        result = self._compute(now_s)
        self._cached = (now_s, result)
        if self._check_start_s is None and result.measured:
            self._check_start_s = now_s
            self._check_forecast = result.need_blocks
            self._check_base = self._held_blocks
            self._check_peak = 0
        return result

    def _compute(self, now_s: float) -> Forecast:
        since = now_s - self.window_s
        arrivals = [(t, b) for t, b in self._arrivals if t > since]
        if not arrivals:
            return _NONE
        observed_s = max(now_s - self.started_at_s, 1e-9)
        rate = len(arrivals) / min(self.window_s, observed_s)
        short_s = min(SHORT_WINDOW_S, self.window_s, observed_s)
        recent = sum(1 for t, _ in arrivals if t > now_s - short_s)
        rate = max(rate, recent / short_s)
        services = [s for t, s in self._services if t > since]
        # those still running have held at least their age: total time held / ends
        running_s = max(0.0, self._running * now_s - self._running_since_sum_s)
        service_s = (sum(services) + running_s) / max(1, len(services))
        count = max(1, self._beyond_holding(rate, service_s))
        sizes = sorted(b for _, b in arrivals)
        mean = sum(sizes) / len(sizes)
        var = sum((b - mean) ** 2 for b in sizes) / len(sizes)
        one = sizes[min(len(sizes) - 1, math.ceil(self.quantile * len(sizes)) - 1)]
        blocks = count * mean + self._z * math.sqrt(count * var)
        blocks = min(max(blocks, float(one)), float(count * sizes[-1]))
        m = rate * service_s
        measured_blocks = measured_slots = None
        first = self._first_seen_s
        if first is not None and now_s - first >= self.horizon_s:
            peak_blocks, peak_running = self._peaks(since)
            measured_blocks = max(one, peak_blocks + one - self._held_blocks)
            measured_slots = max(1, peak_running + 1 - self._running)
        return Forecast(
            math.ceil(blocks - 1e-9),
            count,
            rate,
            service_s,
            m,
            True,
            self._running,
            measured_blocks,
            measured_slots,
        )

    def _peaks(self, since: float) -> tuple[int, int]:
        """The most blocks and sequences the pool held at any moment after `since`."""
        entries = list(self._history)
        peak_blocks = peak_running = 0
        for i, (_, blocks, running) in enumerate(entries):
            if i + 1 < len(entries) and entries[i + 1][0] <= since:
                continue  # replaced before the window began
            peak_blocks, peak_running = max(peak_blocks, blocks), max(peak_running, running)
        return peak_blocks, peak_running

    def _beyond_holding(self, rate: float, service_s: float) -> int:
        """K: the most sequences the pool will run beyond the n it runs now at any moment of
        the horizon, at the quantile (the module docstring's Count)."""
        n = self._running
        if service_s <= 0:  # nothing ended yet: new arrivals only, none ending
            return poisson_quantile(rate * self.horizon_s, self.quantile)
        best = 0
        for i in range(1, _GRID + 1):
            ended = 1.0 - math.exp(-(self.horizon_s * i / _GRID) / service_s)
            new = poisson_quantile(rate * service_s * ended, self.quantile)
            spread = math.sqrt(n * ended * (1.0 - ended))
            gone = max(0, math.floor(n * ended - self._z * spread))
            best = max(best, new - gone)
        return best

    # ------------------------------------------------------------------ its error

    def _settle(self, now_s: float) -> None:
        """Close the horizon being checked once it has passed: report measured − forecast."""
        start = self._check_start_s
        if start is None or now_s < start + self.horizon_s:
            return
        self._on_error(float(self._check_peak - self._check_forecast))
        self._check_start_s = None
