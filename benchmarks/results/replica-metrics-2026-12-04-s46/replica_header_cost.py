"""What `x-gpupool-replica` costs per request (issue 25): gpupool's server as the router runs it,
in three forms, rounds interleaved (the order rotated each round), each pinned to CPU 1 with
the load generator (aiohttp, closed loop, c=64) on CPU 0, through
`benchmarks.router_overhead.servers`' own round (CPU µs per request of the server process,
requests/s):

- `before`: the server of the checkout `--before` (no constant headers at all);
- `after-none`: this checkout's server without headers (`Server(..., headers=())`);
- `after-replica`: this checkout's server with the router's header, as router/cli/stack.py
  builds it (`x-gpupool-replica: <host>:<pid>:<6 hex>`);

each with both of that module's apps: `link` (the answer written through the `ClientLink`, as
the generation endpoints answer) and `asgi` (`send`, as every other route answers).

`--micro`: instead, the server's own code for one answer in this process, no socket: a
request head fed to a connection, its `ClientLink.respond` (what the generation endpoints
write), in blocks of 20,000 alternating with and without the header; ns per request.

    python benchmarks/results/replica-metrics-2026-12-04-s46/replica_header_cost.py \
        --before /tmp/wt-before [--rounds 5 --window-s 2.5]
    python benchmarks/results/replica-metrics-2026-12-04-s46/replica_header_cost.py \
        --micro [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
from pathlib import Path

from benchmarks.router_overhead.procs import pin_self
from benchmarks.router_overhead.servers import _GPUPOOL_SERVER, _PORT, _round

_OLD_END = "max_connections=4096))"
_HEADER = f"{socket.gethostname()}:{os.getpid()}:a1b2c3"
_NEW_END = f"max_connections=4096), headers=[(b'x-gpupool-replica', {_HEADER.encode()!r})])"


def _variants(python: str, here: Path, before: Path) -> dict[str, tuple[list[str], Path]]:
    out: dict[str, tuple[list[str], Path]] = {}
    for app, fn in (("link", "link_app"), ("asgi", "app")):
        plain = _GPUPOOL_SERVER.format(port=_PORT, app=fn)
        assert _OLD_END in plain
        out[f"{app}-before"] = ([python, "-c", plain], before)
        out[f"{app}-after-none"] = ([python, "-c", plain], here)
        out[f"{app}-after-replica"] = ([python, "-c", plain.replace(_OLD_END, _NEW_END)], here)
    return out


async def _run(
    variants: dict[str, tuple[list[str], Path]], rounds: int, window_s: float
) -> dict[str, list[tuple[float, float]]]:
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            argv, checkout = variants[name]
            results[name].append(await _round(name, argv, checkout, window_s))
            print(f"round {r + 1} {name}: {results[name][-1][0]:.1f} us", file=sys.stderr)
    return results


class _Sink:
    """A transport that keeps the last write only."""

    last = b""

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name)

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        self.last = data

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _micro(rounds: int, block: int = 20_000) -> dict[str, list[float]]:
    """ns per request head parsed and answered through `ClientLink.respond`, per round."""
    import asyncio
    import time

    from router.gateway.http_protocol import CLIENT_LINK
    from router.gateway.server import Server, ServerSettings, _Connection, _ServerState
    from router.gateway.server import _header_lines as header_lines

    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\ncontent-length: 2\r\n\r\n{}"
    answer_headers = [(b"content-type", b"application/json")]
    body = b'{"id":"x","choices":[]}' * 10

    async def never(scope: object, receive: object, send: object) -> None:
        return None

    async def one(lines: bytes) -> float:
        loop = asyncio.get_running_loop()
        state = _ServerState(never, ServerSettings(), lines)
        conn = _Connection(state, loop)
        sink = _Sink()
        conn.connection_made(sink)  # type: ignore[arg-type]
        conn._serve = lambda exchange, app: None  # type: ignore[method-assign]
        started = time.perf_counter_ns()
        for _ in range(block):
            conn.data_received(head)
            exchange = conn.exchange
            assert exchange is not None
            link = exchange.scope[CLIENT_LINK]
            link.take_body()
            assert link.respond(200, answer_headers, body)
        elapsed_ns = time.perf_counter_ns() - started
        assert sink.last.startswith(b"HTTP/1.1 200 OK\r\ndate: ") and lines in sink.last
        return elapsed_ns / block

    replica = [(b"x-gpupool-replica", _HEADER.encode())]
    Server(never, ServerSettings(), headers=replica)  # the header as the router builds it
    out: dict[str, list[float]] = {"respond-none": [], "respond-replica": []}
    for r in range(rounds):
        order = [("respond-none", b""), ("respond-replica", header_lines(replica))]
        for name, lines in order if r % 2 == 0 else order[::-1]:
            out[name].append(asyncio.run(one(lines)))
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--before", type=Path, help="the checkout before the header")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--window-s", type=float, default=2.5)
    p.add_argument("--micro", action="store_true")
    args = p.parse_args()
    if args.micro:
        print("| variant | ns per request: median (min-max; rounds) |")
        print("| --- | --- |")
        for name, ns in _micro(args.rounds).items():
            each = ", ".join(f"{n:.0f}" for n in ns)
            print(f"| {name} | {statistics.median(ns):.0f} ({min(ns):.0f}-{max(ns):.0f}; {each}) |")
        return 0
    if args.before is None:
        p.error("--before is needed (or --micro)")
    here = Path(__file__).resolve().parents[3]
    python = str(here / ".venv" / "bin" / "python")
    if (os.cpu_count() or 1) >= 2:
        pin_self(frozenset({0}), -10)
    import uvloop

    variants = _variants(python, here, args.before.resolve())
    results = uvloop.run(_run(variants, args.rounds, args.window_s))
    print("| server | CPU µs per request at c=64: median (min-max; rounds) | req/s (median) |")
    print("| --- | --- | --- |")
    for name, rows in results.items():
        cpus = [c for c, _ in rows]
        rates = [q for _, q in rows]
        each = ", ".join(f"{c:.1f}" for c in cpus)
        print(
            f"| {name} | {statistics.median(cpus):.1f} ({min(cpus):.1f}-{max(cpus):.1f};"
            f" {each}) | {statistics.median(rates):,.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
