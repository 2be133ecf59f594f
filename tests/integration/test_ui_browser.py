"""The status page (`GET /ui`) in a real headless Chromium, in front of the three real CPU
engines under load.

A router with an admin key (`gpupool serve`, as a user runs it) fronts the session's engines;
worker threads keep agent runs and chat streaming through it. Chromium (the OS package, driven
by Playwright's Python package through `executable_path`) logs in with HTTP Basic credentials,
the page must render with no console error, list every pool and instance, draw its plots and
cost tables, and every figure it shows must equal the `/admin/pools` (and `/admin/accounting`)
answer it drew from, captured as the browser received it; an independent `/admin/pools` read
at the same moment must agree on everything that does not move under load. The rebalancer
decides every 2 s (with a hysteresis no gap reaches, so it never moves the ratio mid-test): its
pressure per pool and its decisions must show too.

`GPUPOOL_UI_SCREENSHOT=docs/img/status_page.png` also writes the screenshot the README shows.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pools.launchers import InstanceSpec
from tests.integration.conftest import RouterProcess, write_router_config

pytestmark = pytest.mark.integration

PORTS = range(8600, 8650)  # this test's routers
ADMIN_KEY_ENV = "GPUPOOL_TEST_UI_ADMIN_KEY"
ADMIN_KEY = "ui-admin-" + os.urandom(6).hex()
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")
PROMPT = " ".join(f"word{i}" for i in range(300))
AGENT_WORKERS = 3
CHAT_WORKERS = 3


def _chromium() -> str:
    explicit = os.environ.get("GPUPOOL_CHROMIUM")
    found = explicit or next((p for n in CHROMIUM_NAMES if (p := shutil.which(n))), None)
    if found is None:
        message = "no Chromium on PATH (scripts/install.sh installs the OS package as root)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def _free_port() -> int:
    for port in PORTS:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORTS}")


@pytest.fixture(scope="module")
def ui_router(
    real_engines: list[InstanceSpec], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    d = tmp_path_factory.mktemp("ui-router")
    os.environ[ADMIN_KEY_ENV] = ADMIN_KEY  # the router subprocess reads it from its environment
    config = write_router_config(
        d / "gpupool.yaml",
        [e.url for e in real_engines],
        router={"admin_api_key_env": ADMIN_KEY_ENV, "scrape_interval_s": 0.5},
        # decisions every 2 s for the page to show, none of them a move (a gap of 100 in
        # pressure never happens), so the shares stay put while the test compares them
        rebalancer={
            "enabled": True,
            "interval_s": 2.0,
            "hysteresis_frac": 100.0,
            "smoothing_window_s": 4.0,
        },
    )
    router = RouterProcess(config, _free_port(), d / "router.log")
    try:
        yield router.url
    finally:
        router.stop()


class Load:
    """Agent runs (with run ids) and chat, streaming through the router until stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop = threading.Event()
        self.done = 0
        self.failures: list[str] = []
        self.threads = [
            threading.Thread(target=self._work, args=(i, i < AGENT_WORKERS), daemon=True)
            for i in range(AGENT_WORKERS + CHAT_WORKERS)
        ]

    def _work(self, index: int, agent: bool) -> None:
        step = 0
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                headers = {"x-gpupool-class": "agent" if agent else "normal"}
                if agent:  # a new run every 20 steps: runs have a step limit (governance)
                    headers["x-gpupool-run-id"] = f"ui-run-{index}-{step // 20}"
                body = {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": f"{step} {PROMPT}"}],
                    "max_tokens": 64 if agent else 24,
                    "stream": True,
                }
                try:
                    with client.stream(
                        "POST", f"{self.url}/v1/chat/completions", json=body, headers=headers
                    ) as resp:
                        resp.read()
                        if resp.status_code != 200:
                            self.failures.append(f"{resp.status_code} {resp.text[:200]}")
                except httpx.HTTPError as err:
                    self.failures.append(repr(err))
                self.done += 1
                step += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=150)


def _number(text: str) -> float:
    match = re.search(r"-?\d+(?:\.\d+)?", text)
    assert match, f"no number in {text!r}"
    return float(match.group())


def _cell(row: Any, field: str) -> str:
    text: str = row.locator(f'[data-field="{field}"]').first.inner_text()
    return text.strip()


