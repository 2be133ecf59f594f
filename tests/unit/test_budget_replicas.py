"""`GET /v1/budget` and the x-ratelimit-* headers with router replicas on one real PostgreSQL
database (store.url set): they show the shared budgets, not the replica's own bucket
(router/governance/governor.py `budget_now`, `rate_headers`; docs/replicas.md).

Two governors are two replicas (tests/unit/test_governance_replicas.py's rig). The wall clock
(which refills the shared buckets) is frozen unless a test moves it."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from pools.testing.config import config_for_test
from router.errors import RateLimited
from router.governance import GovernanceMetrics, Governor
from router.governance.routes import register
from router.identity import OperatorAccess, Tenants
from tests.postgres import PASSWORD, PostgresServer, start_postgres
from tests.unit.test_governance_replicas import (
    PASSWORD_ENV,
    T0,
    TOKENS_PER_MINUTE,
    Clock,
    enter,
    finish,
    lease,
    replica,
    shared_config,
    shared_level,
    tenant_of,
)

CHUNK = 30  # budget_chunk_frac 0.05 of 600


@pytest.fixture(autouse=True)
def _password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)


def headers(gov: Governor, tenant: str = "t") -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in gov.rate_headers(tenant)}


async def spend_until_refused(gov: Governor, tenant: str = "t") -> int:
    """Tokens the replica really lets the tenant spend now (10 per request)."""
    spent = 0
    while True:
        try:
            await enter(gov, tenant)
        except RateLimited:
            return spent
        spent += 10


@asynccontextmanager
async def a_spent_200(
    server: PostgresServer, database: str
) -> AsyncIterator[tuple[Governor, Governor, Clock]]:
    """Replicas a and b on a fresh database; the tenant spent 200 tokens through a (which
    holds the rest of its last chunk in its lease)."""
    url = server.create_database(database)
    config = shared_config(url)
    wall = Clock(T0)
    async with replica(config, url, wall, "a") as a, replica(config, url, wall, "b") as b:
        for _ in range(20):
            await enter(a, "t")
        yield a, b, wall


async def test_budget_on_one_replica_shows_what_another_spent(
    postgres_server: PostgresServer,
) -> None:
    async with a_spent_200(postgres_server, "budget_view") as (a, b, _):
        held_by_a = lease(a, "t")
        assert 0 <= held_by_a < CHUNK
        on_b = await b.budget_now(tenant_of(b, "t").tenant)
        assert on_b["scope"] == "shared" and on_b["as_of_s"] == 0.0
        left = on_b["tokens"]["remaining"]
        # within one lease of what is left, never more than a client can spend on b
        assert TOKENS_PER_MINUTE - 200 - CHUNK <= left <= TOKENS_PER_MINUTE - 200
        assert left == TOKENS_PER_MINUTE - 200 - math.ceil(held_by_a)
        assert on_b["tokens"]["reset_s"] == pytest.approx((TOKENS_PER_MINUTE - left) / 10)
        # a's sweep gives its lease back: b's next answer has all of it
        await a.sync_replicas()
        on_b = await b.budget_now(tenant_of(b, "t").tenant)
        assert on_b["tokens"]["remaining"] == TOKENS_PER_MINUTE - 200
        # and that is what b really lets the tenant spend, to the request
        assert await spend_until_refused(b) == TOKENS_PER_MINUTE - 200
        assert (await b.budget_now(tenant_of(b, "t").tenant))["tokens"]["remaining"] == 0
        # the replica's own view (its bucket) would have said 200 spent on b, none on a
        assert b._tenants["t"].tokens is not None
        assert b._tenants["t"].tokens.level(b.clock()) == 200


async def test_get_budget_over_http_answers_the_shared_view(
    postgres_server: PostgresServer,
) -> None:
    """The route (router/governance/routes.py) on replica b, after the tenant spent on a."""
    async with a_spent_200(postgres_server, "budget_route") as (a, b, _):
        key = "key-of-t"
        tenant = dataclasses.replace(
            tenant_of(b, "t").tenant, api_key_sha256=hashlib.sha256(key.encode()).hexdigest()
        )
        tenants = Tenants.from_config((tenant,))
        api = FastAPI()
        access = OperatorAccess.from_config(tenants, b.config.router)
        register(api, access, tenants, b, config_source="")
        await a.sync_replicas()
        transport = httpx.ASGITransport(app=api)
        async with httpx.AsyncClient(transport=transport, base_url="http://b") as client:
            answer = await client.get("/v1/budget", headers={"authorization": f"Bearer {key}"})
        assert answer.status_code == 200
        body = answer.json()
        assert body["scope"] == "shared" and body["as_of_s"] == 0.0
        assert body["tokens"]["remaining"] == TOKENS_PER_MINUTE - 200  # b's own: 600


async def test_headers_on_the_next_response_show_at_most_what_is_left(
    postgres_server: PostgresServer,
) -> None:
    async with a_spent_200(postgres_server, "budget_headers") as (a, b, wall):
        outcome = await enter(b, "t")  # b's top-up reads the bucket a spent from
        seen = headers(b)
        level = await shared_level(b, "t")
        assert level is not None
        # what b can spend: the shared level plus its own lease (a's lease is a's)
        can_spend = math.floor(level + lease(b, "t"))
        assert int(seen["x-ratelimit-remaining-tokens"]) == can_spend
        assert can_spend <= TOKENS_PER_MINUTE - 200 - 10
        assert seen["x-ratelimit-limit-tokens"] == str(TOKENS_PER_MINUTE)
        assert seen["x-gpupool-ratelimit-scope"] == "shared"
        assert seen["x-gpupool-ratelimit-age-s"] == "0.000"
        # settling gives the unused estimate back to b's lease: the headers count it
        await finish(b, outcome, used=4)
        assert int(headers(b)["x-ratelimit-remaining-tokens"]) == can_spend + 6
        # a spends 100 more: b's headers learn it at its next read, b's sweep
        for _ in range(10):
            await enter(a, "t")
        await a.sync_replicas()
        wall.now_s += 0.5  # the shared bucket refills 5 tokens meanwhile
        await b.sync_replicas()
        level = await shared_level(b, "t")
        assert level is not None and lease(b, "t") == 0
        after = headers(b)
        assert int(after["x-ratelimit-remaining-tokens"]) == math.floor(level + 5)
        assert after["x-gpupool-ratelimit-age-s"] == "0.000"
        wall.now_s += 0.25  # the read ages; its level refills by the bucket's rate
        aged = headers(b)
        assert aged["x-gpupool-ratelimit-age-s"] == "0.250"
        assert int(aged["x-ratelimit-remaining-tokens"]) == math.floor(level + 5 + 2.5)


@contextmanager
def counted(gov: Governor) -> Iterator[list[int]]:
    """Count the connections the replica's store hands out (each call of SharedBudgets)."""
    assert gov._replica is not None
    store = gov._replica.db.store
    real = store.connection
    count = [0]

    def connection():  # type: ignore[no-untyped-def]
        count[0] += 1
        return real()

    store.connection = connection  # type: ignore[method-assign]
    try:
        yield count
    finally:
        del store.connection


