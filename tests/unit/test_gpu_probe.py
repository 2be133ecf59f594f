"""gpu_probe: inventory and readings through the fake NVML, and the "no GPU" answer."""

from __future__ import annotations

import json

import pytest

from gpu_probe.detect import visible_gpu_count
from gpu_probe.fake_nvml import FakeGpu, FakeNvml, FakeNvmlError
from gpu_probe.nvml import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_GPU_IS_LOST,
    NvmlApi,
    describe_nvml_error,
    load_nvml,
)
from gpu_probe.probe import probe_gpus, read_snapshot

GIB = 1024**3


def two_gpus() -> FakeNvml:
    return FakeNvml(
        [
            FakeGpu.h100(
                0,
                memory_used_bytes=30 * GIB,
                utilization_pct=87,
                memory_utilization_pct=40,
                power_mw=512_345,
                temperature_celsius=61,
                processes=[(4242, 29 * GIB)],
            ),
            FakeGpu.l40s(1, unsupported={"nvmlDeviceGetPowerUsage"}, processes=[(7, None)]),
        ]
    )


def test_snapshot_reads_inventory_and_readings() -> None:
    nvml = two_gpus()
    snap = read_snapshot(nvml, clock=lambda: 123.0)
    assert snap.has_gpu and snap.no_gpu_reason is None
    assert snap.taken_at_s == 123.0
    assert snap.driver_version == "570.133.20"
    h100, l40s = snap.devices
    assert (h100.name, h100.spec_name, h100.compute_capability) == (
        "NVIDIA H100 80GB HBM3",
        "H100",
        "9.0",
    )
    assert l40s.spec_name == "L40S" and l40s.uuid == "GPU-00000001-fake-l40s"
    r0, r1 = snap.readings
    assert r0.memory_used_bytes == 30 * GIB
    assert r0.memory_free_bytes == r0.memory_total_bytes - 30 * GIB
    assert r0.utilization_frac == pytest.approx(0.87)
    assert r0.memory_bandwidth_utilization_frac == pytest.approx(0.40)
    assert r0.power_watts == pytest.approx(512.345)
    assert r0.power_limit_watts == pytest.approx(700.0)
    assert r0.temperature_celsius == 61.0
    assert [(p.pid, p.used_memory_bytes) for p in r0.processes] == [(4242, 29 * GIB)]
    assert r1.power_watts is None  # not supported on that board: None, not 0
    assert r1.processes[0].used_memory_bytes is None


def test_snapshot_initialises_and_shuts_nvml_down() -> None:
    nvml = two_gpus()
    read_snapshot(nvml)
    assert nvml.calls["nvmlInit"] == 1 and nvml.calls["nvmlShutdown"] == 1
    assert not nvml.initialised


def test_snapshot_is_json_ready() -> None:
    data = json.loads(json.dumps(read_snapshot(two_gpus()).to_dict()))
    assert data["has_gpu"] is True
    assert data["readings"][0]["memory_used_bytes"] == 30 * GIB
    assert data["devices"][1]["name"] == "NVIDIA L40S"


def test_no_driver_is_an_answer_not_a_crash() -> None:
    snap = read_snapshot(FakeNvml.without_driver(), clock=lambda: 5.0)
    assert not snap.has_gpu
    assert snap.devices == () and snap.readings == ()
    assert snap.no_gpu_reason is not None
    assert "no NVIDIA driver" in snap.no_gpu_reason
    assert "NVML Shared Library Not Found" in snap.no_gpu_reason


def test_driver_not_loaded_reason() -> None:
    snap = read_snapshot(FakeNvml(init_error=NVML_ERROR_DRIVER_NOT_LOADED))
    assert snap.no_gpu_reason is not None and "not loaded" in snap.no_gpu_reason


def test_zero_devices_reason() -> None:
    nvml = FakeNvml([])
    snap = read_snapshot(nvml)
    assert not snap.has_gpu and snap.no_gpu_reason == "NVML reports no GPUs on this machine"
    assert not nvml.initialised


def test_lost_gpu_mid_read_becomes_no_gpu_answer() -> None:
    nvml = FakeNvml([FakeGpu.h100(errors={"nvmlDeviceGetMemoryInfo": NVML_ERROR_GPU_IS_LOST})])
    snap = read_snapshot(nvml)
    assert snap.no_gpu_reason is not None and "fell off the bus" in snap.no_gpu_reason
    assert not nvml.initialised


def test_this_machine_without_a_gpu_answers_cleanly() -> None:
    """The real pynvml on a machine with no driver: a reason, never a traceback."""
    snap = read_snapshot()
    if snap.has_gpu:
        pytest.skip("this machine has an NVIDIA GPU")
    assert snap.no_gpu_reason


def test_load_nvml_returns_the_binding() -> None:
    api = load_nvml()
    assert not isinstance(api, str), api  # nvidia-ml-py is a test dependency


async def test_probe_gpus_runs_off_the_loop() -> None:
    snap = await probe_gpus(two_gpus(), clock=lambda: 1.0)
    assert len(snap.readings) == 2


def test_fake_enforces_lifecycle() -> None:
    nvml = FakeNvml([FakeGpu.h100()])
    with pytest.raises(FakeNvmlError) as info:
        nvml.nvmlDeviceGetCount()
    assert "Uninitialized" in str(info.value)


def test_fake_satisfies_the_protocol() -> None:
    api: NvmlApi = FakeNvml()
    assert api.NVML_TEMPERATURE_GPU == 0


def test_describe_unknown_error_keeps_nvml_words() -> None:
    assert describe_nvml_error(FakeNvmlError(999)) == "NVML error: NVML error 999"


def test_visible_gpu_count() -> None:
    nvml = two_gpus()
    assert visible_gpu_count(nvml, environ={}) == 2
    assert visible_gpu_count(nvml, environ={"CUDA_VISIBLE_DEVICES": "1"}) == 1
    assert visible_gpu_count(nvml, environ={"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert visible_gpu_count(nvml, environ={"CUDA_VISIBLE_DEVICES": "-1"}) == 0
    assert visible_gpu_count(nvml, environ={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == 2
    assert not nvml.initialised
    assert visible_gpu_count(FakeNvml.without_driver(), environ={}) == 0
