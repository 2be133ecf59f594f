"""A model's shape as far as serving cares, and the KV-cache bytes that shape costs.

`ModelGeometry` is a frozen value built from a HF `config.json` (`from_hf_config`, `from_path`,
or `load("llama-3.1-8b")` for a shipped known model). Its methods are pure arithmetic:

- `kv_bytes_per_token(kv_cache_dtype)`: bytes one token occupies across all layers, ignoring
  sliding windows (what vLLM sizes its blocks by);
- `kv_bytes_per_block(block_size_tokens)`, `blocks_from_kv_cache_bytes(bytes, block_size)`;
- `kv_bytes_for_tokens(n)`: bytes a sequence of n tokens holds, where a sliding layer never holds
  more than its window;
- `blocks_for_sequence(n, block_size)`: blocks a sequence of n tokens needs (ceil; with sliding
  layers, in byte-equivalent blocks of all layers).

Attention is either standard (K and V: `2 x kv_heads x head_dim` elements per layer) or MLA
(DeepSeek-V2/V3: one latent of `kv_lora_rank + qk_rope_head_dim` elements per layer, no K/V
split, replicated on every tensor-parallel rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvcache_model.dtypes import kv_cache_dtype_bytes
from kvcache_model.errors import InvalidInputError

__all__ = ["LayerKind", "MlaDims", "ModelGeometry", "blocks_for_tokens"]

LayerKind = Literal["full", "sliding"]


def blocks_for_tokens(n_tokens: int, block_size_tokens: int) -> int:
    """Blocks a sequence of `n_tokens` occupies in one paged KV cache: ceil(n / block_size)."""
    if n_tokens < 0:
        raise InvalidInputError(f"n_tokens must be >= 0, got {n_tokens}")
    if block_size_tokens <= 0:
        raise InvalidInputError(f"block_size_tokens must be > 0, got {block_size_tokens}")
    return -(-n_tokens // block_size_tokens)


@dataclass(frozen=True)
class MlaDims:
    """Multi-head latent attention dimensions (DeepSeek-V2/V3)."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None

    @property
    def latent_dim(self) -> int:
        """Elements cached per token per layer: the compressed KV plus the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelGeometry:
    """What serving needs to know about a decoder-only transformer.

    `param_count` counts every stored parameter (all experts); `active_param_count` those one
    token runs through (routed experts it is sent to, shared experts, dense layers,
    embeddings). `matmul_param_count` is the part that costs FLOPs per token (the input
    embedding lookup is free; a tied LM head is not). `weight_bytes_per_param` is 1 for fp8
    checkpoints, 0.5 for 4-bit ones, else the dtype's width.
    """

    name: str
    model_type: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    param_count: int
    active_param_count: int
    matmul_param_count: int
    dtype: str
    weight_bytes_per_param: float
    max_context_tokens: int
    layer_kinds: tuple[LayerKind, ...]
    sliding_window_tokens: int | None = None
    mla: MlaDims | None = None
    num_experts: int = 0
    experts_per_token: int = 0
    moe_layer_count: int = 0
    expert_param_count: int = 0

    def __post_init__(self) -> None:
        positive = {
            "num_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "param_count": self.param_count,
            "max_context_tokens": self.max_context_tokens,
        }
        bad = [f"{k}={v}" for k, v in positive.items() if v <= 0]
        if bad:
            raise InvalidInputError(f"geometry of {self.name!r} has non-positive {', '.join(bad)}")
        if len(self.layer_kinds) != self.num_layers:
            raise InvalidInputError(
                f"geometry of {self.name!r}: {len(self.layer_kinds)} layer kinds "
                f"for {self.num_layers} layers"
            )
        if "sliding" in self.layer_kinds and not self.sliding_window_tokens:
            raise InvalidInputError(f"geometry of {self.name!r}: sliding layers need a window")

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_hf_config(
        cls, config: dict[str, Any], *, name: str | None = None, dtype: str | None = None
    ) -> ModelGeometry:
        """Geometry from a parsed HF `config.json`; `dtype` overrides the config's."""
        from kvcache_model.hf_config import geometry_from_hf_config

        return geometry_from_hf_config(config, name=name, dtype=dtype)

    @classmethod
    def from_path(cls, path: str | Path, *, dtype: str | None = None) -> ModelGeometry:
        """Geometry from a model folder holding `config.json`, or from the file itself."""
        from kvcache_model.known import read_config_file

        config, name = read_config_file(path)
        return cls.from_hf_config(config, name=name, dtype=dtype)

    @classmethod
    def load(cls, name_or_path: str | Path, *, dtype: str | None = None) -> ModelGeometry:
        """A shipped known model by name (`llama-3.1-8b`, ...) or else a config path."""
        from kvcache_model.known import load_geometry

        return load_geometry(name_or_path, dtype=dtype)

    # -- derived shape --------------------------------------------------------------------

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def sliding_layer_count(self) -> int:
        return sum(1 for kind in self.layer_kinds if kind == "sliding")

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights as stored (all experts)."""
        return math.ceil(self.param_count * self.weight_bytes_per_param)

    def kv_elements_per_token_per_layer(self, tensor_parallel_size: int = 1) -> int:
        """KV elements one token stores in one layer on one tensor-parallel rank.

        Standard attention splits KV heads across ranks the way vLLM does
        (`max(1, kv_heads // tp)`: heads are replicated when tp exceeds them); the MLA latent
        is not split, every rank holds all of it.
        """
        if tensor_parallel_size <= 0:
            raise InvalidInputError(f"tensor_parallel_size must be > 0, got {tensor_parallel_size}")
        if self.mla is not None:
            return self.mla.latent_dim
        kv_heads = max(1, self.num_kv_heads // tensor_parallel_size)
        return 2 * kv_heads * self.head_dim

    # -- KV bytes -------------------------------------------------------------------------

    def kv_bytes_per_token_per_layer(
        self, kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1
    ) -> int:
        elements = self.kv_elements_per_token_per_layer(tensor_parallel_size)
        return elements * kv_cache_dtype_bytes(kv_cache_dtype, self.dtype)

    def kv_bytes_per_token(
        self, kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1
    ) -> int:
        """Bytes one token's KV occupies across all layers (on one rank when tp > 1).

        `kv_cache_dtype` is vLLM's `--kv-cache-dtype`: `auto` (the model dtype) or `fp8`.
        Sliding windows do not shrink this: it is the size vLLM allocates blocks by.
        """
        per_layer = self.kv_bytes_per_token_per_layer(kv_cache_dtype, tensor_parallel_size)
        return self.num_layers * per_layer

    def kv_bytes_per_block(
        self, block_size_tokens: int, kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1
    ) -> int:
        """Bytes of one block of `block_size_tokens` tokens across all layers."""
        if block_size_tokens <= 0:
            raise InvalidInputError(f"block_size_tokens must be > 0, got {block_size_tokens}")
        return block_size_tokens * self.kv_bytes_per_token(kv_cache_dtype, tensor_parallel_size)

    def blocks_from_kv_cache_bytes(
        self,
        kv_cache_bytes: int,
        block_size_tokens: int,
        kv_cache_dtype: str = "auto",
        tensor_parallel_size: int = 1,
    ) -> int:
        """Blocks vLLM makes of a per-rank KV budget (`--kv-cache-memory-bytes`): floor."""
        if kv_cache_bytes < 0:
            raise InvalidInputError(f"kv_cache_bytes must be >= 0, got {kv_cache_bytes}")
        per_block = self.kv_bytes_per_block(block_size_tokens, kv_cache_dtype, tensor_parallel_size)
        return kv_cache_bytes // per_block

    def tokens_held_per_layer(self, n_tokens: int) -> tuple[int, ...]:
        """Tokens each layer holds for a sequence of `n_tokens`: a sliding layer <= its window."""
        if n_tokens < 0:
            raise InvalidInputError(f"n_tokens must be >= 0, got {n_tokens}")
        window = self.sliding_window_tokens or n_tokens
        return tuple(
            min(n_tokens, window) if kind == "sliding" else n_tokens for kind in self.layer_kinds
        )

    def kv_bytes_for_tokens(
        self, n_tokens: int, kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1
    ) -> int:
        """Bytes of KV a sequence of `n_tokens` holds, honouring sliding windows (unrounded)."""
        per_layer = self.kv_bytes_per_token_per_layer(kv_cache_dtype, tensor_parallel_size)
        return per_layer * sum(self.tokens_held_per_layer(n_tokens))

    def blocks_for_sequence(self, n_tokens: int, block_size_tokens: int) -> int:
        """Blocks (each `block_size_tokens` tokens of all layers) a sequence of n tokens needs.

        Full-attention models: exactly `ceil(n / block_size)`. With sliding layers a sliding
        layer keeps at most the blocks its window spans (`ceil((window - 1) / bs) + 1`, the
        window straddling a block boundary), and the total is rounded up to whole blocks.
        """
        full_blocks = blocks_for_tokens(n_tokens, block_size_tokens)
        if self.sliding_window_tokens is None or self.sliding_layer_count == 0:
            return full_blocks
        window_blocks = blocks_for_tokens(self.sliding_window_tokens - 1, block_size_tokens) + 1
        layer_blocks = sum(
            min(full_blocks, window_blocks) if kind == "sliding" else full_blocks
            for kind in self.layer_kinds
        )
        return -(-layer_blocks // self.num_layers)
