"""Where a session's runs begin and end (pure: the request body in, the rule's answer out).

A session identity (`x-claude-code-session-id`, Codex's `session-id` / `thread-id`,
`x-session-id`, `x-dynamo-trajectory-id`, `vllm_xargs.agentic_context`) lives for hours and
holds many tasks. A run is one task: a step whose LAST input is a new user message starts a
new run of its session; a step whose last input is a tool result continues the run. What a
tool result looks like depends on the protocol:

    chat         the last message has role `tool` (or the legacy `function`): continues;
                 role `user`: a new run
    responses    the last `input` item is a `function_call_output` (or another `*_call_output`):
                 continues; a user message, or a plain string `input`: a new run
    messages     (Anthropic) the last message has role `user` either way: a user message whose
                 content holds a `tool_result` block continues (Claude Code sends tool results
                 so, sometimes with text blocks beside them); text / image blocks only: a new run
    completions  a bare prompt has no turns: every step continues the session's current run

`anchor(body, protocol)` names the user message a step belongs to: the last message for a new
run, else the last user message (not a tool result) before the step's tool results. The
governor numbers a session's runs by their anchors (`governor`): a retried step carries the
same anchor and stays in its run; a side request of the client (a title, a safety check)
interleaved with a task's steps gets its own run, and the task's next tool step goes back to
its own. The anchor's key is the message's position and its text (cache markers, which
clients move from turn to turn, are left out), so it is stable while the conversation grows.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

__all__ = ["PROTOCOLS", "Anchor", "anchor", "starts_new_run"]

PROTOCOLS = ("chat", "completions", "responses", "messages")


@dataclass(frozen=True, slots=True)
class Anchor:
    """The user message a step belongs to."""

    key: str  # stable over the task's steps: position + text digest
    new_run: bool  # the step's last input is this message: the step starts a new run


def starts_new_run(body: dict[str, Any], protocol: str = "chat") -> bool:
    """True when the step's last input is a new user message (see the module docstring)."""
    found = anchor(body, protocol)
    return found is not None and found.new_run


def anchor(body: dict[str, Any], protocol: str = "chat") -> Anchor | None:
    """The step's anchor; None where the body has no user message to name (a completions
    prompt, a Responses follow-up carrying only tool outputs, a malformed body)."""
    if protocol == "responses":
        return _responses(body)
    if protocol in ("chat", "messages"):
        messages = body.get("messages")
        if isinstance(messages, list):
            return _last_user(messages, "")
    return None


def _responses(body: dict[str, Any]) -> Anchor | None:
    previous = body.get("previous_response_id")
    salt = previous if isinstance(previous, str) else ""
    items = body.get("input")
    if isinstance(items, str):
        return Anchor(_key(0, items, salt), True)
    if isinstance(items, list):
        return _last_user(items, salt)
    return None


def _last_user(items: list[Any], salt: str) -> Anchor | None:
    for index in range(len(items) - 1, -1, -1):
        item = items[index]
        if not isinstance(item, dict):
            continue
        if _is_user_message(item):
            key = _key(index, _text(item.get("content")), salt)
            return Anchor(key, index == len(items) - 1)
    return None


def _is_user_message(item: dict[str, Any]) -> bool:
    """A user's own message: role `user`, not an item of another type, and (Anthropic) no
    `tool_result` block in its content."""
    if item.get("role") != "user" or item.get("type", "message") != "message":
        return False
    content = item.get("content")
    if isinstance(content, list):
        return not any(isinstance(b, dict) and b.get("type") == "tool_result" for b in content)
    return True


def _text(content: Any) -> str:
    """A message's content as text: strings and text blocks' text; other blocks by type."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict):
            text = block.get("text")
            parts.append(text if isinstance(text, str) else f"<{block.get('type')}>")
    return "\n".join(parts)


def _key(index: int, text: str, salt: str) -> str:
    digest = hashlib.blake2b(
        f"{index}\0{salt}\0{text}".encode(errors="surrogatepass"), digest_size=12
    )
    return digest.hexdigest()
