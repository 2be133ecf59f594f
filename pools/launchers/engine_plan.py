"""What each local engine runs with on this machine, decided before any engine starts: the model
dtype, the KV cache size, and the problems that would kill an engine at start.

- dtype: `model.dtype: auto` on a CPU engine is float32, or bfloat16 where the CPU has
  `avx512_bf16` or `amx_bf16` (without them bfloat16 matmuls are emulated: prefill of 200 tokens
  took 0.6-0.7 s in bfloat16 against 0.12-0.17 s in float32 on an AVX2-only EPYC); on a GPU
  it stays vLLM's own `auto` (the checkpoint's dtype). An explicit dtype is passed as given.
- KV cache on CPU when `engines.local.kv_cache_bytes` is unset: vLLM's CPU default reserves
  `gpu_memory_utilization` (0.92) of the node's memory in *each* engine, so a second engine
  dies at start. Instead the engines together get `CPU_KV_MEMORY_FRAC` (half) of the memory
  available now, less each engine's weights and runtime (`CPU_ENGINE_BASE_BYTES`), split
  evenly; never less than `CPU_KV_FLOOR_BYTES` and never more than `--max-num-seqs`
  sequences of max_model_len tokens can use. On a GPU vLLM's default (a fraction of the
  GPU's memory, one engine per GPU) is kept.
- problems: a KV cache that holds less than one max_model_len sequence (vLLM refuses to start;
  predicted by `kvcache_model` from the model's config.json), CPU ids in `cpu_affinity` that
  this machine lacks, fewer GPUs than the engines need.

Pure functions of the config and `HostFacts`; `probe_host()` is the only I/O.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from gpu_probe.detect import visible_gpu_count
from kvcache_model.capacity import NULL_BLOCKS, CapacityPlan, capacity_from_kv_cache_bytes
from kvcache_model.errors import KVCacheModelError
from kvcache_model.geometry import ModelGeometry
from pools.config import Config, LocalEnginesConfig, ModelConfig, max_num_seqs
from pools.devmodel import SHAPES, dev_model_hf_config

__all__ = [
    "BF16_CPU_FLAGS",
    "CPU_ENGINE_BASE_BYTES",
    "CPU_KV_FLOOR_BYTES",
    "CPU_KV_MEMORY_FRAC",
    "DtypeChoice",
    "EnginePlan",
    "HostFacts",
    "arg_value",
    "choose_dtype",
    "cpu_flags_from_cpuinfo",
    "default_cpu_kv_cache_bytes",
    "engine_problems",
    "plan_engines",
    "plan_problems",
    "probe_host",
]

_MIB = 1024**2
_GIB = 1024**3

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of native bfloat16 matmuls
CPU_KV_MEMORY_FRAC = 0.5  # of the memory available at start, for all engines together
# What a CPU engine holds besides its KV cache and weights (Python, torch, vLLM, activations):
# measured 1.35 GiB RSS for an idle engine serving the tiny dev model with a 64 MiB cache;
# counted as 2.5 GiB to leave room for activations under load.
CPU_ENGINE_BASE_BYTES = int(2.5 * _GIB)
CPU_KV_FLOOR_BYTES = 64 * _MIB
_CPU_BLOCK_SIZE_TOKENS = 128  # vLLM's CPU default; GPU backends default to 16
_GPU_BLOCK_SIZE_TOKENS = 16
_CPU_MAX_NUM_SEQS = 128  # vLLM's OpenAI server default on CPU


@dataclass(frozen=True, slots=True)
class HostFacts:
    """What the plan needs to know about this machine."""

    gpu_count: int  # GPUs this process may use (CUDA_VISIBLE_DEVICES honoured); 0: CPU engines
    cpu_flags: frozenset[str]  # /proc/cpuinfo flags of the first CPU
    cpu_ids: frozenset[int]  # CPUs this process may run on
    available_memory_bytes: int


def cpu_flags_from_cpuinfo(text: str) -> frozenset[str]:
    """The flags of the first processor in a /proc/cpuinfo text (x86 `flags`, Arm `Features`)."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def probe_host() -> HostFacts:
    """This machine's facts: NVML for GPUs, /proc/cpuinfo, the CPU affinity, psutil memory."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        cpuinfo = ""
    try:
        cpu_ids = frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpu_ids = frozenset(range(os.cpu_count() or 1))
    return HostFacts(
        gpu_count=visible_gpu_count(),
        cpu_flags=cpu_flags_from_cpuinfo(cpuinfo),
        cpu_ids=cpu_ids,
        available_memory_bytes=int(psutil.virtual_memory().available),
    )


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    dtype: str  # the value for vLLM's --dtype
    reason: str  # one line a user reads in the start-up log


def choose_dtype(model_dtype: str, *, on_cpu: bool, cpu_flags: frozenset[str]) -> DtypeChoice:
    """The dtype an engine runs: explicit values as given; `auto` on CPU by the CPU's flags."""
    if model_dtype != "auto":
        return DtypeChoice(model_dtype, f"model.dtype is {model_dtype}")
    if not on_cpu:
        return DtypeChoice("auto", "model.dtype auto on GPU: the checkpoint's dtype (vLLM's auto)")
    found = [flag for flag in BF16_CPU_FLAGS if flag in cpu_flags]
    if found:
        return DtypeChoice("bfloat16", f"the CPU has {' and '.join(found)} (native bfloat16)")
    return DtypeChoice(
        "float32",
        "the CPU has neither avx512_bf16 nor amx_bf16, where bfloat16 prefill runs ~4x slower"
        " than float32",
    )


