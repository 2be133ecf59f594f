"""One real CPU vLLM engine for a benchmark: the tiny dev model under gpupool's own
`LocalLauncher` (64 MiB KV cache, `max_model_len` 4096), with a given `--max-num-seqs`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pools.config import parse_config
from pools.launchers import LocalLauncher

__all__ = ["one_cpu_engine"]


def one_cpu_engine(
    model_dir: Path,
    *,
    port: int,
    key_env: str,
    run_dir: Path,
    max_num_seqs: int,
    progress: Callable[[str], None],
    max_model_len_tokens: int = 4096,
) -> LocalLauncher:
    """A launcher for one engine on `port` that requires the key in `$key_env`; `start()` it."""
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
                    "count": 1,
                    "base_port": port,
                    "kv_cache_bytes": 64 * 1024 * 1024,
                    "api_key_env": key_env,
                    "run_dir": str(run_dir),
                    "vllm_args": ["--max-num-seqs", str(max_num_seqs)],
                },
            },
            "pools": {"normal": {"classes": ["normal", "agent"], "share": {"initial_frac": 1}}},
        }
    )
    return LocalLauncher(config.engines.local, config.model, progress=progress, gpu_count=0)