async def test_the_headers_add_no_statement_to_a_request(postgres_server: PostgresServer) -> None:
    url = postgres_server.create_database("budget_statements")
    config = shared_config(url)
    wall = Clock(T0)
    async with replica(config, url, wall, "a") as a:
        assert a._replica is not None and a._replica._loop is not None
        loop_before = a._replica._loop.statements
        topups = a.metrics.shared_reservations.labels("t", "tokens")
        rounds = []
        for with_headers in (False, True, False, True):
            before = topups._value.get()
            with counted(a) as count:
                for _ in range(12):  # 120 tokens: 4 top-ups of a 30-token chunk
                    outcome = await enter(a, "t")
                    if with_headers:
                        assert "x-ratelimit-remaining-tokens" in headers(a)
                    await finish(a, outcome, used=10)
            rounds.append((count[0], topups._value.get() - before))
        # one connection (reserve_up_to's transaction) per top-up, with or without headers
        assert rounds == [(4, 4)] * 4
        assert a._replica._loop.statements == loop_before  # nothing on the loop's either


async def test_a_store_that_does_not_answer_gives_the_replicas_view_labelled() -> None:
    with start_postgres() as server:
        url = server.create_database("budget_outage")
        wall = Clock(T0)
        config = shared_config(url, budgets_on_outage="open")
        async with replica(config, url, wall, "a") as a, replica(config, url, wall, "b") as b:
            for _ in range(5):
                await enter(a, "t")
            tenant = tenant_of(b, "t").tenant
            assert (await b.budget_now(tenant))["scope"] == "shared"
            await enter(b, "t")
            assert headers(b)["x-gpupool-ratelimit-scope"] == "shared"
            server.stop()
            # the read fails: b's own bucket, labelled, and no outage started by the read
            view = await b.budget_now(tenant)
            assert view["scope"] == "replica"
            assert view["scope_reason"].startswith("the shared store did not answer")
            assert view["tokens"]["remaining"] == TOKENS_PER_MINUTE - 10  # b's own bucket
            assert b._replica is not None and b._replica.down_since_s is None
            # the sweep finds the store down: the headers fall back too (no round trip)
            await b.sync_replicas()
            assert b._replica.down_since_s is not None
            fallback = headers(b)
            assert fallback["x-gpupool-ratelimit-scope"] == "replica"
            assert "x-gpupool-ratelimit-age-s" not in fallback
            assert fallback["x-ratelimit-remaining-tokens"] == str(TOKENS_PER_MINUTE - 10)
            view = await b.budget_now(tenant)
            assert view["scope"] == "replica" and "cannot be reached" in view["scope_reason"]
            server.start()
            await b.sync_replicas()  # reconnects: shared again
            view = await b.budget_now(tenant)
            assert view["scope"] == "shared"
            assert view["tokens"]["remaining"] <= TOKENS_PER_MINUTE - 60


def test_one_router_without_a_store_url_is_unchanged() -> None:
    config = config_for_test(
        tenants=[{"name": "t", "api_key_sha256": "0" * 64, "tokens_per_minute": 600}]
    )
    gov = Governor(config, GovernanceMetrics(CollectorRegistry()), clock=Clock(1000.0))
    view = gov.budget(config.tenants[0])
    assert "scope" not in view and view["tokens"]["remaining"] == 600
    assert set(headers(gov)) == {
        "x-ratelimit-limit-tokens",
        "x-ratelimit-remaining-tokens",
        "x-ratelimit-reset-tokens",
    }


async def test_a_read_overlapping_a_top_up_is_not_kept(postgres_server: PostgresServer) -> None:
    """The top-up's chunk is in the lease before the read that missed it could count it."""
    url = postgres_server.create_database("budget_overlap")
    config = shared_config(url)
    wall = Clock(T0)
    async with replica(config, url, wall, "a") as a:
        rep = a._replica
        assert rep is not None
        await enter(a, "t")  # learned: 570 left, 20 in the lease
        mark = rep._read_from()
        await enter(a, "t")  # from the lease: no top-up
        assert rep._read_clean(mark)
        for _ in range(3):
            await enter(a, "t")  # the third takes a new chunk
        assert not rep._read_clean(mark)
        assert int(headers(a)["x-ratelimit-remaining-tokens"]) == TOKENS_PER_MINUTE - 50
