"""Shared pieces of the soak benchmarks: the router process's readings (RSS, open fds, asyncio
tasks from its `gpupool_asyncio_tasks` gauge), a least-squares slope, the fd limit, a plot."""

from __future__ import annotations

import contextlib
import resource
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import psutil

from benchmarks.router_overhead.procs import Proc

__all__ = [
    "Sample",
    "fit_per_hour",
    "plot_samples",
    "raise_nofile",
    "read_gauge",
    "sample_process",
    "stop_gracefully",
]


@dataclass
class Sample:
    """One reading of the router process at `t_s` seconds since the benchmark started."""

    t_s: float
    phase: str
    rss_mib: float
    fds: int
    asyncio_tasks: float | None
    sent: int = 0
    failed: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def raise_nofile(want: int) -> tuple[int, int]:
    """Raise this process's soft open-file limit to `want` (capped by the hard limit); children
    started afterwards inherit it. Returns the (soft, hard) limits now in effect."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def sample_process(pid: int) -> tuple[float, int]:
    """(RSS in MiB, open file descriptors) of one process (not its children)."""
    p = psutil.Process(pid)
    return p.memory_info().rss / 2**20, p.num_fds()


async def read_gauge(
    session: aiohttp.ClientSession, url: str, name: str, headers: dict[str, str] | None = None
) -> float | None:
    """The value of a gauge on a Prometheus `/metrics` page (its first series), or None."""
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
        async with session.get(url, headers=headers or {}) as resp:
            if resp.status != 200:
                return None
            for line in (await resp.text()).splitlines():
                if line.startswith((name + " ", name + "{")):  # the first series
                    return float(line.rsplit(" ", 1)[1])
    return None


def fit_per_hour(t_s: Sequence[float], values: Sequence[float]) -> float:
    """Least-squares slope of `values` against time, per hour. NaN with under 3 points."""
    if len(t_s) < 3:
        return float("nan")
    slope, _ = np.polyfit(np.asarray(t_s, dtype=float) / 3600.0, np.asarray(values, float), 1)
    return float(slope)


def stop_gracefully(proc: Proc, timeout_s: float = 90.0) -> int | None:
    """SIGTERM the process alone (gpupool stops its own engines), wait, then kill its tree."""
    with contextlib.suppress(ProcessLookupError):
        proc.popen.send_signal(signal.SIGTERM)
    code: int | None = None
    with contextlib.suppress(subprocess.TimeoutExpired):
        code = proc.popen.wait(timeout=timeout_s)
    proc.stop(timeout_s=10)
    return code


def plot_samples(samples: Sequence[Sample], out: Path, title: str) -> None:
    """RSS, fds and asyncio tasks against time, one panel each, phases shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t_min = [s.t_s / 60 for s in samples]
    series: list[tuple[str, list[float | None]]] = [
        ("router RSS (MiB)", [s.rss_mib for s in samples]),
        ("router open fds", [float(s.fds) for s in samples]),
        ("asyncio tasks", [s.asyncio_tasks for s in samples]),
    ]
    fig, axes = plt.subplots(len(series), 1, figsize=(9, 8), sharex=True)
    for ax, (label, ys) in zip(axes, series, strict=True):
        pts = [(x, y) for x, y in zip(t_min, ys, strict=True) if y is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", linewidth=1)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        start = 0.0
        for i, s in enumerate(samples):
            last = i == len(samples) - 1
            if last or samples[i + 1].phase != s.phase:
                if s.phase != "soak":
                    ax.axvspan(start, s.t_s / 60, color="grey", alpha=0.12)
                if not last:
                    start = samples[i + 1].t_s / 60
    axes[-1].set_xlabel("minutes since start (grey: not the measured phase)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
