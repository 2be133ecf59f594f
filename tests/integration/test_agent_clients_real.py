"""The agent clients people point at gpupool, unchanged, against real CPU vLLM engines behind
`gpupool serve` (the session's three engines, one router with the default guards):

- the `openai` SDK: `responses.create` plain and streamed, and a 4-step `previous_response_id`
  chain whose history the engine carries (each step's input tokens hold the last step's);
- the OpenAI Agents SDK on its default Responses model (`set_default_openai_client`), an agent
  with one function tool and `tool_choice="required"`: the runner calls the tool and finishes;
- the `anthropic` SDK: `messages.create`, `messages.stream` with a `tool_use` -> `tool_result`
  round trip, `messages.count_tokens` (equal to the prompt tokens the engine bills); the key
  as `x-api-key` (`api_key=`, ANTHROPIC_API_KEY) and as a Bearer token (`auth_token=`);
- LangChain's `ChatOpenAI(use_responses_api=True)`;
- a replayed 150-step coding-agent session with Claude Code's headers and message shapes: every
  step is served on the default config, and the ledger holds the steps.

The dev model has random weights, so a tool call is made deterministic the way clients force
one: a `strict` tool without parameters and a forced tool choice, whose structured output can
only be that call with `{}` arguments; a turn that must end in text gets its end-of-turn token
biased up (`logit_bias`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from pools.launchers import InstanceSpec
from pools.testing.router_process import free_port
from tests.integration.conftest import RouterProcess, write_router_config

pytestmark = pytest.mark.integration

KEY_ENV = "GPUPOOL_AGENT_CLIENTS_KEY"
KEY = "agent-clients-" + os.urandom(6).hex()
os.environ[KEY_ENV] = KEY
MODEL = "tiny"


class Target:
    """Where the clients point: the router's URL and a tenant's key."""

    def __init__(self, url: str, key: str) -> None:
        self.url = url
        self.key = key

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.key, max_retries=0)

    def anthropic(self, *, x_api_key: bool = False) -> anthropic.Anthropic:
        if x_api_key:  # ANTHROPIC_API_KEY: `x-api-key: <key>`
            return anthropic.Anthropic(base_url=self.url, api_key=self.key, max_retries=0)
        # ANTHROPIC_AUTH_TOKEN: `authorization: Bearer <token>`
        return anthropic.Anthropic(base_url=self.url, auth_token=self.key, max_retries=0)


@pytest.fixture(scope="module")
def target(
    real_engines: list[InstanceSpec], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Target]:
    d: Path = tmp_path_factory.mktemp("agent-clients")
    config = write_router_config(
        d / "gpupool.yaml",
        [e.url for e in real_engines],
        tenants=[{"name": "agents", "api_key_env": KEY_ENV}],  # the default guards
    )
    router = RouterProcess(config, free_port(), d / "router.log")
    try:
        yield Target(router.url, KEY)
    finally:
        router.stop()


# A tool without parameters, strict: a forced choice of it can only be this call with `{}`
# arguments (vLLM's structured output). Without `strict` the dev model writes digits forever.
NO_ARGS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
EOT_TOKEN = "4"  # the dev model's <|eot_id|>: biased up, a turn without a forced call ends at once


# --- the openai SDK: Responses ---------------------------------------------------------------


def test_openai_responses_create_plain_and_streamed(target: Target) -> None:
    client = target.openai()
    text = "Summarise the failing test in one line."
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=1
    )
    plain = client.responses.create(model=MODEL, input=text, max_output_tokens=8, temperature=0)
    assert plain.id.startswith("resp_")
    assert plain.output[0].type == "message" and plain.output_text
    assert plain.usage is not None and chat.usage is not None
    # the same prompt through the same chat template: the same tokens on either protocol
    assert plain.usage.input_tokens == chat.usage.prompt_tokens
    assert 1 <= plain.usage.output_tokens <= 8

    stream = client.responses.create(
        model=MODEL, input=text, max_output_tokens=8, temperature=0, stream=True
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, completed = events[0], events[-1]
    assert created.type == "response.created" and completed.type == "response.completed"
    assert completed.response.id == created.response.id != plain.id
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    # temperature 0 on one model: the streamed text is the plain one
    assert deltas == completed.response.output_text == plain.output_text
    assert completed.response.usage is not None
    assert completed.response.usage.input_tokens == plain.usage.input_tokens
    assert completed.response.usage.output_tokens == plain.usage.output_tokens


def test_openai_previous_response_id_chain_of_four(target: Target) -> None:
    """Each step sends only its new input; the engine that stored the last response carries
    the history, so each step's prompt holds the whole chain so far."""
    client = target.openai()
    steps = [
        client.responses.create(
            model=MODEL, input="Step 1: read the bug report.", max_output_tokens=6
        )
    ]
    for k in range(2, 5):
        steps.append(
            client.responses.create(
                model=MODEL,
                input=f"Step {k}: go on.",
                previous_response_id=steps[-1].id,
                max_output_tokens=6,
            )
        )
    for before, after in itertools.pairwise(steps):
        assert after.previous_response_id == before.id
        assert before.usage is not None and after.usage is not None
        assert after.usage.input_tokens > before.usage.input_tokens + before.usage.output_tokens
    again = client.responses.retrieve(steps[-1].id)
    assert again.id == steps[-1].id and again.previous_response_id == steps[-2].id
    assert again.output_text == steps[-1].output_text


