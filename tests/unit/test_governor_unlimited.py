"""Governance for a tenant with nothing to enforce (issue 28, s47): its requests outside any
run pass `Governor.enter_now` (decided once per tenant config, at load and at reload) and skip
`enter`'s checks, and still leave what others read: in flight, the cost windows, the settled
tokens. A tenant with limits, a run's step and a reload that adds a limit are governed as
before, at once. With a shared store (store.url, s48) such a request takes the same fast
path: two governors on a real PostgreSQL, as two replicas. The governor on a fake clock; the
last tests through the router over a fake engine served over real HTTP."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from pools.config import Config, load_config
from pools.testing.config import config_data, config_for_test, one_pool
from pools.testing.gateway import gateway_over_fakes
from router.admission.estimate import Estimate
from router.errors import BadRequest, RateLimited, RunStopped
from router.governance import GovernanceMetrics, Governor, StepSignals
from router.request import RequestContext, RequestOutcome
from tests.postgres import PASSWORD, PostgresServer
from tests.unit.test_governance_replicas import (
    PASSWORD_ENV,
    T0,
    Clock,
    background_ready,
    ctx,
    loop_ready,
    replica,
)
from tests.unit.test_governance_router import _body

ESTIMATE = Estimate(prompt_tokens=40, output_tokens=20, source="heuristic")
OPEN = {"name": "open", "api_key_sha256": "0" * 64}
LIMITED = {"name": "limited", "api_key_sha256": "1" * 64, "tokens_per_minute": 100}


def config(*tenants: dict[str, Any], **extra: Any) -> Config:
    return config_for_test(tenants=list(tenants), **extra)


def prepared(
    gov: Governor, name: str, clock: Clock, run_id: str | None = None, **headers: str
) -> tuple[RequestContext, StepSignals]:
    tenant = next(t for t in gov.config.tenants if t.name == name)
    body = {"messages": [{"role": "user", "content": "hi"}]}
    return gov.prepare(ctx(name, run_id), tenant, headers, body)


def finish(gov: Governor, c: RequestContext, clock: Clock, gpu_s: float = 0.5) -> None:
    outcome = RequestOutcome(ctx=c, estimate=ESTIMATE)
    outcome.dispatched_at_s = clock()
    gov.dispatched(outcome)
    outcome.status, outcome.ended_at_s = 200, clock()
    outcome.prompt_tokens, outcome.completion_tokens = 40, 7
    outcome.gpu_seconds = gpu_s
    gov.finished(outcome)


def test_a_tenant_without_limits_passes_at_once_and_is_still_counted() -> None:
    clock = Clock(1000.0)
    gov = Governor(config(OPEN), GovernanceMetrics(CollectorRegistry()), clock=clock)
    c, signals = prepared(gov, "open", clock)
    assert gov.enter_now(c, signals)
    st = gov._tenants["open"]
    assert st.inflight == 1  # /v1/budget and the in-flight gauge read it
    assert gov.rate_headers("open") == []
    assert gov.speculation(c.request_id) is None
    finish(gov, c, clock, gpu_s=0.5)
    assert st.inflight == 0
    assert st.hour.total(clock()) == pytest.approx(0.5)  # a cost cap added later reads it
    assert st.day.total(clock()) == pytest.approx(0.5)
    settled = gov.metrics.tenant("open").tokens_settled
    assert settled._value.get() == 47  # prompt + completion tokens
    assert gov.budget(gov.config.tenants[0])["concurrency"]["requests"]["in_flight"] == 0


def test_an_unknown_task_type_is_refused_for_a_tenant_without_limits_too() -> None:
    clock = Clock(1000.0)
    gov = Governor(config(OPEN), GovernanceMetrics(CollectorRegistry()), clock=clock)
    with pytest.raises(BadRequest):
        prepared(gov, "open", clock, **{"x-gpupool-task-type": "no-such-task"})


def test_a_sessions_step_is_mapped_to_its_run_for_a_tenant_without_limits() -> None:
    """A context with a session and no run id yet (classify always gives one; a caller that
    does not) is still mapped to its session's run, not taken for a plain request."""
    clock = Clock(1000.0)
    gov = Governor(config(OPEN), GovernanceMetrics(CollectorRegistry()), clock=clock)
    tenant = gov.config.tenants[0]
    c = dataclasses.replace(ctx("open"), session_id="sess", session_turn="task-1")
    c, signals = gov.prepare(c, tenant, {}, {"messages": []})
    assert c.run_id == "sess:1"
    assert signals is not gov._tenants["open"].plain
    assert not gov.enter_now(c, signals)


