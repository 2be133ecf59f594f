"""A fake NVML: the same calls as `pynvml`, answering from scripted `FakeGpu`s.

Tests (and demos on machines without a GPU) inject it wherever an `NvmlApi` is taken:

    nvml = FakeNvml([FakeGpu.h100(memory_used_bytes=10 * 2**30)])
    snapshot = read_snapshot(nvml)
    nvml.gpus[0].temperature_celsius = 80          # script the next reading
    FakeNvml.without_driver()                      # nvmlInit fails like a machine with no driver

It enforces NVML's lifecycle (calls before `nvmlInit` or after the last `nvmlShutdown` raise
UNINITIALIZED; init/shutdown are reference counted) and counts calls, so tests can assert a
component shut NVML down.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from gpu_probe.nvml import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_UNINITIALIZED,
)

__all__ = ["FakeGpu", "FakeNvml", "FakeNvmlError"]

_MESSAGES = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
}


class FakeNvmlError(Exception):
    """pynvml.NVMLError's shape: an NVML return code in `.value`."""

    def __init__(self, value: int) -> None:
        self.value = value
        super().__init__(value)

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"NVML error {self.value}")


@dataclass(frozen=True)
class _Memory:
    total: int
    free: int
    used: int


@dataclass(frozen=True)
class _Utilization:
    gpu: int
    memory: int


@dataclass(frozen=True)
class _Process:
    pid: int
    usedGpuMemory: int | None  # pynvml's name


@dataclass
class FakeGpu:
    """One scripted device; mutate its fields between samples. `unsupported` names the NVML
    calls (e.g. "nvmlDeviceGetPowerUsage") that raise NOT_SUPPORTED on it; `errors` maps a call
    to the NVML return code it raises (e.g. GPU_IS_LOST) until removed."""

    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    memory_total_bytes: int = 81559 * 1024 * 1024
    memory_used_bytes: int = 0
    utilization_pct: int = 0
    memory_utilization_pct: int = 0
    power_mw: int = 70_000
    power_limit_mw: int = 700_000
    temperature_celsius: int = 35
    compute_capability: tuple[int, int] = (9, 0)
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    unsupported: set[str] = field(default_factory=set)
    errors: dict[str, int] = field(default_factory=dict)

    @classmethod
    def h100(cls, index: int = 0, **overrides: Any) -> FakeGpu:
        """An idle H100 SXM with a distinct UUID per index."""
        return cls(uuid=f"GPU-{index:08d}-fake-h100", **overrides)

    @classmethod
    def l40s(cls, index: int = 0, **overrides: Any) -> FakeGpu:
        values: dict[str, Any] = {
            "name": "NVIDIA L40S",
            "uuid": f"GPU-{index:08d}-fake-l40s",
            "memory_total_bytes": 46068 * 1024 * 1024,
            "power_limit_mw": 350_000,
            "compute_capability": (8, 9),
        }
        values.update(overrides)
        return cls(**values)


class FakeNvml:
    """Implements `gpu_probe.nvml.NvmlApi` from a list of `FakeGpu`s."""

    NVMLError = FakeNvmlError
    NVML_TEMPERATURE_GPU = 0

    def __init__(
        self,
        gpus: list[FakeGpu] | None = None,
        *,
        init_error: int | None = None,
        driver_version: str = "570.133.20",
    ) -> None:
        self.gpus: list[FakeGpu] = list(gpus or [])
        self.init_error = init_error
        self.driver_version = driver_version
        self.calls: Counter[str] = Counter()
        self._init_depth = 0

    @classmethod
    def without_driver(cls) -> FakeNvml:
        """A machine with no NVIDIA driver: nvmlInit raises LIBRARY_NOT_FOUND."""
        return cls(init_error=NVML_ERROR_LIBRARY_NOT_FOUND)

    @property
    def initialised(self) -> bool:
        return self._init_depth > 0

    def _enter(self, call: str) -> None:
        self.calls[call] += 1
        if not self._init_depth:
            raise FakeNvmlError(NVML_ERROR_UNINITIALIZED)

    def _gpu(self, call: str, handle: Any) -> FakeGpu:
        self._enter(call)
        gpu = self.gpus[int(handle)]
        if call in gpu.unsupported:
            raise FakeNvmlError(NVML_ERROR_NOT_SUPPORTED)
        if call in gpu.errors:
            raise FakeNvmlError(gpu.errors[call])
        return gpu

    def nvmlInit(self) -> None:
        self.calls["nvmlInit"] += 1
        if self.init_error is not None:
            raise FakeNvmlError(self.init_error)
        self._init_depth += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self._init_depth -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise FakeNvmlError(2)  # NVML_ERROR_INVALID_ARGUMENT
        return index

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._gpu("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._gpu("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> _Memory:
        gpu = self._gpu("nvmlDeviceGetMemoryInfo", handle)
        used = gpu.memory_used_bytes
        return _Memory(total=gpu.memory_total_bytes, free=gpu.memory_total_bytes - used, used=used)

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> _Utilization:
        gpu = self._gpu("nvmlDeviceGetUtilizationRates", handle)
        return _Utilization(gpu=gpu.utilization_pct, memory=gpu.memory_utilization_pct)

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return self._gpu("nvmlDeviceGetPowerUsage", handle).power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        return self._gpu("nvmlDeviceGetEnforcedPowerLimit", handle).power_limit_mw

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        gpu = self._gpu("nvmlDeviceGetTemperature", handle)
        if sensor != self.NVML_TEMPERATURE_GPU:
            raise FakeNvmlError(NVML_ERROR_NOT_SUPPORTED)
        return gpu.temperature_celsius

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[_Process]:
        gpu = self._gpu("nvmlDeviceGetComputeRunningProcesses", handle)
        return [_Process(pid=pid, usedGpuMemory=mem) for pid, mem in gpu.processes]

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        return self._gpu("nvmlDeviceGetCudaComputeCapability", handle).compute_capability