def test_openai_responses_fields_codex_and_the_agents_sdk_send(target: Target) -> None:
    """Found driving the SDKs by hand (s48): `store: false` (Codex's every step) is not
    remembered, so its follow-up is refused saying why; a follow-up may leave out `input`;
    `background` and `conversation`, which would run outside admission or lose the history,
    are refused as the SDK's typed 400 naming the field; the SDK's own errors are typed."""
    client = target.openai()
    unkept = client.responses.create(
        model=MODEL, input="Read the bug report.", store=False, max_output_tokens=2
    )
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(
            model=MODEL, input="Go on.", previous_response_id=unkept.id, max_output_tokens=2
        )
    assert refused.value.code == "previous_response_not_found"
    assert "store: false" in refused.value.message
    kept = client.responses.create(model=MODEL, input="Read the bug report.", max_output_tokens=2)
    follow = client.responses.create(  # no `input`: vLLM is sent []
        model=MODEL, previous_response_id=kept.id, max_output_tokens=2
    )
    assert follow.previous_response_id == kept.id and follow.usage is not None
    assert kept.usage is not None and follow.usage.input_tokens >= kept.usage.input_tokens
    for field, value in (("background", True), ("conversation", "conv_123")):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(
                model=MODEL, input="hi", max_output_tokens=2, extra_body={field: value}
            )
        assert err.value.param == field and err.value.code == "invalid_field"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.responses.create(model="nope", input="hi", stream=True)
    with pytest.raises(openai.BadRequestError, match="prompt is too long"):
        client.responses.create(model=MODEL, input="word " * 50_000)
    wrong = openai.OpenAI(base_url=f"{target.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.responses.create(model=MODEL, input="hi")


# --- the OpenAI Agents SDK: its default model speaks Responses --------------------------------


def test_openai_agents_sdk_runs_a_tool_loop(target: Target) -> None:
    from agents import (
        Agent,
        ModelSettings,
        Runner,
        ToolCallItem,
        ToolCallOutputItem,
        function_tool,
        set_default_openai_client,
        set_tracing_disabled,
    )

    calls: list[str] = []

    @function_tool
    def run_tests() -> str:
        """Run the test suite and report."""
        calls.append("run_tests")
        return "3 passed, 0 failed"

    async def run() -> Any:
        set_default_openai_client(
            openai.AsyncOpenAI(base_url=f"{target.url}/v1", api_key=target.key, max_retries=0),
            use_for_tracing=False,
        )
        set_tracing_disabled(True)
        agent = Agent(
            name="coder",
            instructions="Run the tests, then say whether they pass.",
            model=MODEL,
            tools=[run_tests],
            # reset_tool_choice (on by default) lets the turn after the tool answer in text;
            # the bias on <|eot_id|> makes that answer end at once (random weights never would)
            model_settings=ModelSettings(
                tool_choice="required",
                parallel_tool_calls=False,
                max_tokens=64,
                temperature=0,
                extra_body={"logit_bias": {EOT_TOKEN: 100}},
            ),
        )
        return await Runner.run(agent, "Do the tests pass?", max_turns=4)

    result = asyncio.run(run())
    assert calls == ["run_tests"]
    assert [type(item) for item in result.new_items] == [ToolCallItem, ToolCallOutputItem]
    assert result.new_items[1].output == "3 passed, 0 failed"
    first, second = result.raw_responses  # the tool call, then the closing turn
    assert first.output[0].type == "function_call" and first.output[0].name == "run_tests"
    # the second turn carries the call and its output back
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert result.final_output == ""


# --- the anthropic SDK: Messages ---------------------------------------------------------------

RUN_TESTS_TOOL: dict[str, Any] = {
    "name": "run_tests",
    "description": "Run the test suite.",
    "input_schema": NO_ARGS,
    "strict": True,
}


def test_anthropic_messages_create_and_count_tokens(target: Target) -> None:
    client = target.anthropic(x_api_key=True)
    messages: list[Any] = [{"role": "user", "content": "Why does the build fail?"}]
    system = "You are a coding agent."
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=messages)
    reply = client.messages.create(model=MODEL, system=system, messages=messages, max_tokens=8)
    assert reply.type == "message" and reply.role == "assistant"
    assert reply.content[0].type == "text" and reply.content[0].text
    assert reply.stop_reason in ("max_tokens", "end_turn")
    assert 1 <= reply.usage.output_tokens <= 8
    # count_tokens counts what the engine bills for the same request's prompt
    assert counted.input_tokens == reply.usage.input_tokens > 0


