"""Read GPU inventory and live readings through an `NvmlApi`; never raises for "no GPU".

Blocking functions (`read_snapshot`, `read_devices`, `read_readings`) talk to NVML directly;
`probe_gpus` runs `read_snapshot` off the event loop with `asyncio.to_thread`. A missing
library, driver or device becomes `GpuSnapshot.no_gpu(reason)`; a reading a device does not
support becomes None.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from gpu_probe.nvml import (
    NVML_ERROR_NOT_SUPPORTED,
    NvmlApi,
    describe_nvml_error,
    load_nvml,
    to_text,
)
from gpu_probe.readings import GpuDevice, GpuProcess, GpuReading, GpuSnapshot
from kvcache_model.gpus import gpu_spec_for_device_name

__all__ = ["open_nvml", "probe_gpus", "read_devices", "read_readings", "read_snapshot"]

log = logging.getLogger(__name__)
T = TypeVar("T")


def open_nvml(nvml: NvmlApi | None = None) -> tuple[NvmlApi | None, str | None]:
    """Load (if not given) and initialise NVML: (api, None), or (None, why there is no GPU)."""
    api = load_nvml() if nvml is None else nvml
    if isinstance(api, str):
        return None, api
    try:
        api.nvmlInit()
    except api.NVMLError as err:
        return None, describe_nvml_error(err)
    except OSError as err:  # a broken library on the loader path
        return None, f"cannot load NVML: {err}"
    return api, None


def _optional(nvml: NvmlApi, call: Callable[[], T]) -> T | None:
    """The call's value, or None where NVML says the device cannot answer."""
    try:
        return call()
    except nvml.NVMLError as err:
        if getattr(err, "value", None) != NVML_ERROR_NOT_SUPPORTED:
            log.debug("NVML reading unavailable: %s", err)
        return None


def _compute_capability(nvml: NvmlApi, handle: Any) -> tuple[int, int] | None:
    return _optional(nvml, lambda: nvml.nvmlDeviceGetCudaComputeCapability(handle))


def read_devices(nvml: NvmlApi) -> tuple[GpuDevice, ...]:
    """Inventory of every device NVML sees (NVML initialised)."""
    devices = []
    for index in range(int(nvml.nvmlDeviceGetCount())):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        name = to_text(nvml.nvmlDeviceGetName(handle))
        cc = _compute_capability(nvml, handle)
        spec = gpu_spec_for_device_name(name)
        devices.append(
            GpuDevice(
                index=index,
                uuid=to_text(nvml.nvmlDeviceGetUUID(handle)),
                name=name,
                memory_total_bytes=int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
                compute_capability=f"{cc[0]}.{cc[1]}" if cc else None,
                spec_name=spec.name if spec else None,
            )
        )
    return tuple(devices)


def _reading(nvml: NvmlApi, index: int) -> GpuReading:
    handle: Any = nvml.nvmlDeviceGetHandleByIndex(index)
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    util = _optional(nvml, lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
    power_mw = _optional(nvml, lambda: nvml.nvmlDeviceGetPowerUsage(handle))
    limit_mw = _optional(nvml, lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle))
    temp = _optional(nvml, lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
    procs = _optional(nvml, lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle)) or []
    return GpuReading(
        index=index,
        uuid=to_text(nvml.nvmlDeviceGetUUID(handle)),
        memory_total_bytes=int(memory.total),
        memory_used_bytes=int(memory.used),
        memory_free_bytes=int(memory.free),
        utilization_frac=util.gpu / 100.0 if util is not None else None,
        memory_bandwidth_utilization_frac=util.memory / 100.0 if util is not None else None,
        power_watts=power_mw / 1000.0 if power_mw is not None else None,
        power_limit_watts=limit_mw / 1000.0 if limit_mw is not None else None,
        temperature_celsius=float(temp) if temp is not None else None,
        processes=tuple(
            GpuProcess(
                pid=int(p.pid),
                used_memory_bytes=int(p.usedGpuMemory) if p.usedGpuMemory is not None else None,
            )
            for p in procs
        ),
    )


def read_readings(nvml: NvmlApi, indices: range | tuple[int, ...]) -> tuple[GpuReading, ...]:
    """Live readings of the devices at `indices` (NVML initialised)."""
    return tuple(_reading(nvml, index) for index in indices)


def read_snapshot(
    nvml: NvmlApi | None = None, *, clock: Callable[[], float] = time.time
) -> GpuSnapshot:
    """Blocking: initialise NVML, read inventory and readings, shut NVML down.

    Never raises for a missing driver, library or device: that is `no_gpu_reason`.
    """
    api, reason = open_nvml(nvml)
    if api is None:
        return GpuSnapshot.no_gpu(reason or "NVML unavailable", clock())
    try:
        devices = read_devices(api)
        if not devices:
            return GpuSnapshot.no_gpu("NVML reports no GPUs on this machine", clock())
        readings = read_readings(api, tuple(d.index for d in devices))
        driver = _optional(api, api.nvmlSystemGetDriverVersion)
        return GpuSnapshot(
            taken_at_s=clock(),
            devices=devices,
            readings=readings,
            driver_version=to_text(driver) if driver is not None else None,
        )
    except api.NVMLError as err:
        return GpuSnapshot.no_gpu(describe_nvml_error(err), clock())
    finally:
        try:
            api.nvmlShutdown()
        except api.NVMLError as err:
            log.debug("nvmlShutdown failed: %s", err)


async def probe_gpus(
    nvml: NvmlApi | None = None, *, clock: Callable[[], float] = time.time
) -> GpuSnapshot:
    """`read_snapshot` off the event loop."""
    return await asyncio.to_thread(read_snapshot, nvml, clock=clock)
