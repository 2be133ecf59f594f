"""The router's last hour, sampled on a timer: the time series behind the status page's plots.

`GET /admin/history` answers from a `History`: every `interval_s` (default 5 s) it takes one
`Reading` of the router (pool shares and queues, each instance's KV use and load, and the
cumulative Prometheus histograms and counters) and keeps one sample per tick for `window_s`
(default one hour) in a ring buffer. A sample holds gauges as read and, for latency, the
quantiles *of the interval since the previous sample* (histogram bucket deltas, interpolated as
Prometheus's `histogram_quantile` does), so a plot of TTFT p95 shows what happened in each
5-second slice, not a since-start average.

Pure core (`HistoryBuffer.record(t_s, reading)`, `bucket_quantile`), thin shell (`History`:
`start()` takes a first sample and one background task, `aclose()` stops it; the wall clock and
the sleep are injected). Sample shape: docs/status_page.md.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from pools.periodic import Periodic

__all__ = [
    "History",
    "HistoryBuffer",
    "Reading",
    "bucket_quantile",
    "reading_from",
]

log = logging.getLogger(__name__)

JsonDict = dict[str, Any]
Buckets = tuple[tuple[float, float], ...]  # (upper bound `le`, cumulative count), ascending

DEFAULT_INTERVAL_S = 5.0
DEFAULT_WINDOW_S = 3600.0

# (series name in a sample, Prometheus family, label the series is keyed by, quantile)
_QUANTILES: tuple[tuple[str, str, str, float], ...] = (
    ("ttft_p50_s", "gpupool_ttft_seconds", "class", 0.50),
    ("ttft_p95_s", "gpupool_ttft_seconds", "class", 0.95),
    ("tpot_p50_s", "gpupool_tpot_seconds", "class", 0.50),
    ("tpot_p95_s", "gpupool_tpot_seconds", "class", 0.95),
    ("queue_wait_p95_s", "gpupool_queue_wait_seconds", "pool", 0.95),
    ("request_p95_s", "gpupool_request_duration_seconds", "pool", 0.95),
)
# (series name, Prometheus counter family, label): per-second rates over the interval
_RATES: tuple[tuple[str, str, str], ...] = (
    ("requests_per_s", "gpupool_requests_total", "pool"),
    ("rejected_per_s", "gpupool_rejections_total", "pool"),
)


@dataclass(frozen=True, slots=True)
class Reading:
    """The router at one instant. `pools` and `instances` are gauges, JSON-ready; `histograms`
    maps (family, label value) to cumulative buckets and `counters` (family, label value) to a
    cumulative count, each summed over the family's other labels."""

    pools: Mapping[str, JsonDict]
    instances: Mapping[str, JsonDict]
    histograms: Mapping[tuple[str, str], Buckets] = field(default_factory=dict)
    counters: Mapping[tuple[str, str], float] = field(default_factory=dict)