def test_anthropic_messages_stream_tool_use_then_tool_result(target: Target) -> None:
    client = target.anthropic()
    task: anthropic.types.MessageParam = {"role": "user", "content": "Run the tests."}
    with client.messages.stream(
        model=MODEL,
        messages=[task],
        tools=[RUN_TESTS_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "run_tests"},
        max_tokens=64,
    ) as stream:
        kinds = [event.type for event in stream]
        call = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    assert call.stop_reason == "tool_use"
    (block,) = call.content
    assert block.type == "tool_use" and block.name == "run_tests" and block.input == {}

    history: list[anthropic.types.MessageParam] = [
        task,
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": block.id, "name": block.name, "input": block.input}
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "3 passed"}],
        },
    ]
    with client.messages.stream(
        model=MODEL,
        messages=history,
        tools=[RUN_TESTS_TOOL],  # type: ignore[list-item]
        max_tokens=8,
    ) as stream:
        text = "".join(stream.text_stream)
        answer = stream.get_final_message()
    assert answer.content[0].type == "text" and answer.content[0].text == text
    assert answer.stop_reason in ("max_tokens", "end_turn")
    # the tool call and its result reached the engine's prompt
    assert answer.usage.input_tokens > call.usage.input_tokens


def test_anthropic_refusals_are_the_sdks_typed_errors_in_anthropics_types(
    target: Target,
) -> None:
    """Each refusal arrives as the SDK's own error class with an Anthropic error type: a
    `system` role inside `messages` (vLLM would serve it), an unknown model, a prompt over
    the context on messages and on count_tokens (vLLM's refusal there, rewritten), a wrong
    key."""
    client = target.anthropic(x_api_key=True)

    def error_type(err: anthropic.APIStatusError) -> object:
        body = err.body
        return body.get("error", {}).get("type") if isinstance(body, dict) else None

    with pytest.raises(anthropic.BadRequestError) as role:
        client.messages.create(
            model=MODEL,
            messages=[{"role": "system", "content": "x"}],
            max_tokens=2,
        )
    assert "messages.0.role" in role.value.message
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(
            model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert error_type(missing.value) == "not_found_error"
    long: list[anthropic.types.MessageParam] = [{"role": "user", "content": "word " * 50_000}]
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        client.messages.create(model=MODEL, messages=long, max_tokens=2)
    with pytest.raises(anthropic.BadRequestError) as counted:
        client.messages.count_tokens(model=MODEL, messages=long)
    assert error_type(counted.value) == "invalid_request_error"
    wrong = anthropic.Anthropic(base_url=target.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        wrong.messages.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert error_type(denied.value) == "authentication_error"


def test_an_output_limit_over_the_context_is_served_as_claude_code_asks_it(
    target: Target,
) -> None:
    """Claude Code asks for max_tokens 32,000 whatever the model; vLLM refuses any limit over
    max_model_len (4,096 here) with a 400, so the router lowers it to the context and the
    request is served (stop sequences, or a schema, end the dev model's output at once)."""
    client = target.anthropic()
    with client.messages.stream(
        model=MODEL,
        messages=[{"role": "user", "content": "Why does the build fail?"}],
        max_tokens=32_000,
        stop_sequences=[" ", "1", "2", "e"],  # vLLM takes at most 4
        extra_body={"temperature": 0},  # this SDK's typed arguments have no temperature
    ) as stream:
        reply = stream.get_final_message()
    assert reply.stop_reason in ("stop_sequence", "end_turn", "max_tokens")
    assert reply.usage.output_tokens < 4096
    answer = target.openai().responses.create(
        model=MODEL,
        input="Say nothing.",
        max_output_tokens=32_000,
        text={
            "format": {"type": "json_schema", "name": "empty", "schema": NO_ARGS, "strict": True}
        },
    )
    assert json.loads(answer.output_text) == {} and answer.status == "completed"


# --- LangChain ---------------------------------------------------------------------------------


def test_langchain_chat_openai_on_the_responses_api(target: Target) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL,
        base_url=f"{target.url}/v1",
        api_key=target.key,  # type: ignore[arg-type]
        use_responses_api=True,
        max_tokens=8,  # type: ignore[call-arg]
        temperature=0,
        max_retries=0,
    )
    message = llm.invoke("Name the failing test.")
    assert message.response_metadata["id"].startswith("resp_")
    assert message.text
    usage = message.usage_metadata
    assert usage is not None and usage["input_tokens"] > 0 and 1 <= usage["output_tokens"] <= 8


# --- a replayed Claude Code session ------------------------------------------------------------

CLAUDE_CODE_TOOLS: list[dict[str, Any]] = [
    {
        "name": "Read",
        "description": "Reads a file from the local filesystem.",
        "input_schema": {
            "type": "object",
            "properties": {"file_path": {"type": "string"}, "limit": {"type": "number"}},
            "required": ["file_path"],
        },
    },
    {
        "name": "Bash",
        "description": "Executes a bash command.",
        "input_schema": {
            "type": "object",
            "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
            "required": ["command"],
        },
    },
]
SESSION_STEPS = 150
WINDOW_TURNS = 12  # tool turns kept in the context (a compacting client), so it fits 4,096


def _tool_turn(step: int) -> list[dict[str, Any]]:
    """The assistant's tool call of `step` and the user turn holding its result, as Claude
    Code sends them back (a different call each step: no loop)."""
    call_id = f"toolu_{step:04d}"
    if step % 2:
        call = {"name": "Bash", "input": {"command": f"pytest -q tests/test_mod_{step}.py"}}
        result = f"{step % 7} passed in 0.{step:02d}s"
    else:
        call = {"name": "Read", "input": {"file_path": f"/repo/src/mod_{step}.py"}}
        result = f"def handler_{step}(request):\n    return respond(request, {step})\n"
    return [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": f"Step {step}: checking."},
                {"type": "tool_use", "id": call_id, **call},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call_id, "content": result}],
        },
    ]


