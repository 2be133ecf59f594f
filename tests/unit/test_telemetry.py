"""Parsing vLLM's /metrics: today's names, the older ones, and junk."""

from __future__ import annotations

from pathlib import Path

import pytest

from pools.telemetry import parse_vllm_metrics
from pools.testing.fake_engine import FakeEngineState

FIXTURE = Path(__file__).parents[1] / "fixtures" / "vllm_0_32_0_cpu_metrics.txt"


def test_real_vllm_0_32_metrics() -> None:
    r = parse_vllm_metrics(FIXTURE.read_text(), taken_at_s=12.0)
    assert r.taken_at_s == 12.0
    assert r.num_gpu_blocks == 512 and r.block_size == 128
    assert r.running == 0 and r.waiting == 0
    assert 0.0 <= r.kv_usage_frac <= 1.0
    assert r.ttft_count == 5 and r.itl_count == 55
    assert r.ttft_sum_s == pytest.approx(0.06705689430236816)


def test_legacy_names_are_understood() -> None:
    state = FakeEngineState(legacy_metric_names=True, num_gpu_blocks=100, block_size=16)
    state.used_blocks = 25
    state.itl_hist.observe(0.02)
    r = parse_vllm_metrics(state.metrics_text(), 0.0)
    assert r.kv_usage_frac == pytest.approx(0.25)
    assert r.itl_count == 1 and r.itl_sum_s == pytest.approx(0.02)


def test_data_parallel_engines_are_summed() -> None:
    text = "\n".join(
        [
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
            'vllm:num_requests_running{engine="1",model_name="m"} 4.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2',
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.4',
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100",x="y"} 1.0',
            'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="100",x="y"} 1.0',
        ]
    )
    r = parse_vllm_metrics(text, 0.0)
    assert r.running == 7 and r.kv_usage_frac == pytest.approx(0.3)
    assert r.num_gpu_blocks == 200 and r.block_size == 16


def test_not_vllm_is_an_error() -> None:
    with pytest.raises(ValueError, match="no vLLM metrics"):
        parse_vllm_metrics("# HELP up\nup 1\n", 0.0)