def _wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_status_page_shows_the_live_pools_in_a_real_browser(
    ui_router: str, real_engines: list[InstanceSpec], tmp_path: Path
) -> None:
    from playwright.sync_api import sync_playwright  # the test extra; imported here to skip fast

    chromium = _chromium()
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    assert httpx.get(f"{ui_router}/ui").status_code == 401  # the page is not open to anyone

    def loaded() -> bool:
        view = httpx.get(f"{ui_router}/admin/pools", headers=admin).json()
        inflight: int = sum(i["inflight"] for i in view["instances"].values())
        return inflight >= 4

    with Load(ui_router) as load:
        _wait(loaded, 120, "the load to reach the engines")

        def measured() -> bool:  # history (a sample every 5 s) with latency and rates in it
            samples = httpx.get(f"{ui_router}/admin/history", headers=admin).json()["samples"]
            return all(
                any(
                    v is not None
                    for sample in samples
                    for series in sample[part].values()
                    for v in series.values()
                )
                for part in ("latency", "rates")
            )

        _wait(measured, 60, "latency and rates in the history")

        problems: list[str] = []
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            context = browser.new_context(
                http_credentials={"username": "sre", "password": ADMIN_KEY},
                viewport={"width": 1440, "height": 1000},
            )
            page = context.new_page()
            page.on(
                "console",
                lambda m: (
                    problems.append(f"console {m.type}: {m.text}")
                    if m.type in ("error", "warning")
                    else None
                ),
            )
            page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
            page.goto(f"{ui_router}/ui")
            page.wait_for_selector("#instances tr[data-instance]", timeout=20_000)
            page.wait_for_selector("#top-runs tr[data-run]", timeout=20_000)

            # stop the page's own timer, then one refresh whose answers we capture as it got them
            page.evaluate("gpupoolUI.pause()")
            page.evaluate("async () => { await gpupoolUI.state.inFlight; }")
            page.evaluate("gpupoolUI.state.lastSlow = 0")  # the slow panels refresh too
            with (
                page.expect_response(lambda r: r.url.endswith("/admin/pools")) as pools_resp,
                page.expect_response(lambda r: "/admin/accounting" in r.url) as acc_resp,
                page.expect_response(lambda r: "/admin/decisions" in r.url) as dec_resp,
            ):
                page.evaluate("gpupoolUI.refresh()")
            shown: dict[str, Any] = pools_resp.value.json()
            accounting: dict[str, Any] = acc_resp.value.json()
            decisions: dict[str, Any] = dec_resp.value.json()
            independent = httpx.get(f"{ui_router}/admin/pools", headers=admin).json()

            _check_pools(page, shown, independent)
            _check_instances(page, shown, independent, real_engines)
            _check_cost(page, accounting)
            _check_plots(page, shown)
            _check_rebalancer(page, shown, decisions)
            page.screenshot(path=str(tmp_path / "status_page.png"), full_page=True)
            target = os.environ.get("GPUPOOL_UI_SCREENSHOT")
            if target:
                page.screenshot(path=target, full_page=True)
            browser.close()
    assert not problems, problems
    assert load.done > 0 and not load.failures, load.failures[:5]


def _check_pools(page: Any, shown: dict[str, Any], independent: dict[str, Any]) -> None:
    rows = page.locator("#pools tr[data-pool]")
    assert sorted(rows.evaluate_all("rs => rs.map(r => r.dataset.pool)")) == sorted(shown["pools"])
    assert set(shown["pools"]) == set(independent["pools"]) == {"agent", "normal"}
    for name, pool in shown["pools"].items():
        row = page.locator(f'#pools tr[data-pool="{name}"]')
        assert _cell(row, "name") == name
        # percentages with one decimal: within half a unit of the last digit
        assert abs(_number(_cell(row, "share_frac")) - 100 * pool["share_frac"]) <= 0.051
        assert abs(_number(_cell(row, "floor_frac")) - 100 * pool["floor_frac"]) <= 0.051
        assert abs(_number(_cell(row, "ceiling_frac")) - 100 * pool["ceiling_frac"]) <= 0.051
        total = len(pool["instances"])
        assert _cell(row, "healthy_instances") == f"{pool['healthy_instances']} / {total}"
        queue = pool["queue"]
        assert _cell(row, "queue_depth") == f"{queue['depth']} / {queue['max_depth']}"
        # what does not move under load agrees with a second read at the same moment
        other = independent["pools"][name]
        for key in ("share_frac", "floor_frac", "ceiling_frac", "instances", "healthy_instances"):
            assert pool[key] == other[key], (name, key)
    assert shown["pools"]["agent"]["healthy_instances"] >= 1


