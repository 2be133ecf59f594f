"""Suite-wide: nothing the suite starts may outlive it.

Every process the suite starts (engines, routers, `gpupool up`, the Ray head and its workers,
the engines' `VLLM::EngineCore` children) inherits `GPUPOOL_TEST_SESSION=<this session's id>`
from the pytest process's environment. When the session ends, every other process that still
carries this session's id (after a grace for processes that are shutting down) is a leak: it is
listed, killed, and the run fails. Processes of other pytest sessions on the same machine
carry another id and are left alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from pathlib import Path

import pytest

SESSION_ENV = "GPUPOOL_TEST_SESSION"
# pytest-xdist workers keep their controller's id: what they start belongs to its session
if "PYTEST_XDIST_WORKER" not in os.environ:
    os.environ[SESSION_ENV] = uuid.uuid4().hex
SESSION_ID = os.environ[SESSION_ENV]
LEAK_GRACE_S = 15.0  # processes stopped by the last teardown may still be exiting


def session_processes(session_id: str = SESSION_ID) -> dict[int, str]:
    """Live (not zombie) processes other than this one whose environment carries
    `session_id`, with their command lines."""
    marker = f"{SESSION_ENV}={session_id}".encode()
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):  # gone, or not ours to read
            continue
        found[int(entry.name)] = cmdline.strip()[:200]
    return found


def leaked_processes(grace_s: float = LEAK_GRACE_S) -> dict[int, str]:
    """This session's processes still alive after `grace_s`; each is killed (SIGKILL)."""
    deadline = time.monotonic() + grace_s
    alive = session_processes()
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = session_processes()
    for pid in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return alive


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "coin: checks the picker's random tie-break itself, or pins what a seeded one drew;"
        " skipped when tests/tools/tieplug.py forces the tie-break",
    )


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput") or not Path("/proc/self/environ").exists():
        return  # an xdist worker (its controller checks), or no /proc to look in
    leaked = leaked_processes()
    if not leaked:
        return
    lines = [f"  pid {pid}: {cmd}" for pid, cmd in sorted(leaked.items())]
    message = (
        f"{len(leaked)} process(es) started by this test session outlived it"
        f" (killed now):\n" + "\n".join(lines)
    )
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_sep("!", "processes outlived the suite", red=True)
        reporter.write_line(message)
    else:
        print(message)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
