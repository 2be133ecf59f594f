"""The router's request path against fake engines served over real HTTP: pass-through,
usage stripping, retries on refused connections, engine failures, deadlines, error shapes."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from pools.config import Config
from pools.launchers.base import InstanceSpec
from pools.telemetry import parse_vllm_metrics
from pools.testing.config import config_for_test, even_pools, one_pool
from pools.testing.fake_engine import FakeEngineState, make_fake_engine
from pools.testing.gateway import gateway_over_fakes
from pools.testing.serve import serve_asgi
from router.gateway.app import Gateway, create_app

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


def _config(tmp_path: Path, **router: Any) -> Config:
    return config_for_test(tmp_path, pools=even_pools(), router=router)


def _look_fresh(gateway: Gateway) -> None:
    """Without a scraper: one healthy, empty reading per instance, as a scrape would give."""
    for state in gateway.fleet:
        gateway.fleet.record_reading(
            state.instance_id,
            parse_vllm_metrics(FakeEngineState().metrics_text(), gateway.clock()),
        )


@pytest.fixture
def dead_url() -> Iterator[str]:
    """A port bound and never listened on, kept for the test: connections to it are refused,
    and no other test (another xdist worker's server) can take it meanwhile, as it could a
    port closed again."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


@dataclass
class Rig:
    gateway: Gateway
    client: httpx.AsyncClient
    states: list[FakeEngineState]

    def pool_state(self, pool: str) -> FakeEngineState:
        (instance,) = self.gateway.pool_map.current.instances_for(pool)
        return self.states[int(instance.split("-")[1])]

    @property
    def normal(self) -> FakeEngineState:
        return self.pool_state("normal")


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    """Two fake engines, one per pool."""
    async with gateway_over_fakes(_config(tmp_path), 2) as r:
        yield Rig(r.gateway, r.client, r.states)


async def test_non_streaming_pass_through(rig: Rig) -> None:
    resp = await rig.client.post(
        "/v1/chat/completions", json={**BODY, "seed": 7, "n": 1, "top_k": 5}
    )
    assert resp.status_code == 200
    assert resp.headers["x-gpupool-pool"] == "normal"
    assert float(resp.headers["x-gpupool-gpu-seconds"]) >= 0
    assert resp.json()["usage"]["completion_tokens"] == 3
    seen = next(s.requests_seen for s in rig.states if s.requests_seen)[-1]
    assert seen["seed"] == 7 and seen["top_k"] == 5  # extra fields pass untouched


async def test_request_ids_are_consecutive_from_a_random_start(rig: Rig) -> None:
    """64-bit ids, consecutive within a router (the ledger's key takes them in order), from a
    random start (unique across routers)."""
    ids = []
    for _ in range(3):
        resp = await rig.client.post("/v1/chat/completions", json=BODY)
        assert resp.status_code == 200
        ids.append(resp.headers["x-gpupool-request-id"])
    assert all(len(i) == 19 and i.startswith("gp-") for i in ids)
    numbers = [int(i[3:], 16) for i in ids]
    assert numbers == [numbers[0], numbers[0] + 1, numbers[0] + 2]


async def test_stream_strips_usage_unless_asked(rig: Rig) -> None:
    body = {**BODY, "stream": True}
    resp = await rig.client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200
    assert b'"usage"' not in resp.content and resp.content.endswith(b"data: [DONE]\n\n")
    upstream = rig.normal.requests_seen[-1]
    assert upstream["stream_options"] == {"include_usage": True}
    asked = await rig.client.post(
        "/v1/chat/completions", json={**body, "stream_options": {"include_usage": True}}
    )
    assert asked.content.count(b'"usage"') == 1
    gpu = await rig.client.post("/v1/chat/completions", json=body, headers={"x-gpupool-usage": "1"})
    usage_events = [
        orjson.loads(line[6:])
        for line in gpu.content.split(b"\n")
        if line.startswith(b"data: {") and b'"usage"' in line
    ]
    assert len(usage_events) == 1 and "gpu_seconds" in usage_events[0]["usage"]


async def test_completions_endpoint_and_tools_go_to_agent(rig: Rig) -> None:
    resp = await rig.client.post(
        "/v1/completions", json={"model": "tiny", "prompt": "a b", "max_tokens": 2}
    )
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"]
    agent = await rig.client.post("/v1/chat/completions", json={**BODY, "tools": [{"x": 1}]})
    assert agent.headers["x-gpupool-pool"] == "agent"
    assert (
        agent.headers["x-gpupool-instance"]
        == rig.gateway.pool_map.current.instances_for("agent")[0]
    )


async def test_client_errors(rig: Rig) -> None:
    bad = await rig.client.post("/v1/chat/completions", content=b"[1,")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    not_obj = await rig.client.post("/v1/chat/completions", content=b"[1]")
    assert not_obj.status_code == 400
    no_model = await rig.client.post("/v1/chat/completions", json={"messages": []})
    assert no_model.status_code == 400 and no_model.json()["error"]["param"] == "model"
    no_prompt = await rig.client.post("/v1/completions", json={"model": "tiny"})
    assert no_prompt.status_code == 400 and no_prompt.json()["error"]["param"] == "prompt"
    unknown = await rig.client.post("/v1/chat/completions", json={**BODY, "model": "other"})
    assert unknown.status_code == 404
    bad_stream = await rig.client.post("/v1/chat/completions", json={**BODY, "stream": "yes"})
    assert bad_stream.status_code == 400
    long = {**BODY, "messages": [{"role": "user", "content": "w " * 5000}]}
    too_long = await rig.client.post("/v1/chat/completions", json=long)
    assert too_long.status_code == 400
    assert "maximum context length" in too_long.json()["error"]["message"]
    nowhere = await rig.client.get("/v1/embeddings")
    assert nowhere.status_code == 404 and "error" in nowhere.json()


async def test_engine_500_becomes_502_and_midstream_failure_is_an_event(rig: Rig) -> None:
    rig.normal.failure, rig.normal.fail_next = "http500", 1
    resp = await rig.client.post("/v1/chat/completions", json=BODY)
    assert resp.status_code == 502 and resp.json()["error"]["type"] == "engine_error"
    rig.normal.failure, rig.normal.fail_next = "drop_midstream", 1
    resp = await rig.client.post("/v1/chat/completions", json={**BODY, "stream": True})
    assert resp.status_code == 200
    events = [line for line in resp.content.split(b"\n") if line.startswith(b"data: {")]
    assert b'"error"' in events[-1] and b"engine_error" in events[-1]


async def test_deadline_gives_504(rig: Rig) -> None:
    rig.normal.failure, rig.normal.fail_next = "hang", 1
    resp = await rig.client.post(
        "/v1/chat/completions", json=BODY, headers={"x-gpupool-deadline-ms": "300"}
    )
    assert resp.status_code == 504 and resp.json()["error"]["code"] == "deadline_exceeded"


async def test_refused_connection_retries_another_instance(tmp_path: Path, dead_url: str) -> None:
    state = FakeEngineState()
    async with serve_asgi(make_fake_engine(state)) as live:
        specs = [InstanceSpec("dead", dead_url, 1), InstanceSpec("live", live, 1)]
        config = config_for_test(tmp_path, pools=one_pool(), router={"scrape_interval_s": 60})
        gateway = create_app(config, specs, scrape=False)
        _look_fresh(gateway)  # both look healthy until the proxy learns otherwise
        # and "live" a little busier (a request waiting there: the load score counts the
        # engine's queue), so the first request is placed on "dead" (tied, the picker would
        # choose at random, and six requests could all miss it)
        busy = FakeEngineState(waiting=1)
        gateway.fleet.record_reading(
            "live", parse_vllm_metrics(busy.metrics_text(), gateway.clock())
        )
        await gateway.start()
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=gateway), base_url="http://gw"
        ) as client:
            statuses = [
                (await client.post("/v1/chat/completions", json=BODY)).status_code for _ in range(6)
            ]
        assert statuses == [200] * 6
        assert not gateway.fleet.get("dead").healthy  # type: ignore[union-attr]
        assert state.served == 6
        await gateway.aclose()


