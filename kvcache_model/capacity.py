"""KV-cache capacity of one engine: blocks, tokens, and concurrent sequences at a context length.

Mirrors how vLLM sizes its cache on each tensor-parallel rank:

    kv_cache_bytes = gpu_memory_bytes x gpu_memory_utilization
                     - weight_bytes / tp - overhead_bytes (activations, CUDA context, graphs)
    num_blocks     = kv_cache_bytes // (kv_bytes_per_token_per_rank x block_size)

or, with `--kv-cache-memory-bytes`, `num_blocks = that // bytes_per_block`
(`capacity_from_kv_cache_bytes`). The overhead default is a heuristic (`estimate_overhead_bytes`);
an engine's own `num_gpu_blocks` always wins over any of this (see `engine_view`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvcache_model.errors import InvalidInputError
from kvcache_model.geometry import ModelGeometry

__all__ = [
    "NULL_BLOCKS",
    "CapacityPlan",
    "capacity_from_kv_cache_bytes",
    "estimate_overhead_bytes",
    "plan_capacity",
]

_GIB = 1024**3
# CUDA context, NCCL buffers, cuBLAS workspace and CUDA-graph pools: outside torch's activations.
_FIXED_OVERHEAD_BYTES = 1 * _GIB
_LOGITS_BYTES_PER_ELEMENT = 8  # fp32 logits plus the sampler's fp32 copy
# vLLM's BlockPool keeps one "null block" it never hands out; its start-up check plans against
# the rest (measured: 32 blocks of 128 tokens do not start a 4096-token max_model_len).
NULL_BLOCKS = 1


@dataclass(frozen=True)
class CapacityPlan:
    """Predicted KV capacity of one engine (per tensor-parallel rank where it matters)."""

    geometry: ModelGeometry
    block_size_tokens: int
    kv_cache_dtype: str
    tensor_parallel_size: int
    kv_cache_bytes_per_gpu: int
    kv_bytes_per_token_per_gpu: int
    num_blocks: int
    weight_bytes_per_gpu: int = 0
    overhead_bytes_per_gpu: int = 0
    usable_bytes_per_gpu: int = 0

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV the cache holds (all layers of each)."""
        return self.num_blocks * self.block_size_tokens

    @property
    def fits(self) -> bool:
        """True when the weights leave room for at least one block."""
        return self.num_blocks > 0

    def blocks_for_sequence(self, n_tokens: int) -> int:
        """Blocks a sequence of `n_tokens` needs (sliding windows honoured)."""
        return self.geometry.blocks_for_sequence(n_tokens, self.block_size_tokens)

    def max_concurrent_sequences(self, context_tokens: int) -> int:
        """Sequences of `context_tokens` each that fit at once (vLLM's kv_cache_max_concurrency,
        floored)."""
        if context_tokens <= 0:
            raise InvalidInputError(f"context_tokens must be > 0, got {context_tokens}")
        return self.num_blocks // self.blocks_for_sequence(context_tokens)

    @property
    def usable_blocks(self) -> int:
        """Blocks a sequence can get: vLLM's BlockPool holds `NULL_BLOCKS` back for good."""
        return max(0, self.num_blocks - NULL_BLOCKS)

    def fits_context(self, context_tokens: int) -> bool:
        """True when one sequence of `context_tokens` fits in the usable blocks (vLLM refuses
        to start otherwise)."""
        return self.blocks_for_sequence(context_tokens) <= self.usable_blocks


def estimate_overhead_bytes(
    geometry: ModelGeometry,
    *,
    tensor_parallel_size: int = 1,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
) -> int:
    """Heuristic per-rank memory vLLM keeps outside weights and KV: a fixed 1 GiB plus the
    peak activation of one `max_num_batched_tokens` forward (MLP intermediate and residual
    stream) and the logits of `max_num_seqs` sequences."""
    if tensor_parallel_size <= 0 or max_num_batched_tokens <= 0 or max_num_seqs <= 0:
        raise InvalidInputError("tensor_parallel_size, max_num_batched_tokens, max_num_seqs > 0")
    act_bytes = 2  # activations run in the 16-bit model dtype
    per_token = 2 * geometry.intermediate_size // tensor_parallel_size + 4 * geometry.hidden_size
    activations = max_num_batched_tokens * per_token * act_bytes
    logits = max_num_seqs * geometry.vocab_size * _LOGITS_BYTES_PER_ELEMENT // tensor_parallel_size
    return _FIXED_OVERHEAD_BYTES + activations + logits


