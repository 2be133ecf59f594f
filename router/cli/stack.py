"""Running the stack in one process: engines (optional), the router behind gpupool's own HTTP
server (router/gateway/server.py), and a clean shutdown on Ctrl-C or SIGTERM (requests in
flight finish within `router.shutdown_grace_s`) that stops every engine this process started.

Every response names the router process that answered it (`x-gpupool-replica: host:pid:random`,
the replica id the store's leases and slots carry). With `router.metrics_port` the router also
listens there for its operators' paths only (`METRICS_PORT_PATHS`: /metrics, /health, /ready,
/admin/*, the status page), so a scraper reads each router replica on its own port.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass

from pools.config import Config
from pools.launchers import (
    DiscoveringLauncher,
    InstanceSpec,
    Launcher,
    LauncherError,
    make_launcher,
)
from pools.launchers.engine_args import local_kv_events
from pools.launchers.static import static_instances
from router.ops.tracing.logs import configure_logging

__all__ = [
    "METRICS_PORT_PATHS",
    "REPLICA_HEADER",
    "Replica",
    "bind_listener",
    "instances_without_launching",
    "metrics_url",
    "run_blocking",
    "run_router",
    "run_stack",
    "say",
    "start_engines",
    "stop_on_signals",
]

log = logging.getLogger(__name__)
# how long an idle client connection stays open (see `run_stack`)
CLIENT_KEEP_ALIVE_S = 75
# the response header naming the router replica that answered (on every response)
REPLICA_HEADER = b"x-gpupool-replica"
# what the metrics port answers (router.metrics_port): the operators' reads and commands of
# this one router process; the client API stays on router.port
METRICS_PORT_PATHS = ("/metrics", "/health", "/ready", "/admin/", "/ui", "/ui/")


def say(message: str) -> None:
    print(f"gpupool: {message}", file=sys.stderr, flush=True)


def instances_without_launching(config: Config) -> list[InstanceSpec]:
    """The engines `gpupool serve` expects to find already running, with the key they require
    when the config names one (`engines.<launcher>.api_key_env`)."""
    engines = config.engines
    if engines.launcher == "static":  # each where its entry in engines.static.kv_events says
        return static_instances(engines.static, kv_events=engines.kv_events_on)
    if engines.launcher == "local":
        local = engines.local
        urls = [f"http://{local.host}:{local.base_port + i}" for i in range(local.count)]
        key = local.api_key
    else:
        raise LauncherError(f"engines.launcher {engines.launcher!r} is not available")
    # local engines publish KV events where their launcher told them to (engines.kv_events)
    events = engines.kv_events_on
    return [
        InstanceSpec(
            instance_id=f"engine-{i}",
            url=url,
            gpus=engines.gpus_per_instance,
            api_key=key,
            kv_events=local_kv_events(engines.local, i) if events else None,
        )
        for i, url in enumerate(urls)
    ]


def bind_listener(
    host: str, port: int, *, reuse_port: bool = False, what: str = "router.port"
) -> socket.socket:
    """A listening socket; `reuse_port`: one of several router processes on the same port
    (SO_REUSEPORT: the kernel spreads new connections over them). `what`: the setting that
    names the port, for the error."""
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted connections only for TCP
    # sockets it recognises as such; with proto 0 every keep-alive response waited ~40 ms for
    # the client's delayed ACK (Nagle), measured in benchmarks/results/router_overhead.md.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise LauncherError(
            f"cannot listen on {host}:{port}: {err.strerror} (set {what} in the config)"
        ) from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def metrics_url(host: str, port: int) -> str:
    return f"http://{host}:{port}/metrics"


def _bind_or_close(other: socket.socket, host: str, port: int) -> socket.socket:
    """`bind_listener(host, port)`; when that fails, `other` is closed before it raises."""
    try:
        return bind_listener(host, port, what="router.metrics_port")
    except LauncherError:
        other.close()
        raise


def _banner(config: Config, gateway_view: dict[str, object], host: str, port: int) -> None:
    say(f"OpenAI base URL: http://{host}:{port}/v1   (model {config.model.name!r})")
    if config.router.metrics_port is not None:
        url = metrics_url(host, config.router.metrics_port)
        say(f"metrics (and /health, /ready, /admin/*): {url}")
    pools = gateway_view.get("pools", {})
    assert isinstance(pools, dict)
    for name, view in pools.items():
        share = view["share_frac"]
        instances = ", ".join(
            f"{i} ({f:.0%})" if f < 1 else i for i, f in view["instances"].items()
        )
        say(
            f"pool {name!r} (classes {', '.join(view['classes'])}): {share:.0%} of capacity on "
            f"{instances or 'no instance'}"
        )
    say("press Ctrl-C to stop")


def run_blocking(config: Config, *, launch: bool) -> int:
    """Run the stack on uvloop where installed, else asyncio's loop. Logs at
    `router.log_level` (`gpupool -v` has made it debug) in `router.log_format`.
    With `router.replicas` > 1, this process supervises that many router processes
    (router/cli/replicas.py)."""
    configure_logging(config.router.log_format, config.router.log_level)
    if config.router.replicas > 1:
        from router.cli.replicas import supervise

        return asyncio.run(supervise(config, launch=launch))
    return run_router(config, launch=launch)


_GC_YOUNG_THRESHOLD = 10_000  # allocations between young collections (default 700)


def run_router(config: Config, *, launch: bool, replica: Replica | None = None) -> int:
    """`run_stack` on uvloop where installed (logging configured by the caller)."""
    # Everything is imported by now: keep those objects (~65k) out of the cyclic GC's scans.
    # Measured: CPU per proxied request 282 -> 261 us (benchmarks/results/router_overhead.md).
    gc.collect()
    gc.freeze()
    # A young-generation collection every 700 allocations (CPython's default) scans what the
    # requests in flight hold, and the survivors it promotes set off full collections: ~6 % of
    # the router's CPU at c=64 (perf: gc_collect_main, visit_decref). Every 10,000 it is ~2 %;
    # per-request objects die by reference count long before that, so memory barely moves.
    gc.set_threshold(_GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    stack = run_stack(config, launch=launch, replica=replica)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(stack)
    return uvloop.run(stack)


def stop_on_signals() -> asyncio.Event:
    """An event SIGINT or SIGTERM sets (handled on the running loop)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def start_engines(launcher: Launcher, stop: asyncio.Event) -> list[InstanceSpec] | None:
    """The launcher's engines once started; None when `stop` was set first (the engines
    started so far are stopped). Raises `LauncherError`."""
    start = asyncio.ensure_future(launcher.start())
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({start, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if not start.done():
        say("interrupted while engines were starting; stopping them")
        start.cancel()
        with contextlib.suppress(asyncio.CancelledError, LauncherError):
            await start
        return None
    stopper.cancel()
    return start.result()


@dataclass(frozen=True, slots=True)
class Replica:
    """How one of several router processes runs (router/cli/replicas.py): over `instances`
    its supervisor knows (neither launched nor followed here), on a port the others share
    (SO_REUSEPORT); `ready` is called once it serves, instead of printing the banner.
    `sock`: the listening socket its supervisor bound and keeps open for this router's place
    (a router started again after a crash accepts what queued there meanwhile); None: bind
    one here. `metrics_sock`: likewise, this place's own metrics port (`router.metrics_port`
    + its index); None: none."""

    instances: list[InstanceSpec]
    ready: Callable[[], None]
    sock: socket.socket | None = None
    metrics_sock: socket.socket | None = None


async def run_stack(config: Config, *, launch: bool, replica: Replica | None = None) -> int:
    """Run until SIGINT/SIGTERM. Returns the exit code. `replica`: one of several routers."""
    # the router's modules, imported here: a replicas' supervisor (router/cli/replicas.py)
    # imports this module and never runs a router itself
    from router.gateway.app import create_app
    from router.gateway.server import PathListener, Server, ServerSettings, StartupFailed

    stop = stop_on_signals()
    rc = config.router
    metrics_sock: socket.socket | None = None
    try:
        sock = (
            replica.sock
            if replica is not None and replica.sock is not None
            else bind_listener(rc.host, rc.port, reuse_port=replica is not None)
        )
        if replica is not None:
            metrics_sock = replica.metrics_sock
        elif rc.metrics_port is not None:
            metrics_sock = _bind_or_close(sock, rc.host, rc.metrics_port)
    except LauncherError as err:
        say(str(err))
        return 1
    try:
        # kubernetes: `serve` too follows the engine groups (there is nothing to launch)
        follows = config.engines.launcher == "kubernetes" and replica is None
        launcher = make_launcher(config, progress=say) if launch or follows else None
    except LauncherError as err:
        say(f"error: {err}")
        sock.close()
        if metrics_sock is not None:
            metrics_sock.close()
        return 1
    try:
        if replica is not None:
            instances = replica.instances
        elif launcher is not None:
            started = await start_engines(launcher, stop)
            if started is None:
                return 130
            instances = started
        else:
            instances = instances_without_launching(config)
        source = launcher.source if isinstance(launcher, DiscoveringLauncher) else None
        gateway = create_app(config, instances, source=source)
        server = Server(
            gateway,
            ServerSettings(
                head_timeout_s=rc.head_timeout_s,
                max_head_bytes=rc.max_header_bytes,
                # longer than clients keep idle connections (httpx 5 s, aiohttp 15 s), so the
                # client closes an idle one first; at uvicorn's 5 s the router closed
                # connections clients were about to reuse (`pools.testing.serve`)
                keep_alive_s=CLIENT_KEEP_ALIVE_S,
                max_connections=rc.max_connections,
            ),
            shutdown_grace_s=rc.shutdown_grace_s,
            # built once: the replica id the store's leases and slots carry
            headers=[(REPLICA_HEADER, gateway.rebalancer.replica.encode("ascii", "replace"))],
        )
        also = [] if metrics_sock is None else [PathListener(metrics_sock, METRICS_PORT_PATHS)]
        try:
            await server.start(sock, also=also)
        except StartupFailed as err:
            log.error("the application's startup failed: %s", err)
            say("the router failed to start")
            return 1
        # What start-up built (~12k objects: the config, the app's components, metrics, the
        # store's connections) lives as long as the router: out of the cyclic GC's scans too,
        # as `run_router` does for what the imports made.
        gc.collect()
        gc.freeze()
        if replica is not None:
            replica.ready()
        else:
            _banner(config, gateway.pools_view(), rc.host, rc.port)
        await stop.wait()
        # stop accepting before saying so: a connection accepted while the router drained
        # would be served
        server.stop_accepting()
        say("shutting down")
        await server.aclose()
        return 0
    except LauncherError as err:
        say(f"error: {err}")
        return 1
    finally:
        if launcher is not None:
            await launcher.aclose()
            say("engines stopped")
        sock.close()
        if metrics_sock is not None:
            metrics_sock.close()
