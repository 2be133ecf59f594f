"""`kv_pressure --api-server-cpus`: every thread of the engine's API server process moves, its
child (EngineCore) stays on the engine's CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from benchmarks.admission.kv_pressure import pin_api_server

# a parent with two extra threads and one child process, all sleeping; prints the child's pid
PROGRAM = """
import subprocess, sys, threading, time
for _ in range(2):
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""


def _affinities(pid: int) -> list[set[int]]:
    return [os.sched_getaffinity(int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir()]


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and two CPUs",
)
def test_moves_every_thread_of_the_server_and_not_its_child() -> None:
    first, second = sorted(os.sched_getaffinity(0))[:2]
    parent = subprocess.Popen(
        [sys.executable, "-c", PROGRAM],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: os.sched_setaffinity(0, {second}),
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 10
        while len(_affinities(parent.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _affinities(parent.pid) == [{second}] * 3
        assert pin_api_server(parent.pid, {first}) == 3
        assert _affinities(parent.pid) == [{first}] * 3
        assert _affinities(child) == [{second}]
    finally:
        for proc in psutil.Process(parent.pid).children(recursive=True):
            proc.kill()
        parent.kill()
        parent.wait()
