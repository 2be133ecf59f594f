"""The Ray launcher for real: a local Ray cluster (its own ports, 8700-8749), two CPU vLLM
engines placed on it as actors, the router serving through them and following each engine's
KV events over TCP (the index fills). One engine's actor is killed;
Ray restarts it (a new engine, at a port free on the node), and the router drains it out and
readmits it, while every request that had not started on the killed engine succeeds. The
killed actor's engine goes with it, `VLLM::EngineCore` included (one used to be left running,
parent 1)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import ray

from pools.config import DEFAULT_CPU_CONFIG, parse_config
from pools.devmodel import is_dev_model, make_dev_model
from pools.launchers import make_launcher
from pools.launchers.ray import RayLauncher, engine_settings
from pools.launchers.reaper import OWNER_POLL_S
from router.gateway.app import create_app
from tests.e2e.stack import seed_vllm_flags

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / ".gpupool" / "models" / "tiny"
GCS_PORT = int(os.environ.get("GPUPOOL_TEST_RAY_BASE_PORT", "8700"))
RAY_BIN = Path(sys.executable).parent / "ray"


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`ray start --head --block` on explicit ports, in its own process group (stopped by
    that group's id, never by name), its workers at niceness 0."""
    p = GCS_PORT
    log = (tmp_path_factory.mktemp("ray") / "head.log").open("wb")
    head = subprocess.Popen(
        [
            str(RAY_BIN),
            "start",
            "--head",
            "--block",
            "--disable-usage-stats",
            "--node-ip-address",
            "127.0.0.1",
            "--port",
            str(p),
            "--node-manager-port",
            str(p + 1),
            "--object-manager-port",
            str(p + 2),
            "--ray-client-server-port",
            str(p + 3),
            "--dashboard-port",
            str(p + 4),
            "--metrics-export-port",
            str(p + 5),
            "--dashboard-agent-listen-port",
            str(p + 6),
            "--dashboard-agent-grpc-port",
            str(p + 7),
            "--runtime-env-agent-port",
            str(p + 8),
            "--min-worker-port",
            str(p + 10),
            "--max-worker-port",
            str(p + 39),
            "--include-dashboard",
            "false",
            "--num-cpus",
            "2",
            "--num-gpus",
            "0",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        # Ray renices its workers to 15, and the engines the actors start inherit it: on two
        # cores they then start behind every other process (the test's own gateway and
        # requests, Ray's daemons, anything else running); at 0 they share the CPU fairly
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_worker_niceness": "0"},
    )
    try:
        deadline = time.monotonic() + 90
        while not _port_open(p):
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Ray head did not start (log: {log.name})")
            time.sleep(0.5)
        yield f"127.0.0.1:{p}"
    finally:
        # a driver still connected when the head goes would end this pytest process 60 s later
        # (Ray: "Failed to connect to GCS ... The program will terminate")
        import ray

        left_connected = ray.is_initialized()
        if left_connected:
            ray.shutdown()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(timeout=3)  # idle, it exits in ~2 s; after this test it hung 10-30 s
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)
        log.close()
    assert not left_connected, "the launcher left its Ray driver connected after aclose"


def _config(address: str, tmp_path: Path) -> Any:
    if not is_dev_model(MODEL_DIR):
        make_dev_model(MODEL_DIR, "tiny")
    data = {
        **DEFAULT_CPU_CONFIG,
        "model": {"name": "tiny", "path": str(MODEL_DIR), "max_model_len_tokens": 4096},
        "engines": {
            "launcher": "ray",
            "ray": {
                "address": address,
                "count": 2,
                "gpus_per_instance": 0,
                "cpus_per_instance": 1,
                "kv_cache_bytes": 64 * 1024 * 1024,
                "vllm_args": ["--max-num-seqs", "16"],
                "poll_interval_s": 0.5,
                "drain_timeout_s": 30,
                "startup_timeout_s": 300,
                "port_range": [GCS_PORT + 40, GCS_PORT + 49],
            },
        },
        "pools": {
            "agent": {"classes": ["agent"], "share": {"initial_frac": 0.5}},
            "normal": {"classes": ["normal"], "share": {"initial_frac": 0.5}},
        },
        "router": {
            "ledger_path": str(tmp_path / "ledger.sqlite"),
            "state_path": str(tmp_path / "state.json"),
            "scrape_interval_s": 0.5,
        },
    }
    return parse_config(data)


def _engine_tree(url: str) -> list[psutil.Process]:
    """The vLLM server listening at `url`'s port and its descendants (`VLLM::EngineCore`)."""
    port = url.rsplit(":", 1)[1]
    for proc in psutil.process_iter(["cmdline"]):
        argv = proc.info["cmdline"] or []
        if "--port" in argv[:-1] and argv[argv.index("--port") + 1] == port:
            with contextlib.suppress(psutil.Error):
                return [proc, *proc.children(recursive=True)]
    raise AssertionError(f"no engine process listens on port {port}")


def _running(procs: list[psutil.Process], until_s: float = 0.0) -> list[str]:
    """Those of `procs` still running (not zombies), once none is or at monotonic `until_s`."""
    while True:
        out = []
        for p in procs:
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(f"{p.pid} {' '.join(p.cmdline())[:80]}")
        if not out or time.monotonic() >= until_s:
            return out
        time.sleep(0.2)


async def _ask(client: httpx.AsyncClient, cls: str) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return await client.post(
        "/v1/chat/completions", json=body, headers={"x-gpupool-class": cls}, timeout=120
    )


