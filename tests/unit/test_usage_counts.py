"""An engine's usage counts that are not counts (a word, a list, infinity, a negative): every
protocol reads them with `token_count`, so a streamed usage event neither cuts the client's
stream nor fails the settlement (through the router with a fake engine: test_proxy.py's
`test_usage_counts_that_are_not_counts_lose_nothing`)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from router.admission.estimate import Estimate
from router.gateway.protocols.base import token_count
from router.gateway.protocols.messages import MessagesAdapter
from router.gateway.protocols.responses import ResponsesAdapter
from router.request import RequestContext, RequestOutcome

ODD: list[object] = ["many", [3], {"n": 3}, float("inf"), float("nan"), -5, "-5", "²", None, ""]


@pytest.mark.parametrize(
    ("value", "count"),
    [(7, 7), (True, 1), (7.9, 7), ("12", 12), (" 12 ", 12), (0, 0), *((odd, 0) for odd in ODD)],
)
def test_token_count_reads_counts_and_nothing_else(value: object, count: int) -> None:
    assert token_count(value) == count


def _outcome() -> RequestOutcome:
    ctx = RequestContext(
        request_id="r1",
        tenant="default",
        class_name="agent",
        pool="agent",
        priority=0,
        deadline_s=1060.0,
        run_id=None,
        model="tiny",
        stream=True,
        client_wants_usage=True,
        received_at_s=1000.0,
    )
    return RequestOutcome(ctx=ctx, estimate=Estimate(6, 4, "heuristic"))


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def _no_extras() -> dict[str, Any]:
    return {}


@pytest.mark.parametrize("odd", ODD)
def test_a_messages_stream_with_odd_usage_passes_through(odd: object) -> None:
    outcome = _outcome()
    adapter = MessagesAdapter()
    start = _event(
        "message_start",
        {"type": "message_start", "message": {"usage": {"input_tokens": 9, "output_tokens": 1}}},
    )
    delta = _event("message_delta", {"type": "message_delta", "usage": {"output_tokens": odd}})
    assert adapter.usage_event(outcome.ctx, start, outcome, _no_extras) == start
    assert adapter.usage_event(outcome.ctx, delta, outcome, _no_extras) == delta
    # the prompt read from message_start stays; the odd output count reads as 0
    assert (outcome.prompt_tokens, outcome.completion_tokens) == (9, 0)


@pytest.mark.parametrize("odd", ODD)
def test_a_responses_stream_with_odd_usage_passes_through(odd: object) -> None:
    outcome = _outcome()
    completed = _event(
        "response.completed",
        {
            "type": "response.completed",
            "response": {"id": "resp_1", "usage": {"input_tokens": odd, "output_tokens": 4}},
        },
    )
    assert ResponsesAdapter().usage_event(outcome.ctx, completed, outcome, _no_extras) == completed
    assert (outcome.prompt_tokens, outcome.completion_tokens) == (0, 4)
