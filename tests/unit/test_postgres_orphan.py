"""A pytest killed with SIGKILL (no teardown runs) leaves no PostgreSQL server behind
(tests/postgres.py): the server and its backends stop within seconds, and the data folder it
leaves is removed by the next start; under xdist, a SIGKILLed controller's worker stops its
server, removes its folder and exits within seconds too; a server restarted from a thread that
ends lives on."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from tests.conftest import SESSION_ENV, session_processes
from tests.postgres import (
    PASSWORD,
    WATCH_EXIT_GRACE_S,
    _remove_orphaned_folders,
    pg_binaries,
    start_postgres,
)

REPO = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 10.0
# a worker notices its controller gone within WATCH_INTERVAL_S (0.5 s) and stops its server in
# ~0.2 s; without the watch it ran on for ~16 s (until execnet noticed the lost channel). The
# worker itself ends within WATCH_EXIT_GRACE_S (once, in CI under load, it took over 5 s, s49)
XDIST_GONE_WITHIN_S = 5.0

HOLDER = """
import os, time
from pathlib import Path

import pytest

@pytest.fixture
def torn_down():  # stands for what a test starts beside the server (a router, an engine)
    yield
    Path(os.environ["PG_SEEN"] + ".teardown").write_text("ran")

def test_hold(postgres_server, torn_down):
    assert postgres_server.process is not None  # and it answers: tests/postgres.py waited
    Path(os.environ["PG_SEEN"]).write_text(
        f"{postgres_server.process.pid} {postgres_server.socket_dir}"
    )
    time.sleep(300)
"""

pytestmark = pytest.mark.skipif(pg_binaries() is None, reason="no PostgreSQL binaries")


def _wait_for(path: Path, child: subprocess.Popen[bytes], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists() or not path.read_text():
        assert child.poll() is None, child.communicate()[0].decode(errors="replace")[-3000:]
        assert time.monotonic() < deadline, "the server never started"
        time.sleep(0.1)
    return path.read_text()


@dataclass
class _Holder:
    """A pytest (`child`) whose test holds `postgres_server` (`server`, its postmaster's pid,
    in `folder`, under `temp`); everything it starts carries `session` in its environment;
    `torn_down` exists once the test's other fixture was torn down."""

    child: subprocess.Popen[bytes]
    session: str
    temp: Path
    server: int
    folder: Path
    torn_down: Path


