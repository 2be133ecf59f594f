"""A real PostgreSQL server for the tests (never a mock): `postgres_server`, once per test
session (per xdist worker, started only when a test asks for it), stopped at the end.

initdb + postgres from PostgreSQL's binaries (/usr/local/bin, or Debian's
/usr/lib/postgresql/*/bin, installed by scripts/install.sh). PostgreSQL refuses to run as root:
as root the server runs as `nobody` in a data folder it owns. It listens on a unix socket in its
own temporary folder only (no TCP port to collide with another suite), with password
authentication (scram), fsync off and small buffers (~40 MB on disk, ~30 MB of memory; about a
second to start). The process is this one's child and carries the session's id in its
environment, so tests/conftest.py would report it if it outlived the suite.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["PostgresServer", "pg_binaries", "postgres_server", "start_postgres"]

USER = "gpupool"
PASSWORD = "gpupool-test-secret"
PORT = 5432  # names the socket file; nothing listens on TCP
START_TIMEOUT_S = 30.0


def pg_binaries() -> Path | None:
    """The folder holding initdb and postgres, or None."""
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), reverse=True)
    return versions[0].parent if versions else None


class PostgresServer:
    """One server on a data folder of its own; `stop()` and `start()` again (an outage)."""

    def __init__(self, root: Path, bin_dir: Path, owner: dict[str, object]) -> None:
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
            self.process = subprocess.Popen(
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
                stdout=subprocess.DEVNULL,
                stderr=sink,
                **self._owner,  # type: ignore[arg-type]
            )
        _wait_ready(self, log)

    def stop(self) -> None:
        """Fast shutdown (open sessions are ended), as a database restart would."""
        process, self.process = self.process, None
        if process is None:
            return
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _as_owner() -> dict[str, object]:
    """Popen arguments that run a child as `nobody` when we are root (PostgreSQL's rule)."""
    if os.geteuid() != 0:
        return {}
    return {"user": "nobody", "group": pwd.getpwnam("nobody").pw_gid, "extra_groups": []}


@contextlib.contextmanager
def start_postgres() -> Iterator[PostgresServer]:
    bin_dir = pg_binaries()
    if bin_dir is None:
        raise RuntimeError(
            "no PostgreSQL binaries (initdb): scripts/install.sh installs Debian's postgresql"
        )
    root = Path(tempfile.mkdtemp(prefix="gpupool-pg-"))
    owner = _as_owner()
    if owner:
        nobody = pwd.getpwnam("nobody")
        os.chown(root, nobody.pw_uid, nobody.pw_gid)
    server = PostgresServer(root, bin_dir, owner)
    try:
        pwfile = root / "pw"
        pwfile.write_text(PASSWORD + "\n")
        if owner:
            os.chown(pwfile, pwd.getpwnam("nobody").pw_uid, -1)
        subprocess.run(
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
            check=True,
            capture_output=True,
            **owner,  # type: ignore[arg-type]
        )
        server.start()
        yield server
    finally:
        server.stop()
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
