"""An engine that leaves the fleet leaves no series behind, and one that comes back under the
same id is exported again from scratch (the cached in-flight child and the preemption
baseline are forgotten with it)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from router.metrics import RouterMetrics


def _exposition(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def test_a_departed_engine_leaves_no_series_and_comes_back_fresh() -> None:
    registry = CollectorRegistry()
    m = RouterMetrics(registry)
    for iid in ("engine-a", "engine-b"):
        m.set_inflight(iid, 3)
        m.healthy.labels(iid).set(1)
        m.kv_usage.labels(iid).set(0.5)
        m.set_preemptions(iid, 7)
    m.forget_instance("engine-a")
    text = _exposition(registry)
    assert 'instance="engine-a"' not in text
    assert 'gpupool_inflight_requests{instance="engine-b"} 3.0' in text
    # back under the same id: exported again, and its preemption counter restarts from the
    # engine's own total (a new process counts from 0)
    m.instance_joined("engine-a")
    m.set_inflight("engine-a", 1)
    m.set_preemptions("engine-a", 2)
    text = _exposition(registry)
    assert 'gpupool_inflight_requests{instance="engine-a"} 1.0' in text
    assert 'gpupool_instance_preemptions_total{instance="engine-a"} 2.0' in text


def test_every_family_labelled_by_instance_alone_is_forgotten() -> None:
    registry = CollectorRegistry()
    m = RouterMetrics(registry)
    per_instance = {
        metric.describe()[0].name
        # its attributes by name: compiled (router/_compiled.py) it has no __dict__ for vars()
        for metric in (getattr(m, name) for name in dir(m) if not name.startswith("__"))
        if getattr(metric, "_labelnames", None) == ("instance",)
    }
    forgotten = {next(iter(family.describe())).name for family in m._per_instance}
    assert per_instance and per_instance == forgotten


def test_a_departed_engines_last_lease_release_does_not_bring_its_series_back() -> None:
    """The last leases on a departed engine are released after `forget_instance`: their
    `set_inflight` must not export the engine's in-flight series again."""
    registry = CollectorRegistry()
    m = RouterMetrics(registry)
    m.set_inflight("engine-a", 2)
    m.forget_instance("engine-a")
    m.set_inflight("engine-a", 1)  # a lease released after the engine left
    m.set_inflight("engine-a", 0)
    assert 'instance="engine-a"' not in _exposition(registry)
