"""SSE comment lines while a streaming request waits (`x-gpupool-wait-comments`), through the
whole gateway in front of a fake engine that runs one sequence at a time: the waiting stream
shows its comments, then its tokens, and the official `openai` client reads it as any other; a
refusal after the comments started is an error event; a bad value is a 400."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from pools.launchers.base import InstanceSpec
from pools.telemetry import parse_vllm_metrics
from pools.testing.config import config_for_test, one_pool
from pools.testing.fake_engine import FakeEngineState, make_fake_engine
from pools.testing.serve import serve_asgi
from router.gateway.app import Gateway, create_app

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
HOLD = {**CHAT, "max_tokens": 30}  # 30 tokens at 0.05 s: the engine's one slot for ~1.5 s


async def _gateway(tmp_path: Path, max_wait_s: float) -> AsyncIterator[Gateway]:
    state = FakeEngineState(itl_s=0.05)
    async with serve_asgi(make_fake_engine(state)) as url:
        config = config_for_test(
            tmp_path,
            # one sequence per engine: a second request waits for the first
            engines={"local": {"vllm_args": ["--max-num-seqs", "1"]}},
            pools=one_pool(queue={"max_wait_s": max_wait_s}),
        )
        gateway = create_app(config, [InstanceSpec("only", url, 1)], scrape=False)
        gateway.fleet.record_reading(
            "only", parse_vllm_metrics(FakeEngineState().metrics_text(), gateway.clock())
        )
        await gateway.start()
        try:
            yield gateway
        finally:
            await gateway.aclose()


@pytest.fixture
async def patient(tmp_path: Path) -> AsyncIterator[Gateway]:
    async for gateway in _gateway(tmp_path, max_wait_s=10.0):
        yield gateway


@pytest.fixture
async def impatient(tmp_path: Path) -> AsyncIterator[Gateway]:
    async for gateway in _gateway(tmp_path, max_wait_s=0.6):
        yield gateway


def _client(gateway: Gateway) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=gateway), base_url="http://gw", timeout=30
    )


async def _behind_a_long_request(gateway: Gateway, **waiting: Any) -> httpx.Response:
    """Send HOLD, then (once it runs) a streaming request with `waiting` as its kwargs."""
    async with _client(gateway) as client:
        hold = asyncio.ensure_future(client.post("/v1/chat/completions", json=HOLD))
        await asyncio.sleep(0.2)  # HOLD holds the engine's one slot
        resp = await client.post("/v1/chat/completions", **waiting)
        assert (await hold).status_code == 200
        return resp


async def test_a_waiting_stream_shows_comments_then_its_tokens(patient: Gateway) -> None:
    resp = await _behind_a_long_request(
        patient,
        json={**CHAT, "stream": True},
        headers={"x-gpupool-wait-comments": "0.3"},
    )
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "text/event-stream"
    assert resp.headers["x-gpupool-pool"] == "normal"
    lines = [line for line in resp.text.split("\n\n") if line]
    comments = [line for line in lines if line.startswith(": gpupool waiting: queue, ")]
    # it waited ~1.3 s: started after 0.3 s, then one a second
    assert 1 <= len(comments) <= 3, lines
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    assert all(line.startswith(":") for line in lines[:first_data])
    assert lines[-1] == "data: [DONE]"
    tokens = [orjson.loads(line[6:]) for line in lines[first_data:-1]]
    assert "".join(t["choices"][0]["delta"].get("content") or "" for t in tokens if t["choices"])


async def test_the_openai_client_reads_a_stream_with_comments(patient: Gateway) -> None:
    async with _client(patient) as http:
        # openai 3.60 takes an httpx (legacy) client at runtime (`is_legacy_httpx_async_client`),
        # but annotates `http_client` as httpx2's only
        client = openai.AsyncOpenAI(
            base_url="http://gw/v1",
            api_key="none",
            http_client=http,  # type: ignore[arg-type]
            max_retries=0,
        )
        hold = asyncio.ensure_future(http.post("/v1/chat/completions", json=HOLD))
        await asyncio.sleep(0.2)
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
            extra_headers={"x-gpupool-wait-comments": "0"},
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert (await hold).status_code == 200
    assert text.strip()  # the comments were skipped, the tokens read


async def test_a_refusal_after_the_comments_started_is_an_error_event(
    impatient: Gateway,
) -> None:
    resp = await _behind_a_long_request(
        impatient,
        json={**CHAT, "stream": True},
        headers={"x-gpupool-wait-comments": "0.1"},
    )
    assert resp.status_code == 200  # the status line went out with the first comment
    lines = [line for line in resp.text.split("\n\n") if line]
    assert lines[0].startswith(": gpupool waiting: queue")
    assert lines[-1] == "data: [DONE]"
    error = orjson.loads(lines[-2][6:])["error"]
    assert error["code"] == "queue_timeout" and error["retry_after_seconds"] >= 1


async def test_without_the_header_a_refusal_is_still_a_429(impatient: Gateway) -> None:
    resp = await _behind_a_long_request(impatient, json={**CHAT, "stream": True})
    assert resp.status_code == 429 and "retry-after" in resp.headers
    assert resp.json()["error"]["code"] == "queue_timeout"


async def test_a_request_admitted_at_once_sends_no_comment(patient: Gateway) -> None:
    async with _client(patient) as client:
        resp = await client.post(
            "/v1/chat/completions",
            json={**CHAT, "stream": True},
            headers={"x-gpupool-wait-comments": "0.5"},
        )
    assert resp.status_code == 200 and not resp.text.startswith(":")


@pytest.mark.parametrize("value", ["-1", "nan", "soon", "3601"])
async def test_a_bad_value_is_a_400(patient: Gateway, value: str) -> None:
    async with _client(patient) as client:
        resp = await client.post(
            "/v1/chat/completions",
            json={**CHAT, "stream": True},
            headers={"x-gpupool-wait-comments": value},
        )
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "x-gpupool-wait-comments"
