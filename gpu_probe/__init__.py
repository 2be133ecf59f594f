"""GPU inventory and live readings through NVML; a clear "no GPU" answer where there is none."""

from gpu_probe.detect import visible_gpu_count

__all__ = ["visible_gpu_count"]
