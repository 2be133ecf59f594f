"""Prometheus counters for GPU-seconds accounting, on a registry the caller passes in.

- `gpupool_gpu_seconds_total{pool,class,tenant}`: GPU-seconds charged to finished requests;
  incremented once per request by `observe_request`.
- `gpupool_idle_gpu_seconds_total{pool}`, `gpupool_capacity_gpu_seconds_total`: fed by
  `update(report)` with the accountant's cumulative totals; they grow by the difference since
  the last update (poll it at scrape time or on a timer).
- `gpupool_accounting_conservation_error_ratio`: |attributed + idle - capacity| / capacity
  from the last update; anything above ~1e-9 means a bug.
- The ledger's health, read from it at scrape time (`watch_ledger`): `gpupool_ledger_buffered_
  records` (submitted, not yet in the store: it grows while the store is unreachable),
  `gpupool_ledger_failed_commits_total` (writes that failed and were kept for a retry),
  `gpupool_ledger_dropped_records_total` (lost: the buffer was full, or malformed),
  `gpupool_ledger_late_commits_total` (responses answered before their record was committed).

Labels are bounded (pools, classes and tenants come from config); never a run or request id.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.accounting.accountant import ConservationReport

__all__ = ["AccountingMetrics", "LedgerHealth"]


class LedgerHealth(Protocol):
    """What the metrics read from the ledger (router/accounting/ledger.py's `Ledger`)."""

    @property
    def buffered(self) -> int: ...

    failed_commits: int
    dropped_records: int
    late_commits: int


class _LedgerCollector(Collector):
    def __init__(self, ledger: LedgerHealth) -> None:
        self._ledger = ledger

    def collect(self) -> Iterator[Metric]:
        ledger = self._ledger
        yield GaugeMetricFamily(
            "gpupool_ledger_buffered_records",
            "Ledger records submitted and not yet committed to the store.",
            value=ledger.buffered,
        )
        for name, text, value in (
            (
                "gpupool_ledger_failed_commits",
                "Ledger writes that failed (the store unreachable); their records stay buffered.",
                ledger.failed_commits,
            ),
            (
                "gpupool_ledger_dropped_records",
                "Ledger records lost: the buffer was full, or the record malformed.",
                ledger.dropped_records,
            ),
            (
                "gpupool_ledger_late_commits",
                "Responses answered before their ledger record was committed (still written).",
                ledger.late_commits,
            ),
        ):
            yield CounterMetricFamily(name, text, value=value)


class AccountingMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._gpu_seconds = Counter(
            "gpupool_gpu_seconds",
            "GPU-seconds charged to finished requests (processor sharing per instance).",
            ["pool", "class", "tenant"],
            registry=registry,
        )
        self._idle = Counter(
            "gpupool_idle_gpu_seconds",
            "GPU-seconds of instances with no sequence in flight, split by pool shares.",
            ["pool"],
            registry=registry,
        )
        self._capacity = Counter(
            "gpupool_capacity_gpu_seconds",
            "GPU-seconds of capacity: GPUs x wall time of every instance accounted.",
            registry=registry,
        )
        self._error = Gauge(
            "gpupool_accounting_conservation_error_ratio",
            "|attributed + idle - capacity| / capacity at the last accounting update.",
            registry=registry,
        )
        self._last_idle_gpu_s: dict[str, float] = {}
        # each (pool, class, tenant)'s series, looked up once (labels() is ~1.5 us a call)
        self._gpu_seconds_series: dict[tuple[str, str, str], Any] = {}
        self._last_capacity_gpu_s = 0.0
        self._registry = registry

    def watch_ledger(self, ledger: LedgerHealth) -> None:
        """Export `ledger`'s health (buffer, failed commits, drops) at every scrape."""
        self._registry.register(_LedgerCollector(ledger))

    def observe_request(self, pool: str, class_name: str, tenant: str, gpu_seconds: float) -> None:
        """Add one finished request's GPU-seconds (negative values are ignored)."""
        if gpu_seconds > 0.0:
            key = (pool, class_name, tenant)  # from the config: bounded
            series = self._gpu_seconds_series.get(key)
            if series is None:
                series = self._gpu_seconds_series[key] = self._gpu_seconds.labels(*key)
            series.inc(gpu_seconds)

    def update(self, report: ConservationReport) -> None:
        """Advance the idle and capacity counters to the report's cumulative totals."""
        for pool, total in report.idle_by_pool_gpu_seconds.items():
            delta = total - self._last_idle_gpu_s.get(pool, 0.0)
            if delta > 0.0:
                self._idle.labels(pool).inc(delta)
                self._last_idle_gpu_s[pool] = total
        delta = report.capacity_gpu_seconds - self._last_capacity_gpu_s
        if delta > 0.0:
            self._capacity.inc(delta)
            self._last_capacity_gpu_s = report.capacity_gpu_seconds
        self._error.set(report.rel_error)
