"""benchmarks/router_overhead/protocols.py: each protocol's request is one the engine serves in
that protocol, and the report's "vs chat" and target verdict follow from the samples."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from benchmarks.router_overhead.protocols import (
    PROTOCOLS,
    ProtocolPlan,
    Samples,
    _results,
    body,
    render,
)
from pools.testing.fake_engine import FakeEngineState, make_fake_engine


@pytest.mark.parametrize(
    ("protocol", "kind"),
    [("chat", "chat.completion"), ("responses", "response"), ("messages", "message")],
)
def test_each_body_is_served_in_its_protocol(protocol: str, kind: str) -> None:
    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=make_fake_engine(FakeEngineState()))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            return await client.post(
                PROTOCOLS[protocol],
                content=body(protocol, 3, stream=False),
                headers={"content-type": "application/json"},
            )

    resp = asyncio.run(send())
    assert resp.status_code == 200, resp.text
    got = resp.json()
    assert got.get("object", got.get("type")) == kind
    usage = got["usage"]
    assert usage.get("completion_tokens", usage.get("output_tokens")) == 3


def test_streamed_bodies_ask_for_a_stream() -> None:
    for protocol in PROTOCOLS:
        assert orjson.loads(body(protocol, 16, stream=True))["stream"] is True


def _samples(direct_ms: float, gpupool_ms: float) -> tuple[Samples, Samples]:
    d, g = Samples(), Samples()
    for s, ms in ((d, direct_ms), (g, gpupool_ms)):
        s.plain = [[ms / 1e3] * 5, [ms / 1e3] * 5]
        s.stream = [[10 * ms / 1e3] * 3, [10 * ms / 1e3] * 3]
    g.cpu_s, g.cpu_requests = 0.5, 1000
    return d, g


def test_vs_chat_subtracts_chat_completions_added_latency() -> None:
    samples = {}
    for protocol, gp_ms in (("chat", 2.0), ("responses", 2.15), ("messages", 1.9)):
        d, g = _samples(1.0, gp_ms)
        samples[("direct", protocol)], samples[("gpupool", protocol)] = d, g
    out = _results(samples, ProtocolPlan())
    assert out["chat"]["plain"]["added_p50_ms"] == pytest.approx(1.0)
    assert out["responses"]["plain"]["vs_chat_p50_ms"] == pytest.approx(0.15)
    assert out["messages"]["plain"]["vs_chat_p50_ms"] == pytest.approx(-0.1)
    assert out["responses"]["plain"]["added_p50_ms_per_round"] == pytest.approx([1.15, 1.15])
    assert out["chat"]["gpupool_cpu_us_per_request"] == pytest.approx(500.0)


@pytest.mark.parametrize(("responses_ms", "verdict"), [(2.15, "met"), (2.3, "NOT met")])
def test_report_says_whether_the_target_is_met(responses_ms: float, verdict: str) -> None:
    samples = {}
    for protocol, gp_ms in (("chat", 2.0), ("responses", responses_ms), ("messages", 2.0)):
        d, g = _samples(1.0, gp_ms)
        samples[("direct", protocol)], samples[("gpupool", protocol)] = d, g
    result = {
        "command": "python -m benchmarks.router_overhead.protocols --out x",
        "date": "today",
        "elapsed_s": 1.0,
        "git": "abc",
        "machine": {"cpu": "cpu", "cpus": 2, "memory_gib": 1, "load_average_at_start": [0]},
        "load_average_at_end": [0],
        "placement": "not pinned",
        "plan": ProtocolPlan().__dict__,
        "protocols": _results(samples, ProtocolPlan()),
    }
    report = render(result)
    assert f"within 0.2 ms of chat completions' (non-streaming): {verdict}" in report
    assert "| `/v1/responses` |" in report
