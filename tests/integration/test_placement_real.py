"""A run's steps and their placement on real CPU engines behind `gpupool serve`: with its home
instance full and another idle, `affinity_or_move` moves the run's next step there and the
run's later steps follow it; `always_affinity` waits for home.

Two engines in the agent pool, which the router is told run two sequences each
(`--max-num-seqs 2` in its engine arguments: the operating point's ceiling), so two long
steps of other runs fill the run's home."""

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

CONTEXT = "the tool said the build is green and the tests pass " * 30  # ~330 tokens


def _step(url: str, run: str, messages: list[dict[str, str]], max_tokens: int) -> httpx.Response:
    reply = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": max_tokens, "ignore_eos": True},
        headers={"x-gpupool-run-id": run},
        timeout=180,
    )
    assert reply.status_code == 200, reply.text
    return reply


def _first(url: str, run: str, max_tokens: int = 1) -> str:
    """A run's first step; the instance that served it (its home from now on)."""
    reply = _step(url, run, [{"role": "user", "content": f"{run}: {CONTEXT}"}], max_tokens)
    return reply.headers["x-gpupool-instance"]


def _instances(url: str) -> dict[str, Any]:
    view: dict[str, Any] = httpx.get(f"{url}/admin/pools", timeout=5).json()["instances"]
    return view


@pytest.mark.parametrize("placement", ["affinity_or_move", "always_affinity"])
def test_a_full_home_moves_the_run_or_waits_for_it(
    tmp_path: Path, real_engines: list[InstanceSpec], placement: str
) -> None:
    config = write_router_config(
        tmp_path / "gpupool.yaml",
        [e.url for e in real_engines],
        engines={"local": {"vllm_args": ["--max-num-seqs", "2"]}},
        pools={
            "agent": {  # two of the three engines
                "classes": ["agent"],
                "share": {"initial_frac": 0.67},
                "slo": {"ttft_p95_ms": 20_000, "tpot_p95_ms": 200},
                "queue": {"max_wait_s": 120},
                "placement": placement,
            },
            "normal": {"classes": ["normal"], "share": {"initial_frac": 0.33}},
        },
    )
    router = RouterProcess(config, free_port(), tmp_path / "router.log")
    try:
        agent = [
            i for i, v in _instances(router.url).items() if v["pools"].get("agent", 0.0) >= 1.0
        ]
        assert len(agent) == 2, _instances(router.url)
        # both agent engines serve a few first steps, so the router has measured their
        # prefill rates (a move is weighed with the destination's)
        warm = 0
        while any(_instances(router.url)[i]["prefill_tokens_per_s"] is None for i in agent):
            assert warm < 40, _instances(router.url)
            _first(router.url, f"warm-{warm}", max_tokens=4)
            warm += 1
            time.sleep(0.6)  # a scrape between steps
        messages = [{"role": "user", "content": f"run: {CONTEXT}"}]
        first = _step(router.url, "run", messages, 8)
        home = first.headers["x-gpupool-instance"]
        other = next(i for i in agent if i != home)
        messages += [
            {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": "and the lint step?"},
        ]
        # two other runs whose home is the same instance fill it with long steps
        fillers: list[str] = []
        tries = 0
        while len(fillers) < 2:
            assert tries < 30, "no run landed on the home instance"
            if _first(router.url, f"filler-{tries}") == home:
                fillers.append(f"filler-{tries}")
            tries += 1
        long_steps = [
            threading.Thread(
                target=_step,
                args=(router.url, run, [{"role": "user", "content": f"{run}: {CONTEXT}"}], 500),
            )
            for run in fillers
        ]
        for t in long_steps:
            t.start()
        wait_for(
            lambda: _instances(router.url)[home]["running_by_pool"].get("agent", 0) == 2,
            timeout_s=60.0,
        )

        started = time.monotonic()
        second = _step(router.url, "run", messages, 16)
        took_s = time.monotonic() - started
        served_by = second.headers["x-gpupool-instance"]
        fillers_busy = any(t.is_alive() for t in long_steps)
        if placement == "affinity_or_move":
            assert served_by == other, (served_by, home)
            assert fillers_busy, f"the fillers ended first: the step took {took_s:.1f} s"
            # the run's affinity followed it: its next step goes where it moved
            messages += [
                {"role": "assistant", "content": second.json()["choices"][0]["message"]["content"]},
                {"role": "user", "content": "ship it"},
            ]
            third = _step(router.url, "run", messages, 4)
            assert third.headers["x-gpupool-instance"] == other
        else:
            assert served_by == home, (served_by, other)
        for t in long_steps:
            t.join(timeout=180)
        steps = httpx.get(f"{router.url}/v1/runs/run", timeout=10).json()
        if placement == "always_affinity":
            # it waited in the router's queue for a slot at home
            assert steps["totals"]["queue_s"] > 0.5, steps["totals"]
    finally:
        router.stop()
