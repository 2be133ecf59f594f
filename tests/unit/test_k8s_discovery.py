"""Engines found in Kubernetes: EndpointSlices and DNS answers turned into instances (pure,
against a fake API server over HTTP, and a fake resolver), and the router's fleet following
them at run time: engines join and take traffic, a leaving engine drains (its requests finish,
no new ones reach it) and then leaves, all without a restart and without a failed request."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from pools.config import KubernetesEnginesConfig, KubernetesServiceConfig
from pools.discovery import DiscoveryError, DiscoveryLoop
from pools.discovery.kubernetes import (
    DnsSource,
    EndpointSliceSource,
    endpoints_from_slices,
    make_kubernetes_source,
)
from pools.launchers.base import InstanceSpec
from pools.launchers.kubernetes import KubernetesLauncher
from pools.testing.config import config_for_test, even_pools
from pools.testing.fake_engine import FakeEngineState, make_fake_engine
from pools.testing.serve import serve_asgi
from router.gateway.app import Gateway, create_app

SERVICE = KubernetesServiceConfig(name="gp-gpupool-engine-main", port=8000, gpus_per_instance=2)
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def _endpoint(
    pod: str, ip: str, *, ready: bool | None = True, terminating: bool | None = None
) -> dict[str, Any]:
    conditions: dict[str, Any] = {}
    if ready is not None:
        conditions["ready"] = ready
    if terminating is not None:
        conditions["terminating"] = terminating
    return {
        "addresses": [ip],
        "conditions": conditions,
        "hostname": pod,
        "targetRef": {"kind": "Pod", "name": pod, "namespace": "llm"},
    }


def _slice(endpoints: list[dict[str, Any]], port: int = 8000, **extra: Any) -> dict[str, Any]:
    return {
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        **extra,
    }


# -- EndpointSlices to instances (pure) ------------------------------------------------------


def test_ready_endpoints_become_instances_named_by_pod() -> None:
    specs = endpoints_from_slices(
        [
            _slice(
                [
                    _endpoint("main-1", "10.0.0.8"),
                    _endpoint("main-0", "10.0.0.7", ready=None),  # unset: ready (API rule)
                    _endpoint("main-2", "10.0.0.9", ready=False),  # starting: not yet
                    _endpoint("main-3", "10.0.0.10", ready=False, terminating=True),  # leaving
                ]
            )
        ],
        SERVICE,
        api_key="engine-key",
    )
    assert specs == [
        InstanceSpec("main-0", "http://10.0.0.7:8000", 2, "engine-key"),
        InstanceSpec("main-1", "http://10.0.0.8:8000", 2, "engine-key"),
    ]


def test_an_endpoint_in_two_slices_counts_once_and_ports_are_the_slices() -> None:
    specs = endpoints_from_slices(
        [
            _slice([_endpoint("main-0", "10.0.0.7")]),
            _slice([_endpoint("main-0", "10.0.0.7")]),
            _slice([_endpoint("main-1", "fd00::5")], port=9000, addressType="IPv6"),
            _slice([_endpoint("x", "10.0.0.1")], addressType="FQDN"),
        ],
        SERVICE,
    )
    assert [(s.instance_id, s.url) for s in specs] == [
        ("main-0", "http://10.0.0.7:8000"),
        ("main-1", "http://[fd00::5]:9000"),  # the only port, named http
    ]


def test_an_endpoint_without_a_pod_is_named_by_its_address() -> None:
    endpoint = {"addresses": ["10.1.2.3"], "conditions": {"ready": True}}
    (spec,) = endpoints_from_slices([_slice([endpoint])], SERVICE)
    assert spec.instance_id == "gp-gpupool-engine-main-10-1-2-3"


# -- the API server, over HTTP ---------------------------------------------------------------


@dataclass
class FakeApi:
    """A fake API server's EndpointSlice list: slices per Service, what it was asked."""

    slices: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    status: int = 200
    seen: list[tuple[str, str, str | None]] = field(default_factory=list)

    def app(self) -> web.Application:
        async def list_slices(request: web.Request) -> web.Response:
            selector = request.query.get("labelSelector", "")
            self.seen.append(
                (request.match_info["ns"], selector, request.headers.get("Authorization"))
            )
            if self.status != 200:
                return web.json_response(
                    {"kind": "Status", "code": self.status}, status=self.status
                )
            service = selector.removeprefix("kubernetes.io/service-name=")
            return web.json_response(
                {"kind": "EndpointSliceList", "items": self.slices.get(service, [])}
            )

        app = web.Application()
        app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", list_slices)
        return app


