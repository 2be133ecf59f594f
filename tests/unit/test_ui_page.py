"""The status page's HTTP side (router/ops/ui/): who may load `/ui`, what it serves, and that the
admin JSON it draws from takes the browser's Basic credentials. Served by uvicorn in front of
fake engines (the hostile-input rig); the page in a real browser is
tests/integration/test_ui_browser.py."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from router.ops.ui import ASSETS
from tests.unit.test_hostile_rig import (
    ADMIN_KEY,
    TENANT_KEY,
    LiveRouter,
    hostile_config,
    live_router,
)

STATIC = Path(__file__).resolve().parents[2] / "router" / "ops" / "ui" / "static"


def basic(password: str, user: str = "sre") -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"authorization": f"Basic {token}"}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRouter]:
    with live_router(hostile_config(tmp_path_factory.mktemp("ui-keyed"))) as router:
        yield router


@pytest.fixture(scope="module")
def open_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRouter]:
    config = hostile_config(tmp_path_factory.mktemp("ui-open"), keys=False)
    with live_router(config) as router:
        yield router


def test_without_credentials_the_page_asks_the_browser_for_them(keyed: LiveRouter) -> None:
    resp = httpx.get(f"{keyed.url}/ui")
    assert resp.status_code == 401
    assert resp.headers["www-authenticate"].startswith("Basic realm=")
    assert resp.json()["error"]["code"] == "missing_api_key"
    assert ADMIN_KEY not in resp.text
    # the same for the page's scripts: nothing of the page without the admin key
    assert httpx.get(f"{keyed.url}/ui/app.js").status_code == 401


@pytest.mark.parametrize("auth", [basic(ADMIN_KEY), basic(ADMIN_KEY, user=""), bearer(ADMIN_KEY)])
def test_the_admin_key_opens_the_page(keyed: LiveRouter, auth: dict[str, str]) -> None:
    resp = httpx.get(f"{keyed.url}/ui", headers=auth)
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "text/html; charset=utf-8"
    assert resp.content == (STATIC / "index.html").read_bytes()
    assert "default-src 'self'" in resp.headers["content-security-policy"]
    assert resp.headers["cache-control"] == "no-cache"


def test_a_wrong_key_is_refused_and_asked_again(keyed: LiveRouter) -> None:
    resp = httpx.get(f"{keyed.url}/ui", headers=basic("not-the-key"))
    assert resp.status_code == 401 and "www-authenticate" in resp.headers
    assert resp.json()["error"]["code"] == "invalid_api_key"
    # Basic credentials that are not base64, or carry no password, are malformed
    for value in ("Basic !!!", "Basic " + base64.b64encode(b"user-only").decode()):
        resp = httpx.get(f"{keyed.url}/ui", headers={"authorization": value})
        assert resp.status_code == 401, value


def test_an_ordinary_tenant_may_not_see_the_page(keyed: LiveRouter) -> None:
    for auth in (basic(TENANT_KEY), bearer(TENANT_KEY)):
        resp = httpx.get(f"{keyed.url}/ui", headers=auth)
        assert resp.status_code == 403
        assert resp.json()["error"]["code"] == "admin_only"
        assert "www-authenticate" not in resp.headers


def test_the_admin_json_takes_the_browsers_basic_credentials(keyed: LiveRouter) -> None:
    for path in ("/admin/pools", "/admin/accounting", "/admin/history"):
        assert httpx.get(keyed.url + path, headers=basic(ADMIN_KEY)).status_code == 200, path
        assert httpx.get(keyed.url + path, headers=basic(TENANT_KEY)).status_code == 403, path
        assert httpx.get(keyed.url + path).status_code == 401, path
    # and a tenant's Basic credentials work where its bearer key does
    models = httpx.get(f"{keyed.url}/v1/models", headers=basic(TENANT_KEY))
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"


def test_basic_credentials_read_but_never_change(keyed: LiveRouter) -> None:
    """A browser sends the page's Basic credentials with a cross-site form's POST too (CSRF):
    with them nothing that changes state is done, not even a completion on the tenant's bill."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    changes = [
        ("/admin/pools/freeze", {}, ADMIN_KEY),
        ("/admin/governance/reload", {}, ADMIN_KEY),
        ("/v1/runs/r1/end", {}, TENANT_KEY),
        ("/v1/chat/completions", chat, TENANT_KEY),
    ]
    for path, body, key in changes:
        refused = httpx.post(keyed.url + path, json=body, headers=basic(key))
        assert refused.status_code == 401, path
        assert refused.json()["error"]["code"] == "basic_read_only", path
    # the same requests with the bearer key are not refused for their credentials
    for path, body, key in changes:
        answer = httpx.post(keyed.url + path, json=body, headers=bearer(key), timeout=30)
        assert answer.status_code != 401, (path, answer.text)
    unfreeze = httpx.post(keyed.url + "/admin/pools/unfreeze", json={}, headers=bearer(ADMIN_KEY))
    assert unfreeze.status_code == 200


def test_every_asset_is_served_with_its_type_and_nothing_else(keyed: LiveRouter) -> None:
    auth = bearer(ADMIN_KEY)
    page = (STATIC / "index.html").read_text()
    referenced = set(re.findall(r'(?:src|href)="/ui/([^"]+)"', page))
    assert referenced == set(ASSETS) - {"index.html"}  # the page needs exactly what is shipped
    for name in referenced:
        resp = httpx.get(f"{keyed.url}/ui/{name}", headers=auth)
        assert resp.status_code == 200, name
        assert resp.content == (STATIC / name).read_bytes()
        expected = "text/css" if name.endswith(".css") else "text/javascript"
        assert resp.headers["content-type"].split(";")[0] == expected
    for path in ("/ui/index.html", "/ui/nope.js", "/ui/..%2Fapp.py", "/ui/"):
        resp = httpx.get(keyed.url + path, headers=auth)
        assert resp.status_code == 404, path
        assert resp.json()["error"]["type"] == "not_found_error"


def test_a_local_router_without_keys_serves_the_page_to_anyone(open_router: LiveRouter) -> None:
    resp = httpx.get(f"{open_router.url}/ui")
    assert resp.status_code == 200 and "<title>gpupool status</title>" in resp.text
    history = httpx.get(f"{open_router.url}/admin/history").json()
    assert history["object"] == "gpupool.history" and history["interval_s"] == 5.0
    # the first sample is taken at start: both pools at their configured 50 %
    first = history["samples"][0]
    assert {p: v["share_frac"] for p, v in first["pools"].items()} == {
        "agent": 0.5,
        "normal": 0.5,
    }
    later = httpx.get(
        f"{open_router.url}/admin/history", params={"since_s": first["t_s"] + 3600}
    ).json()
    assert later["samples"] == []
    bad = httpx.get(f"{open_router.url}/admin/history", params={"since_s": "soon"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "since_s"
