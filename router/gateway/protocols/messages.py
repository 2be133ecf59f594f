"""Anthropic Messages (`POST /v1/messages`), as vLLM 0.32 serves it.

- Body: `model`, `max_tokens` (required), `messages` (each `content` a string or a list of
  blocks: `text`, `tool_use` with `name` / `input`, `tool_result` with `content`, `thinking`),
  `system` (a string or text blocks), `tools`, `stream`. A message's `role` must be `user` or
  `assistant` (vLLM takes any; Anthropic's API refuses the rest with 400).
- Stream: SSE events of an `event:` line and a `data:` line. The first generated token is the
  first `content_block_delta` of a `text_delta`, `input_json_delta` or `thinking_delta`; the
  prompt tokens are in `message_start`'s `message.usage` and again, with the output tokens, in
  `message_delta`'s `usage` (`input_tokens` excludes cache reads: they are added back); the
  last event is `message_stop`.
- Every gpupool error answers Anthropic's shape and status codes (`router.errors`:
  `anthropic_payload`, `anthropic_status`); a started stream that fails ends with
  `event: error`.
"""

from __future__ import annotations

from typing import Any

import orjson

from router.admission.estimate import EstimateInput, estimate_input, positive_int
from router.errors import BadRequest, GpupoolError, anthropic_body, anthropic_status
from router.gateway.protocols.base import (
    Extras,
    ProtocolAdapter,
    sse_data,
    sse_event_name,
    token_count,
)
from router.gateway.protocols.responses import json_text, tools_json
from router.request import RequestContext, RequestOutcome

__all__ = ["MessagesAdapter", "prompt_tokens_of"]

_DELTAS = (b'"text_delta"', b'"input_json_delta"', b'"thinking_delta"')
_ENGINE_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}
_ANTHROPIC_TYPES = frozenset(
    {
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
        "request_too_large",
        "rate_limit_error",
        "api_error",
        "overloaded_error",
        "timeout_error",
    }
)


def prompt_tokens_of(usage: dict[str, Any]) -> int:
    """All prompt tokens of an Anthropic usage: `input_tokens` plus the cache reads and
    writes it leaves out."""
    return sum(
        token_count(usage.get(key))
        for key in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    )


def _blocks(content: object, pieces: list[str], json_pieces: list[str]) -> int:
    """Read a content (a string or a list of blocks) into the text and JSON pieces; returns
    the tool calls (`tool_use` blocks) it holds."""
    if isinstance(content, str):
        if content:
            pieces.append(content)
        return 0
    if not isinstance(content, list):
        return 0
    calls = 0
    for block in content:
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "tool_use":
            calls += 1
            name = block.get("name")
            if isinstance(name, str) and name:
                json_pieces.append(name)
            if block.get("input") is not None:
                json_pieces.append(json_text(block.get("input")))
        elif kind == "tool_result":
            calls += _blocks(block.get("content"), pieces, json_pieces)
        else:
            for key in ("text", "thinking"):
                text = block.get(key)
                if isinstance(text, str) and text:
                    pieces.append(text)
    return calls


