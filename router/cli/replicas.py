"""`gpupool up|serve --replicas N` (or `router.replicas: N`): N router processes on one port.

This process starts the engines (`up`; `serve` finds them running), then N router processes
(multiprocessing's `forkserver`: one fresh interpreter imports the router once, and each
router is forked from it, with no event loop or thread of this process's), each listening on
`router.host:router.port` with SO_REUSEPORT, so the kernel spreads new connections over
them and one machine's cores serve more than one core's worth of requests. This process binds
the N listening sockets and hands router i the i-th; it keeps its own copy of each, so a
router's socket outlives the router: connections the kernel queued there for a router that
died (`kill -9`) are not reset with it, they wait for the router started again in its place
(otherwise each socket has its own accept queue, and a dying router's queued connections
would be reset, not handed to the others, unless the host sets `net.ipv4.tcp_migrate_req`).
They share the budgets, slots, ledger and rebalancer through the PostgreSQL store
(`check-config` refuses more than one without `store.url`); each is a replica of its own
(`host:pid:random`, named in the `x-gpupool-replica` header of every response it writes).
With `router.metrics_port`, router i also listens on `metrics_port + i` for /metrics and the
operators' paths only (router/cli/stack.py), a socket this process binds and keeps as it keeps
the shared port's, so each router's metrics are scraped on a port of its own, across restarts.

Supervision: a router that exits while the others serve (a crash, `kill -9`) is started
again, unless it failed before serving (then everything stops, exit 1). Ctrl-C or SIGTERM:
every router gets SIGTERM and finishes its requests within `router.shutdown_grace_s`; one
still running after that (and 5 s more) is killed; then the engines stop. Each router is told
by the kernel to die with its parent, the fork server (PR_SET_PDEATHSIG), which exits when this
process does, so a `kill -9` of this process leaves no router running (the engines of `up` are
then left, as with one router).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.synchronize
import signal
import socket
import sys
import time

from pools.config import Config
from pools.launchers import InstanceSpec, Launcher, LauncherError, make_launcher
from router.cli.stack import (
    Replica,
    bind_listener,
    instances_without_launching,
    metrics_url,
    run_router,
    say,
    start_engines,
    stop_on_signals,
)
from router.ops.tracing.logs import configure_logging

__all__ = ["supervise"]

_POLL_S = 0.1  # how often the supervisor looks at its routers
_KILL_AFTER_S = 5.0  # past shutdown_grace_s, a router still running is killed
_START_TIMEOUT_S = 120.0  # a router that serves nothing after this is a failed start
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when its parent dies (elsewhere: nothing)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _router_main(
    config: Config,
    instances: list[InstanceSpec],
    ready: multiprocessing.synchronize.Event,
    sock: socket.socket,
    metrics_sock: socket.socket | None,
) -> None:
    """One router process (forked by the fork server), listening on `sock` (and, with a
    metrics port, on `metrics_sock`)."""
    _die_with_parent()
    configure_logging(config.router.log_format, config.router.log_level)
    gc.collect()
    gc.freeze()
    replica = Replica(instances, ready.set, sock, metrics_sock)
    sys.exit(run_router(config, launch=False, replica=replica))


class _Router:
    """One router process, when it started, and the listening sockets of its place (this
    process's copies: they stay open across the router's restarts; `close_listener()` at the
    end): the shared port's and, with `router.metrics_port`, its own metrics port
    (`metrics_port + index`)."""

    def __init__(
        self, ctx: multiprocessing.context.ForkServerContext, index: int, config: Config
    ) -> None:
        self.index = index
        rc = config.router
        self.sock: socket.socket | None = bind_listener(rc.host, rc.port, reuse_port=True)
        self.metrics_port = None if rc.metrics_port is None else rc.metrics_port + index
        self.metrics_sock: socket.socket | None = None
        if self.metrics_port is not None:
            try:
                self.metrics_sock = bind_listener(
                    rc.host, self.metrics_port, what="router.metrics_port"
                )
            except LauncherError:
                self.close_listener()
                raise
        self.ready = ctx.Event()
        self._ctx, self._config = ctx, config
        self.proc: multiprocessing.context.ForkServerProcess | None = None
        self.started_at_s = 0.0
        self.served = False

    def start(self, instances: list[InstanceSpec]) -> None:
        self.ready.clear()
        self.served = False
        self.proc = self._ctx.Process(
            target=_router_main,
            args=(self._config, instances, self.ready, self.sock, self.metrics_sock),
            name=f"gpupool-router-{self.index}",
        )
        self.proc.start()
        self.started_at_s = time.monotonic()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def exited(self) -> int | None:
        """Its exit code (negative: the signal), None while it runs."""
        return None if self.proc is None else self.proc.exitcode

    def close_listener(self) -> None:
        """Close this process's copies of the sockets: once the router closes its own, the
        ports no longer send it connections."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.metrics_sock is not None:
            self.metrics_sock.close()
            self.metrics_sock = None

    def where(self, host: str) -> str:
        """`router i (pid P)`, with its metrics address when it has one."""
        said = f"router {self.index} (pid {self.pid})"
        if self.metrics_port is not None:
            said += f": metrics at {metrics_url(host, self.metrics_port)}"
        return said


