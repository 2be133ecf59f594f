"""Prometheus counters for accounting (router/accounting/metrics.py), on a private registry."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from router.accounting.accountant import Accountant
from router.accounting.metrics import AccountingMetrics


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    got = registry.get_sample_value(name, labels)
    return 0.0 if got is None else got


def test_counters_follow_requests_and_idle_deltas() -> None:
    registry = CollectorRegistry()
    metrics = AccountingMetrics(registry)
    acc = Accountant()
    acc.add_instance("i0", 1.0, {"agent": 0.5, "normal": 0.5}, now_s=0.0)

    metrics.update(acc.conservation(4.0))
    tok = acc.begin("i0", 4.0)
    metrics.observe_request("agent", "agent", "team-a", acc.end(tok, 6.0))
    metrics.update(acc.conservation(10.0))
    metrics.update(acc.conservation(10.0))  # no growth, no change

    labels = {"pool": "agent", "class": "agent", "tenant": "team-a"}
    assert value(registry, "gpupool_gpu_seconds_total", **labels) == pytest.approx(2.0)
    assert value(registry, "gpupool_idle_gpu_seconds_total", pool="agent") == pytest.approx(4.0)
    assert value(registry, "gpupool_idle_gpu_seconds_total", pool="normal") == pytest.approx(4.0)
    assert value(registry, "gpupool_capacity_gpu_seconds_total") == pytest.approx(10.0)
    assert value(registry, "gpupool_accounting_conservation_error_ratio") < 1e-9


def test_two_registries_do_not_collide() -> None:
    AccountingMetrics(CollectorRegistry())
    AccountingMetrics(CollectorRegistry())  # no global state: a second app can be built
