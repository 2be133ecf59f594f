"""Admission on the request path, against fake engines over real HTTP: a request that does
not fit waits and is served when capacity frees; a full queue answers 429 with Retry-After; a
queued client that leaves never reaches an engine; an unmeetable deadline is refused at once;
leases never leak; the official openai client retries a 429 and succeeds."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from pools.config import parse_config
from pools.launchers.base import InstanceSpec
from pools.testing.config import REMOVE, config_data, config_for_test, even_pools
from pools.testing.fake_engine import FakeEngineState, make_fake_engine
from pools.testing.gateway import gateway_over_fakes
from pools.testing.serve import serve_asgi
from router.admission.decision import Need, predicted_ttft_s
from router.gateway.app import Gateway, create_app

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}]}


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


async def asgi_post(
    app: Gateway,
    body: dict[str, Any],
    *,
    headers: dict[str, str] | None = None,
    leave: asyncio.Event | None = None,
) -> Reply:
    """POST /v1/chat/completions straight into the ASGI app; `leave` set = the client hangs up."""
    raw = orjson.dumps(body)
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await (leave or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    messages: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        messages.append(dict(message))

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(k.encode(), v.encode()) for k, v in (headers or {}).items()],
    }
    await app(scope, receive, send)
    start = next((m for m in messages if m["type"] == "http.response.start"), None)
    if start is None:
        return Reply(499, {}, b"")
    body_bytes = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    hdrs = {k.decode(): v.decode() for k, v in start["headers"]}
    return Reply(start["status"], hdrs, body_bytes)


def _config(tmp_path: Path, *, max_depth: int = 4, max_wait_s: float = 5.0, **router: Any) -> Any:
    queue = {"max_depth": max_depth, "max_wait_s": max_wait_s}
    return config_for_test(
        tmp_path,
        pools=even_pools(normal={"queue": queue}),
        router={"scrape_interval_s": 0.05, **router},
    )


@dataclass
class Rig:
    gateway: Gateway
    normal: FakeEngineState
    instance_id: str


@pytest.fixture
async def make_rig(tmp_path: Path) -> AsyncIterator[Any]:
    """A gateway over two fake engines; the normal pool's engine has 12 KV blocks (192
    tokens), so one chat request of the normal class (~140 tokens estimated) fits, two do not.
    """
    async with AsyncExitStack() as stack:

        async def make(**kwargs: Any) -> Rig:
            states = [FakeEngineState(num_gpu_blocks=12, itl_s=0.004) for _ in range(2)]
            rig = await stack.enter_async_context(
                gateway_over_fakes(_config(tmp_path, **kwargs), states)
            )
            (normal_id,) = rig.gateway.pool_map.current.instances_for("normal")
            return Rig(rig.gateway, rig.state_of(normal_id), normal_id)

        yield make


def _leases(rig: Rig) -> tuple[int, int]:
    state = rig.gateway.fleet.get(rig.instance_id)
    assert state is not None
    return state.inflight, state.reserved_blocks


async def _wait_until(cond: Any, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.01)


async def test_a_request_that_does_not_fit_waits_and_is_served(make_rig: Any) -> None:
    rig = await make_rig()
    body = {**CHAT, "max_tokens": 100}  # ~0.4 s each on the fake engine
    first = asyncio.ensure_future(asgi_post(rig.gateway, body))
    await _wait_until(lambda: _leases(rig)[0] == 1)
    second = asyncio.ensure_future(asgi_post(rig.gateway, body))
    await _wait_until(lambda: len(rig.gateway.admitter.queues["normal"]) == 1)
    a, b = await asyncio.gather(first, second)
    assert a.status == 200 and b.status == 200
    assert rig.normal.peak_running == 1  # never both on the engine: KV would not hold them
    assert _leases(rig) == (0, 0)
    waits = rig.gateway.metrics.queue_wait.labels("normal", "normal")
    assert waits._sum.get() > 0.2


async def test_why_a_queued_request_waits_is_counted_once_per_reason(make_rig: Any) -> None:
    """gpupool_admission_waits_total: a dispatch pass finding the queue's head waiting counts
    its reason once, however many passes find it so."""
    rig = await make_rig()
    admitter = rig.gateway.admitter
    body = {**CHAT, "max_tokens": 100}  # ~0.4 s each on the fake engine; two do not fit in KV
    first = asyncio.ensure_future(asgi_post(rig.gateway, body))
    await _wait_until(lambda: _leases(rig)[0] == 1)
    second = asyncio.ensure_future(asgi_post(rig.gateway, body))
    await _wait_until(lambda: len(admitter.queues["normal"]) == 1)
    for _ in range(3):  # the first still runs: each pass finds the second waiting for KV
        admitter.dispatch_once(admitter.clock())
    assert (await first).status == 200 and (await second).status == 200
    counted = rig.gateway.metrics.admission_waits.labels("normal", "kv")._value.get()
    assert counted == 1
    assert admitter._wait_reasons == {}  # forgotten once it left the queue


async def test_nothing_waiting_schedules_no_dispatch_pass(make_rig: Any) -> None:
    """A lease's release asks for a dispatch pass; with every queue empty there is none (a
    callback per request, issue 28); with a request waiting there is."""
    rig = await make_rig()
    admitter = rig.gateway.admitter
    admitter.schedule_pump()
    assert not admitter._pump_scheduled
    body = {**CHAT, "max_tokens": 100}
    running = asyncio.ensure_future(asgi_post(rig.gateway, body))
    await _wait_until(lambda: _leases(rig)[0] == 1)
    queued = asyncio.ensure_future(asgi_post(rig.gateway, body))
    await _wait_until(lambda: len(admitter.queues["normal"]) == 1)
    admitter.schedule_pump()
    assert admitter._pump_scheduled
    assert (await running).status == 200 and (await queued).status == 200


async def test_full_queue_answers_429_with_retry_after(make_rig: Any) -> None:
    rig = await make_rig(max_depth=1)
    body = {**CHAT, "max_tokens": 100}
    running = asyncio.ensure_future(asgi_post(rig.gateway, body))
    await _wait_until(lambda: _leases(rig)[0] == 1)
    queued = asyncio.ensure_future(asgi_post(rig.gateway, body))
    await _wait_until(lambda: len(rig.gateway.admitter.queues["normal"]) == 1)
    refused = await asgi_post(rig.gateway, body)
    assert refused.status == 429
    assert int(refused.headers["retry-after"]) >= 1
    error = refused.json()["error"]
    assert error["type"] == "capacity_exceeded" and error["code"] == "queue_full"
    assert error["retryable"] is True and error["retry_after_seconds"] >= 1
    assert (await running).status == 200 and (await queued).status == 200
    rejected = rig.gateway.metrics.rejections.labels("normal", "queue_full")
    assert rejected._value.get() == 1


async def test_queue_timeout_is_a_429(make_rig: Any) -> None:
    rig = await make_rig(max_wait_s=0.1)
    running = asyncio.ensure_future(asgi_post(rig.gateway, {**CHAT, "max_tokens": 100}))
    await _wait_until(lambda: _leases(rig)[0] == 1)
    late = await asgi_post(rig.gateway, {**CHAT, "max_tokens": 100})
    assert late.status == 429 and late.json()["error"]["code"] == "queue_timeout"
    assert (await running).status == 200
    assert len(rig.gateway.admitter.queues["normal"]) == 0


async def test_a_queued_client_that_leaves_never_reaches_the_engine(make_rig: Any) -> None:
    rig = await make_rig()
    running = asyncio.ensure_future(asgi_post(rig.gateway, {**CHAT, "max_tokens": 100}))
    await _wait_until(lambda: _leases(rig)[0] == 1)
    leave = asyncio.Event()
    queued = asyncio.ensure_future(
        asgi_post(rig.gateway, {**CHAT, "max_tokens": 100, "seed": 4242}, leave=leave)
    )
    await _wait_until(lambda: len(rig.gateway.admitter.queues["normal"]) == 1)
    leave.set()
    assert (await queued).status == 499
    assert len(rig.gateway.admitter.queues["normal"]) == 0  # left at once, not at timeout
    depth = rig.gateway.metrics.queue_depth_g.labels("normal")
    assert depth._value.get() == 0  # no pump pass needed
    assert (await running).status == 200
    await asyncio.sleep(0.1)
    assert all(r.get("seed") != 4242 for r in rig.normal.requests_seen)
    assert _leases(rig) == (0, 0)


async def test_a_client_leaving_before_the_engine_answers_releases_its_lease(
    make_rig: Any,
) -> None:
    """Issue 10's in-flight leak: non-streaming client gives up before the response head."""
    rig = await make_rig()
    rig.normal.failure, rig.normal.fail_next = "hang", 1
    leave = asyncio.Event()
    pending = asyncio.ensure_future(asgi_post(rig.gateway, CHAT, leave=leave))
    await _wait_until(lambda: rig.normal.running == 0 and len(rig.normal.requests_seen) == 1)
    assert _leases(rig)[0] == 1
    leave.set()
    assert (await pending).status == 499
    assert _leases(rig) == (0, 0)
    assert (await asgi_post(rig.gateway, CHAT)).status == 200


