"""Arrival processes: Poisson, gamma burstiness, regular, piecewise schedules, trace replay."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from router.simulate.arrivals import RateSegment, RenewalArrivals, TraceArrivals
from router.simulate.traces import (
    TraceError,
    TraceRow,
    load_azure_csv,
    load_mooncake_jsonl,
    load_trace,
)

SAMPLES = Path(__file__).resolve().parents[2] / "benchmarks" / "scenarios" / "traces"


def times(process: RenewalArrivals, duration_s: float, seed: int = 0) -> np.ndarray:
    return np.array([a.t_s for a in process.arrivals(np.random.default_rng(seed), duration_s)])


def test_poisson_rate_and_exponential_gaps() -> None:
    t = times(RenewalArrivals.poisson(5.0), 2000.0)
    assert abs(len(t) / 2000.0 - 5.0) < 0.15
    gaps = np.diff(t)
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05  # CV of exponential gaps is 1
    assert np.all(np.diff(t) >= 0) and t[0] >= 0 and t[-1] < 2000.0


def test_gamma_cv_sets_burstiness() -> None:
    t = times(RenewalArrivals((RateSegment(0, 5.0),), cv=3.0), 4000.0)
    gaps = np.diff(t)
    assert abs(len(t) / 4000.0 - 5.0) < 0.5
    assert abs(gaps.std() / gaps.mean() - 3.0) < 0.3


def test_constant_rate_is_evenly_spaced() -> None:
    t = times(RenewalArrivals((RateSegment(0, 4.0),), cv=0.0), 10.0)
    assert len(t) in (39, 40)
    assert np.allclose(np.diff(t), 0.25)


def test_schedule_surge_changes_rate_per_segment() -> None:
    # 1/s for a minute, a surge of 10/s for 30 s, then 1/s again.
    process = RenewalArrivals(
        (RateSegment(0, 1.0), RateSegment(60, 10.0), RateSegment(90, 1.0)), cv=1.0
    )
    counts = []
    for seed in range(20):
        t = times(process, 150.0, seed)
        counts.append([((t >= a) & (t < b)).sum() for a, b in ((0, 60), (60, 90), (90, 150))])
    mean = np.array(counts).mean(axis=0)
    assert abs(mean[0] - 60) < 6 and abs(mean[1] - 300) < 15 and abs(mean[2] - 60) < 6
    assert process.expected_count(150.0) == pytest.approx(420.0)


def test_schedule_with_a_silent_segment() -> None:
    process = RenewalArrivals((RateSegment(0, 2.0), RateSegment(10, 0.0), RateSegment(20, 2.0)))
    t = times(process, 30.0, 3)
    assert not np.any((t >= 10) & (t < 20))
    assert np.any(t >= 20)


def test_same_seed_same_arrivals() -> None:
    p = RenewalArrivals((RateSegment(0, 3.0),), cv=2.0)
    assert times(p, 50, 9).tolist() == times(p, 50, 9).tolist()
    assert times(p, 50, 9).tolist() != times(p, 50, 10).tolist()


def test_azure_sample_loads_relative_and_sorted() -> None:
    rows = load_azure_csv(SAMPLES / "azure-sample.csv")
    assert len(rows) == 48
    assert rows[0].t_s == 0.0
    assert all(b.t_s >= a.t_s for a, b in itertools.pairwise(rows))
    assert rows[0].prompt_tokens == 2231 and rows[0].output_tokens == 89


def test_azure_seven_digit_fraction(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,100,10\n"
        "2023-11-16 18:15:48.1805900,200,20\n"
    )
    rows = load_trace(path, "azure")
    assert rows[1].t_s == pytest.approx(1.5)
    assert (rows[1].prompt_tokens, rows[1].output_tokens) == (200, 20)


def test_mooncake_sample_loads_ms() -> None:
    rows = load_mooncake_jsonl(SAMPLES / "mooncake-sample.jsonl")
    assert len(rows) == 48
    assert rows[1].t_s == pytest.approx((333 - 34) / 1000)
    assert rows[0].prompt_tokens == 1130 and rows[0].output_tokens == 84


def test_trace_errors_name_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 3}\n')
    with pytest.raises(TraceError, match=r"bad.jsonl:2"):
        load_mooncake_jsonl(bad)
    csv = tmp_path / "bad.csv"
    csv.write_text("TIMESTAMP,Tokens\n1,2\n")
    with pytest.raises(TraceError, match="missing columns"):
        load_azure_csv(csv)


def test_trace_replay_speedup_offset_and_scale() -> None:
    rows = (
        TraceRow(0.0, 100, 10),
        TraceRow(2.0, 200, 20),
        TraceRow(4.0, 300, 30),
        TraceRow(10.0, 400, 40),
    )
    replay = TraceArrivals(rows, speedup=2.0, offset_s=2.0, length_scale=0.5)
    out = replay.arrivals(np.random.default_rng(0), duration_s=3.5)
    assert [(a.t_s, a.prompt_tokens, a.output_tokens) for a in out] == [
        (0.0, 100, 10),
        (1.0, 150, 15),
    ]
    assert replay.expected_count(100.0) == 3
