"""The demand forecaster (router/admission/forecast.py), against numbers worked out by hand:
Poisson quantiles from the distribution's terms, the need beyond what the pool holds (new
sequences in flight Poisson(lambda E[S] (1 - e^-t/E[S])) less the running ones surely ended by
then), the blocks of K sequences as K * mean + z * sqrt(K) * sd, and the forecast error once
a horizon has passed. Time is the `now_s` each call is given."""

from __future__ import annotations

import math

import pytest

from router.admission.forecast import DemandForecaster, poisson_quantile


def test_poisson_quantile_from_the_terms() -> None:
    # mean 1: P(N<=3) = e^-1 (1 + 1 + 1/2 + 1/6) = 0.9810, P(N<=4) adds 1/24 e^-1: 0.9963
    assert poisson_quantile(1.0, 0.99) == 4
    assert poisson_quantile(1.0, 0.98) == 3
    # mean 2: P(N<=5) = 0.9834, P(N<=6) = 0.9955
    assert poisson_quantile(2.0, 0.99) == 6
    # mean 0.01: P(N=0) = e^-0.01 = 0.990050 >= 0.99
    assert poisson_quantile(0.01, 0.99) == 0
    assert poisson_quantile(0.011, 0.99) == 1  # e^-0.011 = 0.98906
    assert poisson_quantile(0.0, 0.99) == 0


def test_poisson_quantile_large_mean_is_the_normal_one() -> None:
    # mean 10,000: 10,000 + 2.3263 * 100 = 10,232.6, less the continuity half: 10,233
    assert poisson_quantile(10_000.0, 0.99) == 10_233


def _steady(f: DemandForecaster, *, sizes: list[int], until_s: float, hold_s: float = 0.5) -> None:
    """Arrivals every 0.5 s from t = 0.5 (2 per second), sizes in turn, each holding its
    lease `hold_s` (ends are reported in time order)."""
    events: list[tuple[float, int, int, float]] = []  # (at, 0 end / 1 arrival, blocks, from)
    t, i = 0.5, 0
    while t <= until_s + 1e-9:
        events.append((t, 1, sizes[i % len(sizes)], t))
        if t + hold_s <= until_s + 1e-9:
            events.append((t + hold_s, 0, sizes[i % len(sizes)], t))
        t += 0.5
        i += 1
    for at, kind, blocks, since in sorted(events):
        if kind:
            f.arrived(at, blocks)
        else:
            f.departed(at, blocks, since)


def test_steady_chat_of_one_size() -> None:
    f = DemandForecaster(horizon_s=10.0, quantile=0.99, window_s=60.0, started_at_s=0.0)
    _steady(f, sizes=[3], until_s=60.0)
    fc = f.forecast(60.0)
    # 120 arrivals in 60 s: 2/s; E[S] 0.5 s; m = 2 * min(10, 0.5) = 1; p99 of Poisson(1) = 4
    assert fc.rate_per_s == pytest.approx(2.0)
    assert fc.service_s == pytest.approx(0.5)
    assert fc.mean_in_flight == pytest.approx(1.0)
    assert (fc.slots, fc.blocks) == (4, 12)  # 4 sequences of 3 blocks
    assert fc.measured


def _beyond(rate: float, service_s: float, running: int, horizon_s: float) -> int:
    """The documented count, worked term by term here (not through the module): the largest
    over 16 moments of the horizon of the Poisson p99 of the new sequences in flight less
    the running ones ended by then at the 1 % quantile (normal approximation, floored)."""
    z = 2.3263478740408408  # the normal 0.99 quantile
    best = 0
    for i in range(1, 17):
        ended = 1 - math.exp(-(horizon_s * i / 16) / service_s)
        mean = rate * service_s * ended
        k, term, cdf = 0, math.exp(-mean), math.exp(-mean)
        while cdf < 0.99:
            k += 1
            term *= mean / k
            cdf += term
        sd = math.sqrt(running * ended * (1 - ended))
        best = max(best, k - max(0, math.floor(running * ended - z * sd)))
    return best


def test_sizes_that_vary_add_z_sqrt_k_sd() -> None:
    f = DemandForecaster(horizon_s=10.0, quantile=0.99, window_s=60.0, started_at_s=0.0)
    _steady(f, sizes=[2, 4], until_s=60.0, hold_s=5.0)
    fc = f.forecast(60.0)
    # 110 ended after 5 s; the 10 arrived at 55.5 .. 60 still run, aged 4.5 .. 0 (22.5 s):
    # E[S] = (550 + 22.5) / 110 = 5.2045 s, m = 2 * 5.2045 = 10.409
    assert fc.service_s == pytest.approx(572.5 / 110)
    assert fc.mean_in_flight == pytest.approx(10.409, abs=1e-3)
    assert fc.running == 10
    # at t = 10 s: 85.4 % of the running ones ended, D = floor(8.54 - 2.33 * 1.12) = 5; new
    # in flight Poisson(8.885), p99 17: 12 beyond the 10 held (the largest of the 16 moments)
    assert fc.slots == _beyond(2.0, 572.5 / 110, 10, 10.0) == 12
    # mean 3, sd 1: 12 * 3 + 2.3263 * sqrt(12) * 1 = 36 + 8.06 = 44.06 -> 45 blocks
    assert fc.blocks == 45