async def test_an_unmeetable_deadline_is_refused_at_once(make_rig: Any) -> None:
    rig = await make_rig()
    rig.normal.ttft_s = 0.2  # prefill: ~20 prompt tokens in 0.2 s -> ~100 tokens/s
    for _ in range(2):
        assert (await asgi_post(rig.gateway, {**CHAT, "max_tokens": 2})).status == 200
        await asyncio.sleep(0.15)  # a scrape sees the prefill time
    state = rig.gateway.fleet.get(rig.instance_id)
    assert state is not None and state.prefill_tokens_per_s is not None
    started = asyncio.get_running_loop().time()
    long_prompt = {**CHAT, "max_tokens": 2, "messages": [{"role": "user", "content": "w " * 60}]}
    reply = await asgi_post(rig.gateway, long_prompt, headers={"x-gpupool-deadline-ms": "100"})
    assert reply.status == 429 and reply.json()["error"]["code"] == "deadline_unmeetable"
    assert asyncio.get_running_loop().time() - started < 0.1
    assert len(rig.normal.requests_seen) == 2


async def test_non_streaming_requests_record_no_ttft(make_rig: Any) -> None:
    rig = await make_rig()
    assert (await asgi_post(rig.gateway, {**CHAT, "max_tokens": 4})).status == 200
    ttft = rig.gateway.metrics.ttft.labels("normal")
    assert ttft._sum.get() == 0
    streamed = await asgi_post(rig.gateway, {**CHAT, "max_tokens": 4, "stream": True})
    assert streamed.status == 200
    count = [
        s.value
        for m in rig.gateway.metrics.ttft.collect()
        for s in m.samples
        if s.name.endswith("_count") and s.labels["class"] == "normal"
    ]
    assert count == [1.0]


