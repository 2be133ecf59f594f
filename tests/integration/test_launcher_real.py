"""The local launcher against real CPU vLLM engines: every engine answers, logs and metrics are
where gpupool expects them, and the KV cache has the configured size."""

from __future__ import annotations

import httpx
import pytest

from pools.launchers import InstanceSpec
from pools.telemetry import parse_vllm_metrics
from tests.integration.conftest import ENGINE_COUNT, EngineFleet

pytestmark = pytest.mark.integration


def test_every_engine_answers_a_chat_completion(real_engines: list[InstanceSpec]) -> None:
    assert len(real_engines) == ENGINE_COUNT
    for engine in real_engines:
        resp = httpx.post(
            f"{engine.url}/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "ignore_eos": True,
            },
            timeout=60,
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 4


def test_engines_log_to_the_run_dir_and_keep_their_stats(engine_fleet: EngineFleet) -> None:
    for engine, spec in zip(engine_fleet.launcher.engines, engine_fleet.instances, strict=True):
        assert engine.log_path.is_file() and engine.log_path.stat().st_size > 0
        assert engine.pid_path.is_file()
        reading = parse_vllm_metrics(httpx.get(f"{spec.url}/metrics", timeout=5).text, 0.0)
        # 64 MiB of KV at 1024 bytes/token in blocks of 128 tokens (the CPU block size)
        assert (reading.num_gpu_blocks, reading.block_size) == (512, 128)
