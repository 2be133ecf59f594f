"""Tenant and run governance in front of real CPU vLLM engines (the session's engines, one
`gpupool serve` router): each limit refuses with its code while another tenant is served.

- a tenant over its tokens per minute gets 429 `token_rate` with Retry-After and OpenAI's
  x-ratelimit-* headers; the official `openai` client, given that 429, waits and succeeds;
- a looping agent run (the same tool call three times in a row in the history it sends
  back) is stopped with 403 `run_loop`, and the ledger records why the run ended;
- the 51st step of a run is refused with `run_steps`;
- a run over its GPU-seconds gets `run_gpu_seconds`; a tenant over its hourly cost cap gets
  429 `cost_cap` for new work.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pools.launchers import InstanceSpec
from tests.integration.conftest import RouterProcess, write_router_config

pytestmark = pytest.mark.integration

ROUTER_PORT = int(os.environ.get("GPUPOOL_TEST_GOVERNANCE_PORT", "8300"))
KEYS = {
    name: f"gov-{name}-" + os.urandom(4).hex()
    for name in ("budget", "retry", "agent", "gpu", "capped", "other")
}
for _name, _key in KEYS.items():
    os.environ[f"GPUPOOL_GOV_KEY_{_name.upper()}"] = _key
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "grep",
            "description": "search the code",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


def _tenant(name: str, **limits: Any) -> dict[str, Any]:
    return {"name": name, "api_key_env": f"GPUPOOL_GOV_KEY_{name.upper()}", **limits}


@pytest.fixture(scope="module")
def router(
    real_engines: list[InstanceSpec], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RouterProcess]:
    d: Path = tmp_path_factory.mktemp("governance")
    config = write_router_config(
        d / "gpupool.yaml",
        [e.url for e in real_engines],
        pools={
            # a short queue wait: a tenant short of tokens for longer is refused at once
            "normal": {
                "classes": ["normal"],
                "share": {"initial_frac": 0.66},
                "queue": {"max_wait_s": 0.2},
            }
        },
        tenants=[
            _tenant("budget", tokens_per_minute=600),
            _tenant("retry", tokens_per_minute=1200),
            # 50 steps (the default is 500: too slow here), loop after 3 repeats (the default)
            _tenant("agent", run_guards={"max_steps": 50}),
            _tenant("gpu", run_guards={"max_gpu_seconds": 0.05}),
            _tenant("capped", cost_cap_gpu_seconds_per_hour=0.05),
            _tenant("other", admin=True),  # also reads /metrics
        ],
    )
    proc = RouterProcess(config, ROUTER_PORT, d / "router.log")
    try:
        yield proc
    finally:
        proc.stop()


def _post(
    router: RouterProcess, tenant: str, body: dict[str, Any], **headers: str
) -> httpx.Response:
    h = {"authorization": f"Bearer {KEYS[tenant]}", **headers}
    return httpx.post(f"{router.url}/v1/chat/completions", json=body, headers=h, timeout=120)


def _chat(text: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }


def _served_by_other(router: RouterProcess) -> None:
    resp = _post(router, "other", _chat("hello there", 4))
    assert resp.status_code == 200, resp.text


def test_over_budget_tenant_gets_429_token_rate_with_rate_limit_headers(
    router: RouterProcess,
) -> None:
    prompt = " ".join(f"w{i % 89}" for i in range(250))  # ~500 tokens
    first = _post(router, "budget", _chat(prompt, 32))
    assert first.status_code == 200, first.text
    assert first.headers["x-ratelimit-limit-tokens"] == "600"
    used = first.json()["usage"]["total_tokens"]
    second = _post(router, "budget", _chat(prompt, 32))
    assert second.status_code == 429, second.text
    error = second.json()["error"]
    assert error["code"] == "token_rate" and error["type"] == "rate_limit_error"
    level = int(second.headers["x-ratelimit-remaining-tokens"])
    assert 600 - used <= level <= 600 - used + 20  # settled to the real usage (+ refill)
    assert second.headers["x-ratelimit-limit-tokens"] == "600"
    assert second.headers["x-ratelimit-reset-tokens"].endswith("s")
    # the bucket holds the second's ~`used` tokens after (used - level) / 10 per second
    expected_s = (used - level) / 10
    assert abs(int(second.headers["retry-after"]) - expected_s) <= 3
    _served_by_other(router)


def test_the_openai_client_retries_after_retry_after_and_succeeds(router: RouterProcess) -> None:
    # ~1,090 tokens (the dev tokenizer: ~3 a word), inside the 1,200-token bucket: 500 words
    # (~1,510 tokens) left it ~330 in debt, and the refusal below said Retry-After ~18 s
    prompt = " ".join(f"v{i % 83}" for i in range(360))
    assert _post(router, "retry", _chat(prompt, 16)).status_code == 200
    budget = httpx.get(
        f"{router.url}/v1/budget", headers={"authorization": f"Bearer {KEYS['retry']}"}
    ).json()
    level = budget["tokens"]["remaining"]
    # ask for ~40 tokens more than the bucket holds: refused (over the 0.2 s queue wait),
    # held again after ~2 s at 20 tokens a second
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=KEYS["retry"], max_retries=3)
    t0 = time.monotonic()
    raw = client.chat.completions.with_raw_response.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=max(1, level + 40 - 12),
        extra_body={"ignore_eos": True},
    )
    elapsed_s = time.monotonic() - t0
    assert raw.http_response.status_code == 200
    assert raw.parse().usage is not None
    assert 1.0 <= elapsed_s <= 20.0  # it waited for the bucket, then got its answer
    metrics = httpx.get(
        f"{router.url}/metrics", headers={"authorization": f"Bearer {KEYS['other']}"}
    ).text
    assert 'gpupool_governance_refusals_total{code="token_rate",tenant="retry"} 1.0' in metrics


def test_a_looping_agent_run_is_stopped_with_run_loop(router: RouterProcess) -> None:
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "grep", "arguments": '{"q": "TODO"}'},
            }
        ],
    }
    result = {"role": "tool", "tool_call_id": "c1", "content": "no match"}
    history: list[dict[str, Any]] = [{"role": "user", "content": "find the TODOs"}]
    headers = {"x-gpupool-run-id": "loop-run"}
    for step in range(3):
        resp = _post(
            router, "agent", {**_chat("", 8), "messages": history, "tools": TOOLS}, **headers
        )
        assert resp.status_code == 200, (step, resp.text)
        history += [call, result]
    looped = _post(
        router, "agent", {**_chat("", 8), "messages": history, "tools": TOOLS}, **headers
    )
    assert looped.status_code == 403, looped.text
    error = looped.json()["error"]
    assert error["code"] == "run_loop" and "grep" in error["message"]
    _served_by_other(router)
    summary = httpx.get(
        f"{router.url}/v1/runs/loop-run", headers={"authorization": f"Bearer {KEYS['agent']}"}
    ).json()
    assert summary["end"]["reason"] == "run_loop" and summary["end"]["steps"] == 3
    outcomes = summary["totals"]["outcomes"]
    assert outcomes == {"ok": 3, "client_error": 1}  # the refused step never reached an engine


def test_the_51st_step_is_refused_with_run_steps(router: RouterProcess) -> None:
    headers = {"x-gpupool-run-id": "fifty-steps"}
    with httpx.Client(timeout=60) as client:
        for step in range(50):
            resp = client.post(
                f"{router.url}/v1/chat/completions",
                json=_chat(f"step {step}", 1),
                headers={"authorization": f"Bearer {KEYS['agent']}", **headers},
            )
            assert resp.status_code == 200, (step, resp.text)
    refused = _post(router, "agent", _chat("step 50", 1), **headers)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "run_steps"
    _served_by_other(router)


def test_a_run_over_its_gpu_seconds_and_a_tenant_over_its_cap_are_refused(
    router: RouterProcess,
) -> None:
    headers = {"x-gpupool-run-id": "gpu-run"}
    assert _post(router, "gpu", _chat("count to ten", 48), **headers).status_code == 200
    over = _post(router, "gpu", _chat("again", 4), **headers)
    assert over.status_code == 403 and over.json()["error"]["code"] == "run_gpu_seconds"

    assert _post(router, "capped", _chat("count to ten", 48)).status_code == 200
    capped = _post(router, "capped", _chat("more", 4))
    assert capped.status_code == 429 and capped.json()["error"]["code"] == "cost_cap"
    assert 1 <= int(capped.headers["retry-after"]) <= 3600
    _served_by_other(router)
