"""A pytest killed with SIGKILL (no teardown runs) leaves no PostgreSQL server behind
(tests/postgres.py): the server and its backends stop within seconds, and the data folder it
leaves is removed by the next start; a server restarted from a thread that ends lives on."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psycopg
import pytest

from tests.conftest import SESSION_ENV, session_processes
from tests.postgres import PASSWORD, _remove_orphaned_folders, pg_binaries, start_postgres

REPO = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 10.0

HOLDER = """
import os, time
from pathlib import Path

def test_hold(postgres_server):
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


def test_a_sigkilled_pytest_leaves_no_postgres_running(tmp_path: Path) -> None:
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
    pytest_args = ["-q", "-p", "tests.postgres", "-p", "no:cacheprovider", "-c", os.devnull]
    child = subprocess.Popen(
        [sys.executable, "-m", "pytest", *pytest_args, "--rootdir", str(tmp_path), "test_hold.py"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        pid_text, folder_text = _wait_for(seen, child, timeout_s=60).split(" ", 1)
        server, folder = int(pid_text), Path(folder_text)
        running = session_processes(session)
        assert server in running and "postgres" in running[server], running
        assert len(running) >= 2, running  # the postmaster and its background processes
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    deadline = time.monotonic() + GONE_WITHIN_S
    while (left := session_processes(session)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:  # not to outlive this test either
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"outlived the killed pytest: {left}"
    # no teardown ran: the folder is there until a start sweeps it
    assert folder.parent == temp and folder.is_dir()
    _remove_orphaned_folders(temp)
    assert not folder.exists()
    temp.rmdir()


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