class MessagesAdapter(ProtocolAdapter):
    name = "messages"
    final_markers = (b"message_stop",)
    path = "/v1/messages"
    engine_priority = False  # vLLM's Anthropic request has no `priority`

    def validate(self, body: dict[str, Any]) -> None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest(
                "'messages' must be a non-empty list", "missing_field", param="messages"
            )
        for i, message in enumerate(messages):
            role = message.get("role") if isinstance(message, dict) else None
            if role != "user" and role != "assistant":
                # vLLM takes any role; Anthropic's API (and a `system` turn there) refuses it
                raise BadRequest(
                    f"messages.{i}.role must be 'user' or 'assistant' (got {str(role)[:40]!r}); "
                    "a system prompt goes in the top-level 'system' field",
                    "invalid_field",
                    param=f"messages.{i}.role",
                )
        if "max_tokens" not in body:
            raise BadRequest(
                "missing required field 'max_tokens'", "missing_field", param="max_tokens"
            )
        if positive_int(body.get("max_tokens")) is None:
            raise BadRequest(
                "'max_tokens' must be a positive integer", "invalid_field", param="max_tokens"
            )
        system = body.get("system")
        if system is not None and not isinstance(system, str | list):
            raise BadRequest(
                "'system' must be a string or a list of text blocks",
                "invalid_field",
                param="system",
            )

    def estimate_input(self, body: dict[str, Any]) -> EstimateInput:
        tools = tools_json(body.get("tools"))
        pieces: list[str] = []
        json_pieces = list(tools)
        messages = calls = 0
        system = body.get("system")
        if system:
            messages += 1
            calls += _blocks(system, pieces, json_pieces)
        items = body.get("messages")
        if isinstance(items, list):
            for message in items:
                if isinstance(message, dict):
                    messages += 1
                    calls += _blocks(message.get("content"), pieces, json_pieces)
        return estimate_input(
            pieces,
            json_pieces,
            messages=messages,
            tool_calls=calls,
            has_tools=bool(tools),
            requested_output=positive_int(body.get("max_tokens")),
        )

    # -- streams ---------------------------------------------------------------------------

    def is_first_token(self, event: bytes) -> bool:
        return sse_event_name(event) == b"content_block_delta" and any(
            kind in event for kind in _DELTAS
        )

    def is_final_event(self, event: bytes) -> bool:
        return sse_event_name(event) == b"message_stop"

    def usage_event(
        self, ctx: RequestContext, event: bytes, outcome: RequestOutcome, extras: Extras
    ) -> bytes:
        name = sse_event_name(event)
        if name not in (b"message_start", b"message_delta"):
            return event
        data = sse_data(event)
        if data is None:
            return event
        holder = data.get("message") if name == b"message_start" else data
        usage = holder.get("usage") if isinstance(holder, dict) else None
        if not isinstance(usage, dict):
            return event
        prompt = prompt_tokens_of(usage)
        if prompt:
            outcome.prompt_tokens = prompt
        if name == b"message_start":
            return event
        outcome.completion_tokens = token_count(usage.get("output_tokens"))
        if not ctx.want_gpu_usage or not (extra := extras()):
            return event
        usage.update(extra)
        return b"event: message_delta\ndata: " + orjson.dumps(data) + b"\n\n"

    # -- whole bodies ----------------------------------------------------------------------

    def body_usage(self, data: dict[str, Any]) -> tuple[int, int] | None:
        usage = data.get("usage")
        if not isinstance(usage, dict):
            return None
        return prompt_tokens_of(usage), token_count(usage.get("output_tokens"))

    # -- errors ----------------------------------------------------------------------------

    def error_response(self, err: GpupoolError) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        return anthropic_status(err), anthropic_body(err), err.headers()

    def error_event(self, err: GpupoolError) -> bytes:
        return b"event: error\ndata: " + anthropic_body(err) + b"\n\n"

    def engine_error(self, status: int, raw: bytes) -> bytes:
        """vLLM answers refusals on /v1/messages in OpenAI's shape (request validation) or in
        Anthropic's envelope with its own error type (`BadRequestError`): both are rewritten
        into Anthropic's shape and types; a body already so passes through."""
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            data = None
        error = data.get("error") if isinstance(data, dict) else None
        if (
            isinstance(data, dict)
            and data.get("type") == "error"
            and isinstance(error, dict)
            and error.get("type") in _ANTHROPIC_TYPES
        ):
            return raw
        message = error.get("message") if isinstance(error, dict) else None
        if not isinstance(message, str):
            message = raw[:500].decode("utf-8", "replace") or f"engine answered {status}"
        kind = _ENGINE_ERROR_TYPES.get(status, "invalid_request_error")
        return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})

    def refusal_event(self, raw: bytes) -> bytes:
        return b"event: error\ndata: " + self.engine_error(400, raw).strip() + b"\n\n"
