"""The Ray actor undoes Ray's worker niceness (15) before it starts its engine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pools.launchers import ray as ray_launcher


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering a niceness needs root or CAP_SYS_NICE")
def test_a_reniced_process_is_set_back_to_zero_and_its_children_inherit_it() -> None:
    code = (
        "import os, subprocess, sys\n"
        "os.nice(15)\n"
        "from pools.launchers.ray import undo_worker_niceness\n"
        "print(undo_worker_niceness(), os.getpriority(os.PRIO_PROCESS, 0))\n"
        "child = subprocess.run(['sh', '-c', 'ps -o ni= -p $$'], capture_output=True, text=True)\n"
        "print(child.stdout.strip())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split("\n")
    assert out[0] == "None 0"
    assert out[1] == "0"  # the engine, a child, runs at 0 too


def test_a_process_already_at_zero_or_below_is_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(os, "getpriority", lambda which, who: 0)
    monkeypatch.setattr(os, "setpriority", lambda *a: calls.append(a))
    assert ray_launcher.undo_worker_niceness() is None
    assert calls == []


def test_a_node_that_forbids_lowering_it_gets_told_what_to_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(which: int, who: int, prio: int) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "getpriority", lambda which, who: 15)
    monkeypatch.setattr(os, "setpriority", refuse)
    problem = ray_launcher.undo_worker_niceness()
    assert problem is not None
    assert "niceness 15" in problem
    assert "RAY_worker_niceness=0" in problem
    assert "CAP_SYS_NICE" in problem
