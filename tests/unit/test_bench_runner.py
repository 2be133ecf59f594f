"""The open-loop runner against the in-process fake engine (served over real HTTP)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from benchmarks.metrics import summarize_target
from benchmarks.runner import Runner, Target, gpu_seconds_of
from benchmarks.testing import GpupoolLike, serve_asgi
from pools.testing.fake_engine import FakeEngineState, make_fake_engine
from router.simulate.prompts import PromptMaker
from router.simulate.scenario import parse_scenario
from router.simulate.workload import Plan, build_plan


def plan_for(
    duration_s: float = 1.0,
    chat_rate: float = 10.0,
    agent_rate: float = 3.0,
    out: int = 8,
    steps: int = 3,
    drain_s: float = 10.0,
    **over: Any,
) -> Plan:
    classes: dict[str, Any] = {}
    if chat_rate:
        classes["normal"] = {
            "kind": "chat",
            "arrivals": {"process": "constant", "rate_per_s": chat_rate},
            "prompt_tokens": {"dist": "fixed", "value": 40},
            "output_tokens": {"dist": "fixed", "value": out},
            "slo": {"ttft_ms": 1000, "tpot_ms": 100},
        }
    if agent_rate:
        classes["agent"] = {
            "kind": "agent",
            "arrivals": {"process": "constant", "rate_per_s": agent_rate},
            "steps": {"dist": "fixed", "value": steps},
            "prompt_tokens": {"dist": "fixed", "value": 100},
            "output_tokens": {"dist": "fixed", "value": out},
            "tool_result_tokens": {"dist": "fixed", "value": 30},
            "tool_wait_ms": {"dist": "fixed", "value": 20},
            "tools": 2,
            "slo": {"ttft_ms": 1000},
        }
    data = {
        "name": "rt",
        "seed": 1,
        "duration_s": duration_s,
        "drain_timeout_s": drain_s,
        "request_timeout_s": 5,
        "classes": classes,
        **over,
    }
    return build_plan(parse_scenario(data), PromptMaker(None, tokens_per_word=1.0))


async def test_chat_and_agent_records_against_the_fake() -> None:
    state = FakeEngineState(ttft_s=0.005, itl_s=0.001)
    app = GpupoolLike(make_fake_engine(state))
    plan = plan_for()
    async with serve_asgi(app) as url:
        result = await Runner(
            plan, Target("fake", url), run_id_prefix="t", progress=False, settle_s=0.0
        ).run()
    assert len(result.requests) == plan.total_requests == len(plan.chat) + 3 * len(plan.runs)
    assert all(r.ok for r in result.requests), [r.error for r in result.requests if not r.ok]
    for r in result.requests:
        assert r.ttft_ms is not None and r.ttft_ms >= 5.0
        assert r.e2e_ms is not None and r.e2e_ms >= r.ttft_ms
        assert r.output_tokens == 8 and len(r.itl_ms) == 7  # one chunk per token here
        assert r.prompt_tokens and r.prompt_tokens > 0
        assert r.send_s >= r.scheduled_s - 1e-6
    chat_bodies = [b for b in state.requests_seen if not b.get("tools")]
    agent_bodies = [b for b in state.requests_seen if b.get("tools")]
    assert len(chat_bodies) == len(plan.chat) and len(agent_bodies) == 3 * len(plan.runs)
    for body in state.requests_seen:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["max_tokens"] == 8
    # the context grows: step k carries system + user + 2 messages per earlier step
    assert sorted({len(b["messages"]) for b in agent_bodies}) == [2, 4, 6]
    assert {m["role"] for b in agent_bodies for m in b["messages"]} == {
        "system",
        "user",
        "assistant",
        "tool",
    }
    # every step carried its run id; GPU-seconds were read back per run
    assert set(app.steps_by_run.values()) == {3}
    assert {r.run_id for r in result.runs} == set(app.steps_by_run)
    for run in result.runs:
        assert run.outcome == "completed" and run.steps_ok == 3
        assert run.gpu_seconds == pytest.approx(0.75)
        assert run.completion_s is not None and run.completion_s >= 0.04  # two tool waits
    assert {r.pool for r in result.requests if r.kind == "agent"} == {"agent"}
    summary = summarize_target(result, plan.scenario)
    assert summary["classes"]["normal"]["good"] == len(plan.chat)
    assert summary["runs"]["agent"]["gpu_seconds_reported"] == len(plan.runs)


async def test_open_loop_does_not_wait_for_completions() -> None:
    # 10 requests/s for 1 s, every one held by the engine until all 10 are in it: an open loop
    # sends each on its schedule whatever the others do; a closed loop would never get there
    # (the gate opens only then, so it would hang until the timeout). No wall-clock bound: the
    # send lag a loaded machine adds was once 0.47 s.
    state = FakeEngineState(ttft_s=0.0, itl_s=0.0, gate=asyncio.Event())
    plan = plan_for(chat_rate=10.0, agent_rate=0, out=9)

    async def open_gate_when_all_are_in() -> None:
        while state.running < len(plan.chat):  # noqa: ASYNC110 (the fake counts, no event)
            await asyncio.sleep(0.01)
        assert state.served == 0  # none had completed
        assert state.gate is not None
        state.gate.set()

    async with serve_asgi(make_fake_engine(state)) as url:
        runner = Runner(plan, Target("fake", url), run_id_prefix="t", progress=False)
        async with asyncio.timeout(60):
            result, _ = await asyncio.gather(runner.run(), open_gate_when_all_are_in())
    assert len(plan.chat) == 10 and state.peak_running == 10
    assert len(result.requests) == 10 and all(r.ok for r in result.requests)


async def test_rejections_keep_status_code_and_retry_after() -> None:
    app = GpupoolLike(make_fake_engine(FakeEngineState()), reject_agent=True)
    plan = plan_for(chat_rate=2.0, agent_rate=3.0)
    async with serve_asgi(app) as url:
        result = await Runner(
            plan, Target("fake", url), run_id_prefix="t", progress=False, settle_s=0.0
        ).run()
    agent = [r for r in result.requests if r.kind == "agent"]
    assert len(agent) == len(plan.runs)  # a run stops at its first failed step
    for r in agent:
        assert (r.status, r.error_code, r.retry_after_s) == (429, "queue_full", 2.0)
        assert not r.ok
    assert all(run.outcome == "failed" and run.gpu_seconds is None for run in result.runs)
    summary = summarize_target(result, plan.scenario)
    assert summary["rejections"] == {"429 queue_full": len(plan.runs)}
    assert summary["classes"]["agent"]["goodput_rps"] == 0


async def test_drain_timeout_cancels_and_records() -> None:
    state = FakeEngineState(failure="hang", fail_next=-1)
    plan = plan_for(duration_s=0.5, chat_rate=6.0, agent_rate=2.0, drain_s=0.3)
    async with serve_asgi(make_fake_engine(state)) as url:
        # the engine never answers: only the drain ends the run (a deadline, not a timing)
        result = await asyncio.wait_for(
            Runner(
                plan, Target("fake", url), run_id_prefix="t", progress=False, settle_s=0.0
            ).run(),
            timeout=60,
        )
    assert result.cancelled_at_drain == len(plan.chat) + len(plan.runs)
    assert all(r.error_code == "cancelled_at_drain" for r in result.requests)
    assert all(run.outcome == "cancelled" for run in result.runs)


async def test_engine_errors_are_recorded() -> None:
    state = FakeEngineState(failure="http500", fail_next=2)
    plan = plan_for(chat_rate=4.0, agent_rate=0)
    async with serve_asgi(make_fake_engine(state)) as url:
        result = await Runner(plan, Target("fake", url), run_id_prefix="t", progress=False).run()
    failed = [r for r in result.requests if not r.ok]
    assert [(r.status, r.error_code) for r in failed] == [(500, "500"), (500, "500")]
    assert sum(r.ok for r in result.requests) == 2


async def test_midstream_drop_is_a_failure() -> None:
    state = FakeEngineState(failure="drop_midstream", fail_next=-1)
    plan = plan_for(chat_rate=2.0, agent_rate=0)
    async with serve_asgi(make_fake_engine(state)) as url:
        result = await Runner(plan, Target("fake", url), run_id_prefix="t", progress=False).run()
    assert result.requests and not any(r.ok for r in result.requests)
    assert {r.error_code for r in result.requests} <= {"transport_error", "stream_incomplete"}


async def test_unreachable_target_is_a_connect_error() -> None:
    plan = plan_for(chat_rate=2.0, agent_rate=1.0, duration_s=0.5)
    result = await Runner(
        plan,
        Target("gone", "http://127.0.0.1:9/v1"),
        run_id_prefix="t",
        progress=False,
        settle_s=0.0,
    ).run()
    assert result.requests
    assert {(r.status, r.error_code) for r in result.requests} == {(None, "connect_error")}


def test_target_urls() -> None:
    t = Target("x", "http://h:8000/v1/", api_key="k", headers=(("x-a", "1"),))
    assert t.chat_url == "http://h:8000/v1/chat/completions"
    assert t.run_url("r1") == "http://h:8000/v1/runs/r1"
    assert t.request_headers((("x-b", "2"),)) == {
        "content-type": "application/json",
        "x-a": "1",
        "x-b": "2",
        "authorization": "Bearer k",
    }


async def test_calibration_reads_the_template_overhead_and_tokens_per_word() -> None:
    import aiohttp

    from benchmarks.compare import calibrate_prompts, check_target

    # the fake counts one token per word plus 4 per message
    async with (
        serve_asgi(make_fake_engine(FakeEngineState())) as url,
        aiohttp.ClientSession() as session,
    ):
        assert await check_target(session, Target("fake", url)) is None
        wrong = await check_target(session, Target("fake", url, model="other"))
        assert wrong is not None and "not served" in wrong
        prompts = PromptMaker(None)
        await calibrate_prompts(session, Target("fake", url), prompts)
    assert prompts.tokens_per_word == pytest.approx(1.0)
    assert prompts.message_overhead_tokens == 3  # 4 minus the BOS counted once
    assert prompts.content_tokens(100) == 96


def test_gpu_seconds_from_either_shape() -> None:
    assert gpu_seconds_of({"object": "gpupool.run", "totals": {"gpu_seconds": 1.5}}) == 1.5
    assert gpu_seconds_of({"run_id": "r", "gpu_seconds": 2}) == 2.0
    assert gpu_seconds_of({"totals": {"gpu_seconds": None}}) is None
    assert gpu_seconds_of({"gpu_seconds": True}) is None
    assert gpu_seconds_of(["not", "a", "run"]) is None
