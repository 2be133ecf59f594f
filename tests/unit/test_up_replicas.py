"""`gpupool serve --replicas 2` over a fake engine and a real PostgreSQL store: two router
processes on one port (SO_REUSEPORT), both answering; one `kill -9`ed while it holds a
tenant's only concurrency slot: its request fails, the port keeps serving, the dead router is
started again, its slot is free again after `store.slot_lease_s`; connections queued at a
router that is then killed (SIGSTOPped first, so it accepts nothing) are served by the router
started in its place, not reset; Ctrl-C stops every router (none left running). check-config
refuses more than one router without a PostgreSQL store. Conditions are waited for with
generous deadlines; nothing is timed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks.faults_ledger_kill import router_config
from pools.config import contract_problems
from pools.testing.config import config_for_test
from pools.testing.fake_engine import FakeEngineState, make_fake_engine
from pools.testing.router_process import RouterProcess
from pools.testing.serve import serve_asgi
from router.store import PostgresStore
from tests.postgres import PASSWORD, PostgresServer
from tests.unit.test_ledger_kill import MODEL

DEADLINE_S = 60.0
ENV = {
    "GPUPOOL_TEST_STORE_PASSWORD": PASSWORD,
    "GPUPOOL_TEST_ADMIN_KEY": "admin-" + "a" * 20,
    "GPUPOOL_TEST_TIER_KEY": "tier-" + "b" * 20,  # a tenant with one request in flight
    "GPUPOOL_TEST_FREE_KEY": "free-" + "c" * 20,  # a tenant without limits
}


def test_check_config_refuses_replicas_without_a_shared_store() -> None:
    embedded = config_for_test(router={"replicas": 2})
    assert any(
        p.startswith("router.replicas: 2 router processes need a PostgreSQL store")
        for p in contract_problems(embedded)
    )
    shared = config_for_test(router={"replicas": 2}, store={"url": "postgresql://u@db/x"})
    assert not [p for p in contract_problems(shared) if p.startswith("router.replicas")]


async def until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not await condition():
        assert time.monotonic() < deadline, f"not within {DEADLINE_S:g} s: {what}"
        await asyncio.sleep(0.1)


def marked_processes(mark: str) -> list[int]:
    """The live processes whose environment carries `mark` (this test's routers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if mark.encode() in (entry / "environ").read_bytes():
                stat = (entry / "stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] != "Z":  # not a zombie
                    found.append(int(entry.name))
    return found


async def test_two_routers_share_the_port_and_survive_a_kill_9(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    url = postgres_server.create_database("replicas")
    mark = f"GPUPOOL_TEST_MARK={secrets.token_hex(8)}"
    env = {**os.environ, **ENV, mark.split("=")[0]: mark.split("=")[1]}
    state = FakeEngineState(ttft_s=0.001, itl_s=0.001, keep_requests=False)
    async with serve_asgi(make_fake_engine(state)) as engine_url:
        path = router_config(tmp_path, [engine_url], durable=True, model_path=MODEL)
        data: dict[str, Any] = json.loads(path.read_text())
        del data["router"]["ledger_path"]
        data["router"]["admin_api_key_env"] = "GPUPOOL_TEST_ADMIN_KEY"
        data["store"] = {
            "url": url,
            "password_env": "GPUPOOL_TEST_STORE_PASSWORD",
            "slot_lease_s": 3,
        }
        data["governance"] = {
            "tiers": {"one": {"max_concurrent_runs": 1, "max_concurrent_requests": 1}}
        }
        data["tenants"] = [
            {"name": "tier", "api_key_env": "GPUPOOL_TEST_TIER_KEY", "tier": "one"},
            {"name": "free", "api_key_env": "GPUPOOL_TEST_FREE_KEY"},
        ]
        path.write_text(json.dumps(data))
        router = RouterProcess(path, tmp_path / "router.log", args=["--replicas", "2"], env=env)
        try:
            await router.wait_ready_async(DEADLINE_S)
            await _both_answer_then_kill_one(router, url, state)
            await _queued_at_a_killed_router_are_served(router)
            router.signal(signal.SIGINT)  # Ctrl-C
            assert await asyncio.to_thread(router.proc.wait, DEADLINE_S) == 0, router.tail()

            async def none_left() -> bool:  # the fork server exits after its parent
                return marked_processes(mark) == []

            await until(none_left, "every router and the fork server gone")
        finally:
            router.stop()
            for pid in marked_processes(mark):
                os.kill(pid, signal.SIGKILL)


def _headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {ENV[key]}"}


async def _replica(router: RouterProcess) -> dict[str, Any]:
    """The rebalancer's view of whichever router a new connection reaches."""
    async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
        r = await client.get("/admin/pools", headers=_headers("GPUPOOL_TEST_ADMIN_KEY"))
        r.raise_for_status()
        leader: dict[str, Any] = r.json()["rebalancer"]["leader"]
        return leader


async def _chat(router: RouterProcess, key: str) -> int:
    async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
        r = await client.post(
            "/v1/chat/completions",
            headers=_headers(key),
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            },
        )
        return r.status_code


async def _both_answer_then_kill_one(
    router: RouterProcess, url: str, state: FakeEngineState
) -> None:
    seen: dict[str, dict[str, Any]] = {}

    async def both_answered() -> bool:
        view = await _replica(router)
        seen[view["replica"]] = view
        return len(seen) == 2 and len({v["leader"] for v in seen.values()}) == 1

    await until(both_answered, "both routers answering, agreeing on one leader")
    leader = next(iter(seen.values()))["leader"]
    assert leader in seen and [v["leading"] for v in seen.values()].count(True) == 1

    # a request of the tier tenant held in the engine: its router holds the tenant's one slot
    state.gate = asyncio.Event()
    held = asyncio.ensure_future(_chat(router, "GPUPOOL_TEST_TIER_KEY"))
    store = PostgresStore(url, password=PASSWORD)
    await asyncio.to_thread(store.open)
    try:

        async def slot_holder() -> bool:
            return state.running == 1 and bool(await asyncio.to_thread(_holders, store))

        await until(slot_holder, "the held request's slot in the database")
        (holder,) = await asyncio.to_thread(_holders, store)
        victim = holder.split(":")[1]  # host:pid:random:request id
        os.kill(int(victim), signal.SIGKILL)
        with contextlib.suppress(httpx.HTTPError):
            assert await held != 200  # its in-flight request fails
        state.gate.set()
        state.gate = None
        # the port keeps serving: every request on a new connection reaches a live router
        for _ in range(10):
            assert await _chat(router, "GPUPOOL_TEST_FREE_KEY") == 200

        # the dead router's slot: still in the database, free again after the lease
        async def slot_free() -> bool:
            return await _chat(router, "GPUPOOL_TEST_TIER_KEY") == 200

        await until(slot_free, "the tier tenant served again after slot_lease_s")
        assert not [h for h in await asyncio.to_thread(_holders, store) if f":{victim}:" in h]
    finally:
        await asyncio.to_thread(store.close)

    async def started_again() -> bool:
        view = await _replica(router)
        return f":{victim}:" not in view["replica"] and view["replica"] not in seen

    await until(started_again, "a new router in place of the killed one")


async def _queued_at_a_killed_router_are_served(router: RouterProcess) -> None:
    """The kernel spreads new connections over the routers' sockets (SO_REUSEPORT): with one
    router stopped, about half of them queue at its socket. Killed, its place keeps the
    socket, and the router started there answers them (before, they were reset)."""
    victim = int((await _replica(router))["replica"].split(":")[1])
    os.kill(victim, signal.SIGSTOP)

    async def chat() -> int:
        async with httpx.AsyncClient(base_url=router.url, timeout=DEADLINE_S) as client:
            r = await client.post(
                "/v1/chat/completions",
                headers=_headers("GPUPOOL_TEST_FREE_KEY"),
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
            )
            return r.status_code

    sent = [asyncio.ensure_future(chat()) for _ in range(12)]  # a new connection each
    try:
        await until(lambda: _settled(sent, at_least=1), "the other router answering")
        await asyncio.sleep(0.5)  # what the live router would answer is answered by now
        queued = sum(1 for t in sent if not t.done())
        assert queued >= 1, "no connection went to the stopped router"
    finally:
        os.kill(victim, signal.SIGKILL)
    answers = await asyncio.gather(*sent, return_exceptions=True)
    assert answers == [200] * len(sent), answers


async def _settled(tasks: Sequence[asyncio.Future[int]], *, at_least: int) -> bool:
    return sum(1 for t in tasks if t.done()) >= at_least


def _holders(store: PostgresStore) -> list[str]:
    with store.connection() as conn:
        return [row[0] for row in conn.execute("SELECT holder FROM concurrency_slots")]
