"""A real PostgreSQL server for the tests (never a mock): `postgres_server`, once per test
session (per xdist worker, started only when a test asks for it), stopped at the end.

initdb + postgres from PostgreSQL's binaries (/usr/local/bin, or Debian's
/usr/lib/postgresql/*/bin, installed by scripts/install.sh). PostgreSQL refuses to run as root:
as root the server runs as `nobody` in a data folder it owns. It listens on a unix socket in its
own temporary folder only (no TCP port to collide with another suite), with password
authentication (scram), fsync off and small buffers (~40 MB on disk, ~30 MB of memory; about a
second to start). The process is this one's child and carries the session's id in its
environment, so tests/conftest.py would report it if it outlived the suite.

A pytest killed with SIGKILL runs no teardown: the server then gets SIGINT (PostgreSQL's fast
shutdown, which ends open sessions; SIGTERM would wait for them) from the kernel when the
thread that started it dies (`prctl(PR_SET_PDEATHSIG)`, set in the child after the switch to
`nobody`, which would clear it): one thread that lives as long as the process (`_spawn`).
Its data folder stays behind; the next start removes the folders whose owner (the pid in
`owner.pid`) is gone.

Under xdist the server is a worker's child, and a SIGKILLed controller left the worker running
its test for ~16 s (execnet sees the lost channel at once, waits 5 s, sends itself a SIGINT
that did not end a test asleep in the main thread, and calls `os._exit` 10 s after that). So
a worker that starts a server also watches its controller (`_watch_controller`: its parent
pid, every `WATCH_INTERVAL_S`): once it is gone, the watch stops the worker's servers, removes
their data folders, interrupts the main thread (SIGINT to that thread, so pytest unwinds and
the other fixtures' teardowns stop what they started), and ends the worker if it is still
there `WATCH_EXIT_GRACE_S` later.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

__all__ = ["PostgresServer", "pg_binaries", "postgres_server", "start_postgres"]

USER = "gpupool"
PASSWORD = "gpupool-test-secret"
PORT = 5432  # names the socket file; nothing listens on TCP
START_TIMEOUT_S = 30.0
FOLDER_PREFIX = "gpupool-pg-"
OWNER_FILE = "owner.pid"  # the pid of the process that made the folder
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the forked child only calls it
WATCH_INTERVAL_S = 0.5  # how often an xdist worker holding a server checks its controller
WATCH_STOP_S = 3.0  # for its servers' fast shutdown, then SIGKILL
WATCH_EXIT_GRACE_S = 10.0  # for the worker's own teardowns after the interrupt
WATCH_EXIT_CODE = 70  # a worker ended by the watch (EX_SOFTWARE: its controller died)


def pg_binaries() -> Path | None:
    """The folder holding initdb and postgres, or None."""
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), reverse=True)
    return versions[0].parent if versions else None


class PostgresServer:
    """One server on a data folder of its own; `stop()` and `start()` again (an outage)."""

    def __init__(self, root: Path, bin_dir: Path, owner: _Owner) -> None:
        self.socket_dir = root
        self._root, self._bin, self._owner = root, bin_dir, owner
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{USER}@/{database}?host={self.socket_dir}&port={PORT}"

    def create_database(self, name: str) -> str:
        """A fresh database; returns its URL (password: `PASSWORD`)."""
        import psycopg

        with psycopg.connect(self.url(), password=PASSWORD, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def start(self) -> None:
        log = self._root / "log"
        with open(log, "ab") as sink:
            self.process = _spawn(
                [
                    str(self._bin / "postgres"),
                    "-D",
                    str(self._root / "data"),
                    "-k",
                    str(self._root),
                    "-p",
                    str(PORT),
                    "-c",
                    "listen_addresses=",
                    "-c",
                    "fsync=off",
                    "-c",
                    "synchronous_commit=off",
                    "-c",
                    "full_page_writes=off",
                    "-c",
                    "shared_buffers=16MB",
                    "-c",
                    "max_connections=60",
                ],
                self._owner,
                stdout=subprocess.DEVNULL,
                stderr=sink,
            )
        _wait_ready(self, log)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Fast shutdown (open sessions are ended), as a database restart would; SIGKILL after
        `timeout_s`."""
        process, self.process = self.process, None
        if process is None:
            return
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass(frozen=True)
class _Owner:
    """Who PostgreSQL's processes run as: `nobody` when we are root (PostgreSQL's rule), else
    us (all None: Popen's defaults)."""

    user: str | None = None
    group: int | None = None
    extra_groups: list[int] | None = None

    @classmethod
    def for_postgres(cls) -> _Owner:
        if os.geteuid() != 0:
            return cls()
        return cls(user="nobody", group=pwd.getpwnam("nobody").pw_gid, extra_groups=[])

    @property
    def uid(self) -> int | None:
        return None if self.user is None else pwd.getpwnam(self.user).pw_uid


# PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, not the process, and
# tests start and restart servers from threads that end long before the suite does
# (`asyncio.to_thread(server.start)`: the server was stopped between two tests so). Every
# server and initdb is forked by this one thread, which lives as long as the process.
_spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="postgres-spawner")


