"""Real CPU vLLM engines for a benchmark, and a router in front of them.

`cpu_engines`: the tiny dev model under gpupool's own `LocalLauncher` (64 MiB KV cache each,
`max_model_len` 4096), with a given `--max-num-seqs`. `agent_pool_router`: the config of a
gateway over such engines (static URLs) whose one pool, `agent`, holds them all."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pools.config import Config, parse_config
from pools.launchers import LocalLauncher
from pools.launchers.engine_args import EngineTraces

__all__ = ["agent_pool_router", "cpu_engines"]


def cpu_engines(
    model_dir: Path,
    *,
    count: int,
    port: int,
    key_env: str,
    run_dir: Path,
    max_num_seqs: int,
    progress: Callable[[str], None],
    max_model_len_tokens: int = 4096,
    environ: Mapping[str, str] | None = None,
    cpu_affinity: list[list[int]] | None = None,
    traces: EngineTraces | None = None,
) -> LocalLauncher:
    """A launcher for `count` engines on `port`, `port + 1`, ... that require the key in
    `$key_env` (`environ`: their parent environment, default this process's; `cpu_affinity`:
    per engine the CPUs it is pinned to, as `engines.local.cpu_affinity`; `traces`: where they
    export vLLM's own spans); `start()` it."""
    config = parse_config(
        {
            "model": {
                "name": "tiny",
                "path": str(model_dir),
                "max_model_len_tokens": max_model_len_tokens,
            },
            "engines": {
                "launcher": "local",
                "local": {
                    "count": count,
                    "base_port": port,
                    "kv_cache_bytes": 64 * 1024 * 1024,
                    "api_key_env": key_env,
                    "run_dir": str(run_dir),
                    "vllm_args": ["--max-num-seqs", str(max_num_seqs)],
                    "cpu_affinity": cpu_affinity,
                },
            },
            "pools": {"normal": {"classes": ["normal", "agent"], "share": {"initial_frac": 1}}},
        }
    )
    return LocalLauncher(
        config.engines.local,
        config.model,
        progress=progress,
        gpu_count=0,
        environ=environ,
        traces=traces,
    )


def agent_pool_router(
    model_dir: Path,
    urls: list[str],
    *,
    key_env: str,
    max_num_seqs: int,
    agent_pool: Mapping[str, Any],
    agent_class: Mapping[str, Any],
    router: Mapping[str, Any],
    max_model_len_tokens: int = 4096,
) -> Config:
    """A router over the engines at `urls` (static, key in `$key_env`): one pool, `agent`, with
    all of them and classes agent and normal (the harness's prompt-sizing requests carry no
    run id: class normal), its other fields from `agent_pool`; the agent class's fields from
    `agent_class`; `router` as the config's `router` section."""
    return parse_config(
        {
            "model": {
                "name": "tiny",
                "path": str(model_dir),
                "max_model_len_tokens": max_model_len_tokens,
            },
            "engines": {
                "launcher": "static",
                "static": {"urls": urls, "api_key_env": key_env},
                # not launched here: tells the router the engines' --max-num-seqs
                "local": {"vllm_args": ["--max-num-seqs", str(max_num_seqs)]},
            },
            "pools": {
                "agent": {
                    "classes": ["agent", "normal"],
                    "share": {"initial_frac": 1.0},
                    **agent_pool,
                },
            },
            "classes": {
                "agent": dict(agent_class),
                "normal": {"timeout_s": 120, "expected_output_tokens": 32},
            },
            "router": dict(router),
        }
    )
