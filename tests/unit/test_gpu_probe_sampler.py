"""GpuSampler in simulated time: fake NVML, fake clock, a sleep the test releases step by step."""

from __future__ import annotations

import asyncio
import logging

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry

from gpu_probe.fake_nvml import FakeGpu, FakeNvml
from gpu_probe.nvml import NVML_ERROR_GPU_IS_LOST
from gpu_probe.sampler import GpuSampler

GIB = 1024**3


class SimTime:
    """A clock and a sleep: each sleep waits until `step()` advances time past it."""

    def __init__(self) -> None:
        self.now_s = 1000.0
        self.sleeps: asyncio.Queue[tuple[float, asyncio.Event]] = asyncio.Queue()

    def clock(self) -> float:
        return self.now_s

    async def sleep(self, seconds: float) -> None:
        wake = asyncio.Event()
        await self.sleeps.put((seconds, wake))
        await wake.wait()

    async def step(self) -> float:
        """Let the pending sleep end, then wait until the sampler sleeps again (one sample)."""
        seconds, wake = await asyncio.wait_for(self.sleeps.get(), 5)
        self.now_s += seconds
        wake.set()
        pending = await asyncio.wait_for(self.sleeps.get(), 5)
        await self.sleeps.put(pending)
        return seconds


def gauge(registry: CollectorRegistry, name: str, gpu: str = "0") -> float | None:
    return registry.get_sample_value(name, {"gpu": gpu})


@pytest.fixture
def sim() -> SimTime:
    return SimTime()


async def test_samples_into_gauges_on_the_given_registry(sim: SimTime) -> None:
    nvml = FakeNvml(
        [
            FakeGpu.h100(0, memory_used_bytes=10 * GIB, utilization_pct=50, power_mw=300_000),
            FakeGpu.l40s(1, temperature_celsius=44),
        ]
    )
    registry = CollectorRegistry()
    sampler = GpuSampler(
        registry=registry, nvml=nvml, interval_s=2.0, clock=sim.clock, sleep=sim.sleep
    )
    await sampler.start()
    try:
        assert sampler.running
        snap = sampler.latest
        assert snap is not None and snap.has_gpu and snap.taken_at_s == 1000.0
        assert gauge(registry, "gpupool_gpu_memory_used_bytes") == 10 * GIB
        assert gauge(registry, "gpupool_gpu_memory_total_bytes") == 81559 * 1024 * 1024
        assert gauge(registry, "gpupool_gpu_utilization_frac") == 0.5
        assert gauge(registry, "gpupool_gpu_power_watts") == 300.0
        assert gauge(registry, "gpupool_gpu_temperature_celsius", "1") == 44.0

        nvml.gpus[0].memory_used_bytes = 70 * GIB
        nvml.gpus[0].temperature_celsius = 83
        assert await sim.step() == 2.0
        snap = sampler.latest
        assert snap is not None and snap.taken_at_s == 1002.0
        assert gauge(registry, "gpupool_gpu_memory_used_bytes") == 70 * GIB
        assert gauge(registry, "gpupool_gpu_temperature_celsius") == 83.0
        # Never the process-global registry.
        assert (
            prometheus_client.REGISTRY.get_sample_value(
                "gpupool_gpu_memory_used_bytes", {"gpu": "0"}
            )
            is None
        )
    finally:
        await sampler.aclose()
    assert not sampler.running
    assert not nvml.initialised and nvml.calls["nvmlShutdown"] == 1
    assert asyncio.all_tasks() == {asyncio.current_task()}  # no leaked task


async def test_no_gpu_start_is_quiet_and_idle(sim: SimTime) -> None:
    registry = CollectorRegistry()
    sampler = GpuSampler(
        registry=registry, nvml=FakeNvml.without_driver(), clock=sim.clock, sleep=sim.sleep
    )
    await sampler.start()
    snap = sampler.latest
    assert snap is not None and not snap.has_gpu
    assert snap.no_gpu_reason and "no NVIDIA driver" in snap.no_gpu_reason
    assert not sampler.running
    assert await sampler.sample_once() is None
    assert gauge(registry, "gpupool_gpu_memory_used_bytes") is None
    await sampler.aclose()


async def test_machine_with_zero_gpus(sim: SimTime) -> None:
    nvml = FakeNvml([])
    sampler = GpuSampler(registry=CollectorRegistry(), nvml=nvml, clock=sim.clock, sleep=sim.sleep)
    await sampler.start()
    assert sampler.latest is not None and not sampler.latest.has_gpu
    assert not nvml.initialised
    await sampler.aclose()


async def test_failed_sample_keeps_last_snapshot_and_recovers(
    sim: SimTime, caplog: pytest.LogCaptureFixture
) -> None:
    nvml = FakeNvml([FakeGpu.h100()])
    registry = CollectorRegistry()
    sampler = GpuSampler(
        registry=registry, nvml=nvml, interval_s=1.0, clock=sim.clock, sleep=sim.sleep
    )
    await sampler.start()
    try:
        nvml.gpus[0].errors["nvmlDeviceGetMemoryInfo"] = NVML_ERROR_GPU_IS_LOST
        with caplog.at_level(logging.WARNING, logger="gpu_probe.sampler"):
            await sim.step()
            await sim.step()
        warnings = [r for r in caplog.records if "GPU sample failed" in r.getMessage()]
        assert len(warnings) == 1  # once per distinct error, not once per tick
        snap = sampler.latest
        assert snap is not None and snap.taken_at_s == 1000.0  # stale, visibly
        del nvml.gpus[0].errors["nvmlDeviceGetMemoryInfo"]
        nvml.gpus[0].memory_used_bytes = 5 * GIB
        await sim.step()
        snap = sampler.latest
        assert snap is not None and snap.taken_at_s == 1003.0
        assert gauge(registry, "gpupool_gpu_memory_used_bytes") == 5 * GIB
    finally:
        await sampler.aclose()


async def test_lifecycle_rules(sim: SimTime) -> None:
    with pytest.raises(ValueError, match="interval_s"):
        GpuSampler(registry=CollectorRegistry(), interval_s=0)
    nvml = FakeNvml([FakeGpu.h100()])
    sampler = GpuSampler(registry=CollectorRegistry(), nvml=nvml, clock=sim.clock, sleep=sim.sleep)
    await sampler.start()
    with pytest.raises(RuntimeError):
        await sampler.start()
    await sampler.aclose()
    await sampler.aclose()  # idempotent
    assert nvml.calls["nvmlShutdown"] == 1
    with pytest.raises(RuntimeError):
        await sampler.start()


async def test_real_sampler_without_gpu_never_raises() -> None:
    """Default NVML on this machine: either real readings or a no-GPU answer."""
    sampler = GpuSampler(registry=CollectorRegistry(), interval_s=3600)
    await sampler.start()
    try:
        assert sampler.latest is not None
        if not sampler.latest.has_gpu:
            assert sampler.latest.no_gpu_reason
    finally:
        await sampler.aclose()
