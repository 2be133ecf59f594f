"""The cheapest question about GPUs: how many NVIDIA GPUs can this process use? 0 where there is
no driver, no NVML library, or no device. Never raises."""

from __future__ import annotations

import os

__all__ = ["visible_gpu_count"]


def visible_gpu_count() -> int:
    """Number of NVIDIA GPUs NVML reports, restricted by CUDA_VISIBLE_DEVICES when set."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no library, no driver, no device: all mean "no GPU" here
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v for v in visible.split(",") if v.strip() and v.strip() != "-1"]
        return min(count, len(ids))
    return count
