"""The local launcher against real CPU vLLM engines: every engine answers with its key and only
with it, logs and metrics are where gpupool expects them, the KV cache has the configured size,
and neither prompts nor keys reach the engines' logs or command lines."""

from __future__ import annotations

import httpx
import psutil
import pytest

from pools.launchers import InstanceSpec
from pools.launchers.engine_plan import arg_value
from pools.telemetry import parse_vllm_metrics
from tests.integration.conftest import ENGINE_COUNT, KV_CACHE_BYTES, EngineFleet

pytestmark = pytest.mark.integration

MARKER = "zq-secret-marker-7f3a"  # in prompts; must appear in no log
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": f"hi {MARKER}"}],
    "max_tokens": 4,
    "ignore_eos": True,
}


def _bearer(spec: InstanceSpec) -> dict[str, str]:
    assert spec.api_key, "the launcher gives every engine a key"
    return {"authorization": f"Bearer {spec.api_key}"}


def test_every_engine_answers_a_chat_completion(real_engines: list[InstanceSpec]) -> None:
    assert len(real_engines) == ENGINE_COUNT
    for engine in real_engines:
        resp = httpx.post(
            f"{engine.url}/v1/chat/completions", json=CHAT, headers=_bearer(engine), timeout=60
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 4


def test_engines_answer_only_with_their_key(real_engines: list[InstanceSpec]) -> None:
    """vLLM's own --api-key leaves /invocations and /tokenize open; gpupool's guard does not.
    /health and /metrics stay open for probes and the router's scrape."""
    engine = real_engines[0]
    wrong = {"authorization": f"Bearer {'x' * 43}"}
    for method, path, body in (
        ("POST", "/v1/chat/completions", CHAT),
        ("GET", "/v1/models", None),
        ("POST", "/invocations", CHAT),
        ("POST", "/tokenize", {"model": "tiny", "prompt": MARKER}),
        ("GET", "/version", None),
    ):
        for headers in ({}, wrong):
            resp = httpx.request(method, engine.url + path, json=body, headers=headers, timeout=60)
            assert resp.status_code == 401, (path, resp.status_code, resp.text)
    ok = httpx.post(f"{engine.url}/invocations", json=CHAT, headers=_bearer(engine), timeout=60)
    assert ok.status_code == 200, ok.text
    for path in ("/health", "/metrics"):
        assert httpx.get(engine.url + path, timeout=10).status_code == 200, path


def test_no_prompt_or_key_in_engine_logs_or_command_lines(engine_fleet: EngineFleet) -> None:
    for engine, spec in zip(engine_fleet.launcher.engines, engine_fleet.instances, strict=True):
        httpx.post(f"{spec.url}/v1/chat/completions", json=CHAT, headers=_bearer(spec), timeout=60)
        assert spec.api_key
        log = engine.log_path.read_text(errors="replace")
        assert MARKER not in log and spec.api_key not in log
        proc = psutil.Process(engine.pid)
        for p in (proc, *proc.children(recursive=True)):
            assert spec.api_key not in " ".join(p.cmdline())


def test_engines_log_to_the_run_dir_and_keep_their_stats(engine_fleet: EngineFleet) -> None:
    for engine, spec in zip(engine_fleet.launcher.engines, engine_fleet.instances, strict=True):
        assert engine.log_path.is_file() and engine.log_path.stat().st_size > 0
        assert engine.pid_path.is_file()
        reading = parse_vllm_metrics(httpx.get(f"{spec.url}/metrics", timeout=5).text, 0.0)
        # the tiny model: 2 layers x (K, V) x 2 KV heads x 64, at the dtype the launcher chose
        width = {"bfloat16": 2, "float32": 4}[arg_value(engine.command.argv, "--dtype") or ""]
        blocks = KV_CACHE_BYTES // (128 * 2 * 2 * 2 * 64 * width)
        assert (reading.num_gpu_blocks, reading.block_size) == (blocks, 128)
