"""kvcache_model capacity: blocks, concurrent sequences, the engine's numbers winning."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcache_model.capacity import (
    capacity_from_kv_cache_bytes,
    estimate_overhead_bytes,
    plan_capacity,
)
from kvcache_model.engine_view import instance_capacity
from kvcache_model.errors import InvalidInputError
from kvcache_model.geometry import ModelGeometry, blocks_for_tokens
from kvcache_model.gpus import gpu_spec
from kvcache_model.known import known_model_names, load_geometry

GIB = 1024**3
TINY = ModelGeometry.from_hf_config(
    {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_hidden_layers": 2,
        "max_position_embeddings": 8192,
        "vocab_size": 4096,
        "torch_dtype": "bfloat16",
    },
    name="tiny",
)
GEOMETRIES = [load_geometry(n) for n in known_model_names()] + [TINY]


def test_blocks_for_tokens_is_ceil() -> None:
    assert blocks_for_tokens(0, 16) == 0
    assert blocks_for_tokens(1, 16) == 1
    assert blocks_for_tokens(16, 16) == 1
    assert blocks_for_tokens(17, 16) == 2
    with pytest.raises(InvalidInputError):
        blocks_for_tokens(-1, 16)
    with pytest.raises(InvalidInputError):
        blocks_for_tokens(10, 0)


def test_kv_cache_memory_bytes_like_vllm_cpu() -> None:
    """vLLM 0.32 CPU, tiny model, --kv-cache-memory-bytes 64 MiB: block_size 128, 512 blocks,
    kv_cache_max_concurrency 16 at max_model_len 4096 (measured)."""
    plan = capacity_from_kv_cache_bytes(TINY, 64 * 2**20, 128)
    assert plan.num_blocks == 512
    assert plan.kv_tokens == 65536
    assert plan.max_concurrent_sequences(4096) == 16


def test_plan_capacity_llama_8b_on_h100() -> None:
    g = load_geometry("llama-3.1-8b")
    plan = plan_capacity(g, gpu_memory_bytes=gpu_spec("H100").memory_bytes)
    assert plan.fits and plan.fits_context(131072)
    # 0.9 x 79.6 GiB - 14.96 GiB weights - ~1.9 GiB overhead ~ 54.8 GiB of KV at 128 KiB/token.
    assert 400_000 < plan.kv_tokens < 470_000
    assert plan.num_blocks == plan.kv_cache_bytes_per_gpu // (131072 * 16)
    assert plan.max_concurrent_sequences(8192) == plan.num_blocks // 512


def test_explicit_weight_and_overhead_bytes() -> None:
    plan = plan_capacity(
        TINY,
        gpu_memory_bytes=10 * GIB,
        gpu_memory_utilization_frac=0.5,
        weight_bytes=1 * GIB,
        overhead_bytes_per_gpu=1 * GIB,
        block_size_tokens=128,
    )
    assert plan.kv_cache_bytes_per_gpu == 3 * GIB
    assert plan.num_blocks == 3 * GIB // (1024 * 128)


def test_model_that_does_not_fit_has_zero_blocks() -> None:
    plan = plan_capacity(load_geometry("llama-3.1-70b"), gpu_memory_bytes=80 * GIB)
    assert not plan.fits and plan.num_blocks == 0
    assert plan.max_concurrent_sequences(1024) == 0
    tp4 = plan_capacity(
        load_geometry("llama-3.1-70b"), gpu_memory_bytes=80 * GIB, tensor_parallel_size=4
    )
    assert tp4.fits and tp4.weight_bytes_per_gpu == -(-tp4.geometry.weight_bytes // 4)


def test_fp8_kv_cache_doubles_blocks() -> None:
    g = load_geometry("llama-3.1-8b")
    auto = capacity_from_kv_cache_bytes(g, 10 * GIB, 16)
    fp8 = capacity_from_kv_cache_bytes(g, 10 * GIB, 16, kv_cache_dtype="fp8")
    assert fp8.num_blocks == 2 * auto.num_blocks


def test_invalid_inputs() -> None:
    with pytest.raises(InvalidInputError):
        plan_capacity(TINY, gpu_memory_bytes=0)
    with pytest.raises(InvalidInputError):
        plan_capacity(TINY, gpu_memory_bytes=GIB, gpu_memory_utilization_frac=1.5)
    with pytest.raises(InvalidInputError):
        plan_capacity(TINY, gpu_memory_bytes=GIB, tensor_parallel_size=0)
    with pytest.raises(InvalidInputError):
        capacity_from_kv_cache_bytes(TINY, -1, 16)
    with pytest.raises(InvalidInputError):
        capacity_from_kv_cache_bytes(TINY, GIB, 16).max_concurrent_sequences(0)


def test_overhead_estimate_grows_with_batched_tokens() -> None:
    g = load_geometry("llama-3.1-8b")
    small = estimate_overhead_bytes(g, max_num_batched_tokens=2048)
    big = estimate_overhead_bytes(g, max_num_batched_tokens=16384)
    assert GIB < small < big < 4 * GIB


# -- the engine's numbers win ------------------------------------------------------------


def test_engine_numbers_win_over_prediction() -> None:
    predicted = capacity_from_kv_cache_bytes(TINY, 64 * 2**20, 128)
    view = instance_capacity(num_gpu_blocks=500, block_size=128, predicted=predicted)
    assert view.source == "engine"
    assert view.num_blocks == 500 and view.kv_tokens == 64000
    assert view.predicted_num_blocks == 512
    assert view.prediction_error_frac == pytest.approx(12 / 500)
    assert view.blocks_for_tokens(129) == 2
    assert view.max_concurrent_sequences(4096) == 500 // 32


def test_prediction_rescaled_to_engine_block_size() -> None:
    predicted = capacity_from_kv_cache_bytes(TINY, 64 * 2**20, 16)
    view = instance_capacity(num_gpu_blocks=512, block_size=128, predicted=predicted)
    assert view.predicted_num_blocks == 512
    assert view.prediction_error_frac == 0.0


def test_prediction_used_until_the_engine_reports() -> None:
    predicted = capacity_from_kv_cache_bytes(TINY, 64 * 2**20, 128)
    view = instance_capacity(num_gpu_blocks=None, block_size=None, predicted=predicted)
    assert view.source == "predicted" and view.num_blocks == 512
    assert view.prediction_error_frac is None
    with pytest.raises(InvalidInputError):
        instance_capacity(num_gpu_blocks=None, block_size=None)
    with pytest.raises(InvalidInputError):
        instance_capacity(num_gpu_blocks=10, block_size=0)


# -- properties -------------------------------------------------------------------------

geometries = st.sampled_from(GEOMETRIES)
block_sizes = st.sampled_from([1, 16, 32, 64, 128])


@given(geometries, st.integers(0, 1_000_000), st.integers(0, 1_000_000), block_sizes)
def test_blocks_for_sequence_monotone_in_tokens(
    g: ModelGeometry, a: int, b: int, block_size: int
) -> None:
    lo, hi = sorted((a, b))
    assert g.blocks_for_sequence(lo, block_size) <= g.blocks_for_sequence(hi, block_size)
    # Never more than a full-attention model would need.
    assert g.blocks_for_sequence(hi, block_size) <= blocks_for_tokens(hi, block_size)


@given(geometries, st.integers(1, 1_000_000), block_sizes)
def test_full_attention_blocks_hold_the_sequence(g: ModelGeometry, n: int, block_size: int) -> None:
    blocks = g.blocks_for_sequence(n, block_size)
    if g.sliding_layer_count == 0:
        assert blocks == blocks_for_tokens(n, block_size)
        assert (blocks - 1) * block_size < n <= blocks * block_size
    assert g.kv_bytes_for_tokens(n) <= blocks * g.kv_bytes_per_block(block_size)


@given(geometries, st.integers(0, 2**40), st.integers(0, 2**40), block_sizes)
def test_blocks_monotone_in_kv_bytes(g: ModelGeometry, a: int, b: int, block_size: int) -> None:
    lo, hi = sorted((a, b))
    small = g.blocks_from_kv_cache_bytes(lo, block_size)
    big = g.blocks_from_kv_cache_bytes(hi, block_size)
    assert small <= big
    assert big * g.kv_bytes_per_block(block_size) <= hi  # never more than the budget holds


@given(
    geometries,
    st.integers(8 * GIB, 200 * GIB),
    st.floats(0.5, 0.95),
    st.integers(1, 131072),
    st.integers(1, 131072),
)
def test_capacity_monotone(
    g: ModelGeometry, memory_bytes: int, util: float, ctx_a: int, ctx_b: int
) -> None:
    plan = plan_capacity(g, gpu_memory_bytes=memory_bytes, gpu_memory_utilization_frac=util)
    more = plan_capacity(g, gpu_memory_bytes=memory_bytes + GIB, gpu_memory_utilization_frac=util)
    assert plan.num_blocks <= more.num_blocks
    short, long_ = sorted((ctx_a, ctx_b))
    assert plan.max_concurrent_sequences(short) >= plan.max_concurrent_sequences(long_)
    # Whatever fits really fits: n sequences of `short` tokens need no more blocks than exist.
    n = plan.max_concurrent_sequences(short)
    assert n * plan.blocks_for_sequence(short) <= plan.num_blocks


@given(geometries, st.sampled_from([1, 2, 4, 8]))
def test_tensor_parallel_never_grows_per_gpu_kv(g: ModelGeometry, tp: int) -> None:
    assert g.kv_bytes_per_token(tensor_parallel_size=tp) <= g.kv_bytes_per_token()
    assert g.kv_bytes_per_token(tensor_parallel_size=tp) * tp >= g.kv_bytes_per_token()


def test_one_sequence_needs_a_block_beyond_its_own() -> None:
    """vLLM's BlockPool holds one null block back: a 4096-token sequence in 128-token blocks
    (32 blocks) needs a cache of 33. Measured on CPU vLLM 0.32 with the tiny model (1024
    B/token in bfloat16): --kv-cache-memory-bytes 4194304 (32 blocks) fails at start with
    'the estimated maximum model length is 3968' (31 blocks)."""
    block_bytes = 128 * TINY.kv_bytes_per_token()
    assert block_bytes == 128 * 1024
    exact = capacity_from_kv_cache_bytes(TINY, 32 * block_bytes, 128)
    assert exact.num_blocks == 32 and exact.usable_blocks == 31
    assert not exact.fits_context(4096) and exact.fits_context(3968)
    assert capacity_from_kv_cache_bytes(TINY, 33 * block_bytes, 128).fits_context(4096)
    assert capacity_from_kv_cache_bytes(TINY, 0, 128).usable_blocks == 0
