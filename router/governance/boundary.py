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
    """Walk back to the last user message that is not a tool result: O(1) per item, about
    0.3 us (it runs on every step of a task: ~100 us at 300 messages, measured on a loaded
    2-core machine; the body's JSON parse costs more)."""
    for index in range(len(items) - 1, -1, -1):
        item = items[index]
        if type(item) is not dict or item.get("role") != "user":
            continue
        if item.get("type", "message") != "message":
            continue
        content = item.get("content")
        if type(content) is list and content:
            first = content[0]  # Anthropic puts tool_result blocks first
            if type(first) is dict and first.get("type") == "tool_result":
                continue
        return Anchor(_key(index, content, salt), index == len(items) - 1)
    return None


# the text a key reads: a message's head and tail (a long pasted file costs no more than this)
_KEY_TEXT_CHARS = 2048


def _key(index: int, content: Any, salt: str) -> str:
    """Position + the message's text (strings and text blocks; other blocks by type; cache
    markers and other keys left out), digested. Reads at most the head and tail of a long
    text, with its length."""
    h = hashlib.blake2b(f"{index}\0{salt}\0".encode(errors="surrogatepass"), digest_size=12)
    blocks = [content] if isinstance(content, str) else content if isinstance(content, list) else []
    for block in blocks:
        if isinstance(block, dict):
            text = block.get("text")
            block = text if isinstance(text, str) else f"<{block.get('type')}>"
        if isinstance(block, str):
            if len(block) > 2 * _KEY_TEXT_CHARS:
                block = f"{block[:_KEY_TEXT_CHARS]}\0{len(block)}\0{block[-_KEY_TEXT_CHARS:]}"
            h.update(block.encode(errors="surrogatepass"))
            h.update(b"\0")
    return h.hexdigest()