async def test_admission_off_forwards_at_once(make_rig: Any) -> None:
    rig = await make_rig(admission="off")
    body = {**CHAT, "max_tokens": 100}
    replies = await asyncio.gather(*(asgi_post(rig.gateway, body) for _ in range(3)))
    assert [r.status for r in replies] == [200, 200, 200]
    assert rig.normal.peak_running == 3  # no admission: the engine takes all three
    assert _leases(rig) == (0, 0)


async def test_openai_client_retries_a_429_and_succeeds(make_rig: Any) -> None:
    rig = await make_rig(max_depth=0)  # no queue: refuse while the engine is busy
    running = asyncio.ensure_future(asgi_post(rig.gateway, {**CHAT, "max_tokens": 150}))
    await _wait_until(lambda: _leases(rig)[0] == 1)
    refused = await asgi_post(rig.gateway, {**CHAT, "max_tokens": 150})
    assert refused.status == 429
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=rig.gateway), base_url="http://gw")
    # openai 3.60 takes an httpx (legacy) client at runtime (`is_legacy_httpx_async_client`),
    # but annotates `http_client` as httpx2's only
    client = openai.AsyncOpenAI(
        api_key="none",
        base_url="http://gw/v1",
        http_client=http,  # type: ignore[arg-type]
        max_retries=3,
    )
    reply = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=150
    )
    assert reply.choices[0].message.content
    assert (await running).status == 200
    await http.aclose()


async def test_engine_priority_is_sent_for_its_pool_only(tmp_path: Path) -> None:
    state = FakeEngineState()
    async with serve_asgi(make_fake_engine(state)) as url:
        config = config_for_test(
            tmp_path,
            urls=[url],
            pools=even_pools(normal={"engine_priority": -10}),  # one instance split between them
            router={"scrape_interval_s": 0.05},
        )
        gateway = create_app(config, [InstanceSpec("engine-0", url, 1)])
        await gateway.start()
        assert (await asgi_post(gateway, {**CHAT, "max_tokens": 2})).status == 200
        agent = {
            **CHAT,
            "max_tokens": 2,
            "tools": [{"type": "function", "function": {"name": "f"}}],
        }
        assert (await asgi_post(gateway, agent)).status == 200
        client_set = {**CHAT, "max_tokens": 2, "priority": 3}
        assert (await asgi_post(gateway, client_set)).status == 200
        await gateway.aclose()
    assert [r.get("priority") for r in state.requests_seen] == [-10, None, 3]


def test_engine_priority_needs_the_priority_policy() -> None:
    from pools.config import ConfigError

    data = config_data(pools=even_pools(normal={"engine_priority": -1}))
    with pytest.raises(ConfigError, match="--scheduling-policy priority"):
        parse_config(data)
    data["engines"] = {"local": {"vllm_args": ["--scheduling-policy", "priority"]}}
    assert parse_config(data).pool("normal").engine_priority == -1