async def test_no_healthy_instance_is_503_and_ready_says_so(tmp_path: Path, dead_url: str) -> None:
    specs = [InstanceSpec("dead", dead_url, 1)]
    gateway = create_app(config_for_test(tmp_path, router={"scrape_timeout_s": 0.5}), specs)
    await gateway.start()
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=gateway), base_url="http://gw"
    ) as client:
        resp = await client.post("/v1/chat/completions", json=BODY)
        assert resp.status_code == 503
        assert resp.json()["error"]["code"] == "no_healthy_instance"
        ready = await client.get("/ready")
        assert ready.status_code == 503
        assert (await client.get("/health")).status_code == 200
    await gateway.aclose()


async def test_metrics_and_admin_views(rig: Rig) -> None:
    await rig.client.post("/v1/chat/completions", json=BODY)
    text = (await rig.client.get("/metrics")).text
    assert (
        'gpupool_requests_total{class="normal",endpoint="chat",outcome="ok",pool="normal",'
        'reason="200"}' in text
    )
    assert "gpupool_gpu_seconds_total" in text and "gpupool_idle_gpu_seconds_total" in text
    view = (await rig.client.get("/admin/pools")).json()
    assert set(view["pools"]) == {"agent", "normal"}
    assert view["instances"]["engine-0"]["num_gpu_blocks"] == 1024
    models = (await rig.client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "tiny"


async def test_gpu_readings_reach_metrics_with_a_fake_nvml(tmp_path: Path) -> None:
    from gpu_probe.fake_nvml import FakeGpu, FakeNvml

    nvml = FakeNvml([FakeGpu(name="NVIDIA H100 80GB HBM3", memory_used_bytes=10 * 2**30)])
    gateway = create_app(_config(tmp_path), [], scrape=False, nvml=nvml)
    await gateway.start()
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=gateway), base_url="http://gw"
    ) as client:
        text = (await client.get("/metrics")).text
        assert 'gpupool_gpu_memory_used_bytes{gpu="0"}' in text
        gpus = (await client.get("/admin/gpus")).json()
        assert gpus["snapshot"]["devices"][0]["name"].startswith("NVIDIA H100")
    await gateway.aclose()


