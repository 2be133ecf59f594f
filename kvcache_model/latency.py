"""Roofline latency priors: prefill time, one decode step, TTFT/TPOT, and the TPOT-limited batch.

A forward step over T tokens takes

    max(FLOPs / (peak x compute_eff), bytes / (HBM x bandwidth_eff)) + step overhead + all-reduces

per tensor-parallel rank, where FLOPs = 2 x matmul params x T (the LM head only for the last
token of a prefill) + attention (4 x heads x head_dim per attended query/key pair, a sliding layer
attending at most its window), and bytes = the weights the step reads (for MoE only the experts
the T tokens are routed to, in expectation: E x (1 - (1 - k/E)^T) per layer) + the KV it reads.
With tensor parallelism each rank does 1/tp of the work and two all-reduces per layer.

These are priors: the router starts its operating point from `max_batch_for_tpot` and then
learns from observed TPOT. How good they are (tests/unit/test_kvcache_priors.py): the GPU
efficiencies were tuned on batch-1 decode of Llama-3.1-8B (A100-40GB, and an uncited H100
figure), so those points prove nothing; the one published point they were not tuned on
(A100-40GB, concurrency 8, same sweep) is predicted 18 % low, as its measured TPOT includes
prefill interference. No other GPU or model has been checked against a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache_model.errors import InvalidInputError
from kvcache_model.geometry import ModelGeometry
from kvcache_model.gpus import GpuSpec

__all__ = ["LatencyPrior"]

_ACT_BYTES = 2  # activations and all-reduce payloads in 16 bits


def _attended_pairs(n_tokens: int, window: int | None) -> int:
    """Query/key pairs causal attention over n tokens computes, within a window if any."""
    if window is None or n_tokens <= window:
        return n_tokens * (n_tokens + 1) // 2
    return window * (window + 1) // 2 + (n_tokens - window) * window


@dataclass(frozen=True)
class LatencyPrior:
    """Roofline latency model of one engine: `geometry` on `tensor_parallel_size` x `gpu`.

    All times in seconds. Monotone: more tokens, a bigger batch or a longer context never
    predicts less time.
    """

    geometry: ModelGeometry
    gpu: GpuSpec
    tensor_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    max_num_batched_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.tensor_parallel_size <= 0:
            raise InvalidInputError(
                f"tensor_parallel_size must be > 0, got {self.tensor_parallel_size}"
            )
        if self.max_num_batched_tokens <= 0:
            raise InvalidInputError("max_num_batched_tokens must be > 0")

    # -- pieces ---------------------------------------------------------------------------

    def _weight_bytes_read(self, step_tokens: int) -> float:
        """Weight bytes one step over `step_tokens` tokens streams from HBM (all ranks)."""
        g = self.geometry
        active_expert_params = g.moe_layer_count * g.experts_per_token * g.expert_param_count
        dense_params = g.matmul_param_count - active_expert_params
        touched = 0.0
        if g.num_experts:
            unused = (1.0 - g.experts_per_token / g.num_experts) ** step_tokens
            touched = g.num_experts * (1.0 - unused)
        params = dense_params + g.moe_layer_count * touched * g.expert_param_count
        return params * g.weight_bytes_per_param

    def _attention_flops_per_pair(self, absorbed: bool) -> int:
        """FLOPs per query/key pair per layer, all heads (QK^T plus AV)."""
        g = self.geometry
        if g.mla is None:
            return 4 * g.num_attention_heads * g.head_dim
        if absorbed:  # decode: attention runs in the latent space
            qk, v = g.mla.latent_dim, g.mla.kv_lora_rank
        else:
            qk, v = g.mla.qk_nope_head_dim + g.mla.qk_rope_head_dim, g.mla.v_head_dim
        return 2 * g.num_attention_heads * (qk + v)

    def _attention_flops(self, pairs_full: int, pairs_sliding: int, absorbed: bool) -> float:
        g = self.geometry
        full_layers = g.num_layers - g.sliding_layer_count
        pairs = full_layers * pairs_full + g.sliding_layer_count * pairs_sliding
        return float(pairs * self._attention_flops_per_pair(absorbed))

    def _allreduce_s(self, step_tokens: int, steps: int) -> float:
        tp = self.tensor_parallel_size
        if tp == 1:
            return 0.0
        payload = step_tokens * self.geometry.hidden_size * _ACT_BYTES
        per_reduce = self.gpu.allreduce_latency_s + (
            2 * (tp - 1) / tp * payload / self.gpu.interconnect_bytes_per_s
        )
        return 2 * self.geometry.num_layers * per_reduce * steps

    def _roofline_s(self, flops: float, bytes_: float) -> float:
        tp = self.tensor_parallel_size
        compute_s = flops / tp / self.gpu.effective_flops_per_s
        memory_s = bytes_ / tp / self.gpu.effective_bytes_per_s
        return max(compute_s, memory_s)

    # -- priors ---------------------------------------------------------------------------

    def decode_step_s(self, batch_size: int, context_tokens: int) -> float:
        """One decode step for `batch_size` sequences of `context_tokens` tokens each."""
        if batch_size <= 0 or context_tokens <= 0:
            raise InvalidInputError(
                f"batch_size and context_tokens must be > 0, got {batch_size}, {context_tokens}"
            )
        g = self.geometry
        window = g.sliding_window_tokens
        sliding_ctx = min(context_tokens, window) if window else context_tokens
        flops = 2.0 * g.matmul_param_count * batch_size + self._attention_flops(
            batch_size * context_tokens, batch_size * sliding_ctx, absorbed=True
        )
        kv_bytes = batch_size * g.kv_bytes_for_tokens(context_tokens, self.kv_cache_dtype)
        if g.mla is not None:  # the latent is replicated: every rank reads all of it
            kv_bytes *= self.tensor_parallel_size
        bytes_ = self._weight_bytes_read(batch_size) + kv_bytes
        return (
            self._roofline_s(flops, bytes_)
            + self.gpu.step_overhead_s
            + self._allreduce_s(batch_size, 1)
        )

    def prefill_s(self, prompt_tokens: int, batch_size: int = 1) -> float:
        """Prefill of `batch_size` prompts of `prompt_tokens` each, chunked by
        `max_num_batched_tokens` (each chunk re-reads the weights)."""
        if prompt_tokens <= 0 or batch_size <= 0:
            raise InvalidInputError(
                f"prompt_tokens and batch_size must be > 0, got {prompt_tokens}, {batch_size}"
            )
        g = self.geometry
        total = prompt_tokens * batch_size
        chunks = -(-total // self.max_num_batched_tokens)
        chunk_tokens = min(total, self.max_num_batched_tokens)
        head_params = g.vocab_size * g.hidden_size
        flops = 2.0 * (g.matmul_param_count - head_params) * total + 2.0 * head_params * batch_size
        flops += self._attention_flops(
            batch_size * _attended_pairs(prompt_tokens, None),
            batch_size * _attended_pairs(prompt_tokens, g.sliding_window_tokens),
            absorbed=False,
        )
        bytes_ = chunks * self._weight_bytes_read(chunk_tokens) + batch_size * (
            g.kv_bytes_for_tokens(prompt_tokens, self.kv_cache_dtype)
        )
        return (
            self._roofline_s(flops, bytes_)
            + chunks * self.gpu.step_overhead_s
            + self._allreduce_s(chunk_tokens, chunks)
        )

    def ttft_s(self, prompt_tokens: int, batch_size: int = 1) -> float:
        """Time to first token when `batch_size` prompts arrive together (that of the last to
        finish prefill), excluding queueing."""
        return self.prefill_s(prompt_tokens, batch_size)

    def tpot_s(self, batch_size: int, context_tokens: int) -> float:
        """Time per output token with `batch_size` sequences decoding at `context_tokens`."""
        return self.decode_step_s(batch_size, context_tokens)

    def max_batch_for_tpot(
        self, tpot_target_s: float, context_tokens: int, max_batch: int = 1024
    ) -> int:
        """Largest batch in [0, max_batch] whose predicted TPOT at `context_tokens` is within
        `tpot_target_s`; 0 when not even one sequence meets it."""
        if tpot_target_s <= 0 or max_batch <= 0:
            raise InvalidInputError("tpot_target_s and max_batch must be > 0")
        if self.tpot_s(1, context_tokens) > tpot_target_s:
            return 0
        lo, hi = 1, max_batch  # invariant: tpot(lo) meets the target
        if self.tpot_s(hi, context_tokens) <= tpot_target_s:
            return hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.tpot_s(mid, context_tokens) <= tpot_target_s:
                lo = mid
            else:
                hi = mid
        return lo
