"""GPU spec table for the roofline priors: peak dense BF16 FLOP/s, HBM bandwidth, memory.

Peaks are NVIDIA's datasheet numbers (dense, no sparsity). Memory is what NVML reports as
total on that part (what vLLM's `gpu_memory_utilization` multiplies). The efficiency factors are
what a vLLM engine reaches in practice: decode streams weights at ~80 % of HBM peak (measured
77 % for Llama-3.1-8B on an A100-40GB), prefill GEMMs reach ~60 % of dense peak, and every
forward step costs a fixed ~0.3 ms of scheduling and launch overhead (CUDA graphs on).

`gpu_spec("h100")` looks a spec up by table name or alias; `gpu_spec_for_device_name(
"NVIDIA H100 80GB HBM3")` maps an NVML device name to a spec, or None.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType

from kvcache_model.errors import UnknownGPUError

__all__ = ["GPU_SPECS", "GpuSpec", "gpu_spec", "gpu_spec_for_device_name"]

_MIB = 1024 * 1024


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model. Rates per second, sizes in bytes, efficiencies in (0, 1]."""

    name: str
    peak_bf16_flops_per_s: float
    hbm_bytes_per_s: float
    memory_bytes: int
    interconnect_bytes_per_s: float
    compute_efficiency_frac: float = 0.60
    bandwidth_efficiency_frac: float = 0.80
    step_overhead_s: float = 0.0003
    allreduce_latency_s: float = 10e-6

    @property
    def effective_flops_per_s(self) -> float:
        return self.peak_bf16_flops_per_s * self.compute_efficiency_frac

    @property
    def effective_bytes_per_s(self) -> float:
        return self.hbm_bytes_per_s * self.bandwidth_efficiency_frac


_SPECS = (
    GpuSpec("A100", 312e12, 2.039e12, 81920 * _MIB, 300e9),  # SXM4 80GB
    GpuSpec("A100-40GB", 312e12, 1.555e12, 40960 * _MIB, 300e9),
    GpuSpec("H100", 989.4e12, 3.35e12, 81559 * _MIB, 450e9),  # SXM5 80GB
    GpuSpec("H100-PCIE", 756.5e12, 2.0e12, 81559 * _MIB, 32e9, allreduce_latency_s=30e-6),
    GpuSpec("H100-NVL", 835.5e12, 3.9e12, 95830 * _MIB, 300e9),  # 94GB PCIe with NVLink bridge
    GpuSpec("H200", 989.4e12, 4.8e12, 143771 * _MIB, 450e9),  # SXM 141GB
    GpuSpec("L40S", 362.05e12, 0.864e12, 46068 * _MIB, 32e9, allreduce_latency_s=30e-6),
    GpuSpec("B200", 2250e12, 8.0e12, 183359 * _MIB, 900e9, compute_efficiency_frac=0.50),
)

GPU_SPECS: MappingProxyType[str, GpuSpec] = MappingProxyType({s.name: s for s in _SPECS})

_ALIASES = {
    "a100-80gb": "A100",
    "a100-sxm": "A100",
    "a100-40": "A100-40GB",
    "h100-sxm": "H100",
    "h100-80gb": "H100",
    "h200-sxm": "H200",
    "b200-sxm": "B200",
}


def gpu_spec(name: str) -> GpuSpec:
    """The spec called `name` (case-insensitive, a few aliases); `UnknownGPUError` otherwise."""
    key = name.strip().lower()
    for spec_name, spec in GPU_SPECS.items():
        if spec_name.lower() == key:
            return spec
    if key in _ALIASES:
        return GPU_SPECS[_ALIASES[key]]
    found = gpu_spec_for_device_name(name)
    if found is not None:
        return found
    raise UnknownGPUError(f"unknown GPU {name!r}; known GPUs: {', '.join(GPU_SPECS)}")


def gpu_spec_for_device_name(device_name: str) -> GpuSpec | None:
    """The spec of an NVML device name such as `NVIDIA A100-SXM4-40GB`, or None."""
    n = device_name.upper()
    if re.search(r"\bB200\b", n):
        return GPU_SPECS["B200"]
    if re.search(r"\bH200\b", n):
        return GPU_SPECS["H200"]
    if re.search(r"\bH100\b", n):
        if "NVL" in n:
            return GPU_SPECS["H100-NVL"]
        return GPU_SPECS["H100-PCIE" if "PCIE" in n else "H100"]
    if re.search(r"\bA100\b", n):
        return GPU_SPECS["A100-40GB" if "40GB" in n else "A100"]
    if re.search(r"\bL40S\b", n):
        return GPU_SPECS["L40S"]
    return None