async def test_connection_reset_before_the_answer_is_retried(tmp_path: Path) -> None:
    """An engine that accepts and then drops the connection (a stale keep-alive, a dying
    engine) costs a retry, never a 500."""
    import asyncio

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.transport.abort()

    server = await asyncio.start_server(drop, "127.0.0.1", 0)
    drop_url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    state = FakeEngineState()
    async with serve_asgi(make_fake_engine(state)) as live:
        specs = [InstanceSpec("drops", drop_url, 1), InstanceSpec("live", live, 1)]
        gateway = create_app(config_for_test(tmp_path, pools=one_pool()), specs, scrape=False)
        _look_fresh(gateway)
        await gateway.start()
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=gateway), base_url="http://gw"
        ) as client:
            for _ in range(8):
                resp = await client.post("/v1/chat/completions", json=BODY)
                assert resp.status_code == 200, resp.text
        # only one instance, and it drops everything: a clear 502, not a 500
        gateway.fleet.get("live").healthy = False  # type: ignore[union-attr]
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=gateway), base_url="http://gw"
        ) as client:
            resp = await client.post("/v1/chat/completions", json=BODY)
            assert resp.status_code == 502
            assert resp.json()["error"]["code"] == "engine_unreachable"
        await gateway.aclose()
    server.close()


@pytest.mark.parametrize(
    "odd",
    [
        {"prompt_tokens": "many", "completion_tokens": [3]},
        {"prompt_tokens": float("inf"), "completion_tokens": {"n": 3}},
        {"prompt_tokens": -5, "completion_tokens": "3"},
    ],
)
@pytest.mark.parametrize("stream", [True, False])
async def test_usage_counts_that_are_not_counts_lose_nothing(
    rig: Rig, odd: dict[str, Any], stream: bool
) -> None:
    """An engine's usage whose counts are not counts: the client's answer is whole, as the
    engine sent it (the stream to its [DONE]), and the record is settled with what could be
    read (a digit string read as its number, anything else as 0)."""
    for state in rig.states:
        state.usage_override = dict(odd)
    run_id = f"odd-usage-{stream}-{len(str(odd))}"
    resp = await rig.client.post(
        "/v1/chat/completions",
        json={**BODY, "stream": stream, "stream_options": {"include_usage": True}}
        if stream
        else BODY,
        headers={"x-gpupool-run-id": run_id},
    )
    assert resp.status_code == 200, resp.text
    if stream:
        assert resp.content.endswith(b"data: [DONE]\n\n")
        assert resp.content.count(b'"usage"') == 1  # asked for, passed on
    else:
        assert "usage" in resp.json()
    await rig.gateway.ledger.flush()
    run = (await rig.client.get(f"/v1/runs/{run_id}")).json()
    (record,) = run["requests"]
    completion = 3 if odd["completion_tokens"] == "3" else 0
    assert (record["prompt_tokens"], record["completion_tokens"]) == (0, completion), record
