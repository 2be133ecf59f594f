"""Benchmark: router throughput with 1 vs N router processes (`gpupool serve --replicas N`) on
fake engines, every router on one PostgreSQL store (issue 25: 2 routers >= 1.6x of 1).

    .venv/bin/python -m benchmarks.replicas_throughput --postgres-url URL --password-env VAR
        [--replicas 1,2] [--engines 2] [--requests 3000] [--concurrency 64] [--rounds 2]

Each round runs every replica count in turn over the same fake engines (one process each,
`python -m pools.testing.fake_engine`, no delays): `gpupool serve --replicas N`, 200 warm-up
requests, then `--requests` non-streaming chat completions (8 tokens) from `--concurrency`
keep-alive connections (aiohttp, this process), and prints completed requests per second. The
load generator, the engines, the routers and PostgreSQL share the machine's CPUs: on a small
machine the result is theirs together, so the load average is printed beside it, and the
cores each role used while the load ran (routers, fake engines, PostgreSQL, this load
generator, other processes: other sessions' work), from /proc. Use a database of its own (the
routers migrate it and write their ledger there).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from pools.testing.router_process import RouterProcess

MODEL = Path(__file__).resolve().parents[1] / ".gpupool" / "models" / "tiny"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _config(folder: Path, engines: list[str], url: str, password_env: str) -> Path:
    config = {
        "model": {"name": "tiny", "path": str(MODEL)},
        "engines": {"launcher": "static", "static": {"urls": engines}},
        "pools": {"normal": {"classes": ["normal", "agent"], "share": {"initial_frac": 1.0}}},
        "router": {"state_path": str(folder / "state.json"), "log_level": "warning"},
        "store": {"url": url, "password_env": password_env},
    }
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return path


async def _load(url: str, requests: int, concurrency: int) -> tuple[int, int, float]:
    """(ok, failed, seconds) for `requests` sent by `concurrency` workers."""
    left = requests
    ok = failed = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal left, ok, failed
            while left > 0:
                left -= 1
                try:
                    async with session.post(f"{url}/v1/chat/completions", json=BODY) as r:
                        await r.read()
                        ok, failed = (ok + 1, failed) if r.status == 200 else (ok, failed + 1)
                except aiohttp.ClientError:
                    failed += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return ok, failed, time.perf_counter() - started


ROLES = ("routers", "engines", "postgres", "load generator", "other")


def _role(pid: int, cmdline: bytes, comm: str) -> str:
    if pid == os.getpid():
        return "load generator"
    if b"pools.testing.fake_engine" in cmdline:
        return "engines"
    if comm.startswith("postgres") or cmdline.startswith(b"postgres"):
        return "postgres"
    if b"gpupool" in cmdline:
        return "routers"
    return "other"


def cpu_by_pid() -> dict[int, tuple[str, float]]:
    """Each live process's role and the CPU seconds (user + system) it has used (Linux /proc:
    its threads included, its exited children not)."""
    tick = os.sysconf("SC_CLK_TCK")
    used: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        comm, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
        fields = rest.split()
        # after the comm: state is field 3, utime 14 and stime 15 (1-based in proc(5))
        pid = int(entry.name)
        used[pid] = (_role(pid, cmdline, comm), (int(fields[11]) + int(fields[12])) / tick)
    return used


def cores_by_role(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], took_s: float
) -> dict[str, float]:
    """Cores each role used between two `cpu_by_pid` samples `took_s` apart (processes alive
    at both)."""
    cores = dict.fromkeys(ROLES, 0.0)
    for pid, (role, cpu_s) in after.items():
        if pid in before:
            cores[role] += (cpu_s - before[pid][1]) / took_s
    return cores


async def _one(config: Path, replicas: int, args: argparse.Namespace, folder: Path) -> float:
    router = RouterProcess(
        config, folder / f"router-{replicas}.log", args=["--replicas", str(replicas)]
    )
    try:
        await router.wait_ready_async(120)
        await _load(router.url, 200, args.concurrency)  # warm-up
        before = cpu_by_pid()
        ok, failed, took_s = await _load(router.url, args.requests, args.concurrency)
        after = cpu_by_pid()
    finally:
        router.stop()
    rate = ok / took_s
    load = os.getloadavg()[0]
    print(
        f"replicas {replicas}: {rate:7.0f} req/s ({ok} ok, {failed} failed, {took_s:.1f} s;"
        f" load {load:.1f})",
        flush=True,
    )
    cores = cores_by_role(before, after, took_s)
    print(
        "  cores used: " + ", ".join(f"{role} {cores[role]:.2f}" for role in ROLES),
        flush=True,
    )
    return rate


def _start_engines(count: int) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    engines, urls = [], []
    for _ in range(count):
        port = _free_port()
        argv = [
            "-m",
            "pools.testing.fake_engine",
            "--port",
            str(port),
            "--num-gpu-blocks",
            "100000",
        ]
        engines.append(subprocess.Popen([sys.executable, *argv]))
        urls.append(f"http://127.0.0.1:{port}")
    return engines, urls


async def _rounds(args: argparse.Namespace, urls: list[str]) -> None:
    counts = [int(n) for n in args.replicas.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        config = _config(folder, urls, args.postgres_url, args.password_env)
        rates: dict[int, list[float]] = {n: [] for n in counts}
        for _ in range(args.rounds):
            for n in counts:
                rates[n].append(await _one(config, n, args, folder))
    base = max(rates[counts[0]])
    for n in counts:
        best = max(rates[n])
        print(f"replicas {n}: best {best:.0f} req/s, {best / base:.2f}x of {counts[0]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--postgres-url", required=True)
    parser.add_argument("--password-env", required=True, help="the env var holding the password")
    parser.add_argument("--replicas", default="1,2", help="router process counts, in turn")
    parser.add_argument("--engines", type=int, default=2, help="fake engine processes")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    engines, urls = _start_engines(args.engines)
    try:
        asyncio.run(_rounds(args, urls))
    finally:
        for engine in engines:
            engine.terminate()
        for engine in engines:
            engine.wait(10)


if __name__ == "__main__":
    main()
