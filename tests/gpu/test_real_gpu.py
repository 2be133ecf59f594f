"""gpu_probe on a real NVIDIA GPU: the readings NVML gives are sane. Skipped without one."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from gpu_probe.detect import visible_gpu_count
from gpu_probe.probe import probe_gpus, read_snapshot
from gpu_probe.sampler import GpuSampler
from kvcache_model.capacity import plan_capacity
from kvcache_model.gpus import GPU_SPECS
from kvcache_model.known import load_geometry

GIB = 1024**3

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(visible_gpu_count() == 0, reason="no NVIDIA GPU visible to this process"),
]


def test_inventory_is_sane() -> None:
    snap = read_snapshot()
    assert snap.has_gpu, snap.no_gpu_reason
    assert snap.driver_version
    assert len(snap.devices) >= visible_gpu_count() >= 1
    assert [d.index for d in snap.devices] == list(range(len(snap.devices)))
    assert len({d.uuid for d in snap.devices}) == len(snap.devices)
    for d in snap.devices:
        assert d.name.strip()
        assert d.uuid.startswith(("GPU-", "MIG-")), d.uuid
        assert d.memory_total_bytes > 1 * GIB
        if d.compute_capability is not None:
            major, _, minor = d.compute_capability.partition(".")
            assert int(major) >= 3 and minor.isdigit()
        if d.spec_name is not None:  # the spec table's memory matches the device within 10 %
            spec = GPU_SPECS[d.spec_name]
            assert abs(spec.memory_bytes - d.memory_total_bytes) / d.memory_total_bytes < 0.10, (
                f"{d.name}: NVML total {d.memory_total_bytes} B vs spec {spec.memory_bytes} B"
            )


def test_readings_are_sane() -> None:
    snap = read_snapshot()
    for r in snap.readings:
        assert 0 <= r.memory_used_bytes <= r.memory_total_bytes
        assert 0 <= r.memory_free_bytes <= r.memory_total_bytes
        assert r.memory_used_bytes + r.memory_free_bytes <= r.memory_total_bytes
        assert r.memory_used_bytes + r.memory_free_bytes >= 0.9 * r.memory_total_bytes
        if r.utilization_frac is not None:
            assert 0.0 <= r.utilization_frac <= 1.0
        if r.temperature_celsius is not None:
            assert 0.0 < r.temperature_celsius < 110.0
        if r.power_watts is not None:
            assert 0.0 < r.power_watts < 2000.0
            if r.power_limit_watts is not None:
                assert r.power_watts <= r.power_limit_watts * 1.25
        for p in r.processes:
            assert p.pid > 0
            if p.used_memory_bytes is not None:
                assert 0 <= p.used_memory_bytes <= r.memory_total_bytes


async def test_async_probe_and_sampler_gauges() -> None:
    snap = await probe_gpus()
    assert snap.has_gpu
    registry = CollectorRegistry()
    sampler = GpuSampler(registry=registry, interval_s=3600)
    await sampler.start()
    try:
        assert sampler.running
        for d in snap.devices:
            total = registry.get_sample_value(
                "gpupool_gpu_memory_total_bytes", {"gpu": str(d.index)}
            )
            assert total == d.memory_total_bytes
            used = registry.get_sample_value("gpupool_gpu_memory_used_bytes", {"gpu": str(d.index)})
            assert used is not None and 0 <= used <= total
    finally:
        await sampler.aclose()
    assert not sampler.running


def test_plan_for_this_device_memory() -> None:
    snap = read_snapshot()
    device = snap.devices[0]
    plan = plan_capacity(load_geometry("llama-3.1-8b"), gpu_memory_bytes=device.memory_total_bytes)
    if device.memory_total_bytes >= 40 * GIB:
        assert plan.fits and plan.kv_tokens > 100_000
