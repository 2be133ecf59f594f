"""The request path's metric writes (router/metrics.py `hot_observer`, `hot_counter`): the same
exposition as prometheus_client's own `observe` and `inc`, series by series."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from router.metrics import RouterMetrics, hot_counter, hot_observer

BUCKETS = (0.001, 0.01, 0.1, 1.0, 10.0)
# on every bound, between bounds, below the first, past the last, zero, negative, NaN, inf
AMOUNTS = (0.001, 0.01, 0.1, 1.0, 10.0, 0.005, 0.5, 0.0001, 50.0, 0.0, -3.0, math.nan, math.inf)


def _pair() -> tuple[CollectorRegistry, Histogram, CollectorRegistry, Histogram]:
    mine, theirs = CollectorRegistry(), CollectorRegistry()
    made = [Histogram("h_seconds", "h", ["a"], buckets=BUCKETS, registry=r) for r in (mine, theirs)]
    return mine, made[0], theirs, made[1]


def _text(registry: CollectorRegistry) -> list[str]:
    # `_created` holds each series' creation time: equal only by accident
    return [
        line for line in generate_latest(registry).decode().splitlines() if "_created" not in line
    ]


def test_hot_observer_exposes_what_observe_does() -> None:
    mine, hot_family, theirs, family = _pair()
    hot = hot_observer(hot_family.labels("x"))
    for amount in AMOUNTS:
        hot(amount)
        family.labels("x").observe(amount)
    assert _text(mine) == _text(theirs)
    count = [line for line in _text(mine) if line.startswith("h_seconds_count")]
    assert count == ['h_seconds_count{a="x"} 12.0']  # NaN lands in no bucket, not even +Inf


def test_hot_observer_on_an_unlabelled_histogram_and_a_counter() -> None:
    mine, theirs = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("o_seconds", "o", buckets=BUCKETS, registry=mine)
    h2 = Histogram("o_seconds", "o", buckets=BUCKETS, registry=theirs)
    c1 = Counter("n", "n", ["k"], registry=mine)
    c2 = Counter("n", "n", ["k"], registry=theirs)
    observe, inc = hot_observer(h1), hot_counter(c1.labels("y"))
    for amount in (0.2, 0.2, 3.0, 20.0):
        observe(amount)
        h2.observe(amount)
        inc()
        c2.labels("y").inc()
    assert _text(mine) == _text(theirs)
    assert 'n_total{k="y"} 4.0' in _text(mine)


def test_a_child_of_another_layout_keeps_its_own_methods() -> None:
    class Other:
        def __init__(self) -> None:
            self.seen: list[float] = []

        def observe(self, amount: float) -> None:
            self.seen.append(amount)

        def inc(self) -> None:
            self.seen.append(1.0)

    other = Other()
    hot_observer(other)(0.5)
    hot_counter(other)()
    assert other.seen == [0.5, 1.0]


def test_router_metrics_request_series() -> None:
    metrics = RouterMetrics()
    for latency_s in (0.003, 0.2, 7.0):
        metrics.request_done("normal", "chat", "ok", "200", latency_s)
    metrics.request_done("normal", "chat", "rejected", "429", 0.001)
    metrics.observe_overhead(0.00025)
    metrics.observe_estimate_error("heuristic", -0.3)
    metrics.observe_ttft("chat", 0.04)
    metrics.observe_tpot("chat", 0.02)
    text = generate_latest(metrics.registry).decode()
    ok = 'class="chat",endpoint="chat",outcome="ok",pool="normal",reason="200"'
    assert f"gpupool_requests_total{{{ok}}} 3.0" in text
    assert (
        'gpupool_request_duration_seconds_count{class="chat",endpoint="chat",pool="normal"} 4.0'
        in text
    )
    by_le = 'class="chat",endpoint="chat",le="0.25",pool="normal"'
    assert f"gpupool_request_duration_seconds_bucket{{{by_le}}} 3.0" in text
    assert 'gpupool_router_overhead_seconds_bucket{le="0.0003"} 1.0' in text
    assert 'gpupool_router_overhead_seconds_bucket{le="0.0002"} 0.0' in text
    assert 'gpupool_token_estimate_error_ratio_sum{source="heuristic"} 0.3' in text
    assert 'gpupool_ttft_seconds_count{class="chat"} 1.0' in text
    assert 'gpupool_tpot_seconds_bucket{class="chat",le="0.02"} 1.0' in text
