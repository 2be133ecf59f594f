"""`gpupool serve --replicas 2` with `router.metrics_port` over a fake engine and a real
PostgreSQL store (issue 25): the supervisor prints each router's metrics address; every
response on the shared port (whole, streamed, an error) names the replica that answered it
(`x-gpupool-replica`); each router's own metrics port answers as that replica (the same
header), counts exactly the requests the header says it served, and refuses the client API.
Requests go on new connections, so the kernel spreads them over both routers."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.faults_ledger_kill import router_config
from pools.testing.fake_engine import FakeEngineState, make_fake_engine
from pools.testing.router_process import RouterProcess
from pools.testing.serve import serve_asgi
from tests.postgres import PASSWORD, PostgresServer
from tests.unit.test_ledger_kill import MODEL

DEADLINE_S = 60.0
KEYS = {
    "GPUPOOL_TEST_STORE_PASSWORD": PASSWORD,
    "GPUPOOL_TEST_TENANT_KEY": "tenant-" + "a" * 20,
    "GPUPOOL_TEST_METRICS_KEY": "metrics-" + "b" * 20,
}
TENANT = {"Authorization": f"Bearer {KEYS['GPUPOOL_TEST_TENANT_KEY']}"}
SCRAPER = {"Authorization": f"Bearer {KEYS['GPUPOOL_TEST_METRICS_KEY']}"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
OK_CHATS = re.compile(
    r'^gpupool_requests_total\{(?=[^}]*endpoint="chat")(?=[^}]*outcome="ok")[^}]*\} (\S+)$',
    re.MULTILINE,
)


def _two_free_ports() -> int:
    """A port p with p and p + 1 free on 127.0.0.1 now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        if port < 65535:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise AssertionError("no two consecutive free ports")


async def test_each_replica_is_scraped_on_its_own_port_and_named_in_every_response(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    url = postgres_server.create_database("replica_metrics")
    metrics_port = _two_free_ports()
    state = FakeEngineState(ttft_s=0.001, itl_s=0.001, keep_requests=False)
    async with serve_asgi(make_fake_engine(state)) as engine_url:
        path = router_config(
            tmp_path,
            [engine_url],
            durable=False,
            model_path=MODEL,
            router={
                "metrics_port": metrics_port,
                "metrics_api_key_env": "GPUPOOL_TEST_METRICS_KEY",
            },
        )
        data: dict[str, Any] = json.loads(path.read_text())
        del data["router"]["ledger_path"]
        data["store"] = {"url": url, "password_env": "GPUPOOL_TEST_STORE_PASSWORD"}
        data["tenants"] = [{"name": "team", "api_key_env": "GPUPOOL_TEST_TENANT_KEY"}]
        path.write_text(json.dumps(data))
        router = RouterProcess(
            path, tmp_path / "router.log", args=["--replicas", "2"], env={**os.environ, **KEYS}
        )
        try:
            await router.wait_ready_async(DEADLINE_S)
            await _served_and_counted(router, metrics_port)
        finally:
            router.stop()
    log = router.log_path.read_text()
    for i in (0, 1):
        assert f": metrics at http://127.0.0.1:{metrics_port + i}/metrics" in log, log


async def _served_and_counted(router: RouterProcess, metrics_port: int) -> None:
    # which replica owns which metrics port: the header of the port's own answers
    owner: dict[str, int] = {}
    for port in (metrics_port, metrics_port + 1):
        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.get(f"http://127.0.0.1:{port}/health")
            assert r.status_code == 200
            owner[r.headers["x-gpupool-replica"]] = port
            # the client API is not served there
            r = await client.post(
                f"http://127.0.0.1:{port}/v1/chat/completions", headers=TENANT, json=CHAT
            )
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_on_this_port"
    assert len(owner) == 2, owner

    served: collections.Counter[str] = collections.Counter()

    async def chat(stream: bool) -> None:
        async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:  # new connection
            r = await client.post(
                "/v1/chat/completions", headers=TENANT, json={**CHAT, "stream": stream}
            )
            assert r.status_code == 200, r.text
            assert r.headers["x-gpupool-replica"] in owner, r.headers
            served[r.headers["x-gpupool-replica"]] += 1

    for i in range(24):
        await chat(stream=i % 2 == 1)
    assert sum(served.values()) == 24
    assert len(served) == 2, f"the kernel sent every connection to one router: {served}"
    # an error names its replica too
    async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
        r = await client.post("/v1/chat/completions", json=CHAT)  # no key
        assert r.status_code == 401 and r.headers["x-gpupool-replica"] in owner

    # each replica's own metrics: the chats it served, none of the other's (a request is
    # counted just after its last bytes: read again until it is, then exactly)
    for replica, port in owner.items():
        deadline = time.monotonic() + DEADLINE_S
        async with httpx.AsyncClient(timeout=10) as client:
            while True:
                r = await client.get(f"http://127.0.0.1:{port}/metrics", headers=SCRAPER)
                assert r.status_code == 200 and r.headers["x-gpupool-replica"] == replica
                counted = sum(float(v) for v in OK_CHATS.findall(r.text))
                if counted >= served[replica] or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
        assert counted == served[replica], (replica, counted, dict(served))
