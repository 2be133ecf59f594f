"""`gpupool plan`: KV-cache capacity and latency priors of a model on a GPU, before launching.

    gpupool plan --model-config llama-3.1-8b --gpu H100 [--tp N] [--max-model-len N]
                 [--gpu-memory-utilization F] [--kv-cache-dtype auto|fp8] [--json]

Prints KV bytes per token, blocks, tokens of KV, the largest number of concurrent sequences at
several context lengths, TTFT/TPOT priors at several batch sizes and the TPOT-limited batch.
Exit 0; 2 for an unknown model or GPU, or a model that does not fit.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from kvcache_model.capacity import CapacityPlan, plan_capacity
from kvcache_model.errors import KVCacheModelError
from kvcache_model.geometry import ModelGeometry
from kvcache_model.gpus import GpuSpec, gpu_spec
from kvcache_model.known import known_model_names, load_geometry
from kvcache_model.latency import LatencyPrior

__all__ = ["build_plan", "register", "run"]

_CONTEXTS_TOKENS = (1024, 4096, 8192, 32768, 131072)
_BATCH_SIZES = (1, 8, 32, 64, 128, 256)
_GIB = 1024**3


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "plan", help="KV-cache capacity and TTFT/TPOT priors of a model on a GPU"
    )
    p.add_argument(
        "--model-config",
        required=True,
        metavar="PATH_OR_NAME",
        help=f"model folder, config.json, or a known model ({', '.join(known_model_names())})",
    )
    p.add_argument(
        "--gpu",
        required=True,
        help="GPU model: A100, A100-40GB, H100, H100-PCIE, H100-NVL, H200, L40S, B200",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="default 0.9")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    p.add_argument("--block-size", type=int, default=16, help="KV block size, tokens (16)")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="prompt length for TTFT")
    p.add_argument(
        "--context-tokens", type=int, default=None, help="context for TPOT (default min(4096, len))"
    )
    p.add_argument("--tpot-target-ms", type=float, default=50.0, help="for the operating point")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def build_plan(
    geometry: ModelGeometry,
    gpu: GpuSpec,
    *,
    tensor_parallel_size: int = 1,
    max_model_len: int | None = None,
    gpu_memory_utilization_frac: float = 0.9,
    kv_cache_dtype: str = "auto",
    block_size_tokens: int = 16,
    prompt_tokens: int = 1024,
    context_tokens: int | None = None,
    tpot_target_ms: float = 50.0,
) -> dict[str, Any]:
    """The whole plan as a JSON-ready dict (what `--json` prints)."""
    max_len = max_model_len or geometry.max_context_tokens
    ctx = context_tokens or min(4096, max_len)
    capacity: CapacityPlan = plan_capacity(
        geometry,
        gpu_memory_bytes=gpu.memory_bytes,
        gpu_memory_utilization_frac=gpu_memory_utilization_frac,
        tensor_parallel_size=tensor_parallel_size,
        block_size_tokens=block_size_tokens,
        kv_cache_dtype=kv_cache_dtype,
    )
    prior = LatencyPrior(geometry, gpu, tensor_parallel_size, kv_cache_dtype)
    contexts = sorted({c for c in _CONTEXTS_TOKENS if c < max_len} | {max_len})
    op_batch = prior.max_batch_for_tpot(tpot_target_ms / 1000.0, ctx)
    kv_limit = capacity.max_concurrent_sequences(ctx) if capacity.fits else 0
    return {
        "model": {
            "name": geometry.name,
            "model_type": geometry.model_type,
            "param_count": geometry.param_count,
            "active_param_count": geometry.active_param_count,
            "dtype": geometry.dtype,
            "weight_bytes": geometry.weight_bytes,
            "num_layers": geometry.num_layers,
            "num_kv_heads": geometry.num_kv_heads,
            "head_dim": geometry.head_dim,
            "mla": geometry.mla is not None,
            "sliding_window_tokens": geometry.sliding_window_tokens,
            "sliding_layers": geometry.sliding_layer_count,
            "max_context_tokens": geometry.max_context_tokens,
        },
        "gpu": {
            "name": gpu.name,
            "memory_bytes": gpu.memory_bytes,
            "peak_bf16_flops_per_s": gpu.peak_bf16_flops_per_s,
            "hbm_bytes_per_s": gpu.hbm_bytes_per_s,
        },
        "tensor_parallel_size": tensor_parallel_size,
        "gpu_memory_utilization_frac": gpu_memory_utilization_frac,
        "kv_cache_dtype": kv_cache_dtype,
        "block_size_tokens": block_size_tokens,
        "max_model_len": max_len,
        "kv_bytes_per_token": geometry.kv_bytes_per_token(kv_cache_dtype),
        "kv_bytes_per_token_per_gpu": capacity.kv_bytes_per_token_per_gpu,
        "kv_bytes_per_block_per_gpu": capacity.kv_bytes_per_token_per_gpu * block_size_tokens,
        "weight_bytes_per_gpu": capacity.weight_bytes_per_gpu,
        "overhead_bytes_per_gpu": capacity.overhead_bytes_per_gpu,
        "kv_cache_bytes_per_gpu": capacity.kv_cache_bytes_per_gpu,
        "num_blocks": capacity.num_blocks,
        "kv_tokens": capacity.kv_tokens,
        "fits": capacity.fits,
        "fits_max_model_len": capacity.fits and capacity.fits_context(max_len),
        "contexts": [
            {
                "context_tokens": c,
                "blocks_per_sequence": capacity.blocks_for_sequence(c),
                "max_concurrent_sequences": capacity.max_concurrent_sequences(c),
            }
            for c in contexts
        ],
        "latency": {
            "prompt_tokens": prompt_tokens,
            "context_tokens": ctx,
            "rows": [
                {
                    "batch_size": b,
                    "ttft_ms": prior.ttft_s(prompt_tokens, b) * 1000.0,
                    "tpot_ms": prior.tpot_s(b, ctx) * 1000.0,
                    "output_tokens_per_s": b / prior.tpot_s(b, ctx),
                    "fits_kv": b <= kv_limit,
                }
                for b in _BATCH_SIZES
            ],
        },
        "operating_point": {
            "tpot_target_ms": tpot_target_ms,
            "context_tokens": ctx,
            "max_batch_for_tpot": op_batch,
            "max_concurrent_by_kv": kv_limit,
            "max_batch": min(op_batch, kv_limit),
        },
    }


def _bytes(n: float) -> str:
    for unit, size in (("GiB", _GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _print_text(plan: dict[str, Any], out: TextIO) -> None:
    m, g = plan["model"], plan["gpu"]
    attention = "MLA" if m["mla"] else f"{m['num_kv_heads']} KV heads x {m['head_dim']}"
    if m["sliding_layers"]:
        attention += f", {m['sliding_layers']} sliding layers (window {m['sliding_window_tokens']})"
    w = out.write
    w(
        f"model  {m['name']} ({m['model_type']}, {m['param_count'] / 1e9:.2f} B params, "
        f"{m['active_param_count'] / 1e9:.2f} B active, {m['dtype']}, {m['num_layers']} layers, "
        f"{attention})\n"
    )
    w(
        f"gpu    {plan['tensor_parallel_size']} x {g['name']} ({_bytes(g['memory_bytes'])}, "
        f"utilization {plan['gpu_memory_utilization_frac']:.2f}), "
        f"kv cache dtype {plan['kv_cache_dtype']}\n\n"
    )
    per_token = plan["kv_bytes_per_token"]
    w(f"KV bytes per token        {per_token} ({_bytes(per_token)})")
    if plan["tensor_parallel_size"] > 1:
        w(f", {plan['kv_bytes_per_token_per_gpu']} per GPU")
    w("\n")
    w(
        f"KV bytes per block        {_bytes(plan['kv_bytes_per_block_per_gpu'])} per GPU "
        f"({plan['block_size_tokens']} tokens)\n"
    )
    w(f"weights per GPU           {_bytes(plan['weight_bytes_per_gpu'])}\n")
    overhead = _bytes(plan["overhead_bytes_per_gpu"])
    w(f"overhead per GPU          {overhead} (activations, CUDA context, graphs)\n")
    w(f"KV cache per GPU          {_bytes(plan['kv_cache_bytes_per_gpu'])}\n")
    w(f"KV blocks                 {plan['num_blocks']} ({plan['kv_tokens']} tokens of KV)\n\n")
    w("context_tokens  blocks/seq  max_concurrent_seqs\n")
    for row in plan["contexts"]:
        w(
            f"{row['context_tokens']:>14}  {row['blocks_per_sequence']:>10}  "
            f"{row['max_concurrent_sequences']:>19}\n"
        )
    lat = plan["latency"]
    w(
        f"\nroofline priors: TTFT for {lat['prompt_tokens']}-token prompts arriving together, "
        f"TPOT at {lat['context_tokens']} tokens of context\n"
    )
    w("batch  ttft_ms  tpot_ms  output_tok/s  fits_kv\n")
    for row in lat["rows"]:
        w(
            f"{row['batch_size']:>5}  {row['ttft_ms']:>7.1f}  {row['tpot_ms']:>7.2f}  "
            f"{row['output_tokens_per_s']:>12.0f}  {'yes' if row['fits_kv'] else 'no':>7}\n"
        )
    op = plan["operating_point"]
    w(
        f"\noperating point: largest batch with TPOT <= {op['tpot_target_ms']:g} ms at "
        f"{op['context_tokens']} tokens: {op['max_batch_for_tpot']} "
        f"(KV allows {op['max_concurrent_by_kv']}; use {op['max_batch']})\n"
    )


def run(args: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        if args.tp <= 0:
            raise KVCacheModelError(f"--tp must be >= 1, got {args.tp}")
        geometry = load_geometry(args.model_config)
        gpu = gpu_spec(args.gpu)
        plan = build_plan(
            geometry,
            gpu,
            tensor_parallel_size=args.tp,
            max_model_len=args.max_model_len,
            gpu_memory_utilization_frac=args.gpu_memory_utilization,
            kv_cache_dtype=args.kv_cache_dtype,
            block_size_tokens=args.block_size,
            prompt_tokens=args.prompt_tokens,
            context_tokens=args.context_tokens,
            tpot_target_ms=args.tpot_target_ms,
        )
    except KVCacheModelError as error:
        print(f"gpupool plan: {error}", file=err)
        return 2
    if args.json:
        out.write(json.dumps(plan, indent=2) + "\n")
    else:
        _print_text(plan, out)
    if not plan["fits"]:
        print(
            f"gpupool plan: {geometry.name} does not fit on {args.tp} x {gpu.name}: "
            f"{_bytes(plan['weight_bytes_per_gpu'])} of weights per GPU leave no room for KV; "
            "raise --tp or --gpu-memory-utilization",
            file=err,
        )
        return 2
    if not plan["fits_max_model_len"]:
        print(
            f"gpupool plan: one {plan['max_model_len']}-token sequence needs more KV than the "
            f"{plan['kv_tokens']} tokens available; lower --max-model-len",
            file=err,
        )
        return 2
    return 0