def _session_step(task: dict[str, Any], step: int) -> dict[str, Any]:
    """Step `step` (0: the task itself) of the session, with the last WINDOW_TURNS tool turns."""
    messages = [task]
    for earlier in range(max(1, step - WINDOW_TURNS + 1), step + 1):
        messages += _tool_turn(earlier)
    last = messages[-1]["content"][-1]
    messages[-1] = {
        **messages[-1],
        "content": [
            *messages[-1]["content"][:-1],
            {**last, "cache_control": {"type": "ephemeral"}},
        ],
    }
    return {
        "model": MODEL,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "system": [
            {
                "type": "text",
                "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                "cache_control": {"type": "ephemeral"},
            }
        ],
        "tools": CLAUDE_CODE_TOOLS,
        "metadata": {"user_id": "user_0123_account__session_replay"},
        "messages": messages,
    }


def _sse_events(raw: str) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in raw.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        events.append((fields.get("event", ""), json.loads(fields.get("data", "null"))))
    return events


def test_replayed_claude_code_session_of_150_steps_on_the_default_config(
    target: Target,
) -> None:
    session = str(uuid.uuid4())
    headers = {
        "authorization": f"Bearer {target.key}",  # ANTHROPIC_AUTH_TOKEN
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
        "fine-grained-tool-streaming-2025-05-14",
        "x-app": "cli",
        "user-agent": "claude-cli/2.0.14 (external, cli)",
        "x-claude-code-session-id": session,
        "x-stainless-lang": "js",
    }
    task = {
        "role": "user",
        "content": [{"type": "text", "text": "The CI is red on main. Find out why and fix it."}],
    }
    prompt_tokens = 0
    started = time.monotonic()
    with httpx.Client(base_url=target.url, headers=headers, timeout=60) as client:
        for step in range(SESSION_STEPS):
            body = _session_step(task, step)
            with client.stream("POST", "/v1/messages", json=body) as resp:
                raw = resp.read().decode()
            assert resp.status_code == 200, (step, raw[:500])
            events = _sse_events(raw)
            assert events[0][0] == "message_start" and events[-1][0] == "message_stop", step
            prompt_tokens += events[0][1]["message"]["usage"]["input_tokens"]
    elapsed_s = time.monotonic() - started
    auth = {"authorization": f"Bearer {target.key}"}
    # one task: the first step starts run <session>:1, every tool-result step continues it
    session_view = httpx.get(f"{target.url}/v1/runs/{session}", headers=auth, timeout=10)
    assert session_view.status_code == 200, session_view.text
    view = session_view.json()
    assert view["runs"] == [f"{session}:1"] and view["current_run"] == f"{session}:1"
    run = httpx.get(f"{target.url}/v1/runs/{session}:1", headers=auth, timeout=10).json()
    assert run["totals"]["requests"] == SESSION_STEPS
    assert run["totals"]["outcomes"] == {"ok": SESSION_STEPS}
    assert run["totals"]["prompt_tokens"] == prompt_tokens  # what the engine reported
    assert run["classes"] == ["agent"]
    instances = sorted({r["instance"] for r in run["requests"]})
    queue_s = run["totals"]["queue_s"]
    print(f"{SESSION_STEPS} steps in {elapsed_s:.1f} s on {instances}, {queue_s:.2f} s queued")
