"""kvcache_model against real CPU vLLM engines: KV blocks predicted from what gpupool configured,
never from what the engine reports, against the engine's own `num_gpu_blocks`; and the start-up
refusal `check-config` predicts against the one vLLM makes.

The prediction's inputs: the 64 MiB `kv_cache_bytes` the fixture configures, the tiny model's
config.json at the dtype gpupool told each engine to run (`--dtype` on its command line: float32
or bfloat16 by the CPU), and vLLM's CPU block size (128 tokens). The engine's labels
(`vllm:cache_config_info`) are only the measurement.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcache_model.capacity import capacity_from_kv_cache_bytes
from kvcache_model.geometry import ModelGeometry
from pools.config import parse_config
from pools.launchers import InstanceSpec
from pools.launchers.engine_args import build_engine_command, supported_vllm_flags
from pools.launchers.engine_plan import arg_value, engine_problems, probe_host
from pools.launchers.health import wait_healthy
from pools.launchers.local import EngineProcess
from tests.e2e.stack import seed_vllm_flags
from tests.integration.conftest import KV_CACHE_BYTES, MAX_MODEL_LEN, MODEL_DIR, EngineFleet

pytestmark = pytest.mark.integration

CPU_BLOCK_SIZE = 128  # vLLM's CPU default (vllm/platforms/cpu.py)


def cache_config_info(url: str) -> dict[str, str]:
    """Labels of `vllm:cache_config_info` scraped from an engine's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                return dict(sample.labels)
    raise AssertionError(f"{url}/metrics has no vllm:cache_config_info")


def test_predicted_kv_blocks_match_real_engines(engine_fleet: EngineFleet) -> None:
    assert engine_fleet.instances, "no engines"
    for engine, spec in zip(engine_fleet.launcher.engines, engine_fleet.instances, strict=True):
        dtype = arg_value(engine.command.argv, "--dtype")
        assert dtype in ("float32", "bfloat16"), dtype
        geometry = ModelGeometry.from_path(MODEL_DIR, dtype=dtype)
        # by hand: 2 layers x (K, V) x 2 KV heads x head_dim 64 x the dtype's width
        assert (
            geometry.kv_bytes_per_token() == 2 * 2 * 2 * 64 * {"float32": 4, "bfloat16": 2}[dtype]
        )
        predicted = capacity_from_kv_cache_bytes(geometry, KV_CACHE_BYTES, CPU_BLOCK_SIZE)

        info = cache_config_info(spec.url)
        engine_blocks = int(info["num_gpu_blocks"])
        assert int(info["block_size"]) == CPU_BLOCK_SIZE
        assert predicted.num_blocks == engine_blocks, (
            f"{spec.url}: predicted {predicted.num_blocks} blocks of {CPU_BLOCK_SIZE} tokens from"
            f" {KV_CACHE_BYTES} B at {geometry.kv_bytes_per_token()} B/token ({dtype}); the"
            f" engine reports {engine_blocks}"
            f" ({(predicted.num_blocks - engine_blocks) / engine_blocks:+.2%})"
        )
        concurrency = float(info["kv_cache_max_concurrency"])
        assert predicted.max_concurrent_sequences(MAX_MODEL_LEN) == math.floor(concurrency)
        print(f"{spec.url} ({dtype}): {engine_blocks} blocks, predicted {predicted.num_blocks}")


async def _starts(kv_cache_bytes: int, port: int, run_dir: Path, flags: frozenset[str]) -> bool:
    """Whether a real engine with this KV size becomes healthy (False: it exits at start)."""
    config = _config(kv_cache_bytes, port, run_dir)
    command = build_engine_command(
        model=config.model,
        local=config.engines.local,
        index=0,
        gpu_ids=None,
        flags=flags,
        api_key="calibration",
    )
    spec = InstanceSpec(instance_id=f"kv-{port}", url=f"http://127.0.0.1:{port}", gpus=1)
    engine = EngineProcess(
        spec,
        command,
        log_path=run_dir / f"kv-{port}.log",
        pid_path=run_dir / f"kv-{port}.pid",
        cpus=None,
        backoff_s=600.0,  # never restarted within the test
        backoff_max_s=600.0,
        grace_s=10.0,
    )
    try:
        await engine.spawn()
        missing = await wait_healthy(
            {spec.instance_id: spec.url},
            time.monotonic() + 300,
            alive=lambda _: engine.down_reason(),
            poll_s=0.2,  # (the default 1 s) the refusal and the start are seen sooner
        )
        return not missing
    finally:
        await engine.stop()


def _config(kv_cache_bytes: int, port: int, run_dir: Path) -> Any:
    return parse_config(
        {
            "model": {
                "name": "tiny",
                "path": str(MODEL_DIR),
                "max_model_len_tokens": MAX_MODEL_LEN,
                "dtype": "bfloat16",
            },
            "engines": {
                "local": {
                    "count": 1,
                    "base_port": port,
                    "kv_cache_bytes": kv_cache_bytes,
                    "run_dir": str(run_dir),
                }
            },
            "pools": {"normal": {"classes": ["normal"], "share": {"initial_frac": 1.0}}},
            "classification": {"tools_class": "normal", "run_class": "normal"},
        }
    )


def test_check_config_refuses_exactly_what_vllm_refuses(tmp_path: Path) -> None:
    """A 4096-token sequence is 32 blocks of 128 tokens; vLLM also holds one null block back.
    At bfloat16 (128 KiB a block) 33 blocks start and 32 do not: check-config must say so."""
    block = CPU_BLOCK_SIZE * 2 * 2 * 2 * 64 * 2
    fits, short = 33 * block, 32 * block
    host = dataclasses.replace(probe_host(), gpu_count=0)
    assert engine_problems(_config(fits, 8170, tmp_path), host) == []
    (problem,) = engine_problems(_config(short, 8171, tmp_path), host)
    assert "less than one 4096-token sequence" in problem
    seed_vllm_flags(tmp_path)
    flags = supported_vllm_flags(tmp_path)

    async def both() -> list[bool]:
        return list(
            await asyncio.gather(
                _starts(fits, 8170, tmp_path, flags), _starts(short, 8171, tmp_path, flags)
            )
        )

    started_fits, started_short = asyncio.run(both())
    assert started_fits, (tmp_path / "kv-8170.log").read_text()[-2000:]
    assert not started_short, "vLLM started a cache check-config refuses"
    assert "estimated maximum model length is 3968" in (tmp_path / "kv-8171.log").read_text()
