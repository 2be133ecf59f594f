"""Governance on the router's request path, against fake engines served over real HTTP:
429 token_rate with Retry-After and x-ratelimit-* headers, waiting while the bucket refills,
settling to real usage, concurrency tiers, each run guard's refusal, the cost cap, GET
/v1/budget, ending a run, and the ledger's record of why a run ended."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pools.launchers.base import InstanceSpec
from pools.testing.config import config_data, config_for_test, even_pools, one_pool
from pools.testing.fake_engine import FakeEngineState, make_fake_engine
from pools.testing.gateway import gateway_over_fakes
from pools.testing.serve import serve_asgi
from router.gateway.app import Gateway, create_app

TENANTS: list[dict[str, Any]] = [
    {"name": "slow", "api_key": "k-slow", "tokens_per_minute": 120},  # 2 tokens a second
    {"name": "mid", "api_key": "k-mid", "tokens_per_minute": 600},  # 10 a second
    {"name": "rpm", "api_key": "k-rpm", "requests_per_minute": 2},
    {"name": "free", "api_key": "k-free", "tier": "free"},
    {"name": "guarded", "api_key": "k-guarded", "run_guards": {"max_steps": 3}},
    {"name": "brief", "api_key": "k-brief", "run_guards": {"max_duration_s": 0.5}},
    {"name": "frugal", "api_key": "k-frugal", "run_guards": {"max_tokens": 50}},
    {"name": "gpu", "api_key": "k-gpu", "run_guards": {"max_gpu_seconds": 1e-9}},
    {"name": "capped", "api_key": "k-capped", "cost_cap_gpu_seconds_per_hour": 1e-9},
    {"name": "open", "api_key": "k-open"},
    {"name": "lender", "api_key": "k-lender", "tokens_per_minute": 600},
    {"name": "borrower", "api_key": "k-borrower", "tokens_per_minute": 120, "borrow_max_frac": 0.5},
    {
        "name": "daily",
        "api_key": "k-daily",
        "tokens_per_minute": 600,
        "daily_budget_gpu_seconds": 1e-9,
    },
]


def _body(max_tokens: int = 3, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
        **extra,
    }


@dataclass
class Rig:
    gateway: Gateway
    client: httpx.AsyncClient
    engine: FakeEngineState

    async def post(
        self, tenant: str, body: dict[str, Any] | None = None, **headers: str
    ) -> httpx.Response:
        h = {
            "authorization": f"Bearer k-{tenant}",
            **{k.replace("_", "-"): v for k, v in headers.items()},
        }
        return await self.client.post("/v1/chat/completions", json=body or _body(), headers=h)

    async def get(self, tenant: str, path: str) -> httpx.Response:
        return await self.client.get(path, headers={"authorization": f"Bearer k-{tenant}"})


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    engine = FakeEngineState()
    config = config_for_test(
        tmp_path,
        pools=even_pools(),
        tenants=TENANTS,
        governance={"run_idle_timeout_s": 30},
    )
    async with gateway_over_fakes(config, [engine]) as r:
        yield Rig(r.gateway, r.client, engine)


def _client(gateway: Gateway) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://gw")


def _used(resp: httpx.Response) -> int:
    usage = resp.json()["usage"]
    return int(usage["prompt_tokens"]) + int(usage["completion_tokens"])


# ------------------------------------------------------------------------------ token budgets


async def test_over_its_tokens_per_minute_a_tenant_gets_429_token_rate_with_headers(
    rig: Rig,
) -> None:
    first = await rig.post("slow", _body(max_tokens=100))
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-tokens"] == "120"
    # while it ran it held its reservation: prompt + its 100 output tokens
    assert int(first.headers["x-ratelimit-remaining-tokens"]) <= 20
    second = await rig.post("slow", _body(max_tokens=100))
    assert second.status_code == 429
    error = second.json()["error"]
    assert (error["code"], error["type"], error["retryable"]) == (
        "token_rate", "rate_limit_error", True
    )  # fmt: skip
    # settled to the real usage of the first: 120 - used left (+ what refilled since)
    level = int(second.headers["x-ratelimit-remaining-tokens"])
    assert 120 - _used(first) <= level <= 120 - _used(first) + 2
    # the bucket holds the second's 100 + prompt (<= 30) after (need - level) / 2 per second
    retry_s = int(second.headers["retry-after"])
    assert math.ceil((100 - level) / 2) <= retry_s <= math.ceil((130 - level) / 2) + 1
    assert retry_s * 1000 - 1000 < int(second.headers["retry-after-ms"]) <= retry_s * 1000
    assert second.json()["error"]["retry_after_seconds"] == retry_s
    assert "x-gpupool-instance" not in second.headers  # never dispatched
    assert rig.engine.served == 1
    other = await rig.post("open")  # another tenant is served meanwhile
    assert other.status_code == 200 and "x-ratelimit-limit-tokens" not in other.headers


async def test_a_request_waits_while_the_bucket_refills_within_its_deadline(rig: Rig) -> None:
    used = 0
    for _ in range(4):
        resp = await rig.post("mid", _body(max_tokens=120))
        assert resp.status_code == 200
        # the prompt estimate (corrected online after each request) from what was reserved
        prompt_estimate = 600 - used - 120 - int(resp.headers["x-ratelimit-remaining-tokens"])
        used += _used(resp)
    level = (await rig.get("mid", "/v1/budget")).json()["tokens"]["remaining"]
    # a request needing 20 more than the bucket holds: ~2 s at 10 a second, within the
    # normal pool's 5 s queue wait
    max_tokens = level + 20 - prompt_estimate
    assert 1 <= max_tokens <= 128  # under the class's expected output: the estimate is exact
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    waited = await rig.post("mid", _body(max_tokens=max_tokens))
    waited_s = loop.time() - t0
    assert waited.status_code == 200  # served: its wait fit the queue's 5 s (else 429)
    assert waited_s >= 1.0  # it waited for the refill (~2 s); no upper wall-clock bound
    metrics = rig.gateway.governor.metrics
    assert metrics.waits.labels("mid", "token_rate")._value.get() == 1


async def test_a_request_that_never_reaches_an_engine_gets_its_reservation_back(
    rig: Rig,
) -> None:
    refused = await rig.post(
        "slow", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}
    )
    assert refused.status_code == 404  # refused before governance: nothing reserved
    rig.engine.failure, rig.engine.fail_next = "http500", 1
    failed = await rig.post("slow", _body(max_tokens=100))
    assert failed.status_code == 502
    budget = (await rig.get("slow", "/v1/budget")).json()
    # the engine read the prompt (a few tokens) and produced nothing: the 100 came back
    assert budget["tokens"]["remaining"] >= 100 and budget["tokens_reserved"] == 0


async def test_requests_per_minute(rig: Rig) -> None:
    assert (await rig.post("rpm")).status_code == 200
    assert (await rig.post("rpm")).status_code == 200
    third = await rig.post("rpm")
    assert third.status_code == 429 and third.json()["error"]["code"] == "request_rate"
    assert third.headers["x-ratelimit-limit-requests"] == "2"
    assert third.headers["x-ratelimit-remaining-requests"] == "0"
    assert 25 <= int(third.headers["retry-after"]) <= 31  # one request refills in 30 s


# ------------------------------------------------------------------------------ concurrency


async def test_a_free_tenant_runs_one_agent_run_at_a_time(rig: Rig) -> None:
    assert (await rig.post("free", x_gpupool_run_id="a")).status_code == 200
    busy = await rig.post("free", x_gpupool_run_id="b")
    assert busy.status_code == 429
    assert busy.json()["error"]["code"] == "tenant_concurrency"
    assert "max_concurrent_runs" in busy.json()["error"]["message"]
    assert 25 <= int(busy.headers["retry-after"]) <= 30  # run a goes idle after 30 s
    assert (await rig.post("free", x_gpupool_run_id="a")).status_code == 200  # its own run
    ended = await rig.client.post("/v1/runs/a/end", headers={"authorization": "Bearer k-free"})
    assert ended.status_code == 200 and ended.json()["reason"] == "client_end"
    assert (await rig.post("free", x_gpupool_run_id="b", x_gpupool_run_end="1")).status_code == 200
    assert (await rig.post("free", x_gpupool_run_id="c")).status_code == 200  # b ended itself
    unknown = await rig.client.post("/v1/runs/zz/end", headers={"authorization": "Bearer k-free"})
    assert unknown.status_code == 404


# ------------------------------------------------------------------------------ run guards


async def test_the_step_after_max_steps_is_refused_and_the_ledger_says_why(rig: Rig) -> None:
    for _ in range(3):
        assert (await rig.post("guarded", x_gpupool_run_id="r")).status_code == 200
    for _ in range(2):  # stays stopped
        stopped = await rig.post("guarded", x_gpupool_run_id="r")
        assert stopped.status_code == 403
        error = stopped.json()["error"]
        assert (error["code"], error["type"], error["retryable"]) == (
            "run_steps", "run_stopped", False
        )  # fmt: skip
        assert "3 steps" in error["message"]
    assert (await rig.post("guarded", x_gpupool_run_id="other")).status_code == 200
    summary = (await rig.get("guarded", "/v1/runs/r")).json()
    assert summary["end"]["reason"] == "run_steps" and summary["end"]["steps"] == 3
    assert error["param"] == "tenants[guarded].run_guards.max_steps"
    # ended by the client, the same id starts a fresh run (it used to stay 403 for good)
    ended = await rig.client.post("/v1/runs/r/end", headers={"authorization": "Bearer k-guarded"})
    assert ended.status_code == 200 and ended.json()["reason"] == "client_end"
    assert (await rig.post("guarded", x_gpupool_run_id="r")).status_code == 200


async def test_a_looping_run_is_stopped(rig: Rig) -> None:
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c",
                "type": "function",
                "function": {"name": "grep", "arguments": '{"q": "x"}'},
            }
        ],
    }
    result = {"role": "tool", "tool_call_id": "c", "content": "nothing"}
    history: list[dict[str, Any]] = [{"role": "user", "content": "find x"}]
    for i in range(3):
        resp = await rig.post("open", {**_body(), "messages": history}, x_gpupool_run_id="loop")
        assert resp.status_code == 200, i
        history += [call, result]
    looped = await rig.post("open", {**_body(), "messages": history}, x_gpupool_run_id="loop")
    assert looped.status_code == 403
    assert looped.json()["error"]["code"] == "run_loop"
    assert "grep" in looped.json()["error"]["message"]
    summary = (await rig.get("open", "/v1/runs/loop")).json()
    assert summary["end"]["reason"] == "run_loop"


async def test_duration_tokens_and_gpu_seconds_guards(rig: Rig) -> None:
    assert (await rig.post("brief", x_gpupool_run_id="d")).status_code == 200
    await asyncio.sleep(0.6)
    late = await rig.post("brief", x_gpupool_run_id="d")
    assert late.status_code == 403 and late.json()["error"]["code"] == "run_duration"

    first = await rig.post("frugal", _body(max_tokens=60), x_gpupool_run_id="t")
    assert first.status_code == 200 and _used(first) >= 50
    over = await rig.post("frugal", x_gpupool_run_id="t")
    assert over.status_code == 403 and over.json()["error"]["code"] == "run_tokens"

    assert (await rig.post("gpu", x_gpupool_run_id="g")).status_code == 200
    over = await rig.post("gpu", x_gpupool_run_id="g")
    assert over.status_code == 403 and over.json()["error"]["code"] == "run_gpu_seconds"


async def test_an_unknown_task_type_is_a_bad_request(rig: Rig) -> None:
    resp = await rig.post("open", x_gpupool_task_type="forever")
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "x-gpupool-task-type"


# ------------------------------------------------------------------------------ cost caps


async def test_at_its_cost_cap_new_runs_are_refused_and_running_ones_finish(rig: Rig) -> None:
    assert (await rig.post("capped", x_gpupool_run_id="running")).status_code == 200
    new = await rig.post("capped", x_gpupool_run_id="new")
    assert new.status_code == 429 and new.json()["error"]["code"] == "cost_cap"
    assert 1 <= int(new.headers["retry-after"]) <= 3600
    assert (await rig.post("capped", x_gpupool_run_id="running")).status_code == 200
    metrics = rig.gateway.governor.metrics
    assert metrics.cost_alerts.labels("capped")._value.get() == 1
    budget = (await rig.get("capped", "/v1/budget")).json()
    assert budget["cost"]["hourly"]["used_frac"] > 1


async def test_budget_shows_what_is_left(rig: Rig) -> None:
    await rig.post("free", x_gpupool_run_id="a")
    budget = (await rig.get("free", "/v1/budget")).json()
    assert budget["tier"] == "free"
    assert budget["concurrency"]["runs"] == {"limit": 1, "active": 1}
    assert budget["concurrency"]["requests"] == {"limit": 2, "in_flight": 0}
    assert budget["tokens"] is None and budget["cost"]["hourly"] is None
    (run,) = budget["active_runs"]
    assert run["run_id"] == "a" and run["steps"] == 1 and run["max_steps"] == 500
    mid = (await rig.get("mid", "/v1/budget")).json()
    assert mid["tokens"] == {"limit_per_minute": 600, "remaining": 600, "reset_s": 0.0}
    assert (await rig.client.get("/v1/budget")).status_code == 401


async def test_a_spent_daily_budget_tightens_the_rate_and_refuses_new_work(rig: Rig) -> None:
    fresh = await rig.post("daily")
    assert fresh.status_code == 200
    assert fresh.headers["x-ratelimit-limit-tokens"] == "600"  # nothing spent yet
    spent = await rig.post("daily")
    assert spent.status_code == 429 and spent.json()["error"]["code"] == "cost_cap"
    assert "daily_budget_gpu_seconds" in spent.json()["error"]["message"]
    # all of the day's budget is spent: the rate is down to governance.daily_min_rate_frac
    assert spent.headers["x-ratelimit-limit-tokens"] == "60"
    budget = (await rig.get("daily", "/v1/budget")).json()
    assert budget["tokens"]["limit_per_minute"] == 60
    assert budget["cost"]["daily"]["used_frac"] > 1


async def test_a_tenant_borrows_from_an_idle_budget_up_to_its_fraction(rig: Rig) -> None:
    metrics = rig.gateway.governor.metrics
    first = await rig.post("borrower", _body(max_tokens=100))  # its own 120 a minute
    assert first.status_code == 200
    second = await rig.post("borrower", _body(max_tokens=40))  # short: borrowed, no wait
    assert second.status_code == 200
    borrowed = metrics.borrowed.labels("borrower")._value.get()
    assert 20 <= borrowed <= 60  # the shortfall, within 0.5 x 120 a minute
    # one idle tenant with a full bucket lent it (lender, mid and daily hold 600 each)
    lent = {t["name"]: metrics.lent.labels(t["name"])._value.get() for t in TENANTS}
    (lender_name,) = [name for name, amount in lent.items() if amount]
    assert lender_name in ("lender", "mid", "daily") and lent[lender_name] == borrowed
    lender = (await rig.get(lender_name, "/v1/budget")).json()["tokens"]
    assert 600 - borrowed - 1 <= lender["remaining"] <= 600 - borrowed + 1
    third = await rig.post("borrower", _body(max_tokens=40))  # its allowance is spent
    assert third.status_code == 429 and third.json()["error"]["code"] == "token_rate"
    owner = await rig.post("lender", _body(max_tokens=100))  # the owner's tokens are there
    assert owner.status_code == 200


async def test_budgets_and_stopped_runs_survive_a_restart_without_a_clean_shutdown(
    tmp_path: Path,
) -> None:
    """The first router is never closed before the second starts (as after `kill -9`): what
    its once-a-second save wrote is what the second one finds."""
    engine = FakeEngineState()
    config = config_for_test(tmp_path, pools=one_pool(), tenants=TENANTS)
    async with serve_asgi(make_fake_engine(engine)) as url:
        spec = [InstanceSpec("engine-0", url, 1)]
        first = create_app(config, spec)
        await first.start()
        async with _client(first) as client:
            rig = Rig(first, client, engine)
            assert (await rig.post("slow", _body(max_tokens=100))).status_code == 200
            for _ in range(3):
                assert (await rig.post("guarded", x_gpupool_run_id="r")).status_code == 200
            assert (await rig.post("guarded", x_gpupool_run_id="r")).status_code == 403
            before = (await rig.get("slow", "/v1/budget")).json()["tokens"]["remaining"]
            await asyncio.sleep(1.5)  # the sweep saves once a second
        second = create_app(config, spec)
        await second.start()
        try:
            async with _client(second) as client:
                rig = Rig(second, client, engine)
                after = (await rig.get("slow", "/v1/budget")).json()["tokens"]["remaining"]
                assert before <= after <= before + 8  # not full: refilled 2 a second since
                stopped = await rig.post("guarded", x_gpupool_run_id="r")
                assert stopped.status_code == 403
                assert stopped.json()["error"]["code"] == "run_steps"
                assert (await rig.post("guarded", x_gpupool_run_id="new")).status_code == 200
        finally:
            await second.aclose()
            await first.aclose()


async def test_an_admin_reload_applies_new_budgets_without_refilling_them(tmp_path: Path) -> None:
    import yaml

    from pools.config import load_config

    engine = FakeEngineState()
    path = tmp_path / "gpupool.yaml"
    tenants = [
        {"name": "slow", "api_key": "k-slow", "tokens_per_minute": 120},
        {"name": "ops", "api_key": "k-ops", "admin": True},
    ]
    data = config_data(tmp_path, pools=one_pool(), tenants=tenants)
    path.write_text(yaml.safe_dump(data))
    async with serve_asgi(make_fake_engine(engine)) as url:
        gateway = create_app(load_config(path), [InstanceSpec("engine-0", url, 1)])
        await gateway.start()
        try:
            async with _client(gateway) as client:
                rig = Rig(gateway, client, engine)
                assert (await rig.post("slow", _body(max_tokens=100))).status_code == 200
                assert (await rig.post("slow", _body(max_tokens=100))).status_code == 429
                level = (await rig.get("slow", "/v1/budget")).json()["tokens"]["remaining"]

                admin = {"authorization": "Bearer k-ops"}
                data["tenants"][0]["tokens_per_minute"] = 6000
                path.write_text(yaml.safe_dump(data))
                reload = await client.post("/admin/governance/reload", headers=admin)
                assert reload.status_code == 200 and reload.json()["tenants"] == ["slow", "ops"]
                budget = (await rig.get("slow", "/v1/budget")).json()["tokens"]
                assert budget["limit_per_minute"] == 6000
                assert level <= budget["remaining"] <= level + 10  # kept, not refilled
                denied = await client.post(
                    "/admin/governance/reload", headers={"authorization": "Bearer k-slow"}
                )
                assert denied.status_code == 403

                data["tenants"][0]["tier"] = "platinum"  # not a tier: refused, nothing changes
                path.write_text(yaml.safe_dump(data))
                bad = await client.post("/admin/governance/reload", headers=admin)
                assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_config"
                after = (await rig.get("slow", "/v1/budget")).json()["tokens"]
                assert after["limit_per_minute"] == 6000
        finally:
            await gateway.aclose()


async def test_a_gateway_closes_twice_without_error(tmp_path: Path) -> None:
    """aclose() is idempotent with the governance store open (a second close raised)."""
    async with gateway_over_fakes(config_for_test(tmp_path, tenants=TENANTS), 1) as rig:
        await rig.gateway.aclose()
        await rig.gateway.aclose()


async def test_a_tenants_gauges_are_set_at_the_scrape_not_per_request(rig: Rig) -> None:
    """`gpupool_tenant_tokens_reserved`, `..._inflight_requests`, `..._tokens_remaining` and
    `..._active_runs` are set when `/metrics` is read (and each sweep), not by each request."""
    governor = rig.gateway.governor
    series = governor.metrics.tenant("slow")
    series.inflight.set(-1)  # a value no request path writes
    resp = await rig.post("slow", _body(max_tokens=5))
    assert resp.status_code == 200
    assert series.inflight._value.get() == -1  # the request did not set it
    rig.gateway._refresh_metrics()  # what `GET /metrics` calls first
    assert series.inflight._value.get() == 0
    assert series.tokens_remaining._value.get() > 0
