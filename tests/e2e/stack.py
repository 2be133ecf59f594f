"""What the e2e tests share: where the `gpupool` console script is, waiting for a stack
started with `gpupool up` (or a router, or an engine) to answer `/ready` (failing with its log
when it exits first; `pools.testing.router_process.wait_ready`), and the installed vLLM's flag
list for an engine run_dir."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path

from pools.launchers.engine_args import installed_vllm_version, supported_vllm_flags
from pools.testing.router_process import GPUPOOL, wait_ready

__all__ = ["GPUPOOL", "REPO", "seed_vllm_flags", "vllm_flags_file", "wait_ready"]

REPO = Path(__file__).resolve().parents[2]
FLAGS_CACHE_DIR = REPO / ".gpupool" / "test-cache"


@functools.cache
def vllm_flags_file() -> Path | None:
    """The installed vLLM's flags as `supported_vllm_flags` caches them in a run_dir, read from
    `vllm ... --help` once (10-20 s) and kept in `.gpupool/test-cache/` (per vLLM version, as
    the launcher keeps it); None when there is no vLLM or its `--help` said nothing."""
    version = installed_vllm_version()
    if version is None:
        return None
    cache = FLAGS_CACHE_DIR / f"vllm-{version}-flags.txt"
    if not cache.is_file():
        with tempfile.TemporaryDirectory() as scratch:
            supported_vllm_flags(Path(scratch))
            written = Path(scratch) / cache.name
            if not written.is_file():
                return None
            FLAGS_CACHE_DIR.mkdir(parents=True, exist_ok=True)
            partial = cache.with_name(f"{cache.name}.{os.getpid()}")
            shutil.copyfile(written, partial)
            partial.replace(cache)  # another session may be writing it too
    return cache


def seed_vllm_flags(run_dir: Path) -> None:
    """Put the flag list in an engine `run_dir` before gpupool starts engines there, so each
    test that starts its own engines does not read vLLM's `--help` again (the suite reads it
    once per vLLM version, through `supported_vllm_flags` itself)."""
    source = vllm_flags_file()
    if source is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, run_dir / source.name)