def bucket_quantile(q: float, buckets: Buckets) -> float | None:
    """The q-quantile (q in [0, 1]) of observations counted in cumulative `buckets`, linearly
    interpolated within the bucket that holds it (Prometheus's `histogram_quantile`): the first
    bucket's lower bound is 0, and a rank in the +Inf bucket answers the largest finite bound.
    None when the buckets hold no observation."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    lower_le, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank and count > lower_count:
            if math.isinf(le):
                return lower_le
            return lower_le + (le - lower_le) * (rank - lower_count) / (count - lower_count)
        lower_le, lower_count = le, count
    return lower_le


def _delta(now: Buckets, before: Buckets | None) -> Buckets:
    """Counts added between two readings of one histogram (a reset counts from zero)."""
    if before is None or len(before) != len(now):
        return now
    out = tuple((le, c - b) for (le, c), (_, b) in zip(now, before, strict=True))
    return now if any(c < 0 for _, c in out) else out


class HistoryBuffer:
    """The last `window_s` of samples, one per `record` call (pure: the caller gives the time)."""

    def __init__(
        self, *, interval_s: float = DEFAULT_INTERVAL_S, window_s: float = DEFAULT_WINDOW_S
    ) -> None:
        if interval_s <= 0 or window_s < interval_s:
            raise ValueError(f"need 0 < interval_s <= window_s, got {interval_s}, {window_s}")
        self.interval_s = interval_s
        self.window_s = window_s
        self._samples: deque[JsonDict] = deque(maxlen=math.ceil(window_s / interval_s) + 1)
        self._previous: Reading | None = None
        self._previous_t_s: float | None = None

    def __len__(self) -> int:
        return len(self._samples)

    def record(self, t_s: float, reading: Reading) -> JsonDict:
        """Append the sample for `reading` taken at wall time `t_s` (Unix seconds) and return it.
        Quantiles and rates cover the time since the previous call (None on the first)."""
        before, before_t_s = self._previous, self._previous_t_s
        elapsed_s = None if before_t_s is None else t_s - before_t_s
        latency: dict[str, dict[str, float | None]] = {}
        for name, family, _, q in _QUANTILES:
            series = latency.setdefault(name, {})
            for (fam, key), buckets in reading.histograms.items():
                if fam != family:
                    continue
                if before is None:
                    series[key] = None
                    continue
                value = bucket_quantile(q, _delta(buckets, before.histograms.get((fam, key))))
                series[key] = None if value is None else round(value, 6)
        rates: dict[str, dict[str, float | None]] = {}
        for name, family, _ in _RATES:
            series = rates.setdefault(name, {})
            for (fam, key), count in reading.counters.items():
                if fam != family:
                    continue
                if before is None or elapsed_s is None or elapsed_s <= 0:
                    series[key] = None
                    continue
                added = count - before.counters.get((fam, key), 0.0)
                series[key] = round((count if added < 0 else added) / elapsed_s, 4)
        sample: JsonDict = {
            "t_s": round(t_s, 3),
            "pools": {k: dict(v) for k, v in reading.pools.items()},
            "instances": {k: dict(v) for k, v in reading.instances.items()},
            "latency": latency,
            "rates": rates,
        }
        self._samples.append(sample)
        self._previous, self._previous_t_s = reading, t_s
        return sample

    def samples(self, since_s: float | None = None) -> list[JsonDict]:
        """Samples oldest first; with `since_s`, only those taken after it."""
        if since_s is None:
            return list(self._samples)
        return [s for s in self._samples if s["t_s"] > since_s]

    def view(self, since_s: float | None = None) -> JsonDict:
        """The body of `GET /admin/history`."""
        return {
            "object": "gpupool.history",
            "interval_s": self.interval_s,
            "window_s": self.window_s,
            "samples": self.samples(since_s),
        }


def _label_sums(
    registry: CollectorRegistry, families: Iterable[tuple[str, str]]
) -> tuple[dict[tuple[str, str], Buckets], dict[tuple[str, str], float]]:
    wanted = dict(families)  # family -> label
    per_le: dict[tuple[str, str], dict[float, float]] = {}
    counters: dict[tuple[str, str], float] = {}
    for metric in registry.collect():
        label = wanted.get(metric.name)
        if label is None:
            # prometheus_client drops `_total` from a counter family's name
            label = wanted.get(metric.name + "_total")
            if label is None:
                continue
            family = metric.name + "_total"
        else:
            family = metric.name
        for s in metric.samples:
            key = (family, s.labels.get(label, ""))
            if metric.type == "histogram" and s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                bucket = per_le.setdefault(key, {})
                bucket[le] = bucket.get(le, 0.0) + s.value
            elif metric.type == "counter" and s.name.endswith("_total"):
                counters[key] = counters.get(key, 0.0) + s.value
    histograms = {k: tuple(sorted(v.items())) for k, v in per_le.items()}
    return histograms, counters


def reading_from(pools_view: JsonDict, registry: CollectorRegistry) -> Reading:
    """A `Reading` from the body of `GET /admin/pools` and the router's metrics registry (a
    pool's pressure is the rebalancer's smoothed pressure, where there is a rebalancer)."""
    pressure = (pools_view.get("rebalancer") or {}).get("smoothed_pressure") or {}
    pools = {
        name: {
            "share_frac": p["share_frac"],
            "queue_depth": p["queue"]["depth"],
            "healthy_instances": p["healthy_instances"],
            **({"pressure": pressure[name]} if name in pressure else {}),
        }
        for name, p in pools_view["pools"].items()
    }
    instances = {}
    for iid, i in pools_view["instances"].items():
        blocks = i.get("num_gpu_blocks")
        reserved = i.get("kv_reserved_blocks")
        instances[iid] = {
            "healthy": i["healthy"],
            "kv_usage_frac": i.get("kv_usage_frac"),
            "kv_reserved_frac": None
            if not blocks or reserved is None
            else round(reserved / blocks, 4),
            "running": i.get("running"),
            "waiting": i.get("waiting"),
            "inflight": i["inflight"],
            "op_limit": (i.get("operating_point") or {}).get("limit"),
        }
    families = [(f, label) for _, f, label, _ in _QUANTILES] + [(f, lb) for _, f, lb in _RATES]
    histograms, counters = _label_sums(registry, families)
    return Reading(pools=pools, instances=instances, histograms=histograms, counters=counters)


class History:
    """Samples `read()` into a `HistoryBuffer` every `interval_s` on one background task."""

    def __init__(
        self,
        read: Callable[[], Reading],
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        window_s: float = DEFAULT_WINDOW_S,
        wall_clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.buffer = HistoryBuffer(interval_s=interval_s, window_s=window_s)
        self._read = read
        self._wall_clock = wall_clock
        self._loop = Periodic("gpupool-history", self.sample_once, interval_s, sleep=sleep)

    def sample_once(self) -> JsonDict | None:
        """Take one sample now; None when reading the router failed (logged, not raised)."""
        try:
            return self.buffer.record(self._wall_clock(), self._read())
        except Exception:
            log.exception("history sample failed")
            return None

    async def start(self) -> None:
        if self._loop.running:
            return
        self.sample_once()
        self._loop.start()

    async def aclose(self) -> None:
        await self._loop.aclose()

    def view(self, since_s: float | None = None) -> JsonDict:
        return self.buffer.view(since_s)
