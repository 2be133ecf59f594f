"""The run boundary rule (router/governance/boundary.py) on each protocol's shapes, Claude
Code's real ones included, and how a session's runs are numbered (runtable.SessionRuns, and
the governor: retries, restarts, ends)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from pools.testing.config import config_for_test
from router.admission.estimate import Estimate
from router.errors import RateLimited, RunStopped
from router.gateway.classify import classify
from router.governance import GovernanceMetrics, Governor, StepSignals
from router.governance.boundary import anchor, starts_new_run
from router.governance.runtable import MAX_ANCHORS, SessionRuns
from router.governance.store import GovernanceStore
from router.request import RequestOutcome

# ------------------------------------------------------------------------------ chat


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}],
}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "a.py b.py"}


def test_chat_a_user_message_starts_a_run_and_tool_results_continue_it() -> None:
    first = [{"role": "system", "content": "be brief"}, _user("list the files")]
    assert starts_new_run({"messages": first})
    step2 = [*first, CALL, RESULT]
    assert not starts_new_run({"messages": step2})
    a1, a2 = anchor({"messages": first}), anchor({"messages": step2})
    assert a1 is not None and a2 is not None and a1.key == a2.key  # the same task
    turn2 = [*step2, {"role": "assistant", "content": "a.py and b.py"}, _user("now delete b")]
    a3 = anchor({"messages": turn2})
    assert a3 is not None and a3.new_run and a3.key != a1.key
    legacy = [*first, {"role": "function", "name": "ls", "content": "x"}]
    assert not starts_new_run({"messages": legacy})


def test_the_same_words_later_in_the_conversation_are_a_new_task() -> None:
    one = [_user("continue")]
    two = [*one, {"role": "assistant", "content": "done"}, _user("continue")]
    a1, a2 = anchor({"messages": one}), anchor({"messages": two})
    assert a1 is not None and a2 is not None and a1.key != a2.key


# ------------------------------------------------------------------------------ Claude Code

# What Claude Code sends on /v1/messages: system reminders as text blocks, a cache marker on
# the last block (moved to the newest message on every step), tool results as `tool_result`
# blocks of a user message, sometimes with text blocks beside them.
CC_TURN: dict[str, Any] = {  # a JSON message, as the product takes a body
    "role": "user",
    "content": [
        {"type": "text", "text": "<system-reminder>\nAs you answer ...\n</system-reminder>"},
        {"type": "text", "text": "fix the failing test", "cache_control": {"type": "ephemeral"}},
    ],
}
CC_TOOL_USE = {
    "role": "assistant",
    "content": [
        {"type": "text", "text": "I'll run the tests."},
        {
            "type": "tool_use",
            "id": "toolu_01A",
            "name": "Bash",
            "input": {"command": "pytest -q", "description": "Run tests"},
        },
    ],
}


def _cc_result(n: int, *, with_text: bool = False) -> dict[str, Any]:
    blocks: list[dict[str, Any]] = [
        {
            "type": "tool_result",
            "tool_use_id": f"toolu_0{n}",
            "content": [{"type": "text", "text": "1 failed"}],
            "cache_control": {"type": "ephemeral"},
        }
    ]
    if with_text:
        blocks.append({"type": "text", "text": "<system-reminder>todo list</system-reminder>"})
    return {"role": "user", "content": blocks}


def test_claude_code_tool_results_continue_and_a_typed_prompt_starts_a_run() -> None:
    start = {"messages": [CC_TURN]}
    assert starts_new_run(start, "messages")
    moved = {  # the next step: the cache marker moved off the first message
        **CC_TURN,
        "content": [
            {k: v for k, v in b.items() if k != "cache_control"} for b in CC_TURN["content"]
        ],
    }
    step = {"messages": [moved, CC_TOOL_USE, _cc_result(1)]}
    assert not starts_new_run(step, "messages")
    with_text = {"messages": [moved, CC_TOOL_USE, _cc_result(1, with_text=True)]}
    assert not starts_new_run(with_text, "messages")
    a0, a1, a2 = (anchor(b, "messages") for b in (start, step, with_text))
    assert a0 is not None and a1 is not None and a2 is not None
    assert a0.key == a1.key == a2.key
    image_turn = {
        "role": "user",
        "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}},
            {"type": "text", "text": "what is wrong here?"},
        ],
    }
    later = {"messages": [moved, CC_TOOL_USE, _cc_result(1), _cc_assistant(), image_turn]}
    assert starts_new_run(later, "messages")


def _cc_assistant() -> dict[str, Any]:
    return {"role": "assistant", "content": [{"type": "text", "text": "Fixed."}]}


def test_a_string_content_user_message_starts_a_run_on_messages() -> None:
    assert starts_new_run({"messages": [_user("hi")]}, "messages")
    assistant_prefill = {"messages": [_user("hi"), {"role": "assistant", "content": "{"}]}
    assert not starts_new_run(assistant_prefill, "messages")


# ------------------------------------------------------------------------------ responses


def test_responses_input_shapes() -> None:
    assert starts_new_run({"input": "write a haiku"}, "responses")
    items = [
        {"role": "user", "content": "what is the weather"},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    assert not starts_new_run({"input": items}, "responses")
    a_start = anchor({"input": items[:1]}, "responses")
    a_tool = anchor({"input": items}, "responses")
    assert a_start is not None and a_tool is not None and a_start.key == a_tool.key
    typed = [
        *items,
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "and tomorrow?"}],
        },
    ]
    assert starts_new_run({"input": typed}, "responses")
    # a follow-up with only tool outputs names no user message: it joins the current run
    follow = {"previous_response_id": "resp_1", "input": items[2:]}
    assert anchor(follow, "responses") is None and not starts_new_run(follow, "responses")
    # the same words after different responses are different tasks
    k1 = anchor({"previous_response_id": "resp_1", "input": "go on"}, "responses")
    k2 = anchor({"previous_response_id": "resp_2", "input": "go on"}, "responses")
    assert k1 is not None and k2 is not None and k1.key != k2.key


def test_completions_have_no_turns() -> None:
    assert anchor({"prompt": "def f():"}, "completions") is None
    assert not starts_new_run({"prompt": "def f():"}, "completions")


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool", "system"]), "content": _json}
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["messages", "input", "previous_response_id", "prompt"]),
        _json | st.lists(_message | _json, max_size=6),
        max_size=3,
    ),
    st.sampled_from(["chat", "completions", "responses", "messages"]),
)
def test_any_body_gets_an_answer_and_never_an_error(body: dict[str, Any], protocol: str) -> None:
    found = anchor(body, protocol)
    assert found is None or (isinstance(found.key, str) and len(found.key) == 24)
    assert starts_new_run(body, protocol) == (found is not None and found.new_run)


# ------------------------------------------------------------------------------ numbering


def test_session_runs_number_tasks_and_keep_retries_and_interleaving() -> None:
    s = SessionRuns()
    assert s.run_for(None) == 1  # an anchor-less first step: run 1
    assert s.run_for("task-a") == 2
    assert s.run_for("task-a") == 2  # a retry, or its next tool step
    assert s.run_for("title") == 3  # a side request between the task's steps
    assert s.run_for("task-a") == 2  # the task's next tool step goes back to its run
    assert s.run_for(None) == 2  # no anchor: the current run
    s.ended(2)
    assert s.run_for("task-a") == 4  # ended: the task continues as a new run
    for i in range(MAX_ANCHORS + 5):
        s.run_for(f"t{i}")
    assert len(s.anchors) == MAX_ANCHORS and s.last == 4 + MAX_ANCHORS + 5


# ------------------------------------------------------------------------------ the governor


class Clock:
    now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


CONFIG = config_for_test(
    tenants=[{"name": "t", "api_key_sha256": "0" * 64, "run_guards": {"max_steps": 3}}]
)
TENANT = CONFIG.tenants[0]
ESTIMATE = Estimate(prompt_tokens=10, output_tokens=5, source="heuristic")
SESSION = {"x-claude-code-session-id": "9f1c2d3e-aaaa-bbbb-cccc-0123456789ab"}
_ids = iter(range(10**9))


async def _step(
    gov: Governor,
    clock: Clock,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    protocol: str = "messages",
    *,
    serve: bool = True,
) -> str:
    """One step through classify -> prepare -> enter -> dispatch -> finish. Returns its run."""
    h = {**SESSION, **(headers or {})}
    ctx = classify(
        h, body, TENANT, CONFIG, request_id=f"r{next(_ids)}", now_s=clock(), protocol=protocol
    )
    ctx, signals = gov.prepare(ctx, TENANT, h, body)
    await gov.enter(ctx, ESTIMATE, signals)
    outcome = RequestOutcome(ctx=ctx, estimate=ESTIMATE)
    if serve:
        outcome.dispatched_at_s = clock()
        gov.dispatched(outcome)
        outcome.status = 200
    else:
        outcome.status, outcome.outcome = 429, "rejected"
    clock.now_s += 1.0
    gov.finished(outcome)
    assert ctx.run_id is not None
    return ctx.run_id


def _governor(clock: Clock, store: GovernanceStore | None = None) -> Governor:
    return Governor(CONFIG, GovernanceMetrics(CollectorRegistry()), clock=clock, store=store)


def _task(n_results: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [CC_TURN]
    for i in range(n_results):
        messages += [CC_TOOL_USE, _cc_result(i)]
    return {"model": "tiny", "messages": messages}


async def test_a_session_gets_one_run_per_task(tmp_path: Path) -> None:
    clock = Clock()
    gov = _governor(clock)
    sid = SESSION["x-claude-code-session-id"]
    assert await _step(gov, clock, _task(0), serve=False) == f"{sid}:1"  # refused (429) ...
    assert await _step(gov, clock, _task(0)) == f"{sid}:1"  # ... and retried: still run 1
    assert await _step(gov, clock, _task(1)) == f"{sid}:1"
    assert await _step(gov, clock, _task(2)) == f"{sid}:1"  # 3 dispatched steps: its limit
    with pytest.raises(RunStopped):
        await _step(gov, clock, _task(3))
    # the user types again: a new run, the guard does not lock the session out
    turn2 = _task(3)
    turn2["messages"] += [_cc_assistant(), _user("try another way")]
    assert await _step(gov, clock, turn2) == f"{sid}:2"
    session = gov.session("t", sid)
    assert session is not None and session["runs"] == [f"{sid}:1", f"{sid}:2"]
    assert session["current_run"] == f"{sid}:2"


async def test_ending_a_session_run_moves_its_task_to_the_next_run() -> None:
    clock = Clock()
    gov = _governor(clock)
    sid = SESSION["x-claude-code-session-id"]
    assert await _step(gov, clock, _task(0)) == f"{sid}:1"
    ended = gov.end_run("t", sid)  # POST /v1/runs/{session}/end: the current run
    assert ended is not None and ended.run_id == f"{sid}:1" and ended.ended == "client_end"
    assert await _step(gov, clock, _task(1)) == f"{sid}:2"
    assert await _step(gov, clock, _task(2), {"x-gpupool-run-end": "1"}) == f"{sid}:2"
    assert await _step(gov, clock, _task(3)) == f"{sid}:3"


async def test_session_numbering_survives_a_restart(tmp_path: Path) -> None:
    clock = Clock()
    gov = _governor(clock, GovernanceStore(tmp_path / "g.sqlite"))
    await gov.start()
    sid = SESSION["x-claude-code-session-id"]
    turn2 = _task(1)
    turn2["messages"] += [_cc_assistant(), _user("next")]
    assert await _step(gov, clock, _task(0)) == f"{sid}:1"
    assert await _step(gov, clock, turn2) == f"{sid}:2"
    await gov.aclose()
    again = _governor(clock, GovernanceStore(tmp_path / "g.sqlite"))
    await again.start()
    try:
        assert await _step(again, clock, _task(2)) == f"{sid}:1"  # task one's anchor is kept
        turn3 = _task(2)
        turn3["messages"] += [_cc_assistant(), _user("and another")]
        assert await _step(again, clock, turn3) == f"{sid}:3"  # never a reused number
    finally:
        await again.aclose()


async def test_an_explicit_run_id_is_one_run_and_other_identities_are_sessions() -> None:
    clock = Clock()
    gov = _governor(clock)
    body = {"model": "tiny", "messages": [_user("hi")]}
    explicit = {"x-gpupool-run-id": "job-7", "x-claude-code-session-id": ""}
    assert await _step(gov, clock, body, explicit, "chat") == "job-7"
    for header in ("x-dynamo-trajectory-id", "session-id", "thread-id", "x-session-id"):
        h = {"x-claude-code-session-id": "", header: f"s-{header}"}
        assert await _step(gov, clock, body, h, "chat") == f"s-{header}:1"
    xargs = {**body, "vllm_xargs": {"agentic_context": {"session_id": "ctx-1"}}}
    assert await _step(gov, clock, xargs, {"x-claude-code-session-id": ""}, "chat") == "ctx-1:1"


def test_classify_names_the_session_and_the_turn() -> None:
    body = {"model": "tiny", "messages": [_user("hi")]}
    ctx = classify(SESSION, body, TENANT, CONFIG, request_id="r", now_s=0.0, protocol="chat")
    assert ctx.session_id == SESSION["x-claude-code-session-id"] and ctx.session_turn
    assert ctx.home_key == ("t", ctx.session_id)
    plain = classify({"x-gpupool-run-id": "r1"}, body, TENANT, CONFIG, request_id="r", now_s=0.0)
    assert plain.session_id is None and plain.session_turn is None
    assert plain.home_key == plain.run_key == ("t", "r1")


def test_signals_type_is_exported() -> None:
    assert StepSignals(tenant=TENANT).run_end is False


async def test_a_sessions_runs_share_one_concurrency_slot() -> None:
    """A free tenant (one agent run at a time) types its next task while the last run is
    still active: the session holds the slot, so it is served; another session is refused."""
    config = config_for_test(tenants=[{"name": "t", "api_key_sha256": "0" * 64, "tier": "free"}])
    tenant = config.tenants[0]
    clock = Clock()
    gov = Governor(config, GovernanceMetrics(CollectorRegistry()), clock=clock)

    async def step(headers: dict[str, str], body: dict[str, Any]) -> str:
        ctx = classify(headers, body, tenant, config, request_id=f"r{next(_ids)}", now_s=clock())
        ctx, signals = gov.prepare(ctx, tenant, headers, body)
        await gov.enter(ctx, ESTIMATE, signals)
        outcome = RequestOutcome(ctx=ctx, estimate=ESTIMATE, status=200)
        gov.finished(outcome)
        assert ctx.run_id is not None
        return ctx.run_id

    sid = SESSION["x-claude-code-session-id"]
    assert await step(SESSION, _task(1)) == f"{sid}:1"
    turn2 = _task(1)
    turn2["messages"] += [_cc_assistant(), _user("next")]
    assert await step(SESSION, turn2) == f"{sid}:2"  # run 1 still active: same slot
    with pytest.raises(RateLimited) as refused:
        await step({"x-claude-code-session-id": "another"}, _task(0))
    assert refused.value.code == "tenant_concurrency"
