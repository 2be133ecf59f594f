"""`pools/launchers/reaper.py`: the engine's whole tree goes when the engine exits, when the
reaper is told to stop, and when its owner (a Ray actor's process) is killed the way Ray
kills one: SIGKILL to the actor's process and to each of its children."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pools.launchers.reaper import OWNER_POLL_S, REAPER_PATH, ReapedProcess, descendants

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")

# The "engine": writes its pid and that of a child that escaped into a session of its own (as
# an orphaned EngineCore would be), then lives until told otherwise.
ENGINE = """
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)
if sys.argv[2] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(float(sys.argv[3]))
sys.exit(7)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _wait_until(cond: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.02)


def _engine_argv(pids: Path, mode: str = "plain", lives_s: float = 600) -> list[str]:
    return [sys.executable, "-c", ENGINE, str(pids), mode, str(lives_s)]


def _reaper_argv(argv: list[str], grace_s: float) -> list[str]:
    return [sys.executable, str(REAPER_PATH), str(grace_s), "--", *argv]


def _pids(path: Path) -> list[int]:
    _wait_until(path.exists, 30)
    return [int(p) for p in path.read_text().split()]


def test_the_engine_exiting_takes_its_escaped_child_down_and_passes_its_code_on(
    tmp_path: Path,
) -> None:
    reaper = subprocess.Popen(_reaper_argv(_engine_argv(tmp_path / "pids", lives_s=1), 5))
    engine, escaped = _pids(tmp_path / "pids")
    assert reaper.wait(timeout=30) == 7
    assert not _alive(engine) and not _alive(escaped)


def test_sigterm_gives_the_engine_its_grace_then_kills_what_ignores_it(tmp_path: Path) -> None:
    grace_s = 1.0
    reaper = subprocess.Popen(
        _reaper_argv(_engine_argv(tmp_path / "pids", "ignore-term"), grace_s),
        start_new_session=True,
    )
    engine, escaped = _pids(tmp_path / "pids")
    assert set(descendants(reaper.pid)) >= {engine}
    started = time.monotonic()
    reaper.send_signal(signal.SIGTERM)
    reaper.wait(timeout=30)
    took_s = time.monotonic() - started
    assert grace_s <= took_s < grace_s + 10 * OWNER_POLL_S, took_s
    assert not _alive(engine) and not _alive(escaped)


def test_the_reaper_takes_the_tree_down_when_its_parent_is_killed(tmp_path: Path) -> None:
    argv = _reaper_argv(_engine_argv(tmp_path / "pids"), 5)
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, time; subprocess.Popen({argv!r}); time.sleep(600)",
        ],
        start_new_session=True,
    )
    engine, escaped = _pids(tmp_path / "pids")
    (reaper,) = (p for p in descendants(parent.pid) if p not in (engine, escaped))
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    # the reaper notices within a poll, the engine exits on SIGTERM, the escaped child is killed
    _wait_until(lambda: not any(_alive(p) for p in (reaper, engine, escaped)), 10)


# An owner as a Ray actor is: it starts the engine with `ReapedProcess`, says the reaper's pid.
OWNER = """
import sys, time
from pools.launchers.reaper import ReapedProcess
reaped = ReapedProcess(sys.argv[2:], float(sys.argv[1]), env={})
print(reaped.pid, flush=True)
time.sleep(600)
"""


def test_a_detached_reaper_survives_its_owner_and_its_owners_children_being_killed(
    tmp_path: Path,
) -> None:
    """What `ray.kill` does to an actor: SIGKILL to its process and to every child of it (Ray's
    kill_child_processes_on_worker_exit). A reaper that is its child dies too, and its engine
    stays (the EngineCore with parent 1 of issue 23): the detached one is no one's child."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, "5", *_engine_argv(tmp_path / "pids")],
        stdout=subprocess.PIPE,
        start_new_session=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert owner.stdout is not None
    reaper = int(owner.stdout.readline())
    engine, escaped = _pids(tmp_path / "pids")
    assert reaper not in descendants(owner.pid)
    for pid in [owner.pid, *descendants(owner.pid)]:
        os.kill(pid, signal.SIGKILL)
    owner.wait()
    _wait_until(lambda: not any(_alive(p) for p in (reaper, engine, escaped)), 10)


def test_a_detached_reaper_reports_the_exit_code_and_stops_on_terminate(tmp_path: Path) -> None:
    exits = ReapedProcess(_engine_argv(tmp_path / "a", lives_s=0.5), 5, env=dict(os.environ))
    assert exits.wait(30) == 7
    assert not any(_alive(p) for p in _pids(tmp_path / "a"))
    stays = ReapedProcess(_engine_argv(tmp_path / "b", "ignore-term"), 0.5, env=dict(os.environ))
    engine, escaped = _pids(tmp_path / "b")
    assert stays.wait(0.2) is None  # still running
    stays.terminate()
    assert stays.wait(10) is not None  # written once the tree is gone, just before it exits
    assert not _alive(engine) and not _alive(escaped)
    _wait_until(lambda: not _alive(stays.pid), 10)