def _check_instances(
    page: Any,
    shown: dict[str, Any],
    independent: dict[str, Any],
    engines: list[InstanceSpec],
) -> None:
    ids = page.locator("#instances tr[data-instance]").evaluate_all(
        "rs => rs.map(r => r.dataset.instance)"
    )
    assert sorted(ids) == sorted(shown["instances"]) == sorted(e.instance_id for e in engines)
    busy = 0
    for iid, inst in shown["instances"].items():
        row = page.locator(f'#instances tr[data-instance="{iid}"]')
        assert _cell(row, "id") == iid
        assert _cell(row, "healthy") == ("healthy" if inst["healthy"] else "unhealthy")
        assert abs(_number(_cell(row, "kv_usage_frac")) - 100 * inst["kv_usage_frac"]) <= 0.051
        assert int(_number(_cell(row, "kv_reserved_blocks"))) == inst["kv_reserved_blocks"]
        for field in ("running", "waiting", "inflight", "preemptions_seen"):
            assert int(_number(_cell(row, field))) == inst[field], (iid, field)
        assert int(_number(_cell(row, "op_limit"))) == inst["operating_point"]["limit"]
        prefix = inst["prefix_cache"]  # the router's index of its prefix cache (KV events)
        blocks = _cell(row, "prefix_cached_blocks")
        assert blocks == "–" if prefix is None else int(blocks) == prefix["cached_blocks"]
        pools = _cell(row, "pools")
        for pool, frac in inst["pools"].items():
            if frac > 0:
                assert f"{pool} {round(frac * 100)} %" in pools
        busy += inst["inflight"]
        other = independent["instances"][iid]
        assert (inst["url"], inst["healthy"], inst["pools"]) == (
            other["url"],
            other["healthy"],
            other["pools"],
        )
    assert busy >= 1, "the page was read while no request was in flight"


def _check_cost(page: Any, accounting: dict[str, Any]) -> None:
    runs = accounting["top_runs"]
    assert any(r["run_id"].startswith("ui-run-") for r in runs)
    rows = page.locator("#top-runs tr[data-run]")
    assert rows.evaluate_all("rs => rs.map(r => r.dataset.run)") == [r["run_id"] for r in runs]
    for run in runs:
        row = page.locator(f'#top-runs tr[data-run="{run["run_id"]}"]')
        assert abs(_number(_cell(row, "gpu_seconds")) - run["gpu_seconds"]) <= 0.0051
        assert int(_number(_cell(row, "requests"))) == run["requests"]
    by_tenant = accounting["ledger"]["by_tenant"]
    tenants = page.locator("#top-tenants tr[data-tenant]").evaluate_all(
        "rs => rs.map(r => r.dataset.tenant)"
    )
    assert tenants == sorted(by_tenant, key=lambda t: -by_tenant[t]["gpu_seconds"])[:10]
    for tenant in tenants:
        row = page.locator(f'#top-tenants tr[data-tenant="{tenant}"]')
        expected = by_tenant[tenant]["gpu_seconds"]
        assert abs(_number(_cell(row, "gpu_seconds")) - expected) <= 0.0051


def _check_plots(page: Any, shown: dict[str, Any]) -> None:
    # one line per pool in the ratio plot, one per instance in the KV plot
    share_lines = page.locator("#plot-share svg path.line").evaluate_all(
        "ps => ps.map(p => p.dataset.series)"
    )
    assert sorted(share_lines) == sorted(shown["pools"])
    kv_lines = page.locator("#plot-kv svg path.line").evaluate_all(
        "ps => ps.map(p => p.dataset.series)"
    )
    assert sorted(kv_lines) == sorted(shown["instances"])
    # latency was measured in at least one interval: a point or a line in the TTFT plot
    assert page.locator("#plot-ttft svg circle, #plot-ttft svg path.line").count() >= 1
    assert page.locator("#plot-rate svg circle, #plot-rate svg path.line").count() >= 1
    # pressure is plotted once the rebalancer has decided
    assert page.locator("#plot-pressure svg circle, #plot-pressure svg path.line").count() >= 1


def _check_rebalancer(page: Any, shown: dict[str, Any], decisions: dict[str, Any]) -> None:
    smoothed = shown["rebalancer"]["smoothed_pressure"]
    assert set(smoothed) == set(shown["pools"])  # it has decided at least once
    for name, value in smoothed.items():
        row = page.locator(f'#pools tr[data-pool="{name}"]')
        assert abs(_number(_cell(row, "pressure")) - value) <= 0.0051, name
    assert page.locator("#decisions-section").is_visible()
    rows = page.locator("#decisions tr[data-decision]").count()
    assert rows == min(20, len(decisions["data"])) and rows >= 1
    assert shown["rebalancer"]["moves"] == 0  # as configured: the ratio held still
