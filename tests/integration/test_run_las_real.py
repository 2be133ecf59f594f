"""`queue.order: run_las` on a real CPU engine behind `gpupool serve`: a fresh run's step
overtakes a queued step of a run that has already been served, and `/v1/runs/{id}` splits a
run's wall time into queue, execution and time between steps.

The router is told the engine runs one sequence at a time (`--max-num-seqs 1` in its engine
arguments: the operating point's ceiling), so its queue, not the engine, orders the steps."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pools.launchers import InstanceSpec
from pools.testing.router_process import free_port
from tests.integration.conftest import RouterProcess, wait_for, write_router_config

pytestmark = pytest.mark.integration


def _step(url: str, run: str, max_tokens: int, done: list[tuple[str, float]]) -> None:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"step of {run} " * 40}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    reply = httpx.post(
        f"{url}/v1/chat/completions", json=body, headers={"x-gpupool-run-id": run}, timeout=120
    )
    assert reply.status_code == 200, reply.text
    done.append((run, time.monotonic()))


def _queue_depth(url: str) -> int:
    depth: int = httpx.get(f"{url}/admin/pools", timeout=5).json()["pools"]["agent"]["queue"][
        "depth"
    ]
    return depth


def test_a_fresh_run_overtakes_a_served_one_and_the_run_reports_its_time_split(
    tmp_path: Path, real_engines: list[InstanceSpec]
) -> None:
    config = write_router_config(
        tmp_path / "gpupool.yaml",
        [real_engines[0].url, real_engines[1].url],
        engines={"local": {"vllm_args": ["--max-num-seqs", "1"]}},
        pools={
            # one whole engine each
            "agent": {
                "classes": ["agent"],
                "share": {"initial_frac": 0.5},
                "slo": {"ttft_p95_ms": 30_000, "tpot_p95_ms": 500},
                "queue": {"order": "run_las", "run_las_aging_s": 50, "max_wait_s": 60},
            },
            "normal": {"classes": ["normal"], "share": {"initial_frac": 0.5}},
        },
    )
    router = RouterProcess(config, free_port(), tmp_path / "router.log")
    try:
        done: list[tuple[str, float]] = []
        for _ in range(3):  # the long run gets served three steps
            _step(router.url, "long", 32, done)
            time.sleep(0.2)  # its tool call
        blocker = threading.Thread(target=_step, args=(router.url, "blocker", 600, done))
        blocker.start()
        wait_for(interval_s=0.02, cond=lambda: len(done) == 3 and _queue_depth(router.url) == 0)
        time.sleep(0.3)  # the blocker is on the engine
        later = [threading.Thread(target=_step, args=(router.url, "long", 32, done))]
        later[0].start()
        wait_for(interval_s=0.02, cond=lambda: _queue_depth(router.url) == 1)
        later.append(threading.Thread(target=_step, args=(router.url, "fresh", 32, done)))
        later[1].start()
        wait_for(interval_s=0.02, cond=lambda: _queue_depth(router.url) == 2)
        for t in (blocker, *later):
            t.join(timeout=120)
        assert [run for run, _ in done[3:]] == ["blocker", "fresh", "long"]

        run = httpx.get(f"{router.url}/v1/runs/long", timeout=10).json()
        totals = run["totals"]
        assert totals["requests"] == 4
        # the 4th step waited for the blocker and the fresh step: a real queue wait
        assert totals["queue_s"] > 0.3
        assert totals["exec_s"] > 0
        # three tool calls of >= 0.2 s, plus the wait for the blocker to start
        assert totals["between_steps_s"] >= 0.6
        parts = totals["queue_s"] + totals["exec_s"] + totals["between_steps_s"]
        assert parts == pytest.approx(totals["wall_s"], abs=0.01)
    finally:
        router.stop()
