"""Traces (router/ops/tracing) over fake engines, exported to a real OTLP/HTTP receiver in the
test (tests/otlp_receiver.py: protobuf decoded with opentelemetry-proto): the span tree and
its tiling, `traceparent` in and out, an agent run as one trace, refusals, sampling, a
collector that fails, JSON logs, and the `observability:` settings. Real engines:
tests/integration/test_tracing_real.py."""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    TraceFlags,
    set_span_in_context,
)

from pools.config import ConfigError, parse_config
from pools.launchers import InstanceSpec
from pools.testing.config import config_data, config_for_test, even_pools, one_pool
from pools.testing.fake_engine import FakeEngineState, make_fake_engine
from pools.testing.otlp_receiver import CLIENT, SERVER, OtlpReceiver, ReceivedSpan
from pools.testing.serve import serve_asgi
from router.gateway.app import Gateway, create_app
from router.ops.tracing.logs import JsonFormatter
from router.ops.tracing.request_trace import (
    CHILD_SPANS,
    PresetIds,
    RootSampling,
    dropped_context,
)
from router.request import Receive, Scope, Send

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
CHILDREN = CHILD_SPANS
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


class _Rig:
    def __init__(self, gateway: Gateway, client: httpx.AsyncClient, seen: list[dict[str, str]]):
        self.gateway, self.client, self.seen = gateway, client, seen

    async def flush(self) -> None:
        assert self.gateway.tracing is not None
        await self.gateway.tracing.processor.flush()


@contextlib.asynccontextmanager
async def _rig(tmp_path: Path, receiver: OtlpReceiver, **overrides: Any) -> AsyncIterator[_Rig]:
    """A router with traces to `receiver` over one fake engine that records the headers the
    router sent it."""
    seen: list[dict[str, str]] = []
    engine = make_fake_engine(FakeEngineState())

    async def recording(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (
            scope["method"] == "POST" or scope["path"].startswith("/v1/responses/")
        ):
            seen.append({k.decode(): v.decode() for k, v in scope["headers"]})
        await engine(scope, receive, send)

    observability = {"otlp_endpoint": receiver.url, "export_interval_s": 60}
    observability.update(overrides.pop("observability", {}))
    async with contextlib.AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_asgi(recording))
        overrides.setdefault("pools", one_pool())
        config = config_for_test(tmp_path, observability=observability, **overrides)
        gateway = create_app(config, [InstanceSpec("engine-0", url, 1)])
        await gateway.start()
        stack.push_async_callback(gateway.aclose)
        client = await stack.enter_async_context(
            httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://gw")
        )
        yield _Rig(gateway, client, seen)


