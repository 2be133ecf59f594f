"""Every error the router answers has OpenAI's shape, `{"error": {"message", "type", "code",
"param"}}`: unknown paths anywhere, methods a path does not take, malformed query numbers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pools.testing.config import config_for_test
from router.gateway.app import create_app


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    gateway = create_app(config_for_test(tmp_path), [], scrape=False)
    await gateway.start()
    transport = httpx.ASGITransport(app=gateway)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        yield client
    await gateway.aclose()


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) >= {"message", "type", "code", "param"}, error
    assert isinstance(error["message"], str) and error["message"]
    return error


@pytest.mark.parametrize("path", ["/nope", "/admin/nope", "/v2/models", "/"])
async def test_unknown_paths(client: httpx.AsyncClient, path: str) -> None:
    error = _error(await client.get(path), 404)
    assert error["type"] == "not_found_error" and error["code"] == "unknown_endpoint"


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/health"), ("DELETE", "/metrics"), ("PATCH", "/v1/models"), ("PUT", "/admin/pools")],
)
async def test_methods_a_path_does_not_take(
    client: httpx.AsyncClient, method: str, path: str
) -> None:
    resp = await client.request(method, path)
    error = _error(resp, 405)
    assert error["type"] == "invalid_request_error" and error["code"] == "method_not_allowed"
    assert "GET" in resp.headers["allow"]


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "Infinity", "1e999"])
@pytest.mark.parametrize(
    ("path", "param"),
    [
        ("/v1/runs", "limit"),
        ("/v1/runs", "since_s"),
        ("/admin/accounting", "top"),
        ("/admin/accounting", "since_s"),
    ],
)
async def test_non_finite_numbers_are_a_400(
    client: httpx.AsyncClient, path: str, param: str, value: str
) -> None:
    error = _error(await client.get(path, params={param: value}), 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param


@pytest.mark.parametrize("value", ["0", "-3", "2.5", "1001", "ten"])
async def test_a_limit_must_be_a_whole_number_in_range(
    client: httpx.AsyncClient, value: str
) -> None:
    error = _error(await client.get("/v1/runs", params={"limit": value}), 400)
    assert error["param"] == "limit"


async def test_good_numbers_still_work(client: httpx.AsyncClient) -> None:
    assert (await client.get("/v1/runs", params={"limit": "10", "since_s": "0"})).status_code == 200
    assert (await client.get("/v1/runs", params={"limit": "1e2"})).status_code == 200
    resp = await client.get("/admin/accounting", params={"top": "5", "since_s": "1.5"})
    assert resp.status_code == 200
