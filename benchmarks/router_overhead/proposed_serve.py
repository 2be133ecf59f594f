"""`gpupool serve` with the changes this benchmark proposes applied at run time, so the report
can show their effect side by side with what ships. Not a way to run gpupool: once the changes
land in router/, this target measures the same thing as `gpupool` and can be dropped.

The changes (see benchmarks/results/router_overhead.md):
1. router/stack.py `_bind`: create the listening socket with `proto=IPPROTO_TCP`. asyncio sets
   TCP_NODELAY only on sockets whose `proto` is IPPROTO_TCP; a socket made with
   `socket.socket(AF_INET, SOCK_STREAM)` has proto 0, so every accepted connection kept Nagle's
   algorithm on and each keep-alive response waited for the client's delayed ACK (~40 ms).
2. router/commands/serve.py: run the stack on uvloop (`uvicorn[standard]` already installs it),
   as uvicorn itself does when it owns the loop.

    python -m benchmarks.router_overhead.proposed_serve serve --config FILE --port P
"""

from __future__ import annotations

import asyncio
import socket
import sys

import uvloop

import router.stack
from pools.launchers import LauncherError

__all__ = ["main"]


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise LauncherError(f"cannot listen on {host}:{port}: {err.strerror}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def main() -> int:
    router.stack._bind = _bind
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    from router.cli import main as gpupool_main

    return gpupool_main()


if __name__ == "__main__":
    sys.exit(main())
