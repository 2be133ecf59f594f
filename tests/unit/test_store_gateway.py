"""The whole router on a PostgreSQL store (a real server) over fake engines: requests' records,
governance's saved state and the SREs' settings land in the database, and a second router on
the same database (a restart, or the next replica) answers a run's ledger and continues its
step numbering from there; two routers at once on it send a run's steps to its home."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import pytest

from pools.config import Config
from pools.testing.config import REMOVE, config_for_test, even_pools, one_pool
from pools.testing.gateway import another_router, gateway_over_fakes
from router.store import PostgresStore, applied_versions
from tests.postgres import PASSWORD, PostgresServer

ENV = "GPUPOOL_TEST_STORE_PASSWORD"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def _config(tmp_path: Path, url: str) -> Config:
    return config_for_test(
        tmp_path,
        pools=even_pools(),
        router={"ledger_path": REMOVE},
        store={"url": url, "password_env": ENV},
    )


async def test_a_router_on_postgres_shares_its_ledger_with_the_next(
    postgres_server: PostgresServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = postgres_server.create_database("gateway")
    monkeypatch.setenv(ENV, PASSWORD)
    config = _config(tmp_path, url)
    headers = {"x-gpupool-run-id": "shared"}
    async with gateway_over_fakes(config) as rig:
        for _ in range(3):
            resp = await rig.client.post("/v1/chat/completions", json=BODY, headers=headers)
            assert resp.status_code == 200
        await rig.gateway.rebalancer.freeze("sre", True)
        assert rig.gateway.admitter.peers is not None  # reservations shared with replicas
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".sqlite")]  # no embedded file

    store = PostgresStore(url, password=PASSWORD)
    store.open()
    try:
        assert applied_versions(store) == {
            "ledger": 1,
            "governance": 14,
            "rebalancer": 4,
            "responses": 1,
        }
        with store.connection() as conn:
            steps = conn.execute(
                "SELECT step_index FROM requests WHERE run_id = ? ORDER BY step_index", ("shared",)
            ).fetchall()
            assert [s[0] for s in steps] == [0, 1, 2]
            assert conn.execute("SELECT COUNT(*) FROM audit").fetchone()[0] == 1
            # the router withdrew its reservations when it stopped
            assert conn.execute("SELECT COUNT(*) FROM admission_reservations").fetchone()[0] == 0
    finally:
        store.close()

    async with gateway_over_fakes(config) as rig:  # the next router
        assert rig.gateway.rebalancer.sre.frozen  # the SRE's setting, from the database
        resp = await rig.client.post("/v1/chat/completions", json=BODY, headers=headers)
        assert resp.status_code == 200
        run = (await rig.client.get("/v1/runs/shared")).json()
        assert [r["step_index"] for r in run["requests"]] == [0, 1, 2, 3]


async def test_a_runs_steps_keep_their_home_on_the_next_replica(
    postgres_server: PostgresServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two routers on one database over the same two engines: six runs' first steps go to
    router a, which places them on engine-0 or engine-1 (their homes set there); their
    second steps go to router b, which has never seen them and follows each to its home."""
    url = postgres_server.create_database("gateway_homes")
    monkeypatch.setenv(ENV, PASSWORD)
    config = config_for_test(
        tmp_path,
        pools=one_pool(),
        router={"ledger_path": REMOVE},
        store={"url": url, "password_env": ENV},
    )
    homes = {f"run-{i}": f"engine-{i % 2}" for i in range(6)}
    async with gateway_over_fakes(config) as a, another_router(a, config) as (_, b_client):

        async def placed(client: httpx.AsyncClient, run: str) -> str:
            before = [s.served for s in a.states]
            headers = {"x-gpupool-run-id": run}
            resp = await client.post("/v1/chat/completions", json=BODY, headers=headers)
            assert resp.status_code == 200
            return next(
                spec.instance_id
                for spec, state, n in zip(a.specs, a.states, before, strict=True)
                if state.served > n
            )

        for run, home in homes.items():
            a.gateway.affinity.record(("default", run), home)
            assert await placed(a.client, run) == home
        replica = a.gateway.governor._replica
        assert replica is not None
        await asyncio.gather(*replica._pending)  # the homes written, in the background
        assert {run: await placed(b_client, run) for run in homes} == homes
