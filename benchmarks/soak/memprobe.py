"""Where the router's memory grows under the soak's mix: the gateway in this process (called
through httpx's ASGI transport), one fake engine subprocess, tracemalloc snapshots after each
phase of `--units` work units (a third agent runs of 4 steps with a fresh run id, the rest
chat requests), and the allocation sites that grew most, first to last and over the last phase.

    flock /tmp/gpupool-heavy.lock .venv/bin/python -m benchmarks.soak.memprobe --phases 4
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

import httpx

from benchmarks.soak.run import AGENT_STEPS, _words
from pools.config import parse_config
from pools.launchers.base import InstanceSpec
from router.gateway.app import create_app

REPO = Path(__file__).resolve().parents[2]
_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


async def _chat(client: httpx.AsyncClient, rng: random.Random) -> None:
    body = {
        "model": "tiny",
        "max_tokens": 8,
        "stream": True,
        "messages": [{"role": "user", "content": _words(rng, rng.randint(30, 90))}],
    }
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text


async def _agent(client: httpx.AsyncClient, rng: random.Random) -> None:
    run_id = uuid.uuid4().hex
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": _words(rng, 120)},
        {"role": "user", "content": _words(rng, 40)},
    ]
    for _ in range(AGENT_STEPS):
        body = {"model": "tiny", "max_tokens": 8, "stream": True, "messages": messages}
        resp = await client.post(
            "/v1/chat/completions",
            json={**body, "tools": [_TOOL]},
            headers={"x-gpupool-run-id": run_id},
        )
        assert resp.status_code == 200, resp.text
        messages += [
            {"role": "assistant", "content": _words(rng, 8)},
            {"role": "user", "content": _words(rng, 40)},
        ]


async def _phase(client: httpx.AsyncClient, units: int, rng: random.Random) -> None:
    limit = asyncio.Semaphore(8)

    async def unit(i: int) -> None:
        async with limit:
            await (_agent(client, rng) if i % 3 == 0 else _chat(client, rng))

    await asyncio.gather(*(unit(i) for i in range(units)))


async def probe(args: argparse.Namespace, engine_url: str, workdir: Path) -> None:
    config = parse_config(
        {
            "model": {"name": "tiny", "path": str(REPO / ".gpupool/models/tiny")},
            "engines": {"launcher": "static", "static": {"urls": [engine_url]}},
            "pools": {
                "agent": {"classes": ["agent"], "share": {"initial_frac": 0.5}},
                "normal": {"classes": ["normal"], "share": {"initial_frac": 0.5}},
            },
            "router": {
                "ledger_path": str(workdir / "ledger.sqlite"),
                "state_path": str(workdir / "state.json"),
            },
        },
        base_dir=REPO,
    )
    spec = InstanceSpec(instance_id="engine-0", url=engine_url, gpus=1, api_key=None)
    gateway = create_app(config, [spec])
    await gateway.start()
    await asyncio.sleep(2)
    rng = random.Random(1)
    transport = httpx.ASGITransport(app=gateway)
    async with httpx.AsyncClient(transport=transport, base_url="http://r", timeout=60) as client:
        await _phase(client, 300, rng)  # warm-up, before tracing
        gc.collect()
        tracemalloc.start(12)
        snaps = [tracemalloc.take_snapshot()]
        for k in range(args.phases):
            started = time.monotonic()
            await _phase(client, args.units, rng)
            gc.collect()
            snaps.append(tracemalloc.take_snapshot())
            traced, _ = tracemalloc.get_traced_memory()
            print(
                f"phase {k}: {time.monotonic() - started:.1f} s, traced {traced / 2**20:.2f} MiB,"
                f" tasks {len(asyncio.all_tasks())}",
                flush=True,
            )
        for label, a, b in (("first->last", 0, -1), ("last phase", -2, -1)):
            print(f"== growth {label}")
            for stat in snaps[b].compare_to(snaps[a], "traceback")[: args.top]:
                print(f"{stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+7d} objects")
                for line in stat.traceback.format()[-6:]:
                    print("      ", line)
    await gateway.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--phases", type=int, default=4)
    parser.add_argument("--units", type=int, default=1500, help="work units per phase")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--engine-port", type=int, default=8771)
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="gpupool-memprobe-"))
    engine = subprocess.Popen(
        [sys.executable, "-m", "pools.testing.fake_engine", "--port", str(args.engine_port)],
        cwd=REPO,
    )
    try:
        time.sleep(2)
        asyncio.run(probe(args, f"http://127.0.0.1:{args.engine_port}", workdir))
    finally:
        engine.terminate()
        engine.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
