"""What the fake engine (`pools.testing.fake_engine`) answers on the OpenAI Responses API and
the Anthropic Messages API, in vLLM 0.32's shapes: request checks, prompt counts, whole
bodies and SSE events. Pure functions; the engine app does the timing and the I/O.

Output is `reasoning` thinking deltas (" think") followed by `output` text deltas (" tok").
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = [
    "messages_body",
    "messages_events",
    "messages_prompt_tokens",
    "messages_refusal",
    "responses_body",
    "responses_events",
    "responses_prompt_tokens",
    "responses_refusal",
    "too_long",
]


def _words(value: Any) -> int:
    """Whitespace-separated words in a string, or in the `text` / `thinking` / `output` /
    `arguments` / `input` strings anywhere in a JSON value."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(_words(v) for v in value)
    if isinstance(value, dict):
        return sum(
            _words(value.get(key))
            for key in ("text", "thinking", "output", "arguments", "content", "input")
        )
    return 0


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _error(message: str, code: int, param: str | None = None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": "BadRequestError", "param": param, "code": code}}
    )


def _anthropic_error(message: str, kind: str = "invalid_request_error") -> bytes:
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


def too_long(message: str, *, anthropic: bool) -> tuple[int, bytes]:
    """vLLM's 400 for a prompt over the context, in the protocol's shape."""
    return 400, _anthropic_error(message) if anthropic else _error(message, 400, "input_tokens")


# ---------------------------------------------------------------------------- responses


def responses_refusal(body: dict[str, Any]) -> tuple[int, bytes] | None:
    """vLLM's 400 for a body it cannot read (None: it can)."""
    if not isinstance(body.get("input"), str | list):
        return 400, _error("input: Field required", 400, "input")
    limit = body.get("max_output_tokens")
    if limit is not None and _positive(limit) is None:
        return 400, _error("max_output_tokens must be positive", 400, "max_output_tokens")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        return 400, _error("previous_response_id must be a string", 400, "previous_response_id")
    return None


def responses_prompt_tokens(body: dict[str, Any], stored_tokens: int) -> int:
    return (
        stored_tokens
        + _words(body.get("instructions"))
        + _words(body.get("input"))
        + 4 * (1 + (len(body["input"]) if isinstance(body.get("input"), list) else 1))
    )


def _response(
    rid: str, model: str, status: str, output: list[dict[str, Any]], usage: Any
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "response",
        "created_at": 0,
        "model": model,
        "status": status,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": usage,
    }


def _responses_usage(prompt: int, reasoning: int, output: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": reasoning + output,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + reasoning + output,
    }


def _responses_output(rid: str, reasoning: int, output: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if reasoning:
        items.append(
            {
                "type": "reasoning",
                "id": f"rs_{rid}",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": " think" * reasoning}],
            }
        )
    items.append(
        {
            "type": "message",
            "id": f"msg_{rid}",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": " tok" * output, "annotations": []}],
        }
    )
    return items


def responses_body(rid: str, model: str, prompt: int, reasoning: int, output: int) -> bytes:
    usage = _responses_usage(prompt, reasoning, output)
    return orjson.dumps(
        _response(rid, model, "completed", _responses_output(rid, reasoning, output), usage)
    )


def responses_events(rid: str, model: str, prompt: int, reasoning: int, output: int) -> list[bytes]:
    """Every event of a stream, in order: `event:` + `data:` lines, no `[DONE]`."""
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": _response(rid, model, "in_progress", [], None)}),
        ("response.in_progress", {"response": _response(rid, model, "in_progress", [], None)}),
    ]
    index = 0
    if reasoning:
        item = {"type": "reasoning", "id": f"rs_{rid}", "summary": [], "content": []}
        events.append(("response.output_item.added", {"output_index": 0, "item": item}))
        for _ in range(reasoning):
            delta = {"item_id": f"rs_{rid}", "output_index": 0, "content_index": 0}
            events.append(("response.reasoning_text.delta", {**delta, "delta": " think"}))
        events.append(("response.output_item.done", {"output_index": 0, "item": item}))
        index = 1
    message = {"type": "message", "id": f"msg_{rid}", "role": "assistant", "content": []}
    events.append(("response.output_item.added", {"output_index": index, "item": message}))
    part = {"item_id": f"msg_{rid}", "output_index": index, "content_index": 0}
    events.append(("response.content_part.added", {**part, "part": {"type": "output_text"}}))
    for _ in range(output):
        events.append(("response.output_text.delta", {**part, "delta": " tok", "logprobs": []}))
    events.append(("response.output_text.done", {**part, "text": " tok" * output}))
    events.append(("response.output_item.done", {"output_index": index, "item": message}))
    done = _response(
        rid,
        model,
        "completed",
        _responses_output(rid, reasoning, output),
        _responses_usage(prompt, reasoning, output),
    )
    events.append(("response.completed", {"response": done}))
    return [
        b"event: "
        + name.encode()
        + b"\ndata: "
        + orjson.dumps({"type": name, **data, "sequence_number": i})
        + b"\n\n"
        for i, (name, data) in enumerate(events)
    ]


# ---------------------------------------------------------------------------- messages


def messages_refusal(body: dict[str, Any]) -> tuple[int, bytes] | None:
    """vLLM's 400 (in Anthropic's shape) for a body it cannot read (None: it can)."""
    if not isinstance(body.get("messages"), list):
        return 400, _anthropic_error("messages: Field required")
    if _positive(body.get("max_tokens")) is None:
        return 400, _anthropic_error("max_tokens: Input should be a valid integer")
    return None


def messages_prompt_tokens(body: dict[str, Any]) -> int:
    messages = body.get("messages")
    count = len(messages) if isinstance(messages, list) else 0
    return _words(body.get("system")) + _words(messages) + 4 * (count + 1)


def _messages_content(reasoning: int, output: int) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = []
    if reasoning:
        content.append({"type": "thinking", "thinking": " think" * reasoning, "signature": ""})
    content.append({"type": "text", "text": " tok" * output})
    return content


def messages_body(mid: str, model: str, prompt: int, reasoning: int, output: int) -> bytes:
    return orjson.dumps(
        {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": _messages_content(reasoning, output),
            "stop_reason": "max_tokens",
            "stop_sequence": None,
            "usage": {"input_tokens": prompt, "output_tokens": reasoning + output},
        }
    )


def messages_events(mid: str, model: str, prompt: int, reasoning: int, output: int) -> list[bytes]:
    """Every event of a stream, in order, ending with `message_stop`."""
    start: dict[str, Any] = {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": prompt, "output_tokens": 0},
    }
    events: list[tuple[str, dict[str, Any]]] = [("message_start", {"message": start})]
    index = 0
    if reasoning:
        block = {"type": "thinking", "thinking": ""}
        events.append(("content_block_start", {"index": 0, "content_block": block}))
        for _ in range(reasoning):
            delta = {"type": "thinking_delta", "thinking": " think"}
            events.append(("content_block_delta", {"index": 0, "delta": delta}))
        events.append(("content_block_stop", {"index": 0}))
        index = 1
    events.append(
        ("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
    )
    for _ in range(output):
        delta = {"type": "text_delta", "text": " tok"}
        events.append(("content_block_delta", {"index": index, "delta": delta}))
    events.append(("content_block_stop", {"index": index}))
    usage = {"input_tokens": prompt, "output_tokens": reasoning + output}
    stop = {"stop_reason": "max_tokens", "stop_sequence": None}
    events.append(("message_delta", {"delta": stop, "usage": usage}))
    events.append(("message_stop", {}))
    return [
        b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **data}) + b"\n\n"
        for name, data in events
    ]
