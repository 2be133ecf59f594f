"""OpenAI Responses (`POST /v1/responses`), as vLLM 0.32 serves it.

- Body: `model`, `input` (a string or a list of items: messages whose `content` is a string or
  a list of parts with `text`, `function_call` with `name` / `arguments`,
  `function_call_output` with `output`, `reasoning` with `content` / `summary` parts),
  `instructions`, `tools`, `max_output_tokens`, `previous_response_id` (then `input` may be
  left out: vLLM is sent `[]`), `store` (`false`: the router does not remember where the
  response is, as the engine does not keep it), `stream`. Refused with 400 `invalid_field`:
  `background: true` (vLLM would generate after answering `queued`, outside admission and
  accounting) and `conversation` (vLLM ignores it: the history would be lost silently).
- Stream: SSE events of an `event:` line and a `data:` line. The first generated token is the
  first `*.delta` event (`response.output_text.delta`, `response.function_call_arguments.delta`,
  `response.reasoning_text.delta`, ...); the usage (`input_tokens`, `output_tokens`) is in the
  last event, `response.completed` (or `response.incomplete` / `response.failed`), and the
  response's id in the first, `response.created`. No `[DONE]`.
- A started stream that fails ends with an `event: error` carrying `code` and `message`.
"""

from __future__ import annotations

from typing import Any

import orjson

from router.admission.estimate import (
    EstimateInput,
    content_texts,
    estimate_input,
    positive_int,
    template_json,
)
from router.errors import BadRequest, GpupoolError
from router.gateway.protocols.base import (
    Extras,
    ProtocolAdapter,
    sse_data,
    sse_event_name,
    token_count,
)
from router.request import RequestContext, RequestOutcome

__all__ = ["ResponsesAdapter", "json_text", "tools_json"]

_FINAL_EVENTS = (b"response.completed", b"response.incomplete", b"response.failed")


def json_text(value: object) -> str:
    """`value` as the JSON text a chat template renders (a string stays as it is)."""
    return value if isinstance(value, str) else template_json(value)


def tools_json(tools: object) -> list[str]:
    """The tools list as the template renders it (nothing when there are none)."""
    return [template_json(tools)] if isinstance(tools, list) and tools else []