async def test_a_tenant_with_limits_is_still_enforced() -> None:
    clock = Clock(1000.0)
    gov = Governor(config(OPEN, LIMITED), GovernanceMetrics(CollectorRegistry()), clock=clock)
    c, signals = prepared(gov, "limited", clock)
    assert not gov.enter_now(c, signals)
    assert gov._tenants["limited"].inflight == 0  # nothing done: the caller awaits `enter`
    await gov.enter(c, ESTIMATE, signals)  # 60 of its 100 tokens
    assert next(k for k, _ in gov.rate_headers("limited")) == b"x-ratelimit-limit-tokens"
    c2, signals2 = prepared(gov, "limited", clock)
    c2 = dataclasses.replace(c2, deadline_s=clock() + 5.0)
    with pytest.raises(RateLimited):  # 60 more need 12 s of refill: past the deadline
        await gov.enter(c2, ESTIMATE, signals2)


async def test_a_run_step_of_a_tenant_without_limits_is_governed() -> None:
    """A run's guards come from its class: a step goes through `enter` (max_steps here)."""
    clock = Clock(1000.0)
    cfg = config({**OPEN, "run_guards": {"max_steps": 1}})
    gov = Governor(cfg, GovernanceMetrics(CollectorRegistry()), clock=clock)
    c, signals = prepared(gov, "open", clock, run_id="run-1")
    assert not gov.enter_now(c, signals)
    await gov.enter(c, ESTIMATE, signals)
    finish(gov, c, clock)
    c2, signals2 = prepared(gov, "open", clock, run_id="run-1")
    assert not gov.enter_now(c2, signals2)
    with pytest.raises(RunStopped):
        await gov.enter(c2, ESTIMATE, signals2)


def test_a_tier_tenant_is_governed_with_its_queue_weight() -> None:
    """A tier always has a request slot limit: its tenants never take the fast path."""
    clock = Clock(1000.0)
    gold = {"max_concurrent_runs": 5, "max_concurrent_requests": 1, "queue_weight": 4.0}
    cfg = config({**OPEN, "tier": "gold"}, governance={"tiers": {"gold": gold}})
    gov = Governor(cfg, GovernanceMetrics(CollectorRegistry()), clock=clock)
    c, signals = prepared(gov, "open", clock)
    assert c.tenant_weight == pytest.approx(4.0)
    assert not gov.enter_now(c, signals)


@pytest.mark.parametrize(
    ("added", "passes"),
    [
        ({"tokens_per_minute": 30}, 1),  # one request into debt, the next waits past 5 s
        ({"requests_per_minute": 1}, 1),
        ({"cost_cap_gpu_seconds_per_hour": 0.25}, 0),  # the fast path's 0.5 GPU-s count
        ({"daily_budget_gpu_seconds": 0.25}, 0),
    ],
)
async def test_a_reload_that_adds_a_limit_takes_effect_at_once(
    added: dict[str, Any], passes: int
) -> None:
    clock = Clock(1000.0)
    gov = Governor(config(OPEN), GovernanceMetrics(CollectorRegistry()), clock=clock)
    c, signals = prepared(gov, "open", clock)
    assert gov.enter_now(c, signals)
    finish(gov, c, clock, gpu_s=0.5)  # 0.5 GPU-seconds recorded on the fast path

    gov.reload(config({**OPEN, **added}))
    for _ in range(passes):
        c1, signals1 = prepared(gov, "open", clock)
        assert not gov.enter_now(c1, signals1)
        await gov.enter(dataclasses.replace(c1, deadline_s=clock() + 5.0), ESTIMATE, signals1)
    c1, signals1 = prepared(gov, "open", clock)
    assert not gov.enter_now(c1, signals1)
    with pytest.raises(RateLimited):
        await gov.enter(dataclasses.replace(c1, deadline_s=clock() + 5.0), ESTIMATE, signals1)

    gov.reload(config(OPEN))  # and removed again: the fast path is back
    c2, signals2 = prepared(gov, "open", clock)
    assert gov.enter_now(c2, signals2)


# ------------------------------------------------------------------------------ a shared store


def shared(url: str, **limits: Any) -> Config:
    return config(
        {**OPEN, **limits},
        LIMITED,
        store={"url": url, "password_env": PASSWORD_ENV},
    )


@pytest.fixture
def _store_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)


