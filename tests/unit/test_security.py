"""Closed by default where it matters: admin has its own credential, `/metrics` needs one when
keys exist, keys are compared by SHA-256 digest in constant time, may be configured as hashes,
are never duplicated across tenants and never appear in logs or reprs."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pools.config import Config, ConfigError, parse_config
from pools.testing.config import config_data
from router.errors import Forbidden, Unauthorized
from router.gateway.app import create_app
from router.identity import OperatorAccess, Tenants

MARKER = "sk-MARKER-7f3a9c"  # a key that must never show up in a log line or a repr


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _data(tmp_path: Path | None = None, *, tenants: Any = (), **router: Any) -> dict[str, Any]:
    return config_data(tmp_path, tenants=list(tenants), router=router)


def _config(tmp_path: Path | None = None, *, tenants: Any = (), **router: Any) -> Config:
    return parse_config(_data(tmp_path, tenants=tenants, **router))


def _problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return info.value.problems


def _bearer(key: str) -> str:
    return f"Bearer {key}"


# --- config -------------------------------------------------------------------------------------


def test_keys_may_be_given_as_sha256_hashes() -> None:
    config = _config(tenants=[{"name": "a", "api_key_sha256": _sha("key-a").upper()}])
    (tenant,) = config.tenants
    assert tenant.api_key is None and tenant.api_key_sha256 == _sha("key-a")
    tenants = Tenants.from_config(config.tenants)
    assert not tenants.open
    assert tenants.authenticate(_bearer("key-a")).name == "a"
    with pytest.raises(Unauthorized):
        tenants.authenticate(_bearer(_sha("key-a")))  # the hash itself is not a key


def test_a_malformed_hash_is_refused() -> None:
    (problem,) = _problems(_data(tenants=[{"name": "a", "api_key_sha256": "abc"}]))
    assert "api_key_sha256" in problem and "64 hex" in problem


def test_one_key_source_per_tenant() -> None:
    data = _data(tenants=[{"name": "a", "api_key": "k", "api_key_sha256": _sha("k")}])
    (problem,) = _problems(data)
    assert "tenant 'a'" in problem and "only one of" in problem


def test_duplicate_keys_across_tenants_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GP_TEST_KEY_B", MARKER)
    data = _data(
        tenants=[
            {"name": "team-a", "api_key_sha256": _sha(MARKER)},
            {"name": "team-b", "api_key_env": "GP_TEST_KEY_B"},
        ]
    )
    (problem,) = _problems(data)
    assert "team-a" in problem and "team-b" in problem and "same API key" in problem
    assert MARKER not in problem and _sha(MARKER) not in problem


def test_admin_and_metrics_keys_must_differ_from_tenant_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GP_TEST_ADMIN", "shared")
    monkeypatch.setenv("GP_TEST_METRICS", "shared")
    data = _data(
        tenants=[{"name": "team-a", "api_key_sha256": _sha("shared")}],
        admin_api_key_env="GP_TEST_ADMIN",
        metrics_api_key_env="GP_TEST_METRICS",
    )
    problems = _problems(data)
    assert any("router.admin_api_key_env" in p and "team-a" in p for p in problems)
    assert any("router.metrics_api_key_env" in p and "team-a" in p for p in problems)


def test_admin_key_env_must_be_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GP_TEST_NO_ADMIN", raising=False)
    (problem,) = _problems(_data(admin_api_key_env="GP_TEST_NO_ADMIN"))
    assert "router.admin_api_key_env" in problem and "GP_TEST_NO_ADMIN" in problem


def test_literal_keys_warn_but_load(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pools.config"):
        config = _config(tenants=[{"name": "team-a", "api_key": MARKER}])
    assert config.tenants[0].api_key == MARKER
    (warning,) = [r.getMessage() for r in caplog.records if "api_key" in r.getMessage()]
    assert "team-a" in warning and "api_key_env" in warning and "api_key_sha256" in warning
    assert MARKER not in caplog.text


def test_keys_stay_out_of_reprs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GP_TEST_ADMIN", MARKER + "-admin")
    config = _config(tenants=[{"name": "a", "api_key": MARKER}], admin_api_key_env="GP_TEST_ADMIN")
    assert MARKER not in repr(config)
    assert MARKER not in repr(Tenants.from_config(config.tenants))


# --- identity -----------------------------------------------------------------------------------


def test_tenant_keys_authenticate_by_digest() -> None:
    config = _config(tenants=[{"name": "a", "api_key": "key-a"}, {"name": "b", "api_key": "kb"}])
    tenants = Tenants.from_config(config.tenants)
    assert tenants.authenticate("Bearer key-a").name == "a"
    assert tenants.authenticate("bearer  kb ").name == "b"
    for bad in (None, "", "Bearer", "Basic key-a", "Bearer key-", "Bearer key-ab"):
        with pytest.raises(Unauthorized):
            tenants.authenticate(bad)


def test_open_router_callers_are_not_admins_off_loopback() -> None:
    config = _config(host="0.0.0.0")
    access = OperatorAccess.from_config(Tenants.from_config(config.tenants), config.router)
    with pytest.raises(Forbidden) as info:
        access.authorize_admin(None)
    assert info.value.code == "admin_not_configured"
    assert "router.admin_api_key_env" in info.value.message
    assert "loopback" in info.value.message
    access.authorize_metrics(None)  # nothing configured: the metrics stay open


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.2.1", "::1", "localhost"])
def test_open_router_on_loopback_keeps_admin_open(host: str) -> None:
    config = _config(host=host)
    access = OperatorAccess.from_config(Tenants.from_config(config.tenants), config.router)
    access.authorize_admin(None)
    access.authorize_metrics(None)


def test_tenant_keys_without_an_admin_credential_close_admin_even_on_loopback() -> None:
    config = _config(tenants=[{"name": "a", "api_key": "key-a"}], host="127.0.0.1")
    access = OperatorAccess.from_config(Tenants.from_config(config.tenants), config.router)
    with pytest.raises(Forbidden) as info:
        access.authorize_admin("Bearer key-a")
    assert info.value.code == "admin_not_configured"


def test_admin_key_and_admin_tenants(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GP_TEST_ADMIN", "root-key")
    config = _config(
        tenants=[
            {"name": "a", "api_key": "key-a"},
            {"name": "ops", "api_key": "ko", "admin": True},
        ],
        admin_api_key_env="GP_TEST_ADMIN",
        host="0.0.0.0",
    )
    assert config.router.admin_api_key_sha256 == _sha("root-key")
    access = OperatorAccess.from_config(Tenants.from_config(config.tenants), config.router)
    assert access.authorize_admin("Bearer root-key") == "admin"
    assert access.authorize_admin("Bearer ko") == "ops"
    with pytest.raises(Forbidden) as info:
        access.authorize_admin("Bearer key-a")
    assert info.value.code == "admin_only"
    for bad in (None, "Bearer nope"):
        with pytest.raises(Unauthorized):
            access.authorize_admin(bad)
    # the admin key is not a tenant key
    with pytest.raises(Unauthorized):
        access.tenants.authenticate("Bearer root-key")


def test_an_admin_key_alone_closes_admin_on_an_open_router(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GP_TEST_ADMIN", "root-key")
    config = _config(admin_api_key_env="GP_TEST_ADMIN")  # loopback, no tenant keys
    tenants = Tenants.from_config(config.tenants)
    access = OperatorAccess.from_config(tenants, config.router)
    assert tenants.open and tenants.authenticate(None).name == "default"
    with pytest.raises(Unauthorized):
        access.authorize_admin(None)
    assert access.authorize_admin("Bearer root-key") == "admin"
    with pytest.raises(Unauthorized):  # a credential exists: /metrics needs it
        access.authorize_metrics(None)


# --- over HTTP ----------------------------------------------------------------------------------


@pytest.fixture
async def keyed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[httpx.AsyncClient]:
    monkeypatch.setenv("GP_TEST_ADMIN", MARKER + "-admin")
    monkeypatch.setenv("GP_TEST_METRICS", MARKER + "-scrape")
    config = _config(
        tmp_path,
        tenants=[{"name": "team-a", "api_key_sha256": _sha(MARKER)}],
        admin_api_key_env="GP_TEST_ADMIN",
        metrics_api_key_env="GP_TEST_METRICS",
        host="0.0.0.0",
    )
    gateway = create_app(config, [], scrape=False)
    await gateway.start()
    transport = httpx.ASGITransport(app=gateway)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        yield client
    await gateway.aclose()


async def test_metrics_need_the_admin_or_the_metrics_key(keyed: httpx.AsyncClient) -> None:
    assert (await keyed.get("/metrics")).status_code == 401
    tenant = await keyed.get("/metrics", headers={"authorization": _bearer(MARKER)})
    assert tenant.status_code == 403 and tenant.json()["error"]["type"] == "permission_error"
    for key in (MARKER + "-admin", MARKER + "-scrape"):
        ok = await keyed.get("/metrics", headers={"authorization": _bearer(key)})
        assert ok.status_code == 200 and "gpupool_" in ok.text
    # the scrape key reads metrics only
    scrape = await keyed.get("/admin/pools", headers={"authorization": _bearer(MARKER + "-scrape")})
    assert scrape.status_code == 401


async def test_admin_over_http(keyed: httpx.AsyncClient) -> None:
    for path in ("/admin/pools", "/admin/gpus", "/admin/accounting"):
        assert (await keyed.get(path)).status_code == 401
        tenant = await keyed.get(path, headers={"authorization": _bearer(MARKER)})
        assert tenant.status_code == 403 and tenant.json()["error"]["code"] == "admin_only"
        ok = await keyed.get(path, headers={"authorization": _bearer(MARKER + "-admin")})
        assert ok.status_code == 200, ok.text
    runs = await keyed.get("/v1/runs", headers={"authorization": _bearer(MARKER)})
    assert runs.status_code == 200


async def test_open_router_off_loopback_refuses_admin_over_http(tmp_path: Path) -> None:
    gateway = create_app(_config(tmp_path, host="0.0.0.0"), [], scrape=False)
    await gateway.start()
    transport = httpx.ASGITransport(app=gateway)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        resp = await client.get("/admin/pools")
        assert resp.status_code == 403
        error = resp.json()["error"]
        assert error["code"] == "admin_not_configured" and "admin_api_key_env" in error["message"]
        assert (await client.get("/metrics")).status_code == 200
        assert (await client.get("/v1/models")).status_code == 200
    await gateway.aclose()


async def test_keys_never_reach_the_logs(
    keyed: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        for key in (MARKER, MARKER + "-admin", MARKER + "-scrape", MARKER + "-wrong"):
            headers = {"authorization": _bearer(key)}
            await keyed.get("/metrics", headers=headers)
            await keyed.get("/admin/pools", headers=headers)
            await keyed.get("/v1/runs", headers=headers)
            await keyed.post("/v1/chat/completions", headers=headers, json={"model": "tiny"})
    assert MARKER not in caplog.text
