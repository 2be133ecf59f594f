"""GPU-seconds accounting against real CPU vLLM engines: per-run costs, conservation,
processor sharing between concurrent runs, durability across `kill -9`, tenant scoping."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pools.launchers import InstanceSpec
from pools.testing.router_process import free_port
from tests.integration.conftest import RouterProcess, write_router_config

pytestmark = pytest.mark.integration

KEYS = {"a": "key-team-a", "b": "key-team-b", "admin": "key-admin"}
TENANTS = [
    {"name": "team-a", "api_key": KEYS["a"]},
    {"name": "team-b", "api_key": KEYS["b"]},
    {"name": "ops", "api_key": KEYS["admin"], "admin": True},
]


def _auth(who: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[who]}"}


@pytest.fixture
def keyed_router(real_engines: list[InstanceSpec], tmp_path: Path) -> Iterator[RouterProcess]:
    config = write_router_config(
        tmp_path / "gpupool.yaml",
        [e.url for e in real_engines],
        tenants=TENANTS,
        router={"ledger_flush_interval_s": 0.2},
    )
    router = RouterProcess(config, free_port(), tmp_path / "router.log")
    yield router
    if router.proc.poll() is None:
        router.stop()


def _step(
    url: str,
    run_id: str,
    messages: list[dict[str, str]],
    who: str = "a",
    max_tokens: int = 24,
    stream: bool = False,
) -> httpx.Response:
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    return httpx.post(
        f"{url}/v1/chat/completions",
        json=body,
        timeout=120,
        headers={**_auth(who), "x-gpupool-run-id": run_id},
    )


def test_three_step_run_is_accounted_and_conserved(keyed_router: RouterProcess) -> None:
    url = keyed_router.url
    messages = [{"role": "user", "content": "list the files"}]
    for step in range(3):
        resp = _step(url, "run-three", messages)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-gpupool-pool"] == "agent"
        assert float(resp.headers["x-gpupool-gpu-seconds"]) > 0
        messages += [
            {
                "role": "assistant",
                "content": resp.json()["choices"][0]["message"]["content"] or "ok",
            },
            {"role": "user", "content": f"tool result {step}: " + "data " * 40},
        ]
    run = httpx.get(f"{url}/v1/runs/run-three", headers=_auth("a"), timeout=10).json()
    assert run["totals"]["requests"] == 3
    assert [r["step_index"] for r in run["requests"]] == [0, 1, 2]
    assert run["totals"]["gpu_seconds"] > 0
    assert run["totals"]["completion_tokens"] == 72
    assert all(r["gpu_seconds"] > 0 and r["instance"] for r in run["requests"])
    # the run list shows it too
    listed = httpx.get(f"{url}/v1/runs", headers=_auth("a"), timeout=10).json()
    assert "run-three" in [r["run_id"] for r in listed["data"]]
    report = httpx.get(f"{url}/admin/accounting", headers=_auth("admin"), timeout=10).json()
    live = report["live"]
    assert live["rel_error"] < 0.005, live
    total = live["attributed_gpu_seconds"] + sum(live["idle_by_pool_gpu_seconds"].values())
    assert total == pytest.approx(live["capacity_gpu_seconds"], rel=0.005)
    assert live["capacity_gpu_seconds"] > 0 and live["attributed_gpu_seconds"] > 0
    assert httpx.get(f"{url}/admin/accounting", headers=_auth("a"), timeout=10).status_code == 403


def test_usage_gains_gpu_seconds_on_request(keyed_router: RouterProcess) -> None:
    url = keyed_router.url
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    plain = httpx.post(
        f"{url}/v1/chat/completions",
        json=body,
        timeout=60,
        headers={**_auth("a"), "x-gpupool-usage": "1"},
    ).json()
    assert plain["usage"]["gpu_seconds"] > 0
    events = []
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json={**body, "stream": True},
        headers={**_auth("a"), "x-gpupool-usage": "1"},
        timeout=60,
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    usage = [e["usage"] for e in events if e.get("usage")]
    assert len(usage) == 1 and usage[0]["gpu_seconds"] > 0


def test_two_concurrent_runs_split_one_instance(keyed_router: RouterProcess) -> None:
    url = keyed_router.url
    results: dict[str, httpx.Response] = {}

    def go(run_id: str) -> None:
        results[run_id] = _step(url, run_id, [{"role": "user", "content": "go"}], max_tokens=300)

    threads = [threading.Thread(target=go, args=(r,)) for r in ("pair-1", "pair-2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {r.headers["x-gpupool-instance"] for r in results.values()} == {
        results["pair-1"].headers["x-gpupool-instance"]
    }, "both runs should share the agent engine"
    runs = [
        httpx.get(f"{url}/v1/runs/{r}", headers=_auth("a"), timeout=10).json()
        for r in ("pair-1", "pair-2")
    ]
    for run in runs:
        req = run["requests"][0]
        wall = req["ended_at_s"] - req["started_at_s"]
        # sharing one engine (1 GPU-equivalent) with the other run most of the time:
        # each pays clearly less than its own wall time, and together no more than the union
        assert 0 < req["gpu_seconds"] < 0.8 * wall, (req["gpu_seconds"], wall)
    starts = [r["requests"][0]["started_at_s"] for r in runs]
    ends = [r["requests"][0]["ended_at_s"] for r in runs]
    union = max(ends) - min(starts)
    assert sum(r["requests"][0]["gpu_seconds"] for r in runs) <= union * 1.01


def test_tenant_cannot_read_another_tenants_run(keyed_router: RouterProcess) -> None:
    url = keyed_router.url
    assert (
        _step(
            url, "secret-run", [{"role": "user", "content": "x"}], who="a", max_tokens=2
        ).status_code
        == 200
    )
    assert httpx.get(f"{url}/v1/runs/secret-run", headers=_auth("a"), timeout=10).status_code == 200
    other = httpx.get(f"{url}/v1/runs/secret-run", headers=_auth("b"), timeout=10)
    assert other.status_code == 404 and other.json()["error"]["code"] == "run_not_found"
    listed = httpx.get(f"{url}/v1/runs", headers=_auth("b"), timeout=10).json()
    assert "secret-run" not in [r["run_id"] for r in listed["data"]]
    assert httpx.get(f"{url}/v1/runs/secret-run", timeout=10).status_code == 401


def test_kill_9_after_a_flush_keeps_completed_requests(
    keyed_router: RouterProcess, tmp_path: Path
) -> None:
    url = keyed_router.url
    ids = []
    for i in range(5):
        resp = _step(url, "durable-run", [{"role": "user", "content": f"step {i}"}], max_tokens=2)
        assert resp.status_code == 200
        ids.append(resp.headers["x-gpupool-request-id"])
    time.sleep(1.0)  # > flush interval (0.2 s)
    keyed_router.proc.send_signal(signal.SIGKILL)
    keyed_router.proc.wait(timeout=10)
    restarted = RouterProcess(
        keyed_router.config_path,
        free_port(),
        tmp_path / "router2.log",
    )
    try:
        run = httpx.get(
            f"{restarted.url}/v1/runs/durable-run", headers=_auth("a"), timeout=10
        ).json()
        assert sorted(r["request_id"] for r in run["requests"]) == sorted(ids)
        # and it carries on: the next step gets the next index
        assert (
            _step(
                restarted.url, "durable-run", [{"role": "user", "content": "again"}], max_tokens=2
            ).status_code
            == 200
        )
        run = httpx.get(
            f"{restarted.url}/v1/runs/durable-run", headers=_auth("a"), timeout=10
        ).json()
        assert sorted(r["step_index"] for r in run["requests"]) == list(range(6))
    finally:
        restarted.stop()
