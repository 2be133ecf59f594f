"""The server layer alone, with numbers: one trivial ASGI app (read the body, answer a fixed
~300-byte JSON, what the fake engine answers a non-streaming request) behind

- `uvicorn-gpupool`: uvicorn + httptools on uvloop with gpupool's guarded protocol, configured
  as `gpupool serve` configures it (router/cli/stack.py);
- `uvicorn-plain`: uvicorn + httptools on uvloop, its defaults (proxy headers on);
- `granian`: granian's ASGI interface on uvloop, one worker, one runtime thread, when it is
  installed in `.venv-peers/granian` (`pip install granian uvloop`);

each pinned to CPU 1, the load generator (aiohttp, closed loop) on CPU 0, rounds interleaved.
The figure is each server's CPU per request at c=64: what the HTTP server costs gpupool before
its own code runs. (issue 28: "consider the server layer with numbers, not taste")

`python -m benchmarks.router_overhead.servers [--rounds 3] [--window-s 2.5]`
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["main"]
# granian imports this module for `app` in a venv of its own: the harness's imports (aiohttp)
# stay inside the functions that run in gpupool's venv

_PORT = 8570
_BODY = (
    b'{"id":"chatcmpl-fake","object":"chat.completion","created":0,"model":"tiny","choices":'
    b'[{"index":0,"message":{"role":"assistant","content":" tok"},"finish_reason":"length"}],'
    b'"usage":{"prompt_tokens":12,"completion_tokens":1,"total_tokens":13}}'
)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The app every server runs: the body read whole, one fixed answer."""
    if scope["type"] != "http":
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": _BODY})


_UVICORN_GPUPOOL = """
import asyncio, socket, uvicorn, uvloop
from router.gateway.http_protocol import guarded_protocol
from benchmarks.router_overhead.servers import app
sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", {port})); sock.listen(2048); sock.setblocking(False)
config = uvicorn.Config(app, log_level="warning", access_log=False, proxy_headers=False,
    server_header=False, lifespan="off", timeout_keep_alive=75,
    http=guarded_protocol(head_timeout_s=30.0, max_head_bytes=65536))
uvloop.run(uvicorn.Server(config).serve(sockets=[sock]))
"""


def _servers(repo: Path) -> dict[str, list[str]]:
    py = str(repo / ".venv" / "bin" / "python")
    granian = repo / ".venv-peers" / "granian" / "bin" / "granian"
    out = {
        "uvicorn-gpupool": [py, "-c", _UVICORN_GPUPOOL.format(port=_PORT)],
        "uvicorn-plain": [
            *(py, "-m", "uvicorn", "benchmarks.router_overhead.servers:app"),
            *("--port", str(_PORT), "--http", "httptools", "--loop", "uvloop"),
            *("--no-access-log", "--log-level", "warning", "--lifespan", "off"),
        ],
    }
    if granian.exists():
        out["granian"] = [
            *(str(granian), "--interface", "asgi", "--loop", "uvloop", "--workers", "1"),
            *("--runtime-threads", "1", "--port", str(_PORT), "--no-ws"),
            *("--log-level", "warning", "benchmarks.router_overhead.servers:app"),
        ]
    return out


async def _round(name: str, argv: list[str], repo: Path, window_s: float) -> tuple[float, float]:
    """(CPU µs per request, requests per second) of one server over one c=64 window."""
    from benchmarks.router_overhead.load import LoadClient, chat_body
    from benchmarks.router_overhead.procs import start_proc, wait_ready

    workdir = Path(tempfile.mkdtemp(prefix="servers-"))
    proc = start_proc(
        name,
        argv,
        log_dir=workdir,
        cpus=frozenset({1}),
        nice=-5,
        cwd=repo,
        env={"PYTHONPATH": str(repo)},
    )
    try:
        url = f"http://127.0.0.1:{_PORT}"
        body = chat_body(1, stream=False)
        await wait_ready(proc, url + "/v1/chat/completions", timeout_s=30, probe=body)
        client = LoadClient(url)
        try:
            await client.closed_loop(body, 64, 0.5)  # warm-up
            cpu0 = proc.cpu_s()
            res = await client.closed_loop(body, 64, window_s)
            cpu_s = proc.cpu_s() - cpu0
        finally:
            await client.aclose()
        done = len(res.latencies_s)
        return cpu_s / max(done, 1) * 1e6, res.in_window / res.window_s
    finally:
        proc.stop()


async def _run(rounds: int, window_s: float, repo: Path) -> dict[str, list[tuple[float, float]]]:
    servers = _servers(repo)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in servers}
    names = list(servers)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order
            results[name].append(await _round(name, servers[name], repo, window_s))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.router_overhead.servers")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--window-s", type=float, default=2.5)
    p.add_argument("--repo", type=Path, default=Path.cwd())
    args = p.parse_args(argv)
    from benchmarks.router_overhead.procs import pin_self

    if (os.cpu_count() or 1) >= 2:
        pin_self(frozenset({0}), -10)
    import uvloop

    results = uvloop.run(_run(args.rounds, args.window_s, args.repo.resolve()))
    print("| server | CPU µs per request at c=64 (median; rounds) | req/s (median) |")
    print("| --- | --- | --- |")
    for name, rows in results.items():
        cpus = [c for c, _ in rows]
        rates = [q for _, q in rows]
        print(
            f"| {name} | {statistics.median(cpus):.0f} ({', '.join(f'{c:.0f}' for c in cpus)}) "
            f"| {statistics.median(rates):,.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
