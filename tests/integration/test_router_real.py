"""The router in front of real CPU vLLM engines: classification to pools, streaming through the
official OpenAI client, error codes and client disconnects. A dead engine:
`test_engine_kill_real.py` (one kill shared with the fault scenario)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from pools.launchers import InstanceSpec
from pools.testing.router_process import free_port
from tests.integration.conftest import RouterProcess, wait_for, write_router_config

pytestmark = pytest.mark.integration

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "search files",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]


def _post(router_url: str, body: object, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(
        f"{router_url}/v1/chat/completions", json=body, headers=headers or {}, timeout=60
    )


def _pools(router_url: str) -> dict[str, list[str]]:
    view = httpx.get(f"{router_url}/admin/pools", timeout=5).json()
    return {name: list(p["instances"]) for name, p in view["pools"].items()}


def test_openai_client_streams_through_the_router(router_url: str) -> None:
    client = openai.OpenAI(base_url=f"{router_url}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model="tiny",
        messages=HELLO,
        max_tokens=8,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip(), "streamed no text"
    # the client did not ask for usage: the router's own usage chunk must be stripped
    assert all(c.usage is None for c in chunks)
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_usage_chunk_kept_when_client_asks(router_url: str) -> None:
    client = openai.OpenAI(base_url=f"{router_url}/v1", api_key="unused")
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=HELLO,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == 6


def test_classification_reaches_the_right_pool(router_url: str) -> None:
    pools = _pools(router_url)
    plain = _post(router_url, {"model": "tiny", "messages": HELLO, "max_tokens": 2})
    tools = _post(router_url, {"model": "tiny", "messages": HELLO, "max_tokens": 2, "tools": TOOLS})
    header = _post(
        router_url,
        {"model": "tiny", "messages": HELLO, "max_tokens": 2},
        {"x-gpupool-class": "agent"},
    )
    run = _post(
        router_url,
        {"model": "tiny", "messages": HELLO, "max_tokens": 2},
        {"x-claude-code-session-id": "sess-1"},
    )
    for resp in (plain, tools, header, run):
        assert resp.status_code == 200, resp.text
    assert plain.headers["x-gpupool-pool"] == "normal"
    assert plain.headers["x-gpupool-instance"] in pools["normal"]
    for resp in (tools, header, run):
        assert resp.headers["x-gpupool-pool"] == "agent"
        assert resp.headers["x-gpupool-class"] == "agent"
        assert resp.headers["x-gpupool-instance"] in pools["agent"]
    assert plain.headers["x-gpupool-request-id"].startswith("gp-")
    # completions endpoint too
    comp = httpx.post(
        f"{router_url}/v1/completions",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
        timeout=30,
    )
    assert comp.status_code == 200 and comp.json()["usage"]["completion_tokens"] == 2


def test_bad_inputs_get_clear_openai_errors(router_url: str) -> None:
    url = f"{router_url}/v1/chat/completions"
    bad_json = httpx.post(url, content=b"{not json", timeout=10)
    assert bad_json.status_code == 400
    assert bad_json.json()["error"]["code"] == "invalid_json"
    missing = _post(router_url, {"model": "tiny"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages"
    unknown = _post(router_url, {"model": "gpt-9", "messages": HELLO})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    too_long = _post(
        router_url,
        {
            "model": "tiny",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello " * 5000}],
        },
    )
    assert too_long.status_code == 400
    assert "maximum context length" in too_long.json()["error"]["message"]
    bad_class = _post(router_url, {"model": "tiny", "messages": HELLO}, {"x-gpupool-class": "vip"})
    assert bad_class.status_code == 400 and bad_class.json()["error"]["code"] == "unknown_class"
    bad_priority = _post(
        router_url, {"model": "tiny", "messages": HELLO}, {"x-gpupool-priority": "high"}
    )
    assert bad_priority.status_code == 400
    # and the router still serves after all that
    assert (
        _post(router_url, {"model": "tiny", "messages": HELLO, "max_tokens": 1}).status_code == 200
    )


def test_api_keys_map_to_tenants(real_engines: list[InstanceSpec], tmp_path: Path) -> None:
    config = write_router_config(
        tmp_path / "keys.yaml",
        [e.url for e in real_engines],
        tenants=[{"name": "team-a", "api_key": "key-a", "may_set_class": False}],
    )
    router = RouterProcess(config, free_port(), tmp_path / "router.log")
    try:
        body = {"model": "tiny", "messages": HELLO, "max_tokens": 1}
        assert _post(router.url, body).status_code == 401
        wrong = _post(router.url, body, {"authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        ok = _post(router.url, body, {"authorization": "Bearer key-a"})
        assert ok.status_code == 200
        forbidden = _post(
            router.url, body, {"authorization": "Bearer key-a", "x-gpupool-class": "agent"}
        )
        assert forbidden.status_code == 403
    finally:
        router.stop()


def _engine_running(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_running{")
    )


def test_client_disconnect_frees_the_engine(
    router_url: str, real_engines: list[InstanceSpec]
) -> None:
    by_id = {e.instance_id: e.url for e in real_engines}
    body = {
        "model": "tiny",
        "messages": HELLO,
        "max_tokens": 3000,
        "stream": True,
        "ignore_eos": True,
    }
    with (
        httpx.Client(timeout=60) as client,
        client.stream(
            "POST",
            f"{router_url}/v1/chat/completions",
            json=body,
            headers={"x-gpupool-class": "agent"},
        ) as resp,
    ):
        assert resp.status_code == 200
        engine_url = by_id[resp.headers["x-gpupool-instance"]]
        lines = resp.iter_lines()
        for _ in range(5):
            next(lines)
        # the engine's own gauge (read from its /metrics, not the router's scrape) shows it
        wait_for(lambda: _engine_running(engine_url) >= 1, timeout_s=30, interval_s=0.2)
    # the client is gone: the engine must drop the sequence well before 3000 tokens
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and _engine_running(engine_url) > 0:
        time.sleep(0.25)
    assert _engine_running(engine_url) == 0, "the engine kept generating for a departed client"


def test_router_metrics_are_exposed(router_url: str) -> None:
    _post(router_url, {"model": "tiny", "messages": HELLO, "max_tokens": 1})
    text = httpx.get(f"{router_url}/metrics", timeout=5).text
    for name in (
        "gpupool_requests_total",
        "gpupool_ttft_seconds",
        "gpupool_instance_healthy",
        "gpupool_inflight_requests",
        "gpupool_router_overhead_seconds",
        "gpupool_instance_kv_usage_frac",
        "gpupool_pool_share_frac",
    ):
        assert name in text, name
    assert 'outcome="ok"' in text


def test_concurrent_streams_all_complete(router_url: str) -> None:
    results: list[int] = []

    def one(i: int) -> None:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"q {i}"}],
            "max_tokens": 16,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        tokens = 0
        with httpx.stream(
            "POST", f"{router_url}/v1/chat/completions", json=body, timeout=60
        ) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    data = json.loads(line[6:])
                    if data.get("usage"):
                        tokens = data["usage"]["completion_tokens"]
        results.append(tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [16] * 12