def test_a_pool_holding_what_it_will_need_keeps_its_floor() -> None:
    f = DemandForecaster(horizon_s=10.0, quantile=0.99, window_s=60.0, started_at_s=0.0)
    _steady(f, sizes=[3], until_s=60.0, hold_s=20.0)
    # 2/s held 20 s: 40 running (the last 20 s of arrivals); E[S] is over-read at 24.875 s
    # by the censored estimate (the running ones' ages added to the ended ones'), m = 49.75.
    # Beyond the 40 held, the p99 need over 10 s (t = 10: 33 % of them
    # ended at the exponential rate, floor(13.3 - 2.33 * 2.98) = 6 surely; new ones
    # Poisson(16.5), p99 27) is 21, not m's p99 (67) as when the held ones were counted again
    fc = f.forecast(60.0)
    assert fc.running == 40
    assert fc.service_s == pytest.approx(24.875)
    assert fc.slots == _beyond(2.0, 24.875, 40, 10.0) == 21


def test_k_sequences_hold_at_most_k_of_the_largest() -> None:
    f = DemandForecaster(horizon_s=10.0, quantile=0.99, window_s=60.0, started_at_s=0.0)
    _steady(f, sizes=[2, 4], until_s=60.0)
    # K = 4 (m = 1): 12 + 2.3263 * 2 * 1 = 16.65, more than 4 sequences of 4 blocks: 16
    fc = f.forecast(60.0)
    assert (fc.slots, fc.blocks) == (4, 16)


def test_a_short_horizon_bounds_the_mean() -> None:
    f = DemandForecaster(horizon_s=0.25, quantile=0.99, window_s=60.0, started_at_s=0.0)
    _steady(f, sizes=[3], until_s=60.0)
    # at t = 0.25: 39.3 % of E[S] = 0.5 s ended, new in flight Poisson(0.393):
    # P(N<=2) = e^-.393 (1 + .393 + .0774) = 0.9924: 2; the one running (arrived at 60)
    # surely ended? no: floor(0.393 - 2.33 * 0.489) < 0. K = 2
    fc = f.forecast(60.0)
    assert fc.mean_in_flight == pytest.approx(1.0)
    assert (fc.slots, fc.blocks) == (2, 6)


def test_the_rate_counts_only_the_window_and_the_time_observed() -> None:
    f = DemandForecaster(horizon_s=10.0, quantile=0.99, window_s=60.0, started_at_s=0.0)
    f.arrived(1.0, 5)
    f.arrived(2.0, 5)
    # 2 arrivals in the 4 s observed so far; nothing ended: E[S] counts their ages, 3 + 2 s,
    # over one end at least: 5 s
    fc = f.forecast(4.0)
    assert fc.rate_per_s == pytest.approx(0.5)
    assert fc.service_s == pytest.approx(5.0)
    # at t = 10: 86.5 % of E[S] = 5 s ended, new in flight Poisson(2.16): P(N<=5) = 0.977,
    # P(N<=6) = 0.993: 6; of the 2 running, floor(1.73 - 2.33 * 0.48) = 0 surely ended.
    # K = 6; one size: 30 blocks
    assert (fc.slots, fc.blocks) == (6, 30)
    # 70 s later both are out of the window: nothing measured
    assert not f.forecast(74.0).measured
    assert f.forecast(74.0).blocks == 0


def test_a_surge_shows_in_the_short_window() -> None:
    f = DemandForecaster(horizon_s=10.0, quantile=0.99, window_s=60.0, started_at_s=0.0)
    _steady(f, sizes=[3], until_s=60.0)
    for i in range(20):  # 20 more in the next second, each ending 0.5 s later
        f.arrived(60.05 + i * 0.05, 3)
    for i in range(20):
        f.departed(60.55 + i * 0.05, 3, 60.05 + i * 0.05)
    fc = f.forecast(61.5)
    # over 60 s, (1.5, 61.5]: 117 steady (2.0 .. 60.0) + 20 = 137 -> 2.28/s; over the last
    # 10 s, (51.5, 61.5]: 17 steady (52.0 .. 60.0) + 20 = 37 -> 3.7/s, the larger
    assert fc.rate_per_s == pytest.approx(3.7)


