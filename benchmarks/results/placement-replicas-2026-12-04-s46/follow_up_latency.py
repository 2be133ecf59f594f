"""A Responses API follow-up's latency on the replica that made the previous response (found
in its memory) against another replica (looked up in the store: one SELECT), two routers on
one PostgreSQL database over one fake engine, c=1, paired.

    cd benchmarks/results/placement-replicas-2026-12-04-s46 && \
        PYTHONPATH=../../.. ../../../.venv/bin/python follow_up_latency.py [--pairs N] [--rounds N]

Each pair: a new response through router a (not timed), then its follow-up through a
(`same`) or through b (`other`), the two kinds alternating pair by pair, which router makes
the response alternating round by round; reported: p50 per round and kind, and `other - same`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.store_router_latency import KEYS, PASSWORD_ENV, _config, fake_engine
from pools.testing.router_process import RouterProcess

BODY = {"model": "tiny", "input": "hi", "max_output_tokens": 8}
AUTH = {"authorization": f"Bearer {KEYS['plain']}"}


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    async with session.post(f"{url}/v1/responses", json=body, headers=AUTH) as r:
        data = await r.json()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {data}")
        rid: str = data["id"]
        return rid


async def _measure(urls: list[str], pairs: int, rounds: int) -> list[dict[str, float]]:
    sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) for _ in urls]
    out = []
    try:
        for n in range(-1, rounds):  # round -1: warm-up
            maker = n % 2  # the router that makes the responses this round
            took: dict[str, list[float]] = {"same": [], "other": []}
            for k in range(pairs):
                rid = await _post(sessions[maker], urls[maker], BODY)
                kind = "same" if k % 2 == 0 else "other"
                to = maker if kind == "same" else 1 - maker
                started = time.perf_counter()
                await _post(sessions[to], urls[to], {**BODY, "previous_response_id": rid})
                took[kind].append((time.perf_counter() - started) * 1e3)
            if n >= 0:
                p50 = {kind: statistics.median(v) for kind, v in took.items()}
                p50["load"] = os.getloadavg()[0]
                out.append(p50)
                print(f"round {n + 1}: {p50}", file=sys.stderr, flush=True)
    finally:
        for session in sessions:
            await session.close()
    return out


async def _run(args: argparse.Namespace, url: str, password: str, folder: Path, port: int) -> str:
    env = {**os.environ, PASSWORD_ENV: password}
    for tenant, key in KEYS.items():
        env[f"GPUPOOL_BENCH_{tenant.upper()}_KEY"] = key
    env["GPUPOOL_BENCH_METRICS_KEY"] = "unused-" + "m" * 24
    routers = []
    try:
        for name in ("a", "b"):
            (folder / name).mkdir()
            store = {"url": url, "password_env": PASSWORD_ENV}
            data = _config(folder / name, f"http://127.0.0.1:{port}", store, {})
            config = folder / name / "config.json"
            config.write_text(json.dumps(data))
            routers.append(RouterProcess(config, folder / name / "router.log", env=env))
        for router in routers:
            await router.wait_ready_async(120)
        rows = await _measure([r.url for r in routers], args.pairs, args.rounds)
    finally:
        for router in routers:
            router.stop()
    lines = [
        "| round | follow-up on the same router p50 ms | on the other router p50 ms | other - same"
        " ms | load |",
        "| --- | --- | --- | --- | --- |",
    ]
    for n, row in enumerate(rows, 1):
        lines.append(
            f"| {n} | {row['same']:.3f} | {row['other']:.3f} |"
            f" {row['other'] - row['same']:+.3f} | {row['load']:.1f} |"
        )
    diffs = [row["other"] - row["same"] for row in rows]
    lines.append(
        f"\nmedian of the rounds' other - same: {statistics.median(diffs):+.3f} ms"
        f" (range {min(diffs):+.3f}..{max(diffs):+.3f})"
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--pairs", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    pg = importlib.import_module("tests.postgres")
    with pg.start_postgres() as server, tempfile.TemporaryDirectory() as tmp:
        url = server.create_database("follow_up_latency")
        with fake_engine() as port:
            report = asyncio.run(_run(args, url, pg.PASSWORD, Path(tmp), port))
    print(report)


if __name__ == "__main__":
    main()
