"""Prometheus gauges for GPU readings, registered on a registry the caller passes in.

    gpupool_gpu_memory_used_bytes{gpu}      gpupool_gpu_memory_total_bytes{gpu}
    gpupool_gpu_utilization_frac{gpu}       gpupool_gpu_power_watts{gpu}
    gpupool_gpu_temperature_celsius{gpu}

`gpu` is the NVML device index (bounded label). A reading NVML cannot give leaves its gauge
unset for that GPU rather than reporting a made-up zero.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Gauge

from gpu_probe.readings import GpuReading

__all__ = ["GpuGauges"]


class GpuGauges:
    """The five per-GPU gauges on `registry` (never the global one)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["gpu"], registry=registry)

        self.memory_used_bytes = gauge(
            "gpupool_gpu_memory_used_bytes", "GPU memory in use, bytes (NVML)"
        )
        self.memory_total_bytes = gauge(
            "gpupool_gpu_memory_total_bytes", "GPU memory total, bytes (NVML)"
        )
        self.utilization_frac = gauge(
            "gpupool_gpu_utilization_frac",
            "Fraction of the last sample period a kernel ran on the GPU, 0..1 (NVML)",
        )
        self.power_watts = gauge("gpupool_gpu_power_watts", "GPU power draw, watts (NVML)")
        self.temperature_celsius = gauge(
            "gpupool_gpu_temperature_celsius", "GPU core temperature, Celsius (NVML)"
        )

    def update(self, readings: Iterable[GpuReading]) -> None:
        """Set every gauge from `readings`."""
        for r in readings:
            gpu = str(r.index)
            self.memory_used_bytes.labels(gpu=gpu).set(r.memory_used_bytes)
            self.memory_total_bytes.labels(gpu=gpu).set(r.memory_total_bytes)
            if r.utilization_frac is not None:
                self.utilization_frac.labels(gpu=gpu).set(r.utilization_frac)
            if r.power_watts is not None:
                self.power_watts.labels(gpu=gpu).set(r.power_watts)
            if r.temperature_celsius is not None:
                self.temperature_celsius.labels(gpu=gpu).set(r.temperature_celsius)
