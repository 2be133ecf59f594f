"""The one contract every protocol adapter implements (chat, completions, responses, messages).

The request path (`router.gateway.proxy`) is the same for every endpoint; what differs between the
OpenAI Chat Completions, Completions and Responses APIs and the Anthropic Messages API is
only what an adapter knows:

- `validate(body)`: the fields the protocol requires (a `BadRequest` naming the field);
- `estimate_input(body)`: the text, tool JSON and output limit the estimate counts;
- `prepare(body, ctx)`: what the router asks of the engine on top of the client's body
  (`stream_options.include_usage` for chat and completions); True when it changed the body;
  `clamp_output(body, max_model_len)`: an output limit over the context lowered to it;
- on a stream, per SSE event (bytes ending in a blank line): `is_first_token` (a generated
  text, tool-call argument or reasoning delta), `usage_event` (read the usage into the
  outcome; may rewrite or drop the event), `is_final_event` (the event after which the
  response is complete: the router settles right before it);
- on a whole body: `body_usage`;
- errors: `error_response` (status, body, headers) and `error_event` (a started stream's
  last event), each in the protocol's own shape; the statuses come from `router.errors`;
- `response_id(...)`: the id a stateful response is stored under (responses only), and
  `stores_response(body)`: whether the engine keeps it (not with `store: false`).

Adapters hold no per-request state: one instance of each serves every request.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import orjson

from router.admission.estimate import EstimateInput
from router.errors import GpupoolError
from router.request import RequestContext, RequestOutcome

__all__ = ["Extras", "ProtocolAdapter", "sse_data", "sse_event_name", "token_count"]


def token_count(value: object) -> int:
    """A token count from an engine's usage: an int (a bool as 0 or 1), a finite float's whole
    part, or a string of digits; a negative as 0; anything else (absent, null, a word, a list,
    infinity, NaN) 0. An engine's odd usage must not cut the client's answer nor fail the
    settlement (a negative count is refused by the counters it feeds)."""
    if isinstance(value, int):
        return max(value, 0)
    if isinstance(value, float):
        return max(int(value), 0) if math.isfinite(value) else 0
    if isinstance(value, str):
        text = value.strip()
        return int(text) if text.isascii() and text.isdigit() else 0
    return 0


Extras = Callable[[], dict[str, Any]]


def sse_event_name(event: bytes) -> bytes:
    """The `event:` name of an SSE event (b"" when it has none)."""
    if not event.startswith(b"event:"):
        return b""
    end = event.find(b"\n")
    return event[6:end].strip() if end >= 0 else event[6:].strip()


def sse_data(event: bytes) -> dict[str, Any] | None:
    """The JSON object of an SSE event's `data:` line, None when it has none (or not JSON)."""
    start = 0 if event.startswith(b"data:") else event.find(b"\ndata:") + 1
    if start == 0 and not event.startswith(b"data:"):
        return None
    end = event.find(b"\n", start)
    raw = event[start + 5 : end if end >= 0 else len(event)].strip()
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


class ProtocolAdapter:
    """One endpoint's protocol knowledge. Defaults are OpenAI's (error shape, SSE framing)."""

    name: ClassVar[str]  # the `endpoint` metric label
    path: ClassVar[str]  # the engine's path for it
    usage_marker: ClassVar[bytes] = b'"usage"'  # events without it carry no usage
    # every event `is_final_event` accepts contains one of these; () reads every event
    final_markers: ClassVar[tuple[bytes, ...]] = ()
    engine_priority: ClassVar[bool] = True  # the engine reads the body's `priority`
    stateful: ClassVar[bool] = False  # `previous_response_id` continues a stored response
    output_limit_fields: ClassVar[tuple[str, ...]] = ("max_tokens",)  # the output limits

    def validate(self, body: dict[str, Any]) -> None:
        raise NotImplementedError

    def estimate_input(self, body: dict[str, Any]) -> EstimateInput:
        raise NotImplementedError

    def prepare(self, body: dict[str, Any], ctx: RequestContext) -> bool:
        return False

    # -- streams ---------------------------------------------------------------------------

    def is_first_token(self, event: bytes) -> bool:
        raise NotImplementedError

    def usage_event(
        self,
        ctx: RequestContext,
        event: bytes,
        outcome: RequestOutcome,
        extras: Extras,
    ) -> bytes:
        """Read the usage an event carries into `outcome`; return the event to send (b"" to
        drop it). On the response's final usage, with `x-gpupool-usage` (`ctx.want_gpu_usage`),
        `extras()` (GPU-seconds, ...: the observers' `usage_extra`, called once the tokens are
        in `outcome`) joins the usage."""
        return event

    def is_final_event(self, event: bytes) -> bool:
        raise NotImplementedError

    def clamp_output(self, body: dict[str, Any], max_model_len: int) -> bool:
        """Lower an output limit over the model's context to the context; True when it did.
        vLLM refuses a limit above `max_model_len` (400) but serves one that only overruns
        what the prompt leaves, stopping at the context's end: every limit is served that way
        (Claude Code asks for max_tokens 32,000 whatever the model)."""
        changed = False
        for field in self.output_limit_fields:
            value = body.get(field)
            if type(value) is int and value > max_model_len:
                body[field] = max_model_len
                changed = True
        return changed

    def stores_response(self, body: dict[str, Any]) -> bool:
        """Whether the engine keeps the response to `body` for follow-ups, so the router
        remembers where it is (responses without `store: false` only)."""
        return False

    def response_id(self, event: bytes) -> str | None:
        """The stored response's id when `event` announces it (responses only)."""
        return None

    # -- whole bodies ----------------------------------------------------------------------

    def body_usage(self, data: dict[str, Any]) -> tuple[int, int] | None:
        """(prompt, completion) tokens of a whole response, None when it has no usage."""
        usage = data.get("usage")
        if not isinstance(usage, dict):
            return None
        return token_count(usage.get("prompt_tokens")), token_count(usage.get("completion_tokens"))

    def add_body_usage(self, data: dict[str, Any], extra: dict[str, Any]) -> bool:
        """Add `extra` to a whole response's usage; False when it has none."""
        usage = data.get("usage")
        if not isinstance(usage, dict):
            return False
        usage.update(extra)
        return True

    def body_response_id(self, data: dict[str, Any]) -> str | None:
        return None

    # -- errors ----------------------------------------------------------------------------

    def error_response(self, err: GpupoolError) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        return err.status, err.body(), err.headers()

    def error_event(self, err: GpupoolError) -> bytes:
        """A started stream's last event when it fails."""
        return b"data: " + err.body() + b"\n\ndata: [DONE]\n\n"

    def engine_error(self, status: int, raw: bytes) -> bytes:
        """The engine's own 4xx body as this protocol's clients read it (passed through)."""
        return raw

    def refusal_event(self, raw: bytes) -> bytes:
        """The engine's own refusal (a 4xx body) as the one event of a stream the router
        had opened already (SSE wait comments)."""
        return b"data: " + raw.strip() + b"\n\ndata: [DONE]\n\n"
