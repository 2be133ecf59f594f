"""Loop detection: the same tool call with the same arguments N times in a row.

An agent framework sends its whole history back every step, so the assistant turns in
`messages` are the run's tool calls so far. `repeated_tool_call(messages, repeats)` looks at
the last `repeats` assistant turns: when each carries `tool_calls` and all of them are the same
calls (function name and arguments, compared as parsed JSON so key order and spacing do not
matter), the run is looping and the repeated call's name is returned. An assistant turn without
tool calls breaks the streak; tool results and user turns in between do not.

Pure: no I/O, never raises on a malformed history (what cannot be read breaks the streak).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

__all__ = ["repeated_tool_call", "tool_calls_signature"]


def _canonical_arguments(raw: Any) -> str:
    """Arguments as canonical JSON text (OpenAI sends them as a JSON string)."""
    value = raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError):
            return raw.strip()
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):
        return repr(value)


def tool_calls_signature(message: Any) -> tuple[tuple[str, str], ...] | None:
    """The (name, canonical arguments) of an assistant message's tool calls, in order; None
    when it is not an assistant message with at least one readable function call."""
    if not isinstance(message, dict) or message.get("role") != "assistant":
        return None
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        return None
    signature = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return None
        signature.append((function["name"], _canonical_arguments(function.get("arguments"))))
    return tuple(signature)


def repeated_tool_call(messages: Sequence[Any], repeats: int) -> str | None:
    """The name of the tool call the last `repeats` assistant turns all repeat, else None.
    `repeats` below 2 never detects anything."""
    if repeats < 2:
        return None
    streak: tuple[tuple[str, str], ...] | None = None
    seen = 0
    for message in reversed(messages):
        if not isinstance(message, dict) or message.get("role") != "assistant":
            continue
        signature = tool_calls_signature(message)
        if signature is None or (streak is not None and signature != streak):
            return None
        streak = signature
        seen += 1
        if seen >= repeats:
            return ", ".join(name for name, _ in streak)
    return None
