"""The local launcher refuses what it cannot start before it starts anything."""

from __future__ import annotations

import dataclasses

import pytest

from pools.config import default_config
from pools.launchers import LauncherError, LocalLauncher


def test_short_cpu_affinity_is_a_launcher_error_not_an_index_error() -> None:
    config = default_config()
    local = dataclasses.replace(config.engines.local, cpu_affinity=((0,), (1,)))
    with pytest.raises(LauncherError, match="2 CPU lists for 3 engines"):
        LocalLauncher(local, config.model, gpu_count=0)
