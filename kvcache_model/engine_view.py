"""An instance's capacity as the router should believe it: the engine's numbers win.

A running vLLM engine reports `num_gpu_blocks` and `block_size` in `vllm:cache_config_info`;
`instance_capacity(num_gpu_blocks=..., block_size=..., predicted=plan)` turns them into an
`InstanceCapacity`, falling back to the prediction only while the engine has not said, and
keeping the prediction's error for logs and metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvcache_model.capacity import CapacityPlan
from kvcache_model.errors import InvalidInputError
from kvcache_model.geometry import blocks_for_tokens

__all__ = ["InstanceCapacity", "instance_capacity"]


@dataclass(frozen=True)
class InstanceCapacity:
    """KV capacity of one instance in the engine's own block unit.

    `source` says where `num_blocks` came from. `prediction_error_frac` is
    (predicted - engine) / engine when both exist (positive: the model over-predicted).
    """

    num_blocks: int
    block_size_tokens: int
    source: Literal["engine", "predicted"]
    predicted_num_blocks: int | None = None

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size_tokens

    @property
    def prediction_error_frac(self) -> float | None:
        if self.source != "engine" or self.predicted_num_blocks is None or self.num_blocks == 0:
            return None
        return (self.predicted_num_blocks - self.num_blocks) / self.num_blocks

    def blocks_for_tokens(self, n_tokens: int) -> int:
        """Blocks a sequence of `n_tokens` needs here: ceil(n / block_size)."""
        return blocks_for_tokens(n_tokens, self.block_size_tokens)

    def max_concurrent_sequences(self, context_tokens: int) -> int:
        """Sequences of `context_tokens` that fit at once (floor of vLLM's
        kv_cache_max_concurrency)."""
        if context_tokens <= 0:
            raise InvalidInputError(f"context_tokens must be > 0, got {context_tokens}")
        return self.num_blocks // self.blocks_for_tokens(context_tokens)


def instance_capacity(
    *,
    num_gpu_blocks: int | None,
    block_size: int | None,
    predicted: CapacityPlan | None = None,
) -> InstanceCapacity:
    """Capacity from scraped `num_gpu_blocks`/`block_size`, else from `predicted`.

    A prediction made for a different block size is rescaled to the engine's block size (same
    bytes) before the error is computed.
    """
    if num_gpu_blocks is not None and block_size is not None:
        if num_gpu_blocks < 0 or block_size <= 0:
            raise InvalidInputError(
                f"engine reported num_gpu_blocks={num_gpu_blocks}, block_size={block_size}"
            )
        predicted_blocks = None
        if predicted is not None:
            per_block = predicted.kv_bytes_per_token_per_gpu * block_size
            predicted_blocks = predicted.kv_cache_bytes_per_gpu // per_block
        return InstanceCapacity(
            num_blocks=num_gpu_blocks,
            block_size_tokens=block_size,
            source="engine",
            predicted_num_blocks=predicted_blocks,
        )
    if predicted is None:
        raise InvalidInputError("no engine numbers and no prediction to fall back on")
    return InstanceCapacity(
        num_blocks=predicted.num_blocks,
        block_size_tokens=predicted.block_size_tokens,
        source="predicted",
        predicted_num_blocks=predicted.num_blocks,
    )