def _spawn(argv: list[str], owner: _Owner, **kwargs: Any) -> subprocess.Popen[bytes]:
    """`Popen(argv)` as `owner`, stopped by the kernel when this process dies (SIGKILL too)."""

    def popen() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            argv,
            user=owner.user,
            group=owner.group,
            extra_groups=owner.extra_groups,
            preexec_fn=_stops_when_parent_dies(),
            **kwargs,
        )

    return _spawner.submit(popen).result()


def _stops_when_parent_dies() -> Callable[[], None]:
    """A `preexec_fn`: in the child, between fork and exec (after setuid, which would clear
    the setting), ask for SIGINT when the parent's thread that forked it dies, even of
    SIGKILL."""
    parent = os.getpid()

    def in_child() -> None:
        if _libc.prctl(PR_SET_PDEATHSIG, signal.SIGINT, 0, 0, 0) != 0:
            os._exit(127)  # a server that could outlive the suite is not started
        if os.getppid() != parent:  # the parent died before the setting took
            os._exit(127)

    return in_child


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_orphaned_folders(tmp: Path) -> None:
    """Data folders left by a pytest that was killed (its server stopped with it)."""
    for folder in tmp.glob(FOLDER_PREFIX + "*"):
        try:
            owner = int((folder / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # not one of ours, or being made right now
        if not _alive(owner):
            shutil.rmtree(folder, ignore_errors=True)


# The controller of an xdist worker is the parent it was started by: taken when the worker
# imports this module (at collection, before any test), so a controller that dies before a
# server starts is still seen as gone. (worker pid, controller pid); None outside a worker.
_worker = (os.getpid(), os.getppid()) if os.environ.get("PYTEST_XDIST_WORKER") else None
_servers: set[PostgresServer] = set()  # started by start_postgres and not yet torn down
_watch_lock = threading.Lock()
_watch: threading.Thread | None = None


def _watch_controller_once() -> None:
    """In an xdist worker, start the watch of its controller (once per process; not in a
    process forked from the worker, whose parent is the worker)."""
    global _watch
    if _worker is None or _worker[0] != os.getpid():
        return
    with _watch_lock:
        if _watch is None:
            _watch = threading.Thread(
                target=_watch_controller,
                args=(_worker[1], WATCH_INTERVAL_S),
                name="postgres-controller-watch",
                daemon=True,
            )
            _watch.start()


def _watch_controller(controller: int, interval_s: float) -> None:
    """When this process's parent is no longer `controller` (it died: the worker was handed
    to init or a subreaper), stop this process's servers, remove their folders, interrupt the
    main thread and, after `WATCH_EXIT_GRACE_S`, exit."""
    while os.getppid() == controller:
        time.sleep(interval_s)
    print(
        f"tests/postgres.py: xdist controller {controller} gone; stopping"
        f" {len(_servers)} PostgreSQL server(s) and ending worker {os.getpid()}",
        file=sys.stderr,
        flush=True,
    )
    servers = list(_servers)
    for server in servers:
        if (process := server.process) is not None:
            process.send_signal(signal.SIGINT)  # all at once, then wait for each
    for server in servers:
        server.stop(timeout_s=WATCH_STOP_S)
        shutil.rmtree(server.socket_dir, ignore_errors=True)
    main = threading.main_thread().ident
    if main is not None:  # KeyboardInterrupt there: pytest runs the teardowns and ends
        signal.pthread_kill(main, signal.SIGINT)
    time.sleep(WATCH_EXIT_GRACE_S)
    os._exit(WATCH_EXIT_CODE)


@contextlib.contextmanager
def start_postgres() -> Iterator[PostgresServer]:
    bin_dir = pg_binaries()
    if bin_dir is None:
        raise RuntimeError(
            "no PostgreSQL binaries (initdb): scripts/install.sh installs Debian's postgresql"
        )
    _remove_orphaned_folders(Path(tempfile.gettempdir()))
    root = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX))
    (root / OWNER_FILE).write_text(str(os.getpid()))
    owner = _Owner.for_postgres()
    if owner.uid is not None:
        os.chown(root, owner.uid, owner.group if owner.group is not None else -1)
    server = PostgresServer(root, bin_dir, owner)
    _servers.add(server)
    _watch_controller_once()
    try:
        pwfile = root / "pw"
        pwfile.write_text(PASSWORD + "\n")
        if owner.uid is not None:
            os.chown(pwfile, owner.uid, -1)
        initdb = _spawn(
            [
                str(bin_dir / "initdb"),
                "-D",
                str(root / "data"),
                "-U",
                USER,
                "-A",
                "scram-sha-256",
                f"--pwfile={pwfile}",
                "--no-sync",
                "-E",
                "UTF8",
                "--locale=C.UTF-8",
            ],
            owner,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        output, _ = initdb.communicate()
        if initdb.returncode != 0:
            raise RuntimeError(f"initdb failed:\n{output.decode(errors='replace')[-2000:]}")
        server.start()
        yield server
    finally:
        server.stop()
        _servers.discard(server)
        shutil.rmtree(root, ignore_errors=True)


def _wait_ready(server: PostgresServer, log: Path) -> None:
    import psycopg

    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if server.process is None or server.process.poll() is not None:
            raise RuntimeError(f"postgres exited at start:\n{log.read_text()[-2000:]}")
        try:
            psycopg.connect(server.url(), password=PASSWORD, connect_timeout=2).close()
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    with start_postgres() as server:
        yield server