@pytest.fixture
async def api() -> AsyncIterator[tuple[FakeApi, str]]:
    fake = FakeApi()
    runner = web.AppRunner(fake.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    assert isinstance(site._server, asyncio.Server)  # started: the listening server
    port = site._server.sockets[0].getsockname()[1]
    yield fake, f"http://127.0.0.1:{port}"
    await runner.cleanup()


def _k8s(*services: KubernetesServiceConfig, **kw: Any) -> KubernetesEnginesConfig:
    return KubernetesEnginesConfig(services=services, api_key="engine-key", **kw)


async def test_endpointslice_source_lists_each_service_with_the_token(
    api: tuple[FakeApi, str], tmp_path: Path
) -> None:
    fake, url = api
    other = KubernetesServiceConfig("gp-gpupool-engine-l40s", 8000, 1)
    fake.slices = {
        SERVICE.name: [_slice([_endpoint("main-0", "10.0.0.7")])],
        other.name: [_slice([_endpoint("l40s-0", "10.0.1.7")])],
    }
    token = tmp_path / "token"
    token.write_text("token-1\n")
    source = EndpointSliceSource(
        _k8s(SERVICE, other), namespace="llm", api_url=url, token_path=token, ca_path=None
    )
    try:
        assert [(s.instance_id, s.gpus) for s in await source.poll()] == [
            ("main-0", 2),
            ("l40s-0", 1),
        ]
        token.write_text("token-2")  # a projected token rotates: read again each poll
        await source.poll()
    finally:
        await source.aclose()
    assert fake.seen == [
        ("llm", f"kubernetes.io/service-name={SERVICE.name}", "Bearer token-1"),
        ("llm", f"kubernetes.io/service-name={other.name}", "Bearer token-1"),
        ("llm", f"kubernetes.io/service-name={SERVICE.name}", "Bearer token-2"),
        ("llm", f"kubernetes.io/service-name={other.name}", "Bearer token-2"),
    ]


async def test_a_forbidden_answer_names_the_missing_rbac(api: tuple[FakeApi, str]) -> None:
    fake, url = api
    fake.status = 403
    source = EndpointSliceSource(
        _k8s(SERVICE), namespace="llm", api_url=url, token_path=None, ca_path=None
    )
    try:
        with pytest.raises(DiscoveryError, match="needs get/list on endpointslices"):
            await source.poll()
    finally:
        await source.aclose()


async def test_an_unreachable_api_server_is_a_discovery_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    source = EndpointSliceSource(
        _k8s(SERVICE), namespace="llm", api_url=url, token_path=None, ca_path=None
    )
    try:
        with pytest.raises(DiscoveryError, match=SERVICE.name):
            await source.poll()
    finally:
        await source.aclose()


def test_api_discovery_needs_the_in_cluster_address(tmp_path: Path) -> None:
    (tmp_path / "namespace").write_text("llm\n")
    with pytest.raises(DiscoveryError, match="KUBERNETES_SERVICE_HOST"):
        make_kubernetes_source(_k8s(SERVICE), {}, tmp_path)
    source = make_kubernetes_source(
        _k8s(SERVICE),
        {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"},
        tmp_path,
    )
    assert isinstance(source, EndpointSliceSource)
    dns = make_kubernetes_source(_k8s(SERVICE, discovery="dns"), {}, tmp_path)
    assert isinstance(dns, DnsSource)
    assert dns.host(SERVICE) == "gp-gpupool-engine-main.llm.svc.cluster.local"  # its namespace


# -- DNS -------------------------------------------------------------------------------------


async def test_dns_source_follows_the_headless_services_records() -> None:
    answers: dict[str, list[str]] = {
        "gp-gpupool-engine-main.llm.svc.cluster.local": ["10.0.0.8", "10.0.0.7"],
    }
    asked: list[tuple[str, int]] = []

    async def resolve(host: str, port: int) -> list[str]:
        asked.append((host, port))
        return answers.get(host, [])  # NXDOMAIN (no ready pod) answers no address

    source = DnsSource(_k8s(SERVICE, discovery="dns"), namespace="llm", resolve=resolve)
    specs = await source.poll()
    assert [(s.instance_id, s.url, s.api_key) for s in specs] == [
        ("gp-gpupool-engine-main-10-0-0-8", "http://10.0.0.8:8000", "engine-key"),
        ("gp-gpupool-engine-main-10-0-0-7", "http://10.0.0.7:8000", "engine-key"),
    ]
    answers.clear()
    assert await source.poll() == []
    assert asked == [("gp-gpupool-engine-main.llm.svc.cluster.local", 8000)] * 2


# -- the fleet follows the source ------------------------------------------------------------


class ScriptedSource:
    """A source whose next answer the test sets; `fail` makes polls raise."""

    poll_interval_s = 3600.0  # the test polls by hand

    def __init__(self, drain_timeout_s: float = 60.0) -> None:
        self.drain_timeout_s = drain_timeout_s
        self.answer: list[InstanceSpec] = []
        self.fail = False

    async def poll(self) -> list[InstanceSpec]:
        if self.fail:
            raise DiscoveryError("the API server is away")
        return list(self.answer)


def _config(tmp_path: Path) -> Any:
    return config_for_test(tmp_path, pools=even_pools(), router={"scrape_interval_s": 0.05})


@dataclass
class Rig:
    gateway: Gateway
    client: httpx.AsyncClient
    source: ScriptedSource
    engines: dict[str, InstanceSpec]
    states: dict[str, FakeEngineState]

    async def answer(self, *ids: str) -> None:
        self.source.answer = [self.engines[i] for i in ids]
        assert self.gateway.discovery is not None
        await self.gateway.discovery.poll_once()

    async def until_healthy(self, *ids: str) -> None:
        for _ in range(200):
            if all((s := self.gateway.fleet.get(i)) is not None and s.healthy for i in ids):
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{ids} did not become healthy")

    def changes(self, change: str) -> float:
        value = self.gateway.metrics.registry.get_sample_value(
            "gpupool_fleet_changes_total", {"change": change}
        )
        return value or 0.0


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    states = {"main-0": FakeEngineState(), "main-1": FakeEngineState()}
    async with (
        serve_asgi(make_fake_engine(states["main-0"])) as u0,
        serve_asgi(make_fake_engine(states["main-1"])) as u1,
    ):
        engines = {"main-0": InstanceSpec("main-0", u0, 1), "main-1": InstanceSpec("main-1", u1, 1)}
        source = ScriptedSource()
        gateway = create_app(_config(tmp_path), [], source=source)  # the router starts first
        await gateway.start()
        transport = httpx.ASGITransport(app=gateway)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            yield Rig(gateway, client, source, engines, states)
        await gateway.aclose()


async def _until(condition: Any, what: str, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.005)):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


async def _chat(client: httpx.AsyncClient, cls: str, **body: Any) -> httpx.Response:
    return await client.post(
        "/v1/chat/completions", json={**CHAT, **body}, headers={"x-gpupool-class": cls}
    )


async def test_engines_join_without_a_restart_and_take_traffic(rig: Rig) -> None:
    assert (await rig.client.get("/ready")).status_code == 503  # no engine yet
    await rig.answer("main-0")
    await rig.until_healthy("main-0")
    assert (await rig.client.get("/ready")).status_code == 200  # one engine split in two
    assert (await _chat(rig.client, "normal")).status_code == 200
    assert rig.states["main-0"].served == 1

    await rig.answer("main-0", "main-1")
    await rig.until_healthy("main-1")
    allocation = rig.gateway.pool_map.current
    # two engines, two pools at one half each: a whole engine per pool
    assert {allocation.instances_for("agent"), allocation.instances_for("normal")} == {
        ("main-0",),
        ("main-1",),
    }
    for cls in ("agent", "normal"):
        assert (await _chat(rig.client, cls)).status_code == 200
    assert rig.states["main-1"].served == 1 and rig.states["main-0"].served == 2
    assert rig.gateway.accountant.has_instance("main-1")
    assert rig.changes("joined") == 2


async def test_a_leaving_engine_drains_then_leaves(rig: Rig) -> None:
    await rig.answer("main-0", "main-1")
    await rig.until_healthy("main-0", "main-1")
    (normal,) = rig.gateway.pool_map.current.instances_for("normal")
    (other,) = rig.gateway.pool_map.current.instances_for("agent")
    slow = rig.states[normal]
    # the request holds its sequence on the engine until the test lets it go (no timer: at
    # ~0.4 s of tokens it once ended, on a loaded machine, before the engine was seen leaving)
    slow.gate = asyncio.Event()
    in_flight = asyncio.ensure_future(_chat(rig.client, "normal", max_tokens=20))
    await _until(lambda: slow.running > 0, "the slow request started")

    await rig.answer(other)  # `normal`'s pod is terminating: gone from the answer
    state = rig.gateway.fleet.get(normal)
    assert state is not None and state.leaving  # still in the fleet: it has work in flight
    assert rig.gateway.pool_map.current.instances_for("normal") == (other,)
    served_before = slow.served
    for cls in ("normal", "agent", "normal"):  # no new work reaches the leaving engine
        assert (await _chat(rig.client, cls)).status_code == 200
    assert slow.served == served_before

    assert not in_flight.done()
    slow.gate.set()
    done = await in_flight  # the request that had started finishes, whole
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 20
    assert rig.gateway.fleet.get(normal) is None  # left once drained
    assert not rig.gateway.accountant.has_instance(normal)
    assert rig.changes("leaving") == 1 and rig.changes("left") == 1
    assert (
        rig.gateway.metrics.registry.get_sample_value(
            "gpupool_instance_healthy", {"instance": normal}
        )
        is None
    )  # its series went with it


async def test_drain_timeout_drops_the_engine_but_not_its_request(tmp_path: Path) -> None:
    state = FakeEngineState(itl_s=0.02)
    async with serve_asgi(make_fake_engine(state)) as url:
        spec = InstanceSpec("main-0", url, 1)
        source = ScriptedSource(drain_timeout_s=0.0)
        source.answer = [spec]
        gateway = create_app(_config(tmp_path), [spec], source=source)
        await gateway.start()
        assert gateway.discovery is not None
        transport = httpx.ASGITransport(app=gateway)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            await _until(
                lambda: (s := gateway.fleet.get("main-0")) is not None and s.healthy, "healthy"
            )
            in_flight = asyncio.ensure_future(_chat(client, "normal", max_tokens=15))
            await _until(lambda: state.running > 0, "the request started")
            source.answer = []
            await gateway.discovery.poll_once()
            assert gateway.fleet.get("main-0") is None  # timeout 0: gone at once
            resp = await in_flight
            assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 15
            report = gateway.accountant.conservation(gateway.clock())
            assert report.as_dict()  # the request was still accounted after removal
        await gateway.aclose()


async def test_a_failing_source_keeps_the_fleet_and_a_returning_engine_is_kept(rig: Rig) -> None:
    await rig.answer("main-0", "main-1")
    rig.source.fail = True
    assert rig.gateway.discovery is not None
    assert await rig.gateway.discovery.poll_once() is False
    assert sorted(rig.gateway.fleet.instance_ids()) == ["main-0", "main-1"]
    rig.source.fail = False
    # main-1 goes (with work in flight) and comes back before it drained
    await rig.until_healthy("main-1")
    state = rig.gateway.fleet.get("main-1")
    assert state is not None
    lease = rig.gateway.fleet.acquire("main-1", "normal")
    await rig.answer("main-0")
    assert state.leaving
    await rig.answer("main-0", "main-1")
    assert not state.leaving and "main-1" in rig.gateway.pool_map.current.fracs
    lease.release()
    assert rig.gateway.fleet.get("main-1") is state  # a released lease no longer removes it
    assert rig.changes("returned") == 1


async def test_an_engine_at_a_new_address_is_readmitted_after_a_scrape(rig: Rig) -> None:
    await rig.answer("main-0")
    await rig.until_healthy("main-0")
    moved = InstanceSpec("main-0", rig.engines["main-1"].url, 1)  # restarted elsewhere
    rig.source.answer = [moved]
    assert rig.gateway.discovery is not None
    await rig.gateway.discovery.poll_once()
    state = rig.gateway.fleet.get("main-0")
    assert state is not None and state.spec.url == moved.url
    await rig.until_healthy("main-0")
    assert (await _chat(rig.client, "normal")).status_code == 200
    assert rig.states["main-1"].served == 1  # served at the new address
    assert rig.changes("moved") == 1


async def test_kubernetes_launcher_and_router_follow_a_fake_api_server(
    api: tuple[FakeApi, str], tmp_path: Path
) -> None:
    fake, url = api
    engine_states = [FakeEngineState(), FakeEngineState()]
    async with (
        serve_asgi(make_fake_engine(engine_states[0])) as u0,
        serve_asgi(make_fake_engine(engine_states[1])) as u1,
    ):
        ports = [int(u.rsplit(":", 1)[1]) for u in (u0, u1)]
        service = KubernetesServiceConfig("gp-gpupool-engine-main", 8000, 1)
        fake.slices = {service.name: [_slice([_endpoint("main-0", "127.0.0.1")], port=ports[0])]}
        source = EndpointSliceSource(
            KubernetesEnginesConfig(services=(service,), poll_interval_s=0.05),
            namespace="llm",
            api_url=url,
            token_path=None,
            ca_path=None,
        )
        launcher = KubernetesLauncher(KubernetesEnginesConfig(services=(service,)), source=source)
        instances = await launcher.start()
        assert [i.instance_id for i in instances] == ["main-0"]
        gateway = create_app(_config(tmp_path), instances, source=launcher.source)
        await gateway.start()
        transport = httpx.ASGITransport(app=gateway)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
                # a scale-up: a second pod turns ready in its own slice
                fake.slices[service.name].append(
                    _slice([_endpoint("main-1", "127.0.0.1")], port=ports[1])
                )
                for _ in range(300):
                    s = gateway.fleet.get("main-1")
                    if s is not None and s.healthy:
                        break
                    await asyncio.sleep(0.01)
                else:
                    raise AssertionError("main-1 never joined")
                statuses = [(await _chat(client, c)).status_code for c in ("agent", "normal") * 3]
                assert statuses == [200] * 6
                assert engine_states[0].served > 0 and engine_states[1].served > 0
                # a scale-down: main-0's pod terminates (ready false, terminating)
                fake.slices[service.name][0] = _slice(
                    [_endpoint("main-0", "127.0.0.1", ready=False, terminating=True)],
                    port=ports[0],
                )
                for _ in range(300):
                    if gateway.fleet.get("main-0") is None:
                        break
                    await asyncio.sleep(0.01)
                else:
                    raise AssertionError("main-0 never left")
                served = engine_states[0].served
                statuses = [(await _chat(client, c)).status_code for c in ("agent", "normal") * 2]
                assert statuses == [200] * 4 and engine_states[0].served == served
        finally:
            await gateway.aclose()
            await launcher.aclose()


async def test_discovery_loop_polls_on_its_interval() -> None:
    source = ScriptedSource()
    source.poll_interval_s = 0.0
    answers: list[int] = []
    naps: list[float] = []

    async def nap(seconds: float) -> None:
        naps.append(seconds)
        await asyncio.sleep(0)

    loop = DiscoveryLoop(source, lambda specs: answers.append(len(specs)), sleep=nap)
    await loop.start()
    await _until(lambda: len(answers) >= 3, "three answers")
    await loop.aclose()
    assert loop.polls >= 3 and set(naps) == {0.0}
