"""GPU inventory and live readings through NVML; a clear "no GPU" answer where there is none.

- `visible_gpu_count()`: how many GPUs this process may use (0 without a driver);
- `read_snapshot(nvml=None)` / `await probe_gpus()`: inventory plus readings, or
  `GpuSnapshot.no_gpu_reason`;
- `GpuSampler(registry=..., interval_s=...)`: periodic sampling into Prometheus gauges;
- `FakeNvml`: scripted NVML for tests and GPU-less demos (inject it as `nvml=`).

Must not import `pools`, `router` nor `benchmarks` (it may use `kvcache_model`'s GPU specs;
tests/unit/test_layering.py).
"""

from gpu_probe.detect import visible_gpu_count
from gpu_probe.fake_nvml import FakeGpu, FakeNvml, FakeNvmlError
from gpu_probe.metrics import GpuGauges
from gpu_probe.nvml import NvmlApi, describe_nvml_error, load_nvml
from gpu_probe.probe import open_nvml, probe_gpus, read_devices, read_readings, read_snapshot
from gpu_probe.readings import GpuDevice, GpuProcess, GpuReading, GpuSnapshot
from gpu_probe.sampler import GpuSampler

__all__ = [
    "FakeGpu",
    "FakeNvml",
    "FakeNvmlError",
    "GpuDevice",
    "GpuGauges",
    "GpuProcess",
    "GpuReading",
    "GpuSampler",
    "GpuSnapshot",
    "NvmlApi",
    "describe_nvml_error",
    "load_nvml",
    "open_nvml",
    "probe_gpus",
    "read_devices",
    "read_readings",
    "read_snapshot",
    "visible_gpu_count",
]