def _by_name(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    return {s.name: s for s in spans}


async def test_a_traced_request_has_its_tree_under_the_incoming_trace(
    tmp_path: Path, receiver: OtlpReceiver
) -> None:
    async with _rig(tmp_path, receiver) as rig:
        resp = await rig.client.post(
            "/v1/chat/completions",
            json={**CHAT, "stream": True},
            headers={"traceparent": TRACEPARENT, "x-gpupool-run-id": "run-a"},
        )
        assert resp.status_code == 200
        await rig.flush()
    spans = receiver.trace(TRACE_ID)
    names = _by_name(spans)
    assert set(names) == {"POST /v1/chat/completions", *CHILDREN}
    server = names["POST /v1/chat/completions"]
    assert server.kind == SERVER and server.parent_span_id == PARENT_ID
    for name in CHILDREN:
        assert names[name].parent_span_id == server.span_id, name
    assert server.resource["service.name"] == "gpupool"
    attrs = server.attributes
    assert attrs["gpupool.pool"] == "normal" and attrs["gpupool.class"] == "agent"
    assert attrs["gpupool.run_id"] == "run-a" and attrs["gpupool.run_step"] == 0
    assert attrs["gpupool.endpoint"] == "chat" and attrs["gpupool.instance"] == "engine-0"
    assert attrs["http.response.status_code"] == 200 and attrs["gpupool.outcome"] == "ok"
    assert attrs["gen_ai.usage.output_tokens"] == 4 and attrs["gen_ai.usage.input_tokens"] > 0
    assert attrs["gpupool.ttft_ms"] > 0 and attrs["gpupool.gpu_seconds"] > 0
    # the engine got the engine span's id as its parent: vLLM's spans hang below it
    engine = names["gpupool.engine"]
    assert engine.kind == CLIENT
    assert rig.seen[-1]["traceparent"] == f"00-{TRACE_ID}-{engine.span_id}-01"
    # the children tile the server span, in order: nothing uncounted but the final send
    ordered = sorted((names[n] for n in CHILDREN), key=lambda s: s.start_ns)
    assert [s.name for s in ordered] == list(CHILDREN)
    assert ordered[0].start_ns == server.start_ns
    for before, after in itertools.pairwise(ordered):
        assert before.end_ns == after.start_ns, (before.name, after.name)
    assert server.end_ns - ordered[-1].end_ns < 5_000_000
    # nothing of the request's content or headers
    everything = repr([(s.attributes, s.resource) for s in spans])
    assert "hi'" not in everything and "x-gpupool" not in everything


async def test_count_tokens_and_a_stored_responses_get_and_cancel_are_traced(
    tmp_path: Path, receiver: OtlpReceiver
) -> None:
    """The engine calls that skip admission: a server span under the incoming trace and the
    engine call below it, whose id the engine got as its parent; a refused one, its code."""
    calls = {
        "count": ("POST /v1/messages/count_tokens", "count_tokens"),
        "get": ("GET /v1/responses/{id}", "responses_get"),
        "cancel": ("POST /v1/responses/{id}/cancel", "responses_cancel"),
    }
    trace_ids = {what: os.urandom(16).hex() for what in [*calls, "unknown"]}

    def tp(what: str) -> dict[str, str]:
        return {"traceparent": f"00-{trace_ids[what]}-{PARENT_ID}-01"}

    async with _rig(tmp_path, receiver) as rig:
        counted = await rig.client.post(
            "/v1/messages/count_tokens", json={"model": "tiny", **CHAT}, headers=tp("count")
        )
        assert counted.status_code == 200, counted.text
        sent = {"count": rig.seen[-1]["traceparent"]}
        stored = await rig.client.post(
            "/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 4}
        )
        rid = stored.json()["id"]
        got = await rig.client.get(f"/v1/responses/{rid}", headers=tp("get"))
        assert got.status_code == 200
        sent["get"] = rig.seen[-1]["traceparent"]
        cancelled = await rig.client.post(f"/v1/responses/{rid}/cancel", headers=tp("cancel"))
        assert cancelled.status_code == 200
        sent["cancel"] = rig.seen[-1]["traceparent"]
        unknown = await rig.client.get("/v1/responses/resp_nobody", headers=tp("unknown"))
        assert unknown.status_code == 404
        await rig.flush()
    for what, (name, endpoint) in calls.items():
        spans = _by_name(receiver.trace(trace_ids[what]))
        assert set(spans) == {name, "gpupool.engine"}, what
        server, engine = spans[name], spans["gpupool.engine"]
        assert server.kind == SERVER and server.parent_span_id == PARENT_ID
        assert engine.kind == CLIENT and engine.parent_span_id == server.span_id
        assert sent[what] == f"00-{trace_ids[what]}-{engine.span_id}-01"  # the engine's parent
        assert server.start_ns <= engine.start_ns <= engine.end_ns <= server.end_ns
        assert server.attributes["gpupool.endpoint"] == endpoint
        assert server.attributes["http.response.status_code"] == 200
        assert server.attributes["gpupool.instance"] == "engine-0"
        assert engine.attributes["http.response.status_code"] == 200
        assert rid not in repr(server.attributes)
    assert _by_name(receiver.trace(trace_ids["count"]))[calls["count"][0]].attributes[
        "gpupool.pool"
    ] == ("normal")
    (refused,) = receiver.trace(trace_ids["unknown"])  # answered before any engine call
    assert refused.name == "GET /v1/responses/{id}"
    assert refused.attributes["http.response.status_code"] == 404
    assert refused.attributes["gpupool.code"] == "response_not_found"


async def test_an_agent_run_reads_as_one_trace(tmp_path: Path, receiver: OtlpReceiver) -> None:
    run = {"x-gpupool-run-id": "run-b"}
    async with _rig(tmp_path, receiver) as rig:
        for _ in range(3):
            resp = await rig.client.post("/v1/chat/completions", json=CHAT, headers=run)
            assert resp.status_code == 200
        # a step that brings its own trace continues it, and links to the run's first step
        resp = await rig.client.post(
            "/v1/chat/completions", json=CHAT, headers={**run, "traceparent": TRACEPARENT}
        )
        assert resp.status_code == 200
        await rig.flush()
    servers = [s for s in receiver.spans if s.kind == SERVER]
    assert len(servers) == 4
    first = min(servers, key=lambda s: s.start_ns)
    later = [s for s in servers if s is not first and s.trace_id == first.trace_id]
    assert len(later) == 2 and all(s.parent_span_id == first.span_id for s in later)
    assert sorted(s.attributes["gpupool.run_step"] for s in [first, *later]) == [0, 1, 2]
    own = next(s for s in servers if s.trace_id == TRACE_ID)
    assert own.links == [(first.trace_id, first.span_id)]


async def test_a_refused_request_has_a_span_with_its_code(
    tmp_path: Path, receiver: OtlpReceiver
) -> None:
    async with _rig(tmp_path, receiver) as rig:
        bad = await rig.client.post(
            "/v1/chat/completions", content=b"{", headers={"traceparent": TRACEPARENT}
        )
        assert bad.status_code == 400
        await rig.flush()
    names = _by_name(receiver.trace(TRACE_ID))
    assert set(names) == {"POST /v1/chat/completions", "gpupool.classify"}
    server = names["POST /v1/chat/completions"]
    assert server.attributes["gpupool.code"] == "invalid_json"
    assert server.attributes["http.response.status_code"] == 400
    assert names["gpupool.classify"].status_code == 2  # error, with the code
    assert names["gpupool.classify"].status_message == "invalid_json"


async def test_sampling_follows_the_ratio_and_the_parent(
    tmp_path: Path, receiver: OtlpReceiver
) -> None:
    unsampled = f"00-{TRACE_ID}-{PARENT_ID}-00"
    async with _rig(tmp_path, receiver, observability={"sample_ratio": 0.0}) as rig:
        for headers in ({}, {"traceparent": unsampled}, {"traceparent": TRACEPARENT}):
            resp = await rig.client.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert resp.status_code == 200
        await rig.flush()
    # ratio 0 keeps no new trace and honours an unsampled parent; a sampled parent wins
    assert {s.trace_id for s in receiver.spans} == {TRACE_ID}
    assert len([s for s in receiver.spans if s.kind == SERVER]) == 1
    # the unsampled request still told the engine which trace it belongs to
    assert rig.seen[1]["traceparent"].startswith(f"00-{TRACE_ID}-")
    assert rig.seen[1]["traceparent"].endswith("-00")


def test_a_dropped_span_is_decided_and_built_as_the_sdk_would() -> None:
    """`RootSampling` (a dropped request never reaches the SDK) takes the SDK sampler's own
    decision: a new trace is kept exactly when its id is under the ratio's bound, and then the
    SDK's span gets that id; a parent's decision is followed, its trace id and flags kept."""
    root = TraceIdRatioBased(0.5)
    ids = PresetIds()
    provider = TracerProvider(sampler=ParentBased(root), id_generator=ids)
    tracer = provider.get_tracer("test")
    sampling = RootSampling(root, ids)
    kept = dropped = 0
    for _ in range(200):
        span = sampling.drop(None)
        if span is None:  # kept: the SDK starts it on the id the decision was taken on
            kept += 1
            sdk = tracer.start_span("kept")
            sc = sdk.get_span_context()
            assert sdk.is_recording() and sc.trace_flags.sampled
            assert sc.trace_id & root.TRACE_ID_LIMIT < root.bound
            sdk.end()
        else:
            dropped += 1
            sc = dropped_context(span)
            assert sc.is_valid and not sc.is_remote
            assert sc.trace_id & root.TRACE_ID_LIMIT >= root.bound
            assert int(sc.trace_flags) == int(TraceFlags.RANDOM_TRACE_ID)  # as the SDK's
    assert kept and dropped  # both outcomes were exercised (p = 2**-199 otherwise)
    # the short path of a new trace: the same rule, the dropped one's header as drop's would be
    kept = dropped = 0
    for _ in range(200):
        header = sampling.new_trace()
        if header is None:
            kept += 1
            sdk = tracer.start_span("kept")
            sc = sdk.get_span_context()
            assert sdk.is_recording() and sc.trace_id & root.TRACE_ID_LIMIT < root.bound
            sdk.end()
        else:
            dropped += 1
            version, trace_hex, span_hex, flags_hex = header.split("-")
            assert (version, len(trace_hex), len(span_hex)) == ("00", 32, 16)
            assert int(trace_hex, 16) & root.TRACE_ID_LIMIT >= root.bound
            assert int(span_hex, 16) != 0
            assert int(flags_hex, 16) == int(TraceFlags.RANDOM_TRACE_ID)
    assert kept and dropped
    trace_id, parent_id = int(TRACE_ID, 16), int(PARENT_ID, 16)
    for flags, keeps in ((TraceFlags.SAMPLED, True), (TraceFlags.DEFAULT, False)):
        parent_sc = SpanContext(trace_id, parent_id, is_remote=True, trace_flags=TraceFlags(flags))
        span = sampling.drop(set_span_in_context(NonRecordingSpan(parent_sc)))
        assert (span is None) is keeps
        if span is not None:
            sc = dropped_context(span)
            assert (sc.trace_id, int(sc.trace_flags)) == (trace_id, 0)
            assert sc.span_id != parent_id


async def test_a_failing_collector_drops_spans_and_never_fails_a_request(
    tmp_path: Path, receiver: OtlpReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    receiver.fail_next = 1  # a 400: refused, not retried
    async with _rig(tmp_path, receiver) as rig:
        assert rig.gateway.tracing is not None
        processor = rig.gateway.tracing.processor
        resp = await rig.client.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 200
        with caplog.at_level(logging.WARNING, logger="router.ops.tracing.export"):
            await rig.flush()
        assert processor.failures == 1 and processor.dropped == 7 and processor.exported == 0
        metrics = (await rig.client.get("/metrics")).text
        assert 'gpupool_trace_spans_total{result="dropped"} 7.0' in metrics
        assert "export of 7 span(s) failed" in caplog.text
        receiver.fail_next = 0
        resp = await rig.client.post("/v1/chat/completions", json=CHAT)
        await rig.flush()
        assert processor.exported == 7
        metrics = (await rig.client.get("/metrics")).text
        assert 'gpupool_trace_spans_total{result="exported"} 7.0' in metrics
    assert receiver.requests >= 2


async def test_json_logs_name_the_trace_and_never_the_content(
    tmp_path: Path, receiver: OtlpReceiver
) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.DEBUG)
    secret_prompt = "my-secret-prompt-" + os.urandom(4).hex()
    try:
        async with _rig(tmp_path, receiver) as rig:
            resp = await rig.client.post(
                "/v1/chat/completions",
                json={**CHAT, "messages": [{"role": "user", "content": secret_prompt}]},
                headers={"traceparent": TRACEPARENT, "authorization": "Bearer sk-hidden-key"},
            )
            assert resp.status_code == 200
            logging.getLogger("router.gateway.proxy").info("inside no request")
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    lines = [orjson.loads(line) for line in stream.getvalue().splitlines()]
    assert lines and all({"ts", "level", "logger", "message"} <= set(e) for e in lines)
    traced = [e for e in lines if e.get("trace_id") == TRACE_ID]
    outside = [e for e in lines if e["message"] == "inside no request"]
    assert outside and "trace_id" not in outside[0]
    text = stream.getvalue()
    assert secret_prompt not in text and "sk-hidden-key" not in text
    # the request logged at least its settlement at debug level, inside its trace
    assert traced, [e["message"] for e in lines]


def test_the_observability_settings_are_checked() -> None:
    base = config_data(pools=even_pools())

    def problems(observability: dict[str, Any]) -> list[str]:
        with pytest.raises(ConfigError) as err:
            parse_config({**base, "observability": observability})
        return err.value.problems

    assert "set without otlp_endpoint" in problems({"sample_ratio": 0.5})[0]
    assert "OTLP/HTTP" in problems({"otlp_endpoint": "localhost:4317"})[0]
    ratio = {"otlp_endpoint": "http://c:4318", "sample_ratio": 2}
    assert "less than or equal to 1" in problems(ratio)[0]
    assert "unknown field" in problems({"otlp_endpoint": "http://c:4318", "headers": {}})[0]
    assert "not set" in problems({"otlp_endpoint": "http://c:4318", "headers_env": "GP_NO_X"})[0]
    config = parse_config({**base, "observability": {"otlp_endpoint": "http://tempo:4318"}})
    assert config.observability.otlp_endpoint == "http://tempo:4318/v1/traces"
    with pytest.raises(ConfigError) as err:
        parse_config({**base, "router": {"log_format": "yaml"}})
    assert "router.log_format" in err.value.problems[0]


def test_the_collectors_headers_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = config_data(pools=even_pools())
    observability = {"otlp_endpoint": "https://otlp.example/v1/traces", "headers_env": "GP_OTLP_H"}
    monkeypatch.setenv("GP_OTLP_H", "Authorization=Basic%20abc, x-scope-orgid=team-a")
    config = parse_config({**base, "observability": observability})
    assert config.observability.headers == (
        ("authorization", "Basic abc"),
        ("x-scope-orgid", "team-a"),
    )
    assert "abc" not in repr(config)
    assert "GP_OTLP_H" in config.engines.local.secret_env  # engines never inherit it
    monkeypatch.setenv("GP_OTLP_H", "no-equals-sign")
    with pytest.raises(ConfigError) as err:
        parse_config({**base, "observability": observability})
    assert "not `key=value" in err.value.problems[0]
    assert "no-equals-sign" not in str(err.value)


def test_tracing_off_builds_nothing(tmp_path: Path) -> None:
    gateway = create_app(config_for_test(tmp_path, pools=even_pools()), [], scrape=False)
    assert gateway.tracing is None
    assert all(type(o).__name__ != "TraceObserver" for o in gateway.settlement.observers)
