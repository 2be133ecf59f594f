"""The Responses and Messages APIs through `gpupool serve` in front of real CPU vLLM engines
(which the launcher starts with VLLM_ENABLE_RESPONSES_API_STORE=1): responses stream and not,
`previous_response_id` chains pinned to the engine that stored each response, messages stream
and not, count_tokens, and a 50,000-word prompt answered 400 context_length_exceeded on every
endpoint in well under 100 ms without reaching an engine. A chain whose engine was killed (400
previous_response_not_found): `test_engine_kill_real.py`, on the kill it shares.

Run under the engine lock: `flock /tmp/gpupool-engines.lock .venv/bin/pytest -q -p no:cacheprovider
tests/integration/test_protocols_real.py`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import yaml

from pools.launchers import InstanceSpec
from pools.testing.router_process import free_port
from tests.integration.conftest import RouterProcess, write_router_config

RESPONSES = {"model": "tiny", "input": "Say hello.", "max_output_tokens": 8}
MESSAGES = {
    "model": "tiny",
    "max_tokens": 8,
    "messages": [{"role": "user", "content": "Say hello."}],
}


@pytest.fixture(scope="module")
def router(
    real_engines: list[InstanceSpec], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RouterProcess]:
    """One pool over all three engines, so chains spread over three."""
    d = tmp_path_factory.mktemp("protocols")
    path = write_router_config(d / "gpupool.yaml", [e.url for e in real_engines])
    config = yaml.safe_load(path.read_text())
    config["pools"] = {
        "all": {
            "classes": ["agent", "normal"],
            "share": {"initial_frac": 1.0, "floor_frac": 1.0, "ceiling_frac": 1.0},
        }
    }
    path.write_text(yaml.safe_dump(config))
    proc = RouterProcess(path, free_port(), d / "router.log")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def client(router: RouterProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=router.url, timeout=120) as c:
        yield c


def _events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.split(b"\n\n"):
        lines = dict(line.split(b": ", 1) for line in block.split(b"\n") if b": " in line)
        if b"data" in lines and b"event" in lines:
            out.append((lines[b"event"].decode(), orjson.loads(lines[b"data"])))
    return out


# ------------------------------------------------------------------------------ responses


def test_responses_non_stream_and_stream(client: httpx.Client) -> None:
    resp = client.post("/v1/responses", json=RESPONSES)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["object"] == "response" and data["status"] in ("completed", "incomplete")
    assert data["usage"]["output_tokens"] >= 1
    stream = client.post("/v1/responses", json={**RESPONSES, "stream": True})
    assert stream.status_code == 200, stream.text
    events = _events(stream.content)
    names = [name for name, _ in events]
    assert names[0] == "response.created" and names[-1] in (
        "response.completed",
        "response.incomplete",
    )
    assert any(name.endswith(".delta") for name in names)
    assert events[-1][1]["response"]["usage"]["output_tokens"] >= 1
    metrics = client.get("/metrics").text
    assert 'endpoint="responses"' in metrics


def _chain(client: httpx.Client, steps: int) -> tuple[str, list[str]]:
    """A chain of `steps` responses, each continuing the last; (first engine, engines)."""
    previous: str | None = None
    engines = []
    for step in range(steps):
        body: dict[str, Any] = {**RESPONSES, "input": f"Step {step}: say a word."}
        if previous is not None:
            body["previous_response_id"] = previous
        stream = step % 2 == 1
        resp = client.post("/v1/responses", json={**body, "stream": stream})
        assert resp.status_code == 200, (step, resp.text)
        engines.append(resp.headers["x-gpupool-instance"])
        if stream:
            created = next(d for n, d in _events(resp.content) if n == "response.created")
            previous = created["response"]["id"]
        else:
            previous = resp.json()["id"]
    return engines[0], engines


def test_ten_four_step_chains_stay_on_the_engine_that_stored_them(client: httpx.Client) -> None:
    homes = set()
    for _ in range(10):
        home, engines = _chain(client, 4)
        assert engines == [home] * 4
        homes.add(home)
    assert len(homes) >= 2, homes  # chains spread; each stays home


# ------------------------------------------------------------------------------ messages


def test_messages_non_stream_stream_and_count_tokens(client: httpx.Client) -> None:
    resp = client.post("/v1/messages", json=MESSAGES)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["type"] == "message" and data["usage"]["output_tokens"] >= 1
    stream = client.post("/v1/messages", json={**MESSAGES, "stream": True})
    assert stream.status_code == 200, stream.text
    names = [name for name, _ in _events(stream.content)]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert "content_block_delta" in names
    count = client.post("/v1/messages/count_tokens", json=MESSAGES)
    assert count.status_code == 200, count.text
    assert count.json()["input_tokens"] >= 1
    bad = client.post("/v1/messages", json={**MESSAGES, "max_tokens": None})
    assert bad.status_code == 400
    assert bad.json()["type"] == "error"
    assert bad.json()["error"]["type"] == "invalid_request_error"


# ------------------------------------------------------------------------------ context


def _engine_prompt_tokens(real_engines: list[InstanceSpec]) -> float:
    total = 0.0
    for engine in real_engines:
        text = httpx.get(engine.url + "/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith("vllm:prompt_tokens_total"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_50000_word_prompt_is_400_context_length_exceeded_everywhere(
    client: httpx.Client, real_engines: list[InstanceSpec]
) -> None:
    vocab = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")
    text = " ".join(vocab[i % len(vocab)] + str(i % 97) for i in range(50_000))
    bodies = {
        "/v1/chat/completions": {
            "model": "tiny",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": text}],
        },
        "/v1/completions": {"model": "tiny", "prompt": text, "max_tokens": 8},
        "/v1/responses": {**RESPONSES, "input": text},
        "/v1/messages": {**MESSAGES, "messages": [{"role": "user", "content": text}]},
    }
    before = _engine_prompt_tokens(real_engines)
    times = {}
    for path, body in bodies.items():
        raw = orjson.dumps(body)
        start = time.perf_counter()
        resp = client.post(path, content=raw, headers={"content-type": "application/json"})
        times[path] = time.perf_counter() - start
        assert resp.status_code == 400, (path, resp.text[:300])
        payload = resp.json()
        assert payload["error"]["code"] == "context_length_exceeded", payload
        if path == "/v1/messages":
            assert payload["type"] == "error"
            assert payload["error"]["type"] == "invalid_request_error"
    print(f"50,000-word prompt, 400 context_length_exceeded, seconds per endpoint: {times}")
    assert max(times.values()) < 0.1, times
    assert _engine_prompt_tokens(real_engines) == before  # no engine saw any of them
