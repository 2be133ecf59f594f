"""What a GPU probe returns: frozen values, units in the names, JSON-ready via `to_dict()`.

`GpuSnapshot` is the whole answer: the devices and their live readings at `taken_at_s`, or,
where there is no GPU, `no_gpu_reason` (a sentence) and no devices. A reading field NVML does
not support on a device (power on some boards, utilisation under MIG) is None.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["GpuDevice", "GpuProcess", "GpuReading", "GpuSnapshot"]


@dataclass(frozen=True)
class GpuProcess:
    """A compute process on a GPU; memory is None where the platform hides it."""

    pid: int
    used_memory_bytes: int | None


@dataclass(frozen=True)
class GpuDevice:
    """One GPU's identity. `spec_name` is its kvcache_model spec (`H100`, ...) if known."""

    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    compute_capability: str | None
    spec_name: str | None


@dataclass(frozen=True)
class GpuReading:
    """One GPU's live state. Fractions in [0, 1]; power in watts; temperature in Celsius."""

    index: int
    uuid: str
    memory_total_bytes: int
    memory_used_bytes: int
    memory_free_bytes: int
    utilization_frac: float | None
    memory_bandwidth_utilization_frac: float | None
    power_watts: float | None
    power_limit_watts: float | None
    temperature_celsius: float | None
    processes: tuple[GpuProcess, ...] = ()


@dataclass(frozen=True)
class GpuSnapshot:
    """Devices and readings at `taken_at_s` (the injected clock's time), or why there are none."""

    taken_at_s: float
    devices: tuple[GpuDevice, ...] = ()
    readings: tuple[GpuReading, ...] = ()
    driver_version: str | None = None
    no_gpu_reason: str | None = None

    @property
    def has_gpu(self) -> bool:
        return self.no_gpu_reason is None and bool(self.devices)

    @classmethod
    def no_gpu(cls, reason: str, taken_at_s: float) -> GpuSnapshot:
        return cls(taken_at_s=taken_at_s, no_gpu_reason=reason)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict (what `gpupool probe --json` prints)."""
        out = asdict(self)
        out["has_gpu"] = self.has_gpu
        return out
