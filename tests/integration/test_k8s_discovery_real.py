"""Kubernetes discovery in front of real CPU vLLM engines (the session's three): a fake API
server answers EndpointSlices for them, the router follows it. Engines are added (scale up)
and taken away while one of them streams (its pod terminating); traffic follows without a
failed request, and the one in flight on the leaving engine finishes whole."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from pools.config import KubernetesEnginesConfig, KubernetesServiceConfig, parse_config
from pools.discovery.kubernetes import EndpointSliceSource
from pools.launchers import InstanceSpec
from pools.launchers.kubernetes import KubernetesLauncher
from router.gateway.app import create_app
from tests.integration.conftest import ENGINE_KEY_ENV, MAX_MODEL_LEN, MODEL_DIR

pytestmark = pytest.mark.integration

SERVICE = KubernetesServiceConfig("gp-gpupool-engine-cpu", 8000, 1)


def _slice(pod: str, url: str, *, terminating: bool = False) -> dict[str, Any]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return {
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": int(port)}],
        "endpoints": [
            {
                "addresses": [host],
                "conditions": {"ready": not terminating, "terminating": terminating},
                "targetRef": {"kind": "Pod", "name": pod},
            }
        ],
    }


async def test_the_router_follows_real_engines_in_and_out(
    real_engines: list[InstanceSpec], tmp_path: Path
) -> None:
    slices: list[dict[str, Any]] = [_slice("cpu-0", real_engines[0].url)]

    async def list_slices(request: web.Request) -> web.Response:
        assert request.query["labelSelector"] == f"kubernetes.io/service-name={SERVICE.name}"
        return web.json_response({"items": slices})

    app = web.Application()
    app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices", list_slices)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    assert isinstance(site._server, asyncio.Server)  # started: the listening server
    api_port = site._server.sockets[0].getsockname()[1]

    k8s = KubernetesEnginesConfig(
        services=(SERVICE,),
        poll_interval_s=0.2,
        drain_timeout_s=60,
        api_key=os.environ[ENGINE_KEY_ENV],
    )
    source = EndpointSliceSource(
        k8s, namespace="llm", api_url=f"http://127.0.0.1:{api_port}", token_path=None, ca_path=None
    )
    launcher = KubernetesLauncher(k8s, source=source)
    config = parse_config(
        {
            "model": {
                "name": "tiny",
                "path": str(MODEL_DIR),
                "max_model_len_tokens": MAX_MODEL_LEN,
            },
            "engines": {
                "launcher": "kubernetes",
                "kubernetes": {"services": [{"name": SERVICE.name}]},
            },
            "pools": {
                # on three engines: one whole engine for agent, two for normal
                "agent": {"classes": ["agent"], "share": {"initial_frac": 0.34}},
                "normal": {"classes": ["normal"], "share": {"initial_frac": 0.66}},
            },
            "router": {
                "ledger_path": str(tmp_path / "ledger.sqlite"),
                "state_path": str(tmp_path / "state.json"),
                "scrape_interval_s": 0.2,
            },
        }
    )
    gateway = create_app(config, await launcher.start(), source=launcher.source)
    await gateway.start()
    transport = httpx.ASGITransport(app=gateway)

    async def healthy(*ids: str) -> None:
        for _ in range(300):
            if all((s := gateway.fleet.get(i)) is not None and s.healthy for i in ids):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"{ids} not healthy")

    async def ask(client: httpx.AsyncClient, cls: str, **body: Any) -> httpx.Response:
        payload = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
        }
        return await client.post(
            "/v1/chat/completions",
            json={**payload, **body},
            headers={"x-gpupool-class": cls},
            timeout=120,
        )

    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            await healthy("cpu-0")
            assert (await ask(client, "normal")).status_code == 200

            # scale up: two more pods turn ready
            slices.append(_slice("cpu-1", real_engines[1].url))
            slices.append(_slice("cpu-2", real_engines[2].url))
            await healthy("cpu-0", "cpu-1", "cpu-2")
            seen = set()
            for cls in ("agent", "normal") * 4:
                resp = await ask(client, cls)
                assert resp.status_code == 200, resp.text
                seen.add(resp.headers["x-gpupool-instance"])
            assert len(seen) >= 2  # traffic spread over the new engines

            # scale down while the leaving engine streams: its pod turns terminating
            (agent_engine,) = gateway.pool_map.current.instances_for("agent")
            long = asyncio.ensure_future(ask(client, "agent", max_tokens=200, ignore_eos=True))
            for _ in range(200):
                state = gateway.fleet.get(agent_engine)
                if state is not None and state.inflight > 0:
                    break
                await asyncio.sleep(0.02)
            index = int(agent_engine.rsplit("-", 1)[1])
            slices[index] = _slice(agent_engine, real_engines[index].url, terminating=True)
            for _ in range(100):
                state = gateway.fleet.get(agent_engine)
                if state is None or state.leaving:
                    break
                await asyncio.sleep(0.05)
            statuses = []
            for cls in ("agent", "normal") * 3:  # both pools keep serving, not on the leaver
                resp = await ask(client, cls)
                statuses.append(resp.status_code)
                assert resp.headers.get("x-gpupool-instance") != agent_engine
            assert statuses == [200] * 6
            done = await long
            assert done.status_code == 200, done.text
            assert done.json()["usage"]["completion_tokens"] == 200  # finished whole
            for _ in range(100):
                if gateway.fleet.get(agent_engine) is None:
                    break
                await asyncio.sleep(0.05)
            assert gateway.fleet.get(agent_engine) is None  # left once drained
    finally:
        await gateway.aclose()
        await launcher.aclose()
        await runner.cleanup()