class ResponsesAdapter(ProtocolAdapter):
    name = "responses"
    final_markers = _FINAL_EVENTS
    path = "/v1/responses"
    stateful = True
    output_limit_fields = ("max_output_tokens",)

    def validate(self, body: dict[str, Any]) -> None:
        if body.get("background"):
            # vLLM answers `queued` at once and generates after the response: its KV and
            # tokens would escape admission, governance and accounting
            raise BadRequest(
                "'background' responses are not served by gpupool (their work would run "
                "outside admission and accounting); send the request with `stream: true` "
                "instead",
                "invalid_field",
                param="background",
            )
        if body.get("conversation") is not None:
            # vLLM ignores it: the response would silently lose the conversation's history
            raise BadRequest(
                "'conversation' is not served by gpupool (no Conversations API): send the "
                "history as `input`, or chain responses with `previous_response_id`",
                "invalid_field",
                param="conversation",
            )
        value = body.get("input")
        if value is None and body.get("previous_response_id") is None:
            raise BadRequest("missing required field 'input'", "missing_field", param="input")
        if value is not None and not isinstance(value, str | list):
            raise BadRequest(
                "'input' must be a string or a list of items", "invalid_field", param="input"
            )
        for name in ("instructions", "previous_response_id"):
            field = body.get(name)
            if field is not None and not isinstance(field, str):
                raise BadRequest(f"'{name}' must be a string", "invalid_field", param=name)
        limit = body.get("max_output_tokens")
        if limit is not None and positive_int(limit) is None:
            raise BadRequest(
                "'max_output_tokens' must be a positive integer",
                "invalid_field",
                param="max_output_tokens",
            )

    def prepare(self, body: dict[str, Any], ctx: RequestContext) -> bool:
        """A follow-up without `input` (optional in the Responses API) asks vLLM, which
        requires it, for an empty one."""
        if "input" in body:
            return False
        body["input"] = []
        return True

    def stores_response(self, body: dict[str, Any]) -> bool:
        return body.get("store") is not False

    def estimate_input(self, body: dict[str, Any]) -> EstimateInput:
        pieces: list[str] = []
        tools_json_text = tools_json(body.get("tools"))
        json_pieces = list(tools_json_text)
        messages = calls = 0
        instructions = body.get("instructions")
        if isinstance(instructions, str) and instructions:
            pieces.append(instructions)
            messages += 1
        items = body.get("input")
        if isinstance(items, str):
            pieces.append(items)
            messages += 1
        elif isinstance(items, list):
            for item in items:
                if isinstance(item, str):
                    pieces.append(item)
                    messages += 1
                    continue
                if not isinstance(item, dict):
                    continue
                kind = item.get("type")
                if kind == "function_call":
                    calls += 1
                    for key in ("name", "arguments"):
                        text = item.get(key)
                        if isinstance(text, str) and text:
                            json_pieces.append(text)
                elif kind == "function_call_output":
                    messages += 1
                    content_texts(item.get("output"), pieces)
                elif kind == "reasoning":
                    content_texts(item.get("content"), pieces)
                    content_texts(item.get("summary"), pieces)
                else:  # a message (`type: message`, or an easy input message with a role)
                    messages += 1
                    content_texts(item.get("content"), pieces)
        return estimate_input(
            pieces,
            json_pieces,
            messages=messages,
            tool_calls=calls,
            has_tools=bool(tools_json_text),
            requested_output=positive_int(body.get("max_output_tokens")),
        )

    # -- streams ---------------------------------------------------------------------------

    def is_first_token(self, event: bytes) -> bool:
        return sse_event_name(event).endswith(b".delta")

    def is_final_event(self, event: bytes) -> bool:
        return sse_event_name(event) in _FINAL_EVENTS

    def usage_event(
        self, ctx: RequestContext, event: bytes, outcome: RequestOutcome, extras: Extras
    ) -> bytes:
        if sse_event_name(event) not in _FINAL_EVENTS:
            return event
        data = sse_data(event)
        response = data.get("response") if data is not None else None
        if not isinstance(response, dict) or not self._record(response, outcome):
            return event
        if not ctx.want_gpu_usage or not (extra := extras()):
            return event
        assert data is not None
        response["usage"].update(extra)
        return b"event: " + sse_event_name(event) + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def response_id(self, event: bytes) -> str | None:
        if sse_event_name(event) != b"response.created":
            return None
        data = sse_data(event)
        response = data.get("response") if data is not None else None
        rid = response.get("id") if isinstance(response, dict) else None
        return rid if isinstance(rid, str) and rid else None

    # -- whole bodies ----------------------------------------------------------------------

    @staticmethod
    def _record(response: dict[str, Any], outcome: RequestOutcome) -> bool:
        usage = response.get("usage")
        if not isinstance(usage, dict):
            return False
        outcome.prompt_tokens = token_count(usage.get("input_tokens"))
        outcome.completion_tokens = token_count(usage.get("output_tokens"))
        return True

    def body_usage(self, data: dict[str, Any]) -> tuple[int, int] | None:
        usage = data.get("usage")
        if not isinstance(usage, dict):
            return None
        return token_count(usage.get("input_tokens")), token_count(usage.get("output_tokens"))

    def body_response_id(self, data: dict[str, Any]) -> str | None:
        rid = data.get("id")
        return rid if isinstance(rid, str) and rid else None

    # -- errors ----------------------------------------------------------------------------

    def error_event(self, err: GpupoolError) -> bytes:
        payload = {"type": "error", "code": err.code, "message": err.message, "param": err.param}
        return b"event: error\ndata: " + orjson.dumps(payload) + b"\n\n"

    def refusal_event(self, raw: bytes) -> bytes:
        try:
            data = orjson.loads(raw)
            error = data.get("error") if isinstance(data, dict) else None
        except orjson.JSONDecodeError:
            error = None
        if not isinstance(error, dict):
            error = {"message": raw[:500].decode("utf-8", "replace"), "code": None}
        payload = {
            "type": "error",
            "code": error.get("code"),
            "message": error.get("message"),
            "param": error.get("param"),
        }
        return b"event: error\ndata: " + orjson.dumps(payload) + b"\n\n"
