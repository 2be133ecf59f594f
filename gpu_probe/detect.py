"""The cheapest question about GPUs: how many NVIDIA GPUs can this process use? 0 where there is
no driver, no NVML library, or no device. Never raises."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from gpu_probe.nvml import NvmlApi
from gpu_probe.probe import open_nvml

__all__ = ["visible_gpu_count"]

log = logging.getLogger(__name__)


def visible_gpu_count(nvml: NvmlApi | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Number of NVIDIA GPUs NVML reports, restricted by CUDA_VISIBLE_DEVICES when set.

    `nvml` defaults to the real binding and `environ` to `os.environ`; tests pass fakes.
    """
    api, reason = open_nvml(nvml)
    if api is None:
        log.debug("no GPU: %s", reason)
        return 0
    try:
        count = int(api.nvmlDeviceGetCount())
    except Exception as err:  # any NVML failure means "no usable GPU" here
        log.debug("no GPU: %s", err)
        return 0
    finally:
        try:
            api.nvmlShutdown()
        except Exception as err:
            log.debug("nvmlShutdown failed: %s", err)
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v for v in visible.split(",") if v.strip() and v.strip() != "-1"]
        return min(count, len(ids))
    return count