@contextlib.contextmanager
def _holding_pytest(tmp_path: Path, *pytest_args: str) -> Iterator[_Holder]:
    """A pytest started with `pytest_args` and a test that holds a server, once the server
    answers; killed at the end if still running, and its temporary folder removed."""
    (tmp_path / "test_hold.py").write_text(HOLDER)
    seen = tmp_path / "seen"
    session = uuid.uuid4().hex  # what the child starts carries this id, and only that does
    # the child's data folder in a temporary folder of its own, so that no other test's start
    # sweeps it first; short (the server's socket is in it) and open to `nobody`
    temp = Path(tempfile.mkdtemp(prefix="pg-orphan-"))
    temp.chmod(0o755)
    env = {
        **os.environ,
        "TMPDIR": str(temp),
        "PYTHONPATH": str(REPO),
        "PG_SEEN": str(seen),
        SESSION_ENV: session,
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    env.pop("PYTEST_XDIST_WORKER", None)
    args = ["-q", "-p", "tests.postgres", "-p", "no:cacheprovider", "-c", os.devnull, *pytest_args]
    child = subprocess.Popen(
        [sys.executable, "-m", "pytest", *args, "--rootdir", str(tmp_path), "test_hold.py"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        pid_text, folder_text = _wait_for(seen, child, timeout_s=60).split(" ", 1)
        torn_down = seen.with_name(seen.name + ".teardown")
        yield _Holder(child, session, temp, int(pid_text), Path(folder_text), torn_down)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        shutil.rmtree(temp, ignore_errors=True)


def _left_after(
    session: str, timeout_s: float, also: tuple[int, ...] = (), but: tuple[int, ...] = ()
) -> dict[int, str]:
    """The processes carrying `session`, and those of `also` (pids), but not those of `but`,
    still alive after `timeout_s` (killed, not to outlive this test either)."""
    deadline = time.monotonic() + timeout_s

    def alive() -> dict[int, str]:
        return {pid: cmd for pid, cmd in _alive(session, also).items() if pid not in but}

    while (left := alive()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


def test_a_sigkilled_pytest_leaves_no_postgres_running(tmp_path: Path) -> None:
    with _holding_pytest(tmp_path) as held:
        running = session_processes(held.session)
        assert held.server in running and "postgres" in running[held.server], running
        assert len(running) >= 2, running  # the postmaster and its background processes
        held.child.send_signal(signal.SIGKILL)
        held.child.wait(timeout=10)
        left = _left_after(held.session, GONE_WITHIN_S)
        assert not left, f"outlived the killed pytest: {left}"
        # no teardown ran: the folder is there until a start sweeps it
        assert not held.torn_down.exists()
        assert held.folder.parent == held.temp and held.folder.is_dir()
        _remove_orphaned_folders(held.temp)
        assert not held.folder.exists()
        held.temp.rmdir()  # nothing else was left there


def test_a_sigkilled_xdist_controller_leaves_no_worker_or_postgres_running(
    tmp_path: Path,
) -> None:
    """`pytest -n 1`: the server is the worker's child; `kill -9` of the controller. The
    worker's watch (tests/postgres.py) stops the server, removes its folder and interrupts the
    test, whose other fixture is torn down; the worker ends, all within XDIST_GONE_WITHIN_S."""
    with _holding_pytest(tmp_path, "-p", "xdist.plugin", "-n", "1") as held:
        # the worker is not found by its environment: xdist's process title overwrites it
        worker = _parent(held.server)
        assert worker != held.child.pid and _parent(worker) == held.child.pid
        running = _alive(held.session, (worker,))
        assert {held.child.pid, worker, held.server} <= running.keys(), running
        held.child.send_signal(signal.SIGKILL)
        held.child.wait(timeout=10)
        killed_at = time.monotonic()
        # the server and its backends (all but the worker carry the session in their
        # environment): stopped by the watch at once
        left = _left_after(held.session, XDIST_GONE_WITHIN_S, but=(worker,))
        assert not left, f"outlived the killed controller by {XDIST_GONE_WITHIN_S:g} s: {left}"
        # the watch removes the folder once it has reaped the server, which this test may see
        # gone first (a zombie carries no environment): polled, not asserted at once (the
        # assertion lost that race in CI under the full suite's load, s49)
        assert _removed(held.folder, killed_at + XDIST_GONE_WITHIN_S), "the watch left the folder"
        # the worker: its interrupted test's teardowns run and it ends, usually within ~0.5 s;
        # in two CI runs under the full suite's load (s49) it was still there after 5 s (why is
        # not known: the interrupt lost, or pytest's end slow); the watch's exit ends it after
        # WATCH_EXIT_GRACE_S at the latest, teardowns run or not
        left = _left_after(held.session, WATCH_EXIT_GRACE_S + XDIST_GONE_WITHIN_S, also=(worker,))
        took_s = time.monotonic() - killed_at
        assert not left, f"the worker outlived its watch's exit grace: {left}"
        print(f"server gone, worker gone {took_s:.2f} s after the controller's kill -9")
        if took_s < WATCH_EXIT_GRACE_S:  # ended by the interrupt, not by the watch's exit
            assert held.torn_down.read_text() == "ran"


def _removed(folder: Path, deadline: float) -> bool:
    """Whether `folder` is gone by the monotonic `deadline`."""
    while folder.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not folder.exists()


def _alive(session: str, pids: tuple[int, ...]) -> dict[int, str]:
    alive = session_processes(session)
    for pid in pids:
        with contextlib.suppress(OSError):  # gone
            if _stat(pid)[0] != "Z":
                alive[pid] = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:200]
    return alive


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command: state, parent, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _parent(pid: int) -> int:
    return int(_stat(pid)[1])


def test_a_server_restarted_from_a_thread_outlives_that_thread() -> None:
    """PR_SET_PDEATHSIG follows the thread that forked the server: a restart from a thread that
    then ends (`asyncio.to_thread(server.start)`) must not stop the server with it."""
    with start_postgres() as server:
        server.stop()
        restart = threading.Thread(target=server.start)
        restart.start()
        restart.join()
        time.sleep(0.5)  # the kernel's signal, had it been armed by that thread, comes at once
        assert server.process is not None and server.process.poll() is None
        psycopg.connect(server.url(), password=PASSWORD, connect_timeout=5).close()
