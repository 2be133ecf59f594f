"""Sessions and guards on the router's request path, against a fake engine over real HTTP
(issue 22): a coding agent's 150-step task under one `x-claude-code-session-id` on the
default config is served, engine failures do not count as steps, a new user message starts the
session's next run, and `GET /v1/runs/{session}` shows the session; Claude Code's shapes on
/v1/messages and Codex's on /v1/responses follow the same rule; the engine sees a clamped body
`priority` (issue 23)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pools.testing.config import config_for_test
from pools.testing.fake_engine import FakeEngineState
from pools.testing.gateway import gateway_over_fakes

SESSION = "5b0c6a43-7d1e-4d2b-9a57-2f0e8c1d9e11"
KEY = {"authorization": "Bearer k-dev"}


@dataclass
class Rig:
    client: httpx.AsyncClient
    engine: FakeEngineState


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    engine = FakeEngineState(keep_requests=True)
    # the default guards
    config = config_for_test(tmp_path, tenants=[{"name": "dev", "api_key": "k-dev"}])
    async with gateway_over_fakes(config, [engine]) as r:
        yield Rig(r.client, engine)


TOOLS = [
    {
        "type": "function",
        "function": {"name": "bash", "parameters": {"type": "object", "properties": {}}},
    }
]


def _call(i: int) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": "bash", "arguments": f'{{"cmd": "step {i}"}}'},
            }
        ],
    }


async def _post(rig: Rig, messages: list[dict[str, Any]]) -> httpx.Response:
    body = {"model": "tiny", "messages": messages, "tools": TOOLS, "max_tokens": 2}
    headers = {**KEY, "x-claude-code-session-id": SESSION}
    return await rig.client.post("/v1/chat/completions", json=body, headers=headers)


async def test_a_150_step_session_is_served_and_a_new_message_starts_its_next_run(
    rig: Rig,
) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "fix the failing test"}]
    rig.engine.failure, rig.engine.fail_next = "http500", 3  # engine errors: not steps
    for _ in range(3):
        assert (await _post(rig, messages)).status_code == 502
    for i in range(150):
        resp = await _post(rig, messages)
        assert resp.status_code == 200, (i, resp.text)
        messages += [_call(i), {"role": "tool", "tool_call_id": f"call_{i}", "content": "ok"}]
    budget = (await rig.client.get("/v1/budget", headers=KEY)).json()
    (run,) = budget["active_runs"]
    assert run["run_id"] == f"{SESSION}:1" and run["steps"] == 150
    messages += [{"role": "assistant", "content": "fixed"}, {"role": "user", "content": "thanks"}]
    assert (await _post(rig, messages)).status_code == 200
    session = (await rig.client.get(f"/v1/runs/{SESSION}", headers=KEY)).json()
    assert session["object"] == "gpupool.session"
    assert session["runs"] == [f"{SESSION}:1", f"{SESSION}:2"]
    assert session["current_run"] == f"{SESSION}:2"
    assert session["current"]["totals"]["requests"] == 1
    first = (await rig.client.get(f"/v1/runs/{SESSION}:1", headers=KEY)).json()
    assert first["totals"]["requests"] == 153  # 150 served + the 3 the engine failed
    ended = await rig.client.post(f"/v1/runs/{SESSION}/end", headers=KEY)
    assert ended.status_code == 200 and ended.json()["run_id"] == f"{SESSION}:2"


async def test_the_engine_sees_the_clamped_priority(rig: Rig) -> None:
    resp = await rig.client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "priority": -100},
        headers={**KEY, "x-gpupool-priority": "50"},
    )
    assert resp.status_code == 200
    assert resp.headers["x-gpupool-priority"] == "0"
    assert rig.engine.requests_seen[-1]["priority"] == 0


async def _budget_runs(rig: Rig) -> dict[str, int]:
    budget = (await rig.client.get("/v1/budget", headers=KEY)).json()
    return {r["run_id"]: r["steps"] for r in budget["active_runs"]}


async def test_claude_code_on_messages_gets_one_run_per_typed_prompt(rig: Rig) -> None:
    """Claude Code's own shapes on /v1/messages: tool results come back as `tool_result`
    blocks of a user message (with a system reminder beside them), a typed prompt as text."""
    headers = {**KEY, "x-claude-code-session-id": SESSION, "anthropic-version": "2023-06-01"}
    prompt = {
        "role": "user",
        "content": [
            {"type": "text", "text": "<system-reminder>context</system-reminder>"},
            {"type": "text", "text": "run the tests", "cache_control": {"type": "ephemeral"}},
        ],
    }
    messages: list[dict[str, Any]] = [prompt]
    for i in range(3):
        body = {"model": "tiny", "max_tokens": 2, "messages": messages}
        resp = await rig.client.post("/v1/messages", json=body, headers=headers)
        assert resp.status_code == 200, resp.text
        messages += [
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": f"toolu_{i}", "name": "Bash", "input": {}}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": "ok"},
                    {"type": "text", "text": "<system-reminder>todo</system-reminder>"},
                ],
            },
        ]
    assert await _budget_runs(rig) == {f"{SESSION}:1": 3}
    messages += [
        {"role": "assistant", "content": [{"type": "text", "text": "all green"}]},
        {"role": "user", "content": [{"type": "text", "text": "commit it"}]},
    ]
    body = {"model": "tiny", "max_tokens": 2, "messages": messages}
    assert (await rig.client.post("/v1/messages", json=body, headers=headers)).status_code == 200
    assert await _budget_runs(rig) == {f"{SESSION}:1": 3, f"{SESSION}:2": 1}


async def test_a_codex_session_on_responses_gets_one_run_per_user_message(rig: Rig) -> None:
    headers = {**KEY, "session-id": SESSION}
    items: list[dict[str, Any]] = [{"role": "user", "content": "list the files"}]
    for i in range(2):
        body = {"model": "tiny", "max_output_tokens": 2, "input": items, "store": False}
        resp = await rig.client.post("/v1/responses", json=body, headers=headers)
        assert resp.status_code == 200, resp.text
        items += [
            {"type": "function_call", "call_id": f"c{i}", "name": "ls", "arguments": "{}"},
            {"type": "function_call_output", "call_id": f"c{i}", "output": "a.py"},
        ]
    body = {"model": "tiny", "max_output_tokens": 2, "input": "now a new task", "store": False}
    assert (await rig.client.post("/v1/responses", json=body, headers=headers)).status_code == 200
    assert await _budget_runs(rig) == {f"{SESSION}:1": 2, f"{SESSION}:2": 1}
