"""Processes under test: start one pinned to a CPU set at a given niceness, wait until it answers
HTTP, read the CPU-seconds of its whole process tree, and stop it (the tree it started, by pid).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

__all__ = ["Proc", "StartFailed", "pin_self", "start_proc", "wait_ready"]


class StartFailed(Exception):
    """A process exited or did not answer before its deadline; the message says why."""


def _schedstat_ns(pid: int) -> int | None:
    """On-CPU nanoseconds of every live thread of `pid`, or None where schedstat is missing."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total


def _preexec(cpus: frozenset[int] | None, nice: int) -> None:
    os.setpriority(os.PRIO_PROCESS, 0, nice)
    if cpus:
        os.sched_setaffinity(0, cpus)


def pin_self(cpus: frozenset[int] | None, nice: int) -> str:
    """Pin this process (the load generator) and raise its priority; says what it did."""
    done = []
    if cpus:
        os.sched_setaffinity(0, cpus)
        done.append(f"CPU {sorted(cpus)}")
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        done.append(f"nice {nice}")
    except PermissionError:
        done.append(f"nice {nice} refused (not root); left at {os.getpriority(os.PRIO_PROCESS, 0)}")
    return ", ".join(done)


@dataclass
class Proc:
    """One started process and the psutil handles of its tree (kept, so CPU times add up)."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    _tree: dict[int, psutil.Process] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def cpu_s(self) -> float:
        """CPU-seconds of the process and all its live descendants: the sum over their threads
        of the scheduler's on-CPU time (/proc/PID/task/TID/schedstat, nanoseconds), or psutil's
        user + system (10 ms ticks) where schedstat is missing. Threads or children that exited
        between two readings lose their time (these servers keep their threads)."""
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        total = 0.0
        for p in procs:
            known = self._tree.setdefault(p.pid, p)
            ns = _schedstat_ns(p.pid)
            if ns is not None:
                total += ns / 1e9
                continue
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                t = known.cpu_times()
                total += t.user + t.system
        return total

    def cpu_ticks_s(self) -> float:
        """psutil's user + system of the tree (coarse, counts exited threads): a cross-check."""
        total = 0.0
        try:
            root = psutil.Process(self.pid)
            for p in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                    t = p.cpu_times()
                    total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
        return total

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def signal_tree(self, sig: int) -> None:
        """Send `sig` to the process and its descendants (SIGSTOP/SIGCONT to pause a peer while
        another target is measured on the same CPU)."""
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(sig)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the tree this process started, then SIGKILL what is left."""
        try:
            root = psutil.Process(self.pid)
            procs = [*root.children(recursive=True), root]
        except psutil.NoSuchProcess:
            procs = []
        for p in reversed(procs):
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGCONT)  # a paused process cannot act on SIGTERM
                p.terminate()
        _, alive = psutil.wait_procs(procs, timeout=timeout_s)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=2)


def start_proc(
    name: str,
    argv: Sequence[str],
    *,
    log_dir: Path,
    cpus: frozenset[int] | None,
    nice: int = 0,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> Proc:
    log_path = log_dir / f"{name}.log"
    log = log_path.open("wb")
    full_env = {**os.environ, **(env or {})}
    popen = subprocess.Popen(
        list(argv),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=full_env,
        cwd=cwd,
        start_new_session=True,
        preexec_fn=lambda: _preexec(cpus, nice),  # no threads in this process yet
    )
    log.close()
    return Proc(name, popen, log_path)


async def wait_ready(
    proc: Proc, url: str, *, timeout_s: float, probe: bytes | None = None
) -> float:
    """Poll `url` until it answers 200 (GET, or POST `probe` as JSON). Returns seconds waited;
    raises StartFailed with the log's tail when the process exits or the deadline passes."""
    started = time.monotonic()
    deadline = started + timeout_s
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while True:
            if not proc.alive():
                raise StartFailed(f"exited with code {proc.popen.returncode}: {proc.log_tail()}")
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                if probe is None:
                    resp = await session.get(url)
                else:
                    resp = await session.post(
                        url, data=probe, headers={"content-type": "application/json"}
                    )
                async with resp:
                    await resp.read()
                    if resp.status == 200:
                        return time.monotonic() - started
            if time.monotonic() > deadline:
                raise StartFailed(f"not ready after {timeout_s:.0f} s: {proc.log_tail()}")
            await asyncio.sleep(0.25)
