"""kvcache_model against real CPU vLLM engines: predicted KV blocks vs what each engine reports.

Each engine of the `real_engines` fixture serves the tiny dev model with a 64 MiB KV cache
(`--kv-cache-memory-bytes`) and max_model_len 4096; `vllm:cache_config_info` reports its block
size, `num_gpu_blocks` and `kv_cache_max_concurrency`. The prediction (1024 B/token for the tiny
model: 2 layers x 2 x 2 KV heads x 64 x 2 B) must match; the assertion states the error.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcache_model.capacity import capacity_from_kv_cache_bytes
from kvcache_model.engine_view import instance_capacity
from kvcache_model.geometry import ModelGeometry

pytestmark = pytest.mark.integration

MODEL_DIR = Path(__file__).resolve().parents[2] / ".gpupool" / "models" / "tiny"
DEFAULT_KV_CACHE_BYTES = 64 * 1024 * 1024  # what the fixture starts engines with


def cache_config_info(url: str) -> dict[str, str]:
    """Labels of `vllm:cache_config_info` scraped from an engine's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                return dict(sample.labels)
    raise AssertionError(f"{url}/metrics has no vllm:cache_config_info")


def served_max_model_len(url: str) -> int:
    models: list[dict[str, Any]] = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    return int(models[0]["max_model_len"])


def check_engine(url: str, geometry: ModelGeometry) -> str:
    """Compare prediction and engine for one engine; returns a one-line summary."""
    info = cache_config_info(url)
    block_size = int(info["block_size"])
    engine_blocks = int(info["num_gpu_blocks"])
    kv_bytes_label = info.get("kv_cache_memory_bytes", "None")
    kv_cache_bytes = int(kv_bytes_label) if kv_bytes_label.isdigit() else DEFAULT_KV_CACHE_BYTES

    predicted = capacity_from_kv_cache_bytes(geometry, kv_cache_bytes, block_size)
    error = (predicted.num_blocks - engine_blocks) / engine_blocks
    assert predicted.num_blocks == engine_blocks, (
        f"{url}: predicted {predicted.num_blocks} blocks of {block_size} tokens from "
        f"{kv_cache_bytes} B at {geometry.kv_bytes_per_token()} B/token; engine reports "
        f"{engine_blocks} (error {error:+.2%})"
    )

    max_len = served_max_model_len(url)
    engine_concurrency = float(info["kv_cache_max_concurrency"])
    predicted_concurrency = predicted.max_concurrent_sequences(max_len)
    assert predicted_concurrency == math.floor(engine_concurrency), (
        f"{url}: predicted {predicted_concurrency} concurrent {max_len}-token sequences; engine "
        f"reports kv_cache_max_concurrency {engine_concurrency}"
    )

    view = instance_capacity(
        num_gpu_blocks=engine_blocks, block_size=block_size, predicted=predicted
    )
    assert view.source == "engine" and view.prediction_error_frac == 0.0
    return (
        f"{url}: {engine_blocks} blocks x {block_size} tokens, predicted {predicted.num_blocks} "
        f"(error {error:+.2%}), max concurrency {engine_concurrency} at {max_len} tokens"
    )


def test_predicted_kv_blocks_match_real_engines(real_engines: list[Any]) -> None:
    assert (MODEL_DIR / "config.json").is_file(), "the fixture makes the dev model"
    geometry = ModelGeometry.from_path(MODEL_DIR)
    assert geometry.kv_bytes_per_token() == 1024
    assert real_engines, "no engines"
    for engine in real_engines:
        print(check_engine(engine.url, geometry))
