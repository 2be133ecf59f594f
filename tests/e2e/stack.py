"""What the e2e tests share: where the `gpupool` console script is, waiting for a stack
started with `gpupool up` (or a router, or an engine) to answer `/ready` (failing with its log
when it exits first), and the installed vLLM's flag list for an engine run_dir."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pools.launchers.engine_args import installed_vllm_version, supported_vllm_flags

REPO = Path(__file__).resolve().parents[2]
GPUPOOL = str(Path(sys.executable).parent / "gpupool")
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


def wait_ready(
    url: str,
    proc: subprocess.Popen[bytes] | None,
    log: Path | None,
    timeout_s: float,
    *,
    path: str = "/ready",
    interval_s: float = 0.5,
) -> None:
    """Poll `url + path` every `interval_s` until 200; raise with the log if `proc` (when
    given) exits first, or when `timeout_s` passes."""

    def tail() -> str:
        return "" if log is None else ":\n" + log.read_text(errors="replace")

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{proc.args!r} exited {proc.returncode}{tail()}")
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    raise AssertionError(f"{url}{path} not answering 200 after {timeout_s:g} s{tail()}")
