"""Parameter counts of a decoder-only transformer from its dimensions.

Counts the weights that matter for memory and FLOPs: attention (standard or MLA), gated MLPs
(dense, routed experts, shared experts, routers), norms and embeddings. Within about 1 % of the
published totals for Llama 3.1, Qwen2.5, Mixtral, Gemma 2/3 and DeepSeek-V3 (671 B; the
multi-token-prediction head vLLM does not load by default is left out).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache_model.geometry import MlaDims

__all__ = ["MoeShape", "ParamCounts", "count_params"]


@dataclass(frozen=True)
class MoeShape:
    """Mixture-of-experts layout: which layers are sparse and how big an expert is."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    shared_intermediate_size: int
    sparse_layers: tuple[int, ...]
    shared_gate: bool = False

    def expert_params(self, hidden_size: int) -> int:
        """Weights of one routed expert (gate, up and down projections)."""
        return 3 * hidden_size * self.expert_intermediate_size


@dataclass(frozen=True)
class ParamCounts:
    """`total`: stored; `active`: used by one token; `matmul`: costing 2 FLOPs each per token."""

    total: int
    active: int
    matmul: int


def _attention_params(
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    qkv_bias: bool,
    qk_norm: bool,
    mla: MlaDims | None,
) -> int:
    if mla is not None:
        qk_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        if mla.q_lora_rank:
            q = hidden * mla.q_lora_rank + mla.q_lora_rank + mla.q_lora_rank * heads * qk_dim
        else:
            q = hidden * heads * qk_dim
        kv_a = hidden * mla.latent_dim + mla.kv_lora_rank
        kv_b = mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        return q + kv_a + kv_b + heads * mla.v_head_dim * hidden
    q = hidden * heads * head_dim
    kv = 2 * hidden * kv_heads * head_dim
    o = heads * head_dim * hidden
    bias = (heads + 2 * kv_heads) * head_dim if qkv_bias else 0
    norm = 2 * head_dim if qk_norm else 0
    return q + kv + o + bias + norm


def count_params(
    *,
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    vocab_size: int,
    tie_word_embeddings: bool,
    qkv_bias: bool = False,
    qk_norm: bool = False,
    norms_per_layer: int = 2,
    mla: MlaDims | None = None,
    moe: MoeShape | None = None,
) -> ParamCounts:
    """Total, active and matmul parameter counts."""
    attention = _attention_params(
        hidden_size, num_attention_heads, num_kv_heads, head_dim, qkv_bias, qk_norm, mla
    )
    dense_mlp = 3 * hidden_size * intermediate_size
    sparse = set(moe.sparse_layers) if moe else set()
    total_layers = 0
    active_layers = 0
    for layer in range(num_layers):
        base = attention + norms_per_layer * hidden_size
        if moe is not None and layer in sparse:
            expert = moe.expert_params(hidden_size)
            shared = 3 * hidden_size * moe.shared_intermediate_size
            router = hidden_size * moe.num_experts + (hidden_size if moe.shared_gate else 0)
            total_layers += base + moe.num_experts * expert + shared + router
            active_layers += base + moe.experts_per_token * expert + shared + router
        else:
            total_layers += base + dense_mlp
            active_layers += base + dense_mlp
    embedding = vocab_size * hidden_size
    head = 0 if tie_word_embeddings else embedding
    total = total_layers + embedding + head + hidden_size
    active = active_layers + embedding + head + hidden_size
    # The input embedding is a lookup; the LM head (tied or not) is a matmul.
    matmul = active - embedding + (embedding if tie_word_embeddings else 0)
    return ParamCounts(total=total, active=active, matmul=matmul)