def test_a_rare_pool_keeps_one_sequence() -> None:
    f = DemandForecaster(horizon_s=10.0, quantile=0.99, window_s=60.0, started_at_s=0.0)
    f.arrived(10.0, 7)
    f.departed(10.1, 7, 10.0)
    # 1 arrival in 60 s, E[S] 0.1 s: m = 0.00167, p99 count 0, kept at one sequence of 7
    fc = f.forecast(60.0)
    assert (fc.slots, fc.blocks) == (1, 7)


def test_the_error_is_the_new_sequences_peak_less_the_forecast() -> None:
    errors: list[float] = []
    f = DemandForecaster(
        horizon_s=10.0, quantile=0.99, window_s=60.0, started_at_s=0.0, on_error=errors.append
    )
    _steady(f, sizes=[3], until_s=60.0)
    fc = f.forecast(60.0)
    # the model's 12, capped by the measured need: one sequence ever held (3), plus one, less
    # the one held now: 3. The horizon [60, 70] is checked against what is kept, 3
    assert (fc.blocks, fc.need_blocks) == (12, 3)
    # during it: a burst of 5 sequences of 3 at once (15 blocks), then they end
    for i in range(5):
        f.arrived(61.0 + i * 0.01, 3)
    f.departed(63.0, 3, 61.0)
    f.arrived(64.0, 3)  # 5 held again, below the peak
    assert errors == []  # not yet past the horizon
    f.forecast(70.0)  # the horizon has passed: 15 - 3
    assert errors == [12.0]


def test_sequences_held_from_before_the_horizon_do_not_count() -> None:
    errors: list[float] = []
    f = DemandForecaster(
        horizon_s=5.0, quantile=0.99, window_s=60.0, started_at_s=0.0, on_error=errors.append
    )
    f.arrived(1.0, 4)
    fc = f.forecast(2.0)  # m = 0.5 * min(5, 1) = 0.5 -> K = 3: 12 blocks
    assert fc.blocks == 12
    f.departed(3.0, 4, 1.0)  # arrived before the horizon: its end changes nothing counted
    f.forecast(7.0)
    assert errors == [-12.0]  # nothing new arrived: 0 - 12


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        DemandForecaster(horizon_s=0.0, quantile=0.99, window_s=60.0, started_at_s=0.0)
    with pytest.raises(ValueError):
        DemandForecaster(horizon_s=1.0, quantile=1.0, window_s=60.0, started_at_s=0.0)


def test_the_measured_peak_caps_what_is_kept() -> None:
    f = DemandForecaster(horizon_s=10.0, quantile=0.99, window_s=60.0, started_at_s=0.0)
    _steady(f, sizes=[3], until_s=60.0)
    fc = f.forecast(60.0)
    # the model keeps 4 sequences (12 blocks); the pool never held more than one at a time
    # (3 blocks): the peak 3 + one sequence 3 - the 3 it holds now = 3 blocks, 1 slot
    assert (fc.blocks, fc.slots) == (12, 4)
    assert (fc.measured_blocks, fc.measured_slots) == (3, 1)
    assert (fc.need_blocks, fc.need_slots) == (3, 1)


def test_a_higher_peak_in_the_window_is_kept_until_it_leaves_the_window() -> None:
    f = DemandForecaster(horizon_s=10.0, quantile=0.99, window_s=60.0, started_at_s=0.0)
    f.arrived(0.0, 2)
    for _ in range(6):  # a burst: 7 sequences of 2 blocks at 5 s, all ended by 6 s
        f.arrived(5.0, 2)
    for _ in range(6):
        f.departed(6.0, 2, 5.0)
    # 14 held at the peak, 2 now: 14 + 2 - 2 = 14 blocks, 7 + 1 - 1 = 7 slots (the model
    # asks more: 7 arrivals in 20 s)
    fc = f.forecast(20.0)
    assert (fc.measured_blocks, fc.measured_slots) == (14, 7)
    assert fc.need_blocks == min(fc.blocks, 14)
    # at 66.5 s the burst (5-6 s) is out of the window; the one at 0 s still runs (arrival
    # out of the window: the model has nothing, so nothing is measured)
    f.arrived(66.0, 2)
    fc = f.forecast(66.5)
    # peak since 6.5 s: 2 held, then 4 at 66 s: 4 + 2 - 4 = 2 (one sequence), 2 + 1 - 2 = 1
    assert (fc.measured_blocks, fc.measured_slots) == (2, 1)


def test_the_peak_counts_only_after_one_horizon() -> None:
    f = DemandForecaster(horizon_s=10.0, quantile=0.99, window_s=60.0, started_at_s=0.0)
    f.arrived(1.0, 5)
    fc = f.forecast(4.0)  # seen for 3 s: the model alone
    assert fc.measured_blocks is None and fc.need_blocks == fc.blocks > 5
    fc = f.forecast(11.0)  # seen for 10 s: peak 5 + 5 - 5 held = 5
    assert fc.measured_blocks == 5 and fc.need_blocks == 5
