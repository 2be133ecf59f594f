"""The server layer alone, with numbers: one trivial ASGI app (read the body, answer a fixed
~300-byte JSON, what the fake engine answers a non-streaming request) behind

- `gpupool-server`: gpupool's own server (router/gateway/server.py), configured as `gpupool
  serve` configures it (router/cli/stack.py), the app using `receive` and `send`;
- `gpupool-server-link`: the same, the app taking the body and answering through the
  `ClientLink` as gpupool's request path does (no `receive`, one write);
- with `--baseline PATH`, that checkout's server in the same rounds: `gpupool-server*-baseline`
  where it has router/gateway/server.py, else `uvicorn-gpupool` and `uvicorn-gpupool-link`:
  uvicorn with gpupool's guarded protocol (router/gateway/http_protocol.py before 2026-12-03
  s44, when it was the server);
- `uvicorn-plain`: uvicorn + httptools on uvloop, its defaults (proxy headers on);
- `raw-httptools-task`: the ceiling of a server protocol of our own: an `asyncio.Protocol` fed
  to httptools' parser, each request served by a task running a coroutine that writes the
  answer (what the gateway would need: its handler awaits the engine), no ASGI scope, cycle,
  `receive` or `send`;
- `raw-httptools`: the same with the answer written from the parser's callback (no task):
  the floor, below anything a handler that awaits can reach;
- `granian`: granian's ASGI interface on uvloop, one worker, one runtime thread, when it is
  installed in `.venv-peers/granian` (`pip install granian uvloop`);

each pinned to CPU 1, the load generator (aiohttp, closed loop) on CPU 0, rounds interleaved.
The figure is each server's CPU per request at c=64: what the HTTP server costs gpupool before
its own code runs. (issue 28: "consider the server layer with numbers, not taste")

`python -m benchmarks.router_overhead.servers [--rounds 3] [--window-s 2.5] [--baseline PATH]`
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
BODY = (
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
    await send({"type": "http.response.body", "body": BODY})


_HEADERS = [(b"content-type", b"application/json")]


async def link_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """`app` as gpupool's request path answers: the body taken and the response written
    through the scope's `ClientLink` (router/gateway/http_protocol.py), `receive`/`send` only
    where it says so."""
    from router.gateway.http_protocol import CLIENT_LINK

    link = scope.get(CLIENT_LINK)
    if link is None or link.take_body() is None or not link.respond(200, _HEADERS, BODY):
        await app(scope, receive, send)


_UVICORN_GPUPOOL = """
import asyncio, socket, uvicorn, uvloop
from router.gateway.http_protocol import guarded_protocol
from benchmarks.router_overhead.servers import {app} as app
sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", {port})); sock.listen(2048); sock.setblocking(False)
config = uvicorn.Config(app, log_level="warning", access_log=False, proxy_headers=False,
    server_header=False, lifespan="off", timeout_keep_alive=75,
    http=guarded_protocol(head_timeout_s=30.0, max_head_bytes=65536))
uvloop.run(uvicorn.Server(config).serve(sockets=[sock]))
"""

# as `gpupool serve` (router/cli/stack.py) starts it: with the constant header naming the
# replica on every answer, where the checkout's server writes one (s46 on)
_GPUPOOL_SERVER = """
import asyncio, inspect, socket, uvloop
from router.gateway.server import Server, ServerSettings
from benchmarks.router_overhead.servers import {app} as app
sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", {port})); sock.listen(2048); sock.setblocking(False)
replica = [(b"x-gpupool-replica", b"bench-host:12345:0123456789abcdef")]
constant = dict(headers=replica) if "headers" in inspect.signature(Server).parameters else {{}}
async def main():
    server = Server(app, ServerSettings(head_timeout_s=30.0, max_head_bytes=65536,
        keep_alive_s=75.0, max_connections=4096), **constant)
    await server.start(sock)
    await asyncio.Event().wait()
uvloop.run(main())
"""

_RAW_HTTPTOOLS = """
import asyncio, socket, httptools, uvloop
from benchmarks.router_overhead.servers import BODY
ANSWER = (b"HTTP/1.1 200 OK\\r\\ncontent-type: application/json\\r\\ncontent-length: %d\\r\\n\\r\\n"
          % len(BODY)) + BODY
