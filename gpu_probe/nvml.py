"""The NVML seam: the subset of `pynvml` gpu_probe calls, as a Protocol, plus loading it.

`load_nvml()` returns the real `pynvml` module (nvidia-ml-py), or a sentence saying why there is
none. `FakeNvml` (gpu_probe.fake_nvml) implements the same calls with scripted values; code
takes an `NvmlApi` so tests inject the fake instead of patching. `describe_nvml_error` turns
an NVML failure into the "no GPU" reason a person can act on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, cast

__all__ = [
    "NVML_ERROR_DRIVER_NOT_LOADED",
    "NVML_ERROR_GPU_IS_LOST",
    "NVML_ERROR_LIBRARY_NOT_FOUND",
    "NVML_ERROR_NOT_SUPPORTED",
    "NVML_ERROR_NO_PERMISSION",
    "NVML_ERROR_UNINITIALIZED",
    "NvmlApi",
    "describe_nvml_error",
    "load_nvml",
    "to_text",
]

# NVML return codes (nvml.h); stable across driver versions.
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
_ERROR_REASONS = {
    NVML_ERROR_LIBRARY_NOT_FOUND: "the NVIDIA driver library (libnvidia-ml.so.1) was not found: "
    "no NVIDIA driver is installed on this machine",
    NVML_ERROR_DRIVER_NOT_LOADED: "the NVIDIA kernel driver is not loaded",
    NVML_ERROR_NO_PERMISSION: "no permission to talk to the NVIDIA driver",
    NVML_ERROR_GPU_IS_LOST: "a GPU fell off the bus or otherwise became inaccessible",
}


class MemoryInfo(Protocol):
    @property
    def total(self) -> int: ...
    @property
    def free(self) -> int: ...
    @property
    def used(self) -> int: ...


class Utilization(Protocol):
    @property
    def gpu(self) -> int: ...  # percent of time a kernel ran, last sample period
    @property
    def memory(self) -> int: ...  # percent of time device memory was read or written


class ProcessInfo(Protocol):
    @property
    def pid(self) -> int: ...
    @property
    def usedGpuMemory(self) -> int | None: ...  # pynvml's name


class NvmlApi(Protocol):
    """The pynvml calls gpu_probe makes. Blocking: call them off the event loop."""

    @property
    def NVMLError(self) -> type[Exception]: ...
    @property
    def NVML_TEMPERATURE_GPU(self) -> int: ...

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlSystemGetDriverVersion(self) -> str | bytes: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetName(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> MemoryInfo: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Utilization: ...
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int: ...  # milliwatts
    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int: ...  # milliwatts
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int: ...
    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> Sequence[ProcessInfo]: ...
    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]: ...


def load_nvml() -> NvmlApi | str:
    """The real NVML binding, or the reason there is none (a sentence)."""
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py (module pynvml) is not installed"
    return cast(NvmlApi, pynvml)


def describe_nvml_error(err: BaseException) -> str:
    """A reason a person can act on for an NVML failure, keeping NVML's own words."""
    code = getattr(err, "value", None)
    reason = _ERROR_REASONS.get(code) if isinstance(code, int) else None
    detail = str(err) or type(err).__name__
    return f"{reason} (NVML: {detail})" if reason else f"NVML error: {detail}"


def to_text(value: str | bytes) -> str:
    """pynvml returns bytes from older bindings, str from newer ones."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