async def _index_fills_over_tcp(client: httpx.AsyncClient, gateway: Any) -> None:
    """engines.kv_events (on for ray): each engine publishes on TCP at ports its actor picked,
    and the router's index of each fills from a prompt longer than a block."""
    cache = gateway.prefix_cache
    assert cache is not None, "no Ray engine reported where it publishes KV events"
    assert sorted(cache.engines) == ["ray-engine-0", "ray-engine-1"]
    for instance_id, events in cache.engines.items():
        state = gateway.fleet.get(instance_id)
        host = state.spec.url.removeprefix("http://").rsplit(":", 1)[0]  # the actor's node
        assert events.spec.endpoint.startswith(f"tcp://{host}:"), events.spec
    long = " ".join(f"word{i}" for i in range(400))  # some full blocks at any block size
    for cls in ("agent", "normal"):
        body = {"model": "tiny", "messages": [{"role": "user", "content": long}], "max_tokens": 2}
        resp = await client.post(
            "/v1/chat/completions", json=body, headers={"x-gpupool-class": cls}, timeout=120
        )
        assert resp.status_code == 200, resp.text
    for events in cache.engines.values():
        async with asyncio.timeout(30):  # a deadline for a hung test, not a speed bound
            await events.wait_for(lambda e: len(e.index.keys) > 0)
    print({i: len(e.index.keys) for i, e in cache.engines.items()}, "blocks indexed over TCP")


async def test_ray_engines_serve_and_a_killed_actor_is_restarted_and_readmitted(
    ray_cluster: str, tmp_path: Path
) -> None:
    config = _config(ray_cluster, tmp_path)
    seed_vllm_flags(Path(tempfile.gettempdir()) / "gpupool-ray")  # the actors' run_dir
    launcher = make_launcher(config)
    assert isinstance(launcher, RayLauncher)
    instances = await launcher.start()
    assert sorted(i.instance_id for i in instances) == ["ray-engine-0", "ray-engine-1"]
    assert launcher.source is not None
    gateway = create_app(config, instances, source=launcher.source)
    await gateway.start()
    transport = httpx.ASGITransport(app=gateway)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            for _ in range(100):
                if all(s.healthy for s in gateway.fleet):
                    break
                await asyncio.sleep(0.1)
            served = {}
            for cls in ("agent", "normal"):
                resp = await _ask(client, cls)
                assert resp.status_code == 200, resp.text
                served[cls] = resp.headers["x-gpupool-instance"]
            assert sorted(served.values()) == ["ray-engine-0", "ray-engine-1"]  # one pool each
            await _index_fills_over_tcp(client, gateway)

            victim = gateway.fleet.get("ray-engine-0")
            assert victim is not None
            old_url = victim.spec.url
            victim_pool = next(c for c, i in served.items() if i == "ray-engine-0")
            other_pool = next(c for c in served if c != victim_pool)

            old_engine = _engine_tree(old_url)
            assert any("EngineCore" in " ".join(p.cmdline()) for p in old_engine), old_engine
            # niceness 0 on the engines (Ray's default is 15): the fixture's RAY_worker_niceness,
            # and the actor sets itself back to 0 before it starts its engine
            assert {p.nice() for p in old_engine} == {0}, [(p.pid, p.nice()) for p in old_engine]
            ray.kill(launcher.actors[0], no_restart=False)  # Ray restarts it (max_restarts -1)
            killed_at = time.monotonic()

            # traffic goes on: the other pool's requests all succeed; the victim's pool's
            # requests wait (queue) or fail only if they had started on the dead engine
            # (the restarted actor's engine may listen at the old address: the old engine is
            # gone, its port free again)
            results: list[tuple[str, int, str | None]] = []
            out_s = readmitted_s = None
            while time.monotonic() - killed_at < 240:
                resp = await _ask(client, other_pool)
                results.append(
                    (other_pool, resp.status_code, resp.headers.get("x-gpupool-instance"))
                )
                state = gateway.fleet.get("ray-engine-0")
                in_rotation = state is not None and state.healthy
                if not in_rotation and out_s is None:
                    out_s = time.monotonic() - killed_at
                if in_rotation and out_s is not None:
                    readmitted_s = time.monotonic() - killed_at
                    break
                await asyncio.sleep(0.5)
            assert out_s is not None, "ray-engine-0 never left rotation after its actor died"
            assert readmitted_s is not None, "ray-engine-0 was not readmitted within 240 s"
            assert all(code == 200 for _, code, _ in results), results
            # the killed actor's engine tree is gone: its reaper saw the actor die (a poll),
            # gave the engine its stop grace, then killed what was left
            # (any valid port: only the stop grace is read)
            ray_engines = config.engines.ray
            grace_s = engine_settings(
                ray_engines, port=ray_engines.port_range[0], run_dir=tmp_path
            ).stop_grace_s
            left = await asyncio.to_thread(
                _running, old_engine, until_s=killed_at + OWNER_POLL_S + grace_s + 5
            )
            assert not left, left

            resp = await _ask(client, victim_pool)  # the restarted engine serves its pool again
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-gpupool-instance"] == "ray-engine-0"
            changes = {
                c: gateway.metrics.registry.get_sample_value(
                    "gpupool_fleet_changes_total", {"change": c}
                )
                for c in ("moved", "leaving", "joined")
            }
            print(
                f"ray-engine-0 out of rotation {out_s:.1f} s and readmitted {readmitted_s:.1f} s"
                f" after its actor was killed ({changes}); {len(results)} requests to the other"
                " pool meanwhile, all 200"
            )
    finally:
        await gateway.aclose()
        await launcher.aclose()
