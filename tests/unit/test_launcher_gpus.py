"""GPU engines land on the GPUs the parent may use: instance slots map through the parent's own
CUDA_VISIBLE_DEVICES (given `2,3`, engine 0 gets 2 and engine 1 gets 3, never 0 and 1)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pools.config import default_config
from pools.devmodel import make_dev_model
from pools.launchers import LauncherError, LocalLauncher
from pools.launchers.engine_plan import HostFacts
from pools.launchers.local import gpu_assignment

FLAGS = frozenset({"--dtype", "--tensor-parallel-size", "--kv-cache-memory-bytes"})


def _host(gpus: int) -> HostFacts:
    return HostFacts(
        gpu_count=gpus,
        cpu_flags=frozenset(),
        cpu_ids=frozenset(range(8)),
        available_memory_bytes=64 * 1024**3,
    )


def test_slots_map_through_the_parents_list() -> None:
    assert gpu_assignment(2, 1, 2, "2,3") == [["2"], ["3"]]
    assert gpu_assignment(1, 2, 2, "3,1") == [["3", "1"]]  # the parent's order is kept
    assert gpu_assignment(2, 1, 2, "GPU-a1b2, GPU-c3d4") == [["GPU-a1b2"], ["GPU-c3d4"]]
    assert gpu_assignment(1, 1, 3, "4,5,6") == [["4"]]  # spare GPUs stay unused


def test_without_a_parent_list_slots_are_device_indices() -> None:
    assert gpu_assignment(2, 2, 4, None) == [["0", "1"], ["2", "3"]]
    assert gpu_assignment(3, 1, 0, None) == [None, None, None]  # no GPU: CPU engines


def test_too_few_gpus_is_a_launcher_error() -> None:
    with pytest.raises(LauncherError, match="need 4 GPUs"):
        gpu_assignment(2, 2, 2, "2,3")


def test_engines_get_the_parents_devices(tmp_path: Path) -> None:
    config = default_config()
    model = make_dev_model(tmp_path / "tiny")
    local = config.engines.local
    launcher = LocalLauncher(
        dataclasses.replace(local, count=2, run_dir=tmp_path),
        dataclasses.replace(config.model, path=model),
        environ={"CUDA_VISIBLE_DEVICES": "2,3"},
    )
    launcher.prepare(_host(2), FLAGS)
    assert [e.command.env["CUDA_VISIBLE_DEVICES"] for e in launcher.engines] == ["2", "3"]
