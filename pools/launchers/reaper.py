"""Runs a command and takes its whole process tree down with it: the Ray launcher starts each
engine through this, so neither the engine's OpenAI server nor its `VLLM::EngineCore` child
outlives the engine actor that started it.

The reaper starts the command in a process group of its own and makes itself a child
subreaper (Linux), so anything of the engine's that loses its parent (an `EngineCore` whose
server died) becomes the reaper's child instead of init's. It takes the tree down

- when the command exits on its own: the rest of its group and every remaining descendant get
  SIGKILL, and the reaper exits with the command's code;
- on SIGTERM or SIGINT, or when its owner is gone (checked every `OWNER_POLL_S`): SIGTERM to
  the command's group, up to `GRACE_S` for it to exit, then SIGKILL to the group and to every
  remaining descendant.

`ReapedProcess` starts it detached: the reaper is not a child of the owner (it forks and
leaves a session of its own), because Ray ends an actor with SIGKILL *and* SIGKILLs the
actor's child processes (`kill_child_processes_on_worker_exit`), which would take a reaper
that is its child down with it and leave the engine behind (an `EngineCore` with parent 1).
The owner holds one end of a pipe; the reaper sees the owner is gone when that pipe closes,
however it died. A second pipe tells the owner the reaper's pid and, at its end, the
command's exit code. Run directly (`python reaper.py GRACE_S -- COMMAND...`) its owner is its
parent process.

Standard library only, run by path, so starting it imports nothing of gpupool.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

__all__ = ["OWNER_POLL_S", "REAPER_PATH", "ReapedProcess", "descendants", "main"]

REAPER_PATH = Path(__file__).resolve()
OWNER_POLL_S = 0.5
_PR_SET_CHILD_SUBREAPER = 36
_KILLED = -signal.SIGKILL  # the exit code reported when the command's own was lost


class ReapedProcess:
    """`argv` under a detached reaper (see the module's docstring), started now."""

    def __init__(
        self,
        argv: Sequence[str],
        grace_s: float,
        *,
        env: Mapping[str, str],
        stdout: IO[bytes] | int | None = None,
        python: str = sys.executable,
    ) -> None:
        life_r, self._life_w = os.pipe()  # the reaper's end closes only when we are gone
        done_r, done_w = os.pipe()
        try:
            starter = subprocess.Popen(
                [
                    *(python, str(REAPER_PATH), f"{grace_s:g}"),
                    *("--life-fd", str(life_r), "--done-fd", str(done_w), "--"),
                    *argv,
                ],
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=subprocess.STDOUT if stdout is not None else None,
                pass_fds=(life_r, done_w),
                start_new_session=True,
            )
        finally:
            os.close(life_r)
            os.close(done_w)
        self._done = os.fdopen(done_r, "rb", buffering=0)  # select() must see every line
        starter.wait()  # it forks the reaper and exits at once
        first = self._done.readline()
        if not first.strip():
            raise OSError(f"the reaper did not start (its starter exited {starter.returncode})")
        self.pid = int(first)
        self.returncode: int | None = None

    def wait(self, timeout_s: float | None = None) -> int | None:
        """The command's exit code once the reaper is done (its tree is gone); None if it is
        not done within `timeout_s`."""
        if self.returncode is None:
            ready, _, _ = select.select([self._done], [], [], timeout_s)
            if not ready:
                return None
            line = self._done.readline().strip()
            if self.returncode is None:  # another thread may have read it meanwhile
                self.returncode = int(line) if line else _KILLED
        return self.returncode

    def terminate(self) -> None:
        """Ask the reaper to stop the command (its grace, then SIGKILL to what is left)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the reaper and its whole tree, at once."""
        for pid in [*descendants(self.pid), self.pid]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


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


def _owner_gone(life_fd: int | None, parent: int, timeout_s: float) -> bool:
    """Waits up to `timeout_s`; whether the owner is gone (its pipe closed, or without one,
    this process's parent changed)."""
    if life_fd is None:
        time.sleep(timeout_s)
        return os.getppid() != parent
    ready, _, _ = select.select([life_fd], [], [], timeout_s)
    return bool(ready) and os.read(life_fd, 1) == b""


def _run(grace_s: float, argv: list[str], life_fd: int | None, parent: int) -> int:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)
    stop_requested: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stop_requested.append(signum))
    signal.signal(signal.SIGINT, lambda signum, _frame: stop_requested.append(signum))
    proc = subprocess.Popen(argv, start_new_session=True)
    code = proc.poll()
    while code is None and not stop_requested:
        if _owner_gone(life_fd, parent, OWNER_POLL_S):
            break
        code = proc.poll()
    if code is None:  # asked to stop, or the owner is gone: the command gets its grace
        _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while code is None and time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = proc.wait(timeout=min(OWNER_POLL_S, max(0.0, deadline - time.monotonic())))
    _kill_tree(proc.pid)
    return proc.returncode if proc.returncode is not None else _KILLED


def main(args: list[str]) -> int:
    usage = "usage: reaper.py GRACE_S [--life-fd N --done-fd N] -- COMMAND..."
    if "--" not in args or len(args) < 3:
        print(usage, file=sys.stderr)
        return 2
    split = args.index("--")
    options, argv = args[1:split], args[split + 1 :]
    fds = dict(zip(options[::2], (int(v) for v in options[1::2]), strict=True))
    grace_s, life_fd, done_fd = float(args[0]), fds.get("--life-fd"), fds.get("--done-fd")
    parent = os.getppid()
    if done_fd is not None:  # detached: leave the owner's children and session
        if os.fork() > 0:
            os._exit(0)
        os.setsid()
        os.write(done_fd, f"{os.getpid()}\n".encode())
    code = _run(grace_s, argv, life_fd, parent)
    if done_fd is not None:
        os.write(done_fd, f"{code}\n".encode())
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