TASK = {task}

class Proto(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)
        self.loop = asyncio.get_running_loop()
    def data_received(self, data):
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()
    def on_message_begin(self):
        self.url = b""; self.headers = []; self.body = []
    def on_url(self, url): self.url += url
    def on_header(self, name, value): self.headers.append((name.lower(), value))
    def on_body(self, body): self.body.append(body)
    def on_message_complete(self):
        if TASK:
            self.loop.create_task(self.serve(b"".join(self.body)))
        else:
            self.transport.write(ANSWER)
    async def serve(self, body):
        self.transport.write(ANSWER)

async def main():
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", {port})); sock.listen(2048); sock.setblocking(False)
    server = await loop.create_server(Proto, sock=sock)
    await server.serve_forever()
uvloop.run(main())
"""


def _servers(repo: Path, baseline: Path | None = None) -> dict[str, tuple[list[str], Path]]:
    """Each server's command line and the checkout it runs from (its PYTHONPATH)."""
    py = str(repo / ".venv" / "bin" / "python")
    granian = repo / ".venv-peers" / "granian" / "bin" / "granian"
    out = {
        "gpupool-server": [py, "-c", _GPUPOOL_SERVER.format(port=_PORT, app="app")],
        "gpupool-server-link": [py, "-c", _GPUPOOL_SERVER.format(port=_PORT, app="link_app")],
        "uvicorn-plain": [
            *(py, "-m", "uvicorn", "benchmarks.router_overhead.servers:app"),
            *("--port", str(_PORT), "--http", "httptools", "--loop", "uvloop"),
            *("--no-access-log", "--log-level", "warning", "--lifespan", "off"),
        ],
        "raw-httptools-task": [py, "-c", _RAW_HTTPTOOLS.format(port=_PORT, task=True)],
        "raw-httptools": [py, "-c", _RAW_HTTPTOOLS.format(port=_PORT, task=False)],
    }
    if granian.exists():
        out["granian"] = [
            *(str(granian), "--interface", "asgi", "--loop", "uvloop", "--workers", "1"),
            *("--runtime-threads", "1", "--port", str(_PORT), "--no-ws"),
            *("--log-level", "warning", "benchmarks.router_overhead.servers:app"),
        ]
    servers = {name: (argv, repo) for name, argv in out.items()}
    if baseline is not None:  # gpupool's server as that checkout has it, the same apps
        if (baseline / "router" / "gateway" / "server.py").exists():
            for name in ("gpupool-server", "gpupool-server-link"):
                servers[name + "-baseline"] = (out[name], baseline)
        else:
            for name, app in (("uvicorn-gpupool", "app"), ("uvicorn-gpupool-link", "link_app")):
                servers[name] = ([py, "-c", _UVICORN_GPUPOOL.format(port=_PORT, app=app)], baseline)
    return servers


async def _round(name: str, argv: list[str], repo: Path, window_s: float) -> tuple[float, float]:
    # `repo`: the checkout the server runs from (its cwd and PYTHONPATH)
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


async def _run(
    rounds: int, window_s: float, repo: Path, baseline: Path | None
) -> dict[str, list[tuple[float, float]]]:
    servers = _servers(repo, baseline)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in servers}
    names = list(servers)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order
            argv, checkout = servers[name]
            results[name].append(await _round(name, argv, checkout, window_s))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.router_overhead.servers")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--window-s", type=float, default=2.5)
    p.add_argument("--repo", type=Path, default=Path.cwd())
    p.add_argument(
        "--baseline",
        type=Path,
        help="another checkout: its gpupool server also runs, in the same rounds (uvicorn with "
        "gpupool's protocol where it has no router/gateway/server.py; the apps are that "
        "checkout's benchmarks/router_overhead/servers.py's)",
    )
    args = p.parse_args(argv)
    from benchmarks.router_overhead.procs import pin_self

    if (os.cpu_count() or 1) >= 2:
        pin_self(frozenset({0}), -10)
    import uvloop

    baseline = args.baseline.resolve() if args.baseline else None
    results = uvloop.run(_run(args.rounds, args.window_s, args.repo.resolve(), baseline))
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