def arg_value(args: Sequence[str], flag: str) -> str | None:
    """The value of `flag` in an argv (`--flag value` or `--flag=value`; the last one wins)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def default_cpu_kv_cache_bytes(
    *,
    available_memory_bytes: int,
    engine_count: int,
    weight_bytes: int,
    max_useful_bytes: int | None = None,
) -> int:
    """KV bytes per CPU engine when the config sets none (see the module docstring): the
    engines' share of `CPU_KV_MEMORY_FRAC` of available memory after their weights and
    runtime, at least `CPU_KV_FLOOR_BYTES`, at most `max_useful_bytes`; whole MiB."""
    budget = CPU_KV_MEMORY_FRAC * available_memory_bytes
    per_engine = int(budget / engine_count) - weight_bytes - CPU_ENGINE_BASE_BYTES
    if max_useful_bytes is not None:
        per_engine = min(per_engine, max_useful_bytes)
    return max(CPU_KV_FLOOR_BYTES, per_engine // _MIB * _MIB)


@dataclass(frozen=True, slots=True)
class EnginePlan:
    """How every local engine of one launch is started (they are alike)."""

    on_cpu: bool
    dtype: str  # for --dtype
    dtype_reason: str
    kv_cache_bytes: int | None  # for --kv-cache-memory-bytes; None: vLLM's default size
    kv_reason: str
    kv_source: str  # the setting a user changes to change the KV size
    kv_is_default: bool  # True when gpupool chose the size (CPU default)
    block_size_tokens: int
    max_model_len_tokens: int | None  # None: unknown here (no config.json to read)
    capacity: CapacityPlan | None  # None: the KV size or the model's geometry is unknown here


def _geometry(model: ModelConfig, dtype: str) -> ModelGeometry | None:
    """The model's geometry at `dtype` (`auto`: the checkpoint's), or None if unreadable."""
    as_dtype = None if dtype == "auto" else dtype
    try:
        if (model.path / "config.json").is_file():
            return ModelGeometry.from_path(model.path, dtype=as_dtype)
        if model.load_format == "dummy" and model.path.name in SHAPES:  # made at `gpupool up`
            config = dev_model_hf_config(model.path.name)
            return ModelGeometry.from_hf_config(config, name=model.path.name, dtype=as_dtype)
    except KVCacheModelError:
        return None
    return None


def plan_engines(local: LocalEnginesConfig, model: ModelConfig, host: HostFacts) -> EnginePlan:
    """The dtype and KV size of the local engines on `host`, with the reasons to log."""
    args = local.vllm_args
    on_cpu = host.gpu_count == 0
    choice = choose_dtype(model.dtype, on_cpu=on_cpu, cpu_flags=host.cpu_flags)
    dtype, dtype_reason = choice.dtype, choice.reason
    if (given := arg_value(args, "--dtype")) is not None:
        dtype, dtype_reason = given, "engines.local.vllm_args sets --dtype"
    geometry = _geometry(model, dtype)
    block_size = int(
        arg_value(args, "--block-size")
        or (_CPU_BLOCK_SIZE_TOKENS if on_cpu else _GPU_BLOCK_SIZE_TOKENS)
    )
    kv_cache_dtype = arg_value(args, "--kv-cache-dtype") or "auto"
    max_len_arg = arg_value(args, "--max-model-len")
    max_len = int(max_len_arg) if max_len_arg else model.max_model_len_tokens
    if max_len is None and geometry is not None:
        max_len = geometry.max_context_tokens
    kv_bytes: int | None
    is_default = False
    space_gib = dict(local.env).get("VLLM_CPU_KVCACHE_SPACE") or os.environ.get(
        "VLLM_CPU_KVCACHE_SPACE"
    )
    if (given := arg_value(args, "--kv-cache-memory-bytes")) is not None:
        kv_bytes, source = int(given), "engines.local.vllm_args"
        kv_reason = f"{kv_bytes / _MIB:.0f} MiB per engine, as --kv-cache-memory-bytes sets"
    elif local.kv_cache_bytes is not None:
        kv_bytes, source = local.kv_cache_bytes, "engines.local.kv_cache_bytes"
        kv_reason = f"{kv_bytes / _MIB:.0f} MiB per engine, as {source} sets"
    elif on_cpu and space_gib:
        kv_bytes, source = int(space_gib) * _GIB, "VLLM_CPU_KVCACHE_SPACE"
        kv_reason = f"{kv_bytes / _MIB:.0f} MiB per engine, as {source} sets"
    elif on_cpu and arg_value(args, "--gpu-memory-utilization") is None:
        is_default = True
        max_seqs = max_num_seqs(args, default=_CPU_MAX_NUM_SEQS)
        useful = None
        weights = 0
        if geometry is not None:
            weights = geometry.weight_bytes
            if max_len is not None:
                useful = max_seqs * geometry.kv_bytes_for_tokens(max_len, kv_cache_dtype)
        kv_bytes, source = (
            default_cpu_kv_cache_bytes(
                available_memory_bytes=host.available_memory_bytes,
                engine_count=local.count,
                weight_bytes=weights,
                max_useful_bytes=useful,
            ),
            "engines.local.kv_cache_bytes",
        )
        kv_reason = (
            f"{kv_bytes / _MIB:.0f} MiB per engine: engines.local.kv_cache_bytes is unset, so"
            f" {CPU_KV_MEMORY_FRAC:.0%} of the {host.available_memory_bytes / _GIB:.1f} GiB"
            f" available, less weights and {CPU_ENGINE_BASE_BYTES / _GIB:.1f} GiB runtime per"
            f" engine, split across {local.count} engine(s) (at least"
            f" {CPU_KV_FLOOR_BYTES / _MIB:.0f} MiB, at most {max_seqs} full sequences)"
        )
    else:
        kv_bytes, source = None, "vLLM's default"
        kv_reason = "vLLM's default size (a fraction of each GPU's memory)"
        if on_cpu:
            kv_reason = "vLLM's default size (engines.local.vllm_args --gpu-memory-utilization)"
    capacity = None
    if geometry is not None and kv_bytes is not None:
        try:
            capacity = capacity_from_kv_cache_bytes(
                geometry,
                kv_bytes,
                block_size,
                kv_cache_dtype=kv_cache_dtype,
                tensor_parallel_size=1 if on_cpu else local.gpus_per_instance,
            )
        except KVCacheModelError:
            capacity = None
    return EnginePlan(
        on_cpu=on_cpu,
        dtype=dtype,
        dtype_reason=dtype_reason,
        kv_cache_bytes=kv_bytes,
        kv_reason=kv_reason,
        kv_source=source,
        kv_is_default=is_default,
        block_size_tokens=block_size,
        max_model_len_tokens=max_len,
        capacity=capacity,
    )


def engine_problems(config: Config, host: HostFacts) -> list[str]:
    """What would stop the local engines of `config` from starting on `host`; empty if none.
    Nothing for other launchers (their engines run elsewhere)."""
    if config.engines.launcher != "local":
        return []
    local = config.engines.local
    return plan_problems(local, plan_engines(local, config.model, host), host)


def plan_problems(local: LocalEnginesConfig, plan: EnginePlan, host: HostFacts) -> list[str]:
    """What would stop engines started by `plan` on `host`; empty if none."""
    problems: list[str] = []
    cap, max_len = plan.capacity, plan.max_model_len_tokens
    if cap is not None and max_len is not None and not cap.fits_context(max_len):
        need_blocks = cap.blocks_for_sequence(max_len) + NULL_BLOCKS
        need_bytes = need_blocks * cap.block_size_tokens * cap.kv_bytes_per_token_per_gpu
        problems.append(
            f"{plan.kv_source}: {cap.kv_cache_bytes_per_gpu} B of KV cache per engine"
            f"{' (the CPU default for this machine)' if plan.kv_is_default else ''} holds"
            f" {cap.num_blocks} block(s) of {cap.block_size_tokens} tokens at"
            f" {cap.kv_bytes_per_token_per_gpu} B/token ({cap.geometry.dtype}), less than one"
            f" {max_len}-token sequence ({need_blocks} blocks with vLLM's null block,"
            f" {need_bytes} B): the engine would"
            f" refuse to start; give at least {need_bytes} or a smaller"
            " model.max_model_len_tokens"
        )
    if local.cpu_affinity is not None and plan.on_cpu:
        missing = sorted({c for cpus in local.cpu_affinity for c in cpus} - host.cpu_ids)
        if missing:
            problems.append(
                f"engines.local.cpu_affinity: CPU(s) {', '.join(map(str, missing))} are not"
                f" available here (this process may use {len(host.cpu_ids)} CPUs:"
                f" {_ranges(sorted(host.cpu_ids))})"
            )
    need_gpus = local.count * local.gpus_per_instance
    if not plan.on_cpu and host.gpu_count < need_gpus:
        problems.append(
            f"engines.local: {local.count} engines x {local.gpus_per_instance} GPUs need"
            f" {need_gpus} GPUs; this machine has {host.gpu_count}"
        )
    return problems


def _ranges(ids: list[int]) -> str:
    """`0-3, 8` for the sorted ids [0, 1, 2, 3, 8]."""
    spans: list[list[int]] = []
    for i in ids:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)
