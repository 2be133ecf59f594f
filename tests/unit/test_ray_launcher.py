"""The Ray launcher's pure parts: a Ray engine's vLLM command comes from the same builder as a
local engine's, and the source that finds the engines (dead or restarting actors left out,
addresses that move followed). The real thing, on a local Ray cluster with CPU engines, is
tests/integration/test_ray_real.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from pools.config import DEFAULT_CPU_CONFIG, RayEnginesConfig, parse_config
from pools.devmodel import make_dev_model
from pools.launchers.engine_args import build_engine_command
from pools.launchers.engine_plan import HostFacts, plan_engines
from pools.launchers.ray import RayEngineSource, engine_settings
from tests.unit.test_engine_args import ALL_FLAGS

HOST = HostFacts(
    gpu_count=0,
    cpu_flags=frozenset(),
    cpu_ids=frozenset({0, 1}),
    available_memory_bytes=16 * 2**30,
)


def _ray_config(**ray: Any) -> Any:
    data = {**DEFAULT_CPU_CONFIG, "engines": {"launcher": "ray", "ray": ray}}
    return parse_config(data)


def test_a_ray_engine_runs_the_local_launchers_command(tmp_path: Path) -> None:
    config = _ray_config(
        count=2, gpus_per_instance=0, kv_cache_bytes=64 * 2**20, vllm_args=["--max-num-seqs", "8"]
    )
    model = dataclasses.replace(config.model, path=make_dev_model(tmp_path / "tiny"))
    settings = engine_settings(config.engines.ray, port=8731, run_dir=tmp_path)
    plan = plan_engines(settings, model, HOST)
    ray_cmd = build_engine_command(
        model=model, local=settings, index=0, gpu_ids=None, flags=ALL_FLAGS, plan=plan
    )
    # the same settings through the local launcher's config, on the same port
    local = dataclasses.replace(
        config.engines.local,
        count=2,
        host="0.0.0.0",
        base_port=8731,
        kv_cache_bytes=64 * 2**20,
        vllm_args=("--max-num-seqs", "8"),
        run_dir=tmp_path,
    )
    local_cmd = build_engine_command(
        model=model,
        local=local,
        index=0,
        gpu_ids=None,
        flags=ALL_FLAGS,
        plan=plan_engines(local, model, HOST),
    )
    assert ray_cmd.argv == local_cmd.argv
    assert ray_cmd.env == local_cmd.env
    argv = list(ray_cmd.argv)
    assert argv[argv.index("--port") + 1] == "8731" and argv[argv.index("--host") + 1] == "0.0.0.0"
    assert argv[-2:] == ["--max-num-seqs", "8"]
    assert ray_cmd.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # a CPU engine


def test_a_gpu_ray_engine_is_tensor_parallel_over_its_bundle(tmp_path: Path) -> None:
    config = _ray_config(count=4, gpus_per_instance=2)
    settings = engine_settings(config.engines.ray, port=8000, run_dir=tmp_path)
    model = dataclasses.replace(config.model, path=make_dev_model(tmp_path / "tiny"))
    gpu_host = dataclasses.replace(HOST, gpu_count=2)
    cmd = build_engine_command(
        model=model,
        local=settings,
        index=0,
        gpu_ids=["3", "5"],  # the GPUs Ray gave the actor
        flags=ALL_FLAGS,
        plan=plan_engines(settings, model, gpu_host),
    )
    argv = list(cmd.argv)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert cmd.env["CUDA_VISIBLE_DEVICES"] == "3,5"


class FakeActor:
    """An actor handle: `address.remote()` gives a ref; the fake `get` answers or raises."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.dead = False
        outer = self

        class _Method:
            def remote(self) -> FakeActor:
                return outer

        self.address = _Method()


def _get(ref: Any, timeout_s: float) -> tuple[str, Any]:
    assert timeout_s == 2.0
    if ref.dead:
        raise TimeoutError("restarting")
    return str(ref.url), getattr(ref, "kv_events", None)


async def test_the_source_leaves_out_actors_that_do_not_answer() -> None:
    actors = [FakeActor("http://10.0.0.1:40001"), FakeActor("http://10.0.0.2:40002")]
    config = RayEnginesConfig(count=2, gpus_per_instance=2, poll_interval_s=1.5)
    source = RayEngineSource(config, actors, "key", get=_get)
    assert source.poll_interval_s == 1.5
    specs = await source.poll()
    assert [(s.instance_id, s.url, s.gpus, s.api_key) for s in specs] == [
        ("ray-engine-0", "http://10.0.0.1:40001", 2, "key"),
        ("ray-engine-1", "http://10.0.0.2:40002", 2, "key"),
    ]
    actors[0].dead = True  # killed: Ray is restarting it
    assert [s.instance_id for s in await source.poll()] == ["ray-engine-1"]
    actors[0].dead, actors[0].url = False, "http://10.0.0.3:40007"  # back, elsewhere
    specs = await source.poll()
    assert (specs[0].instance_id, specs[0].url) == ("ray-engine-0", "http://10.0.0.3:40007")


def test_cpu_engines_count_one_gpu_for_accounting() -> None:
    config = _ray_config(count=3, gpus_per_instance=0)
    assert config.engines.gpus_per_instance == 1
    with pytest.raises(Exception, match="greater than or equal to -1"):
        _ray_config(max_restarts=-2)


def test_an_engine_port_comes_from_its_own_slots_of_the_range() -> None:
    import socket

    from pools.launchers.base import LauncherError
    from pools.launchers.ray import _free_port

    def free(port: int) -> bool:
        with socket.socket() as probe:
            try:
                probe.bind(("0.0.0.0", port))
            except OSError:
                return False
            return True

    # a port the OS hands out, with its next three free too (other processes on a CI machine
    # take ports of their own: the checks below need only this one taken)
    while True:
        taken = socket.socket()
        taken.bind(("0.0.0.0", 0))
        port = taken.getsockname()[1]
        if all(free(port + k) for k in (1, 2, 3)):
            break
        taken.close()
    with taken:
        taken.listen()
        # engine 0 of 2 tries port, port + 2, ...: the taken one is skipped
        assert _free_port((port, port + 3), index=0, count=2) == port + 2
        # engine 1 of 2 tries port + 1, port + 3: never engine 0's slots
        assert _free_port((port, port + 3), index=1, count=2) == port + 1
        with pytest.raises(LauncherError, match="no free port for engine 0"):
            _free_port((port, port + 1), index=0, count=2)
