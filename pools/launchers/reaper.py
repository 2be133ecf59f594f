"""Runs a command and takes its whole process tree down with it: the Ray launcher starts each
engine through this (`python reaper.py GRACE_S -- vllm ...`), so neither the engine's
OpenAI server nor its `VLLM::EngineCore` child outlives the engine actor that started it.

The reaper starts the command in a process group of its own and makes itself a child
subreaper (Linux), so anything of the engine's that loses its parent (an `EngineCore` whose
server died) becomes the reaper's child instead of init's. It takes the tree down

- when the command exits on its own: the rest of its group and every remaining descendant get
  SIGKILL, and the reaper exits with the command's code (the actor then ends, Ray restarts it);
- on SIGTERM or SIGINT (the actor's `stop`), or when its own parent (the actor's process) is
  gone, checked every `PARENT_POLL_S` (`ray.kill` ends the actor with SIGKILL, which no handler
  in the actor sees): SIGTERM to the command's group, up to `GRACE_S` for it to exit, then
  SIGKILL to the group and to every remaining descendant.

Standard library only, run by path, so starting it imports nothing of gpupool.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["PARENT_POLL_S", "REAPER_PATH", "descendants", "main", "reaper_argv"]

REAPER_PATH = Path(__file__).resolve()
PARENT_POLL_S = 0.5
_PR_SET_CHILD_SUBREAPER = 36


def reaper_argv(argv: Sequence[str], grace_s: float, python: str = sys.executable) -> list[str]:
    """The command line that runs `argv` under the reaper."""
    return [python, str(REAPER_PATH), f"{grace_s:g}", "--", *argv]


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (from /proc), children before their own children."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        kids = children.get(todo.pop(0), [])
        out.extend(kids)
        todo.extend(kids)
    return out


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _kill_tree(pgid: int) -> None:
    """SIGKILL to the command's group and to every descendant of this process, then reap."""
    _signal_group(pgid, signal.SIGKILL)
    for pid in descendants(os.getpid()):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, 0)[0] > 0:
            pass


def main(args: list[str]) -> int:
    if len(args) < 3 or args[1] != "--":
        print("usage: reaper.py GRACE_S -- COMMAND...", file=sys.stderr)
        return 2
    grace_s, argv = float(args[0]), args[2:]
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)
    stop_requested: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stop_requested.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    proc = subprocess.Popen(argv, start_new_session=True)
    code: int | None = None
    while code is None and not stop_requested and os.getppid() == parent:
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = proc.wait(timeout=PARENT_POLL_S)
    if code is None:  # asked to stop, or the actor is gone: the command gets its grace
        _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while code is None and time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = proc.wait(timeout=min(PARENT_POLL_S, max(0.0, deadline - time.monotonic())))
    _kill_tree(proc.pid)
    return proc.returncode if proc.returncode is not None else -signal.SIGKILL


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