@pytest.mark.usefixtures("_store_password")
async def test_with_a_shared_store_a_tenant_without_limits_passes_without_a_statement(
    postgres_server: PostgresServer,
) -> None:
    """`enter` would take nothing from the store for it (no bucket, no slot, no run): the
    fast path, with no statement on either of the replica's connections and no rate-limit
    headers (before s48: `enter`, ~26 us, and a scope header with no limit to label); a
    limited tenant beside it still takes from the shared bucket."""
    url = postgres_server.create_database("unlimited_shared_fast")
    async with replica(shared(url), url, Clock(T0), "a") as a:
        clock = a.clock
        assert isinstance(clock, Clock)
        on_loop, in_background = await loop_ready(a), await background_ready(a)
        for _ in range(3):
            c, signals = prepared(a, "open", clock)
            assert a.enter_now(c, signals)
            assert a._tenants["open"].inflight == 1
            assert a.rate_headers("open") == []
            assert a.speculation(c.request_id) is None
            finish(a, c, clock, gpu_s=0.5)
        assert a._tenants["open"].inflight == 0
        assert a._tenants["open"].hour.total(clock()) == pytest.approx(1.5)
        assert a._replica is not None
        await asyncio.gather(*a._replica._pending)
        assert await loop_ready(a) == on_loop
        assert await background_ready(a) == in_background
        assert a._replica.leases == {}  # nothing taken, nothing to give back

        c, signals = prepared(a, "limited", clock)
        assert not a.enter_now(c, signals)
        await a.enter(c, ESTIMATE, signals)  # 60 of its 100 tokens, from the shared bucket
        assert ("limited", "tokens") in a._replica.leases  # a lease taken from the store
        assert dict(a.rate_headers("limited"))[b"x-gpupool-ratelimit-scope"] == b"shared"


@pytest.mark.usefixtures("_store_password")
async def test_with_a_shared_store_the_fast_paths_cost_reaches_a_cap_added_later(
    postgres_server: PostgresServer,
) -> None:
    """What the replicas share of such a tenant is its cost windows: the GPU-seconds its
    requests took on the fast path on one replica are published once a cap needs them, and
    refuse its next request on the other replica; removing the cap brings the fast path back
    on both."""
    url = postgres_server.create_database("unlimited_shared_cap")
    wall = Clock(T0)
    async with replica(shared(url), url, wall, "a") as a, replica(shared(url), url, wall, "b") as b:
        clock = a.clock
        assert isinstance(clock, Clock)
        c, signals = prepared(a, "open", clock)
        assert a.enter_now(c, signals)
        finish(a, c, clock, gpu_s=12.0)

        capped = shared(url, cost_cap_gpu_seconds_per_hour=10)
        a.reload(capped)
        b.reload(capped)
        await a.sync_replicas()  # a publishes its windows (a cap needs them now)
        await b.sync_replicas()  # b reads them
        c, signals = prepared(b, "open", clock)
        assert not b.enter_now(c, signals)
        with pytest.raises(RateLimited) as refused:
            await b.enter(c, ESTIMATE, signals)
        assert refused.value.code == "cost_cap"

        for gov in (a, b):
            gov.reload(shared(url))
            c, signals = prepared(gov, "open", clock)
            assert gov.enter_now(c, signals)
            finish(gov, c, clock)


# ------------------------------------------------------------------------------ the router


async def test_through_the_router_a_reload_adding_a_budget_applies_to_the_next_request(
    tmp_path: Path,
) -> None:
    tenants = [
        {"name": "open", "api_key": "k-open"},
        {"name": "ops", "api_key": "k-ops", "admin": True},
    ]
    path = tmp_path / "gpupool.yaml"
    data = config_data(tmp_path, pools=one_pool(), tenants=tenants)
    path.write_text(yaml.safe_dump(data))
    async with gateway_over_fakes(load_config(path), engines=1) as rig:
        client = rig.client
        user = {"authorization": "Bearer k-open"}
        for _ in range(3):
            r = await client.post("/v1/chat/completions", json=_body(max_tokens=100), headers=user)
            assert r.status_code == 200
            assert not any(k.startswith("x-ratelimit-") for k in r.headers)
        budget = (await client.get("/v1/budget", headers=user)).json()
        assert budget["concurrency"]["requests"]["in_flight"] == 0

        data["tenants"][0]["tokens_per_minute"] = 120
        path.write_text(yaml.safe_dump(data))
        admin = {"authorization": "Bearer k-ops"}
        assert (await client.post("/admin/governance/reload", headers=admin)).status_code == 200
        first = await client.post("/v1/chat/completions", json=_body(max_tokens=100), headers=user)
        assert first.status_code == 200
        assert first.headers["x-ratelimit-limit-tokens"] == "120"
        second = await client.post("/v1/chat/completions", json=_body(max_tokens=100), headers=user)
        assert second.status_code == 429
        assert second.json()["error"]["code"] == "token_rate"
