"""kvcache_model against real CPU vLLM engines: KV blocks predicted from what gpupool configured,
never from what the engine reports, against the engine's own `num_gpu_blocks`; and the start-up
refusal `check-config` predicts against the one vLLM makes.

The prediction's inputs: the 64 MiB `kv_cache_bytes` the fixture configures, the tiny model's
config.json at the dtype gpupool told each engine to run (`--dtype` on its command line: float32
or bfloat16 by the CPU), and vLLM's CPU block size (128 tokens). The engine's labels
(`vllm:cache_config_info`) are only the measurement.

The refusal is vLLM's own: the command lines gpupool builds for the two KV sizes go through
vLLM's server flag parser into vLLM's `EngineCore` (`pools.testing.engine_init`), the
constructor whose KV check refuses a cache too small for one `max_model_len` sequence. Both
engines are built after one import of vLLM instead of two whole API servers (20 s, not 40-55 s).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcache_model.capacity import capacity_from_kv_cache_bytes
from kvcache_model.geometry import ModelGeometry
from pools.config import parse_config
from pools.launchers.engine_args import build_engine_command, engine_environ, supported_vllm_flags
from pools.launchers.engine_plan import arg_value, engine_problems, probe_host
from pools.testing.engine_init import RESULT_PREFIX
from tests.e2e.stack import REPO, seed_vllm_flags
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


def _starts(configs: list[Any], run_dir: Path) -> list[dict[str, Any]]:
    """Whether real engines with these configs would start: the command lines gpupool builds,
    through vLLM's own server flag parser into vLLM's `EngineCore` (`pools.testing.engine_init`:
    one import of vLLM for both, no HTTP server). `{"started": true}`, or `{"started": false,
    "error": <what vLLM raised>}`, per config."""
    seed_vllm_flags(run_dir)
    flags = supported_vllm_flags(run_dir)
    commands = [
        build_engine_command(
            model=config.model,
            local=config.engines.local,
            index=0,
            gpu_ids=None,
            flags=flags,
            api_key="calibration",
        )
        for config in configs
    ]
    assert len({tuple(sorted(c.env.items())) for c in commands}) == 1, "one environment for all"
    log_path = run_dir / "engine-init.log"
    with log_path.open("wb") as log:
        out = subprocess.run(
            [sys.executable, "-m", "pools.testing.engine_init"]
            + [json.dumps(list(c.argv)) for c in commands],
            cwd=REPO,
            env=engine_environ(os.environ, commands[0]),
            stdout=subprocess.PIPE,  # vLLM's log and the results
            stderr=log,
            timeout=300,
            check=False,
        )
    lines = [
        line.removeprefix(RESULT_PREFIX)
        for line in out.stdout.decode().splitlines()
        if line.startswith(RESULT_PREFIX)
    ]
    assert out.returncode == 0 and len(lines) == len(configs), (
        out.returncode,
        lines,
        out.stdout.decode()[-3000:],
        log_path.read_text()[-3000:],
    )
    return [json.loads(line) for line in lines]


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
    fits_start, short_start = _starts(
        [_config(fits, 8170, tmp_path), _config(short, 8171, tmp_path)], tmp_path
    )
    assert fits_start == {"started": True}, fits_start
    assert not short_start["started"], "vLLM started a cache check-config refuses"
    assert "estimated maximum model length is 3968" in short_start["error"], short_start