async def test_on_a_known_gpu_the_operating_point_starts_from_the_roofline_prior(
    tmp_path: Path,
) -> None:
    import kvcache_model
    from gpu_probe.fake_nvml import FakeGpu, FakeNvml
    from kvcache_model import LatencyPrior, gpu_spec, load_geometry

    model_dir = tmp_path / "m"
    model_dir.mkdir()
    known = Path(kvcache_model.__file__).parent / "known_models" / "llama-3.1-8b.json"
    (model_dir / "config.json").write_text(known.read_text())
    model = {"path": str(model_dir), "max_model_len_tokens": REMOVE}  # the model's own length
    nvml = FakeNvml([FakeGpu(name="NVIDIA H100 80GB HBM3")])
    gateway = create_app(
        config_for_test(tmp_path, model=model),
        [InstanceSpec("engine-0", "http://127.0.0.1:9", 1)],
        scrape=False,
        nvml=nvml,
    )
    await gateway.start()
    state = gateway.fleet.get("engine-0")
    await gateway.aclose()
    assert state is not None and state.op.source == "prior"
    # the limit from the line agrees with the prior's own search at the same context
    prior = LatencyPrior(load_geometry(model_dir), gpu_spec("H100"))
    for target_s in (0.012, 0.02, 0.04):
        expected = prior.max_batch_for_tpot(target_s, 2048, max_batch=64)
        assert abs(state.op.limit(target_s) - expected) <= max(1, 0.1 * expected)


async def test_a_deadline_hit_mid_stream_is_a_timeout_not_an_engine_error(make_rig: Any) -> None:
    """Issue 10: the outcome of a stream cut by its deadline is `timeout`."""
    rig = await make_rig()
    rig.normal.itl_s = 0.05  # 40 tokens take 2 s; the deadline is 0.5 s
    reply = await asgi_post(
        rig.gateway,
        {**CHAT, "max_tokens": 40, "stream": True},
        headers={"x-gpupool-deadline-ms": "500"},
    )
    assert reply.status == 200  # the stream had started
    assert b'"deadline_exceeded"' in reply.body and reply.body.endswith(b"data: [DONE]\n\n")
    requests = rig.gateway.metrics.requests
    assert (
        requests.labels("normal", "normal", "timeout", "deadline_exceeded", "chat")._value.get()
        == 1
    )
    assert (
        requests.labels("normal", "normal", "engine_error", "midstream", "chat")._value.get() == 0
    )
    assert _leases(rig) == (0, 0)


async def test_router_overhead_is_recorded_once_per_request(make_rig: Any) -> None:
    """Issue 10: once per request, not per attempt, and never the client's upload or the
    queue wait (a request that waited ~0.4 s in the queue records well under that)."""
    rig = await make_rig()

    def overhead() -> tuple[float, float]:
        samples = {
            s.name: s.value
            for m in rig.gateway.metrics.overhead.collect()
            for s in m.samples
            if s.name.endswith(("_count", "_sum"))
        }
        return (
            samples["gpupool_router_overhead_seconds_count"],
            samples["gpupool_router_overhead_seconds_sum"],
        )

    assert (await asgi_post(rig.gateway, CHAT)).status == 200  # warm (tokenizer, pools)
    count0, sum0 = overhead()
    body = {**CHAT, "max_tokens": 100}
    first = asyncio.ensure_future(asgi_post(rig.gateway, body))
    await _wait_until(lambda: _leases(rig)[0] == 1)
    second = await asgi_post(rig.gateway, body)
    assert second.status == 200 and (await first).status == 200
    count, total = overhead()
    assert count - count0 == 2
    assert total - sum0 < 0.2  # the second waited ~0.4 s in the queue: not counted


async def test_admission_predicts_prefill_at_the_uncached_rate(make_rig: Any) -> None:
    """vLLM's prefill time covers every prompt token, cached or not, so an engine measured at
    4,000 prompt tokens/s with 75 % of them found in its prefix cache computes 1,000 uncached
    tokens/s. A step's 3,000-token prompt, 2,000 of it cached on its home, costs 1 s of prefill
    there and 3 s elsewhere; at the measured rate admission said 0.25 s and 0.75 s."""
    rig = await make_rig()
    state = rig.gateway.fleet.get(rig.instance_id)
    assert state is not None
    state.prefill_tokens_per_s, state.prefix_hit_frac = 4000.0, 0.75
    view = rig.gateway.admitter._view("normal", state, 1.0, 0.0)
    step_s = view.step_s
    home = Need(3000, 3100, math.inf, cached_on=rig.instance_id, cached_tokens=2000)
    elsewhere = Need(3000, 3100, math.inf, cached_on="another", cached_tokens=2000)
    assert predicted_ttft_s(view, home) == pytest.approx(1.0 + step_s)
    assert predicted_ttft_s(view, elsewhere) == pytest.approx(3.0 + step_s)