def _how(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"code {code}"


async def _stop_all(routers: list[_Router], grace_s: float) -> None:
    """SIGTERM every router, wait up to `grace_s`, SIGKILL what is left, reap all."""
    for router in routers:
        router.close_listener()
    running = [r.proc for r in routers if r.proc is not None and r.proc.exitcode is None]
    for proc in running:
        proc.terminate()
    deadline = time.monotonic() + grace_s
    pending = running
    while pending and (left_s := deadline - time.monotonic()) > 0:
        sentinels = [p.sentinel for p in pending]
        await asyncio.to_thread(multiprocessing.connection.wait, sentinels, left_s)
        pending = [p for p in pending if p.exitcode is None]
    for proc in running:
        if proc.exitcode is None:
            say(f"router {proc.name} (pid {proc.pid}) did not stop in {grace_s:g} s: killed")
            proc.kill()
    for router in routers:
        if router.proc is not None:
            await asyncio.to_thread(router.proc.join)
            router.proc.close()
            router.proc = None


async def _wait_ready(routers: list[_Router], stop: asyncio.Event) -> str | None:
    """None once every router serves; else why not (one exited, a timeout, a stop)."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not all(r.ready.is_set() for r in routers):
        for router in routers:
            code = router.exited()
            if code is not None:
                return f"router {router.index} exited ({_how(code)}) before serving"
        if stop.is_set():
            return "interrupted"
        if time.monotonic() > deadline:
            return f"the routers did not all serve within {_START_TIMEOUT_S:g} s"
        await asyncio.sleep(_POLL_S)
    for router in routers:
        router.served = True
    return None


async def _watch(
    routers: list[_Router], instances: list[InstanceSpec], stop: asyncio.Event, host: str
) -> int:
    """Until `stop`: start again a router that exits after having served; exit 1 when one
    exits before serving (its start failed: so would the next)."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), _POLL_S)
        for router in routers:
            if not router.served and router.ready.is_set():
                router.served = True
            code = router.exited()
            if code is None or stop.is_set():
                continue
            if not router.served:
                say(f"router {router.index} exited ({_how(code)}) before serving: stopping")
                return 1
            say(
                f"router {router.index} (pid {router.pid}) exited ({_how(code)}): starting it again"
            )
            if router.proc is not None:
                router.proc.close()
            router.start(instances)
            if router.metrics_port is not None:
                say(f"{router.where(host)} (started again)")
    return 0


async def supervise(config: Config, *, launch: bool) -> int:
    """Run `config.router.replicas` routers (and, with `launch`, the engines) until SIGINT or
    SIGTERM. Returns the exit code."""
    stop = stop_on_signals()
    rc = config.router
    launcher: Launcher | None = None
    routers: list[_Router] = []
    try:
        if launch:
            launcher = make_launcher(config, progress=say)
            instances = await start_engines(launcher, stop)
            if instances is None:
                return 130
        else:
            instances = instances_without_launching(config)
        ctx = multiprocessing.get_context("forkserver")
        # the router's modules, imported once by the fork server, not by each router
        ctx.set_forkserver_preload([__name__, "router.gateway.app"])
        for i in range(rc.replicas):  # one at a time: a failed bind leaves the others to close
            routers.append(_Router(ctx, i, config))
        for router in routers:
            router.start(instances)
        why = await _wait_ready(routers, stop)
        if why is not None:
            say(f"error: {why}" if why != "interrupted" else "interrupted while starting")
            return 130 if why == "interrupted" else 1
        pids = ", ".join(str(r.pid) for r in routers)
        say(f"OpenAI base URL: http://{rc.host}:{rc.port}/v1   (model {config.model.name!r})")
        for router in routers:
            if router.metrics_port is not None:
                say(router.where(rc.host))
        say(f"{rc.replicas} routers on port {rc.port} (pids {pids}); press Ctrl-C to stop")
        code = await _watch(routers, instances, stop, rc.host)
        say("shutting down")
        return code
    except LauncherError as err:
        say(f"error: {err}")
        return 1
    finally:
        await _stop_all(routers, rc.shutdown_grace_s + _KILL_AFTER_S)
        if routers:
            say("routers stopped")
        if launcher is not None:
            await launcher.aclose()
            say("engines stopped")
