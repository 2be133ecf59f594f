"""The status page's last hour (router/ops/history.py): bucket quantiles, interval rates, the ring
buffer's window, readings from the router's own metrics, and the sampler's lifecycle in
simulated time. Expected values are worked out by hand in the comments."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from typing import Any

import pytest

from router.metrics import RouterMetrics
from router.ops.history import History, HistoryBuffer, Reading, bucket_quantile, reading_from

INF = math.inf


def test_bucket_quantile_interpolates_within_the_bucket() -> None:
    buckets = ((0.1, 2.0), (0.5, 6.0), (1.0, 10.0), (INF, 10.0))
    # p50: rank 5 of 10 lies in (0.1, 0.5] holding ranks 3..6: 0.1 + 0.4 * (5 - 2) / 4 = 0.4
    assert bucket_quantile(0.5, buckets) == pytest.approx(0.4)
    # p95: rank 9.5 in (0.5, 1.0] holding 7..10: 0.5 + 0.5 * 3.5 / 4 = 0.9375
    assert bucket_quantile(0.95, buckets) == pytest.approx(0.9375)
    # the first bucket starts at 0: rank 2 of 4 in (0, 1]: 0.5
    assert bucket_quantile(0.5, ((1.0, 4.0), (INF, 4.0))) == pytest.approx(0.5)


def test_bucket_quantile_in_the_inf_bucket_and_empty() -> None:
    # rank 2.7 of 3 lies past the last finite bound: answer that bound, as Prometheus does
    assert bucket_quantile(0.9, ((0.1, 1.0), (INF, 3.0))) == pytest.approx(0.1)
    assert bucket_quantile(0.5, ((0.1, 0.0), (INF, 0.0))) is None
    assert bucket_quantile(0.5, ()) is None
    # empty leading buckets are skipped: all 4 in (0.5, 1.0], p50 = 0.5 + 0.5 * 2 / 4 = 0.75
    assert bucket_quantile(0.5, ((0.1, 0.0), (0.5, 0.0), (1.0, 4.0), (INF, 4.0))) == 0.75


def _reading(
    share: float, ttft: tuple[tuple[float, float], ...], requests: float, depth: int = 0
) -> Reading:
    return Reading(
        pools={"agent": {"share_frac": share, "queue_depth": depth}},
        instances={"e0": {"kv_usage_frac": 0.25, "running": 3}},
        histograms={("gpupool_ttft_seconds", "agent"): ttft},
        counters={("gpupool_requests_total", "agent"): requests},
    )


def test_quantiles_and_rates_cover_only_the_interval_since_the_last_sample() -> None:
    buf = HistoryBuffer(interval_s=5, window_s=3600)
    before = ((0.1, 10.0), (1.0, 10.0), (INF, 10.0))  # ten fast requests before
    first = buf.record(1000.0, _reading(0.3, before, requests=10))
    assert first["latency"]["ttft_p95_s"] == {"agent": None}  # nothing to compare with yet
    assert first["rates"]["requests_per_s"] == {"agent": None}
    assert first["pools"]["agent"] == {"share_frac": 0.3, "queue_depth": 0}
    # then four slow ones in (0.1, 1.0] over 5 s: the interval's p50 is 0.1 + 0.9 * 2 / 4
    after = ((0.1, 10.0), (1.0, 14.0), (INF, 14.0))
    second = buf.record(1005.0, _reading(0.4, after, requests=14, depth=2))
    assert second["latency"]["ttft_p50_s"]["agent"] == pytest.approx(0.55)
    assert second["rates"]["requests_per_s"]["agent"] == pytest.approx(4 / 5)
    assert second["pools"]["agent"]["share_frac"] == 0.4
    assert second["instances"]["e0"] == {"kv_usage_frac": 0.25, "running": 3}
    # nothing new in the next interval: no latency figure, a rate of 0
    third = buf.record(1010.0, _reading(0.4, after, requests=14))
    assert third["latency"]["ttft_p95_s"]["agent"] is None
    assert third["rates"]["requests_per_s"]["agent"] == 0.0


def test_a_counter_reset_counts_from_zero() -> None:
    buf = HistoryBuffer(interval_s=5, window_s=60)
    buf.record(0.0, _reading(0.5, ((1.0, 8.0), (INF, 8.0)), requests=100))
    # the process restarted: 2 requests, both in (0, 1]
    sample = buf.record(5.0, _reading(0.5, ((1.0, 2.0), (INF, 2.0)), requests=2))
    assert sample["rates"]["requests_per_s"]["agent"] == pytest.approx(2 / 5)
    assert sample["latency"]["ttft_p50_s"]["agent"] == pytest.approx(0.5)


def test_the_buffer_keeps_one_window_and_filters_by_time() -> None:
    buf = HistoryBuffer(interval_s=5, window_s=20)  # 20 s / 5 s = 4 intervals: 5 samples
    for i in range(10):
        buf.record(100.0 + 5 * i, _reading(0.5, ((INF, 0.0),), requests=0))
    kept = [s["t_s"] for s in buf.samples()]
    assert kept == [125.0, 130.0, 135.0, 140.0, 145.0]
    assert [s["t_s"] for s in buf.samples(since_s=135.0)] == [140.0, 145.0]
    view = buf.view(since_s=145.0)
    assert view["object"] == "gpupool.history" and view["samples"] == []
    assert (view["interval_s"], view["window_s"]) == (5, 20)
    with pytest.raises(ValueError):
        HistoryBuffer(interval_s=10, window_s=5)


def test_a_reading_from_the_router_metrics_and_pools_view() -> None:
    metrics = RouterMetrics()
    for ttft_s in (0.3, 0.4, 3.0):  # buckets ... 0.25, 0.5, 1, 2.5, 5 ...
        metrics.observe_ttft("agent", ttft_s)
    for _ in range(3):
        metrics.request_done("agent", "agent", "ok", "200", 1.0)
    metrics.request_done("normal", "normal", "rejected", "queue_full", 0.01)
    metrics.rejected("normal", "queue_full")
    view: dict[str, Any] = {
        "pools": {
            "agent": {"share_frac": 0.34, "queue": {"depth": 1}, "healthy_instances": 1},
            "normal": {"share_frac": 0.66, "queue": {"depth": 0}, "healthy_instances": 2},
        },
        "rebalancer": {"smoothed_pressure": {"normal": 0.7}},
        "instances": {
            "e0": {
                "healthy": True,
                "inflight": 5,
                "kv_usage_frac": 0.5,
                "num_gpu_blocks": 200,
                "kv_reserved_blocks": 50,
                "running": 4,
                "waiting": 1,
                "operating_point": {"limit": 12},
            },
            "e1": {"healthy": False, "inflight": 0},  # never scraped
        },
    }
    reading = reading_from(view, metrics.registry)
    assert reading.pools["agent"] == {"share_frac": 0.34, "queue_depth": 1, "healthy_instances": 1}
    assert reading.pools["normal"]["pressure"] == 0.7  # the rebalancer's smoothed pressure
    assert reading.instances["e0"] == {
        "healthy": True,
        "kv_usage_frac": 0.5,
        "kv_reserved_frac": 0.25,  # 50 of 200 blocks
        "running": 4,
        "waiting": 1,
        "inflight": 5,
        "op_limit": 12,
    }
    assert reading.instances["e1"]["kv_reserved_frac"] is None
    assert reading.counters[("gpupool_requests_total", "agent")] == 3
    assert reading.counters[("gpupool_requests_total", "normal")] == 1
    assert reading.counters[("gpupool_rejections_total", "normal")] == 1
    ttft = dict(reading.histograms[("gpupool_ttft_seconds", "agent")])
    assert (ttft[0.25], ttft[0.5], ttft[2.5], ttft[5.0], ttft[INF]) == (0, 2, 2, 3, 3)


class _Steps:
    """A sleep the test releases one tick at a time, and a wall clock it advances."""

    def __init__(self) -> None:
        self.now_s = 5000.0
        self.sleeping: asyncio.Queue[asyncio.Event] = asyncio.Queue()

    def wall(self) -> float:
        return self.now_s

    async def sleep(self, seconds: float) -> None:
        wake = asyncio.Event()
        await self.sleeping.put(wake)
        await wake.wait()
        self.now_s += seconds

    async def tick(self) -> None:
        (await asyncio.wait_for(self.sleeping.get(), 5)).set()
        wake = await asyncio.wait_for(self.sleeping.get(), 5)  # the next sleep: a sample was taken
        await self.sleeping.put(wake)


async def test_history_samples_on_its_timer_and_stops_on_aclose() -> None:
    steps = _Steps()
    shares = iter([0.1, 0.2, 0.3])
    history = History(
        lambda: _reading(next(shares), ((INF, 0.0),), requests=0),
        interval_s=5,
        wall_clock=steps.wall,
        sleep=steps.sleep,
    )
    await history.start()  # the first sample at once
    assert [s["t_s"] for s in history.view()["samples"]] == [5000.0]
    await steps.tick()
    await steps.tick()
    samples = history.view()["samples"]
    assert [s["t_s"] for s in samples] == [5000.0, 5005.0, 5010.0]
    assert [s["pools"]["agent"]["share_frac"] for s in samples] == [0.1, 0.2, 0.3]
    await history.aclose()
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "gpupool-history"]


async def test_a_failing_read_is_logged_and_sampling_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    steps = _Steps()
    calls: Iterator[RuntimeError | float] = iter([RuntimeError("boom"), 0.5])

    def read() -> Reading:
        value = next(calls)
        if isinstance(value, Exception):
            raise value
        return _reading(value, ((INF, 0.0),), requests=0)

    history = History(read, interval_s=5, wall_clock=steps.wall, sleep=steps.sleep)
    await history.start()
    assert history.view()["samples"] == []
    assert "history sample failed" in caplog.text
    await steps.tick()
    assert [s["t_s"] for s in history.view()["samples"]] == [5005.0]
    await history.aclose()
