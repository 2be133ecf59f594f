"""OpenAI Chat Completions (`/v1/chat/completions`) and Completions (`/v1/completions`).

A streaming request always asks vLLM for `stream_options.include_usage`; the usage-only event
is dropped again when the client did not ask for it (and keeps the GPU-seconds with
`x-gpupool-usage`). The first generated token is the first event whose choice carries text,
`content`, a tool call or a reasoning delta (`reasoning_content` / `reasoning`), not vLLM's
role-only opening event.
"""

from __future__ import annotations

from typing import Any, ClassVar

import orjson

from router.admission.estimate import EstimateInput, read_openai
from router.errors import BadRequest
from router.gateway.protocols.base import Extras, ProtocolAdapter, sse_data, token_count
from router.request import RequestContext, RequestOutcome

__all__ = ["ChatAdapter", "CompletionsAdapter"]

_OUTPUT_KEYS = ("content", "tool_calls", "reasoning_content", "reasoning")
_FIRST_TOKEN_MARKERS = (b'"content"', b'"text"', b'"tool_calls"', b'"reasoning')


class _OpenAIGeneration(ProtocolAdapter):
    chat: ClassVar[bool]
    final_markers = (b"[DONE]",)

    def estimate_input(self, body: dict[str, Any]) -> EstimateInput:
        return read_openai(body, chat=self.chat)

    def prepare(self, body: dict[str, Any], ctx: RequestContext) -> bool:
        if not ctx.stream:
            return False
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            return False
        body["stream_options"] = {
            **(options if isinstance(options, dict) else {}),
            "include_usage": True,
        }
        return True

    def is_first_token(self, event: bytes) -> bool:
        """True for an event carrying generated output: text, content, a tool call or a
        reasoning delta (not the role-only opening event, not the usage-only event)."""
        if not any(marker in event for marker in _FIRST_TOKEN_MARKERS):
            return False
        data = sse_data(event)
        choices = data.get("choices") if data is not None else None
        if not isinstance(choices, list):
            return False
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if choice.get("text"):
                return True
            delta = choice.get("delta")
            if isinstance(delta, dict) and any(delta.get(key) for key in _OUTPUT_KEYS):
                return True
        return False

    def is_final_event(self, event: bytes) -> bool:
        return event.startswith(b"data: [DONE]")

    def usage_event(
        self, ctx: RequestContext, event: bytes, outcome: RequestOutcome, extras: Extras
    ) -> bytes:
        """Record the usage; drop the usage-only event unless the client asked for it."""
        data = sse_data(event) if event.startswith(b"data:") else None
        if data is None or not isinstance(data.get("usage"), dict):
            return event
        usage = data["usage"]
        outcome.prompt_tokens = token_count(usage.get("prompt_tokens"))
        outcome.completion_tokens = token_count(usage.get("completion_tokens"))
        if data.get("choices"):
            return event  # continuous usage stats on a content event: keep it
        if not (ctx.client_wants_usage or ctx.want_gpu_usage):
            return b""
        if not ctx.want_gpu_usage:
            return event
        extra = extras()
        if not extra:
            return event
        usage.update(extra)
        return b"data: " + orjson.dumps(data) + b"\n\n"


class ChatAdapter(_OpenAIGeneration):
    name = "chat"
    path = "/v1/chat/completions"
    chat = True
    output_limit_fields = ("max_tokens", "max_completion_tokens")

    def validate(self, body: dict[str, Any]) -> None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest(
                "'messages' must be a non-empty list", "missing_field", param="messages"
            )


class CompletionsAdapter(_OpenAIGeneration):
    name = "completions"
    path = "/v1/completions"
    chat = False

    def validate(self, body: dict[str, Any]) -> None:
        if "prompt" not in body:
            raise BadRequest("missing required field 'prompt'", "missing_field", param="prompt")