def capacity_from_kv_cache_bytes(
    geometry: ModelGeometry,
    kv_cache_bytes: int,
    block_size_tokens: int,
    *,
    kv_cache_dtype: str = "auto",
    tensor_parallel_size: int = 1,
) -> CapacityPlan:
    """Capacity of an engine started with `--kv-cache-memory-bytes kv_cache_bytes` (per rank)."""
    num_blocks = geometry.blocks_from_kv_cache_bytes(
        kv_cache_bytes, block_size_tokens, kv_cache_dtype, tensor_parallel_size
    )
    return CapacityPlan(
        geometry=geometry,
        block_size_tokens=block_size_tokens,
        kv_cache_dtype=kv_cache_dtype,
        tensor_parallel_size=tensor_parallel_size,
        kv_cache_bytes_per_gpu=kv_cache_bytes,
        kv_bytes_per_token_per_gpu=geometry.kv_bytes_per_token(
            kv_cache_dtype, tensor_parallel_size
        ),
        num_blocks=num_blocks,
    )


def plan_capacity(
    geometry: ModelGeometry,
    *,
    gpu_memory_bytes: int,
    gpu_memory_utilization_frac: float = 0.9,
    tensor_parallel_size: int = 1,
    block_size_tokens: int = 16,
    kv_cache_dtype: str = "auto",
    weight_bytes: int | None = None,
    overhead_bytes_per_gpu: int | None = None,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
) -> CapacityPlan:
    """Predicted KV capacity of one engine on GPUs of `gpu_memory_bytes` each.

    `weight_bytes` (all ranks together) defaults to parameters x stored width; the overhead
    defaults to `estimate_overhead_bytes`. A model that does not fit gets `num_blocks == 0`.
    """
    if gpu_memory_bytes <= 0:
        raise InvalidInputError(f"gpu_memory_bytes must be > 0, got {gpu_memory_bytes}")
    if not 0.0 < gpu_memory_utilization_frac <= 1.0:
        raise InvalidInputError(
            f"gpu_memory_utilization_frac must be in (0, 1], got {gpu_memory_utilization_frac}"
        )
    if tensor_parallel_size <= 0:
        raise InvalidInputError(f"tensor_parallel_size must be > 0, got {tensor_parallel_size}")
    total_weight_bytes = geometry.weight_bytes if weight_bytes is None else weight_bytes
    if total_weight_bytes < 0:
        raise InvalidInputError(f"weight_bytes must be >= 0, got {weight_bytes}")
    overhead = (
        estimate_overhead_bytes(
            geometry,
            tensor_parallel_size=tensor_parallel_size,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
        )
        if overhead_bytes_per_gpu is None
        else overhead_bytes_per_gpu
    )
    usable = math.floor(gpu_memory_bytes * gpu_memory_utilization_frac)
    weight_per_gpu = -(-total_weight_bytes // tensor_parallel_size)
    kv_cache_bytes = max(0, usable - weight_per_gpu - overhead)
    plan = capacity_from_kv_cache_bytes(
        geometry,
        kv_cache_bytes,
        block_size_tokens,
        kv_cache_dtype=kv_cache_dtype,
        tensor_parallel_size=tensor_parallel_size,
    )
    return CapacityPlan(
        geometry=geometry,
        block_size_tokens=block_size_tokens,
        kv_cache_dtype=kv_cache_dtype,
        tensor_parallel_size=tensor_parallel_size,
        kv_cache_bytes_per_gpu=kv_cache_bytes,
        kv_bytes_per_token_per_gpu=plan.kv_bytes_per_token_per_gpu,
        num_blocks=plan.num_blocks,
        weight_bytes_per_gpu=weight_per_gpu,
        overhead_bytes_per_gpu=overhead,
        usable_bytes_per_gpu=usable,
    )
