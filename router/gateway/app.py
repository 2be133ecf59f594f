"""`create_app(config, instances)`: every router component built in one place and passed in.

The returned `Gateway` is the ASGI app and the composition root. The generation endpoints go
straight to the `CompletionsHandler` (raw ASGI, the hot path), and the engine calls without
admission to `EngineCalls`; everything else is a small FastAPI app: `/health`, `/ready` and
`/v1/models` here, and each feature's routes registered by the feature itself
(`router.ops.routes`, `router.rebalancer.routes`, `router.governance.routes`,
`router.accounting.routes`), given the components they read. Lifecycle is explicit:
`await gateway.start()` opens the upstream session and starts telemetry, `await
gateway.aclose()` stops them; the ASGI lifespan calls both, and tests may call them directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Coroutine, Hashable
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from gpu_probe.nvml import NvmlApi
from gpu_probe.sampler import GpuSampler
from kvcache_model import KVCacheModelError, LatencyPrior, gpu_spec, load_geometry
from pools.config import Config
from pools.discovery import DiscoveryLoop, EngineSource
from pools.launchers.base import InstanceSpec
from pools.operating_point import OperatingPoint, TpotLine
from pools.telemetry import TelemetryScraper
from router.accounting import routes as accounting_routes
from router.accounting.accountant import Accountant, with_restored
from router.accounting.ledger import Ledger
from router.accounting.metrics import AccountingMetrics
from router.accounting.observer import AccountingObserver
from router.admission.estimate import TokenEstimator
from router.admission.membership import Membership
from router.admission.picking import RunAffinity
from router.admission.queueing import RunUsage
from router.admission.shared_reservations import SharedReservations
from router.core import build_core
from router.errors import (
    BadRequest,
    GpupoolError,
    MethodNotAllowed,
    NoHealthyInstance,
    NotFound,
    Unauthorized,
    error_for_status,
)
from router.gateway.engine_calls import EngineCalls
from router.gateway.protocols import ADAPTERS, MessagesAdapter, ResponsesAdapter
from router.gateway.proxy import CompletionsHandler
from router.gateway.response_placement import ResponsePlacement
from router.gateway.upstream import Upstream
from router.governance import GovernanceMetrics, Governor
from router.governance import routes as governance_routes
from router.governance.store import GovernanceStore
from router.identity import OperatorAccess, Tenants
from router.ops import routes as ops_routes
from router.ops.history import History, reading_from
from router.ops.openapi import openapi_document
from router.ops.pools_view import PoolsView
from router.prefix import ChatPrompt, PrefixCache
from router.prefix.lookup import PrefixLookup
from router.rebalancer import routes as rebalancer_routes
from router.rebalancer.store import DecisionLog
from router.request import Message, Receive, RequestObserver, Scope, Send
from router.runtable import RunTable
from router.settlement import Settlement
from router.store import Stores

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from router.ops.tracing.tracer import Tracing

__all__ = ["Gateway", "create_app"]

log = logging.getLogger(__name__)

_PRIOR_CONTEXT_TOKENS = 2048  # context at which the roofline prior's TPOT line is drawn
_UPSTREAM_KEEPALIVE_S = 60.0  # an idle pooled connection to an engine is closed after this


class _Component(Protocol):
    async def start(self) -> None: ...
    async def aclose(self) -> None: ...


async def _start(stack: contextlib.AsyncExitStack, component: _Component) -> None:
    """Start `component`; once started, its `aclose` is the next thing `stack` undoes."""
    await component.start()
    stack.push_async_callback(component.aclose)


class Gateway:
    """The router: an ASGI app with an explicit start/aclose lifecycle."""

    def __init__(
        self,
        config: Config,
        instances: list[InstanceSpec],
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        estimator: TokenEstimator | None = None,
        observers: list[RequestObserver] | None = None,
        scrape: bool = True,
        nvml: NvmlApi | None = None,
        source: EngineSource | None = None,
        prefix_lookup: PrefixLookup | None = None,
    ) -> None:
        """`prefix_lookup`: how a chat prompt's cached prefix is found per instance (default:
        from the engines' KV events and the model's chat template; tests pass one over a
        fake index)."""
        self.config = config
        self.clock = clock
        self.tenants = Tenants.from_config(config.tenants)
        rc = config.router
        # everything kept per run (home, attained service, step numbers, span): one bound
        self.runs = RunTable()
        # the ledger, governance, SRE settings and decisions: embedded SQLite files, or one
        # PostgreSQL database shared by router replicas (router/store)
        self.stores = Stores.from_config(config)
        # fleet, pool map, affinity, picker, admitter, rebalancer: wired as the simulator
        # wires them (router/core.py)
        core = build_core(
            config,
            instances,
            clock,
            rng or random.Random(),
            affinity=RunAffinity(runs=self.runs),
            run_usage=self._run_usage,
            decision_log=DecisionLog(
                self.stores.rebalancer, retention_days=config.rebalancer.decision_log_retention_days
            ),
        )
        self.metrics, self.fleet, self.pool_map = core.metrics, core.fleet, core.pool_map
        self.affinity, self.picker = core.affinity, core.picker
        self.admitter, self.rebalancer = core.admitter, core.rebalancer
        max_num_seqs = core.max_num_seqs
        shares = {p.name: p.share.initial_frac for p in config.pools}
        self.accountant = Accountant(runs=self.runs)
        self.estimator = estimator or TokenEstimator.from_config(config)
        self.accounting_metrics = AccountingMetrics(self.metrics.registry)
        self.ledger = Ledger.from_config(
            rc,
            snapshot_source=lambda: self.accountant.conservation(self.clock()),
            runs=self.runs,
            store=self.stores.ledger,
        )
        self.gpu_sampler = GpuSampler(registry=self.metrics.registry, nvml=nvml)
        # budgets and run states survive a restart: in the store
        self.governor = Governor(
            config,
            GovernanceMetrics(self.metrics.registry),
            clock=clock,
            store=GovernanceStore(self.stores.governance),
            replica_id=self.rebalancer.replica,  # one name per router process
        )
        # other router replicas' KV and batch reservations on each engine (shared store only)
        self.admitter.peers = SharedReservations.for_store(
            self.stores.governance,
            self.fleet,
            self.rebalancer.replica,
            self.admitter.schedule_pump,
            interval_s=config.store.admission_interval_s,
            registry=self.metrics.registry,
            attained_runs=self.admitter.attained_runs,  # run_las's attained service, shared
        )
        self.accounting_observer = AccountingObserver(
            self.accountant, self.ledger, self.accounting_metrics, clock=clock
        )
        # traces (router.ops.tracing), when observability.otlp_endpoint is set
        self.tracing = _tracing(config, self.runs, clock, self.metrics.registry)
        if self.tracing is not None:
            observers = [*(observers or []), self.tracing.observer]
        # a request's end and a run's end, after dispatch: meter, governance, ledger, learners
        self.settlement = Settlement(
            accounting=self.accounting_observer,
            governance=self.governor,
            ledger=self.ledger,
            runs=self.runs,
            estimator=self.estimator,
            affinity=self.affinity,
            metrics=self.metrics,
            signals=self.rebalancer.signals,
            observers=observers,
            clock=clock,
        )
        self.governor.on_run_end = self.settlement.run_ended
        self.governor.on_home = self.affinity.adopt  # a run's home from the shared store
        # engines that come and go (Kubernetes, Ray): the fleet follows `source`
        self.membership = Membership(
            self.fleet,
            self.pool_map,
            self.accountant,
            target_shares=lambda: dict(self.rebalancer.loop_state.shares),
            initial_shares=shares,
            pinned=self.rebalancer.pinned_instances,
            drain_timeout_s=source.drain_timeout_s if source is not None else 0.0,
            registry=self.metrics.registry,
            new_operating_point=lambda: OperatingPoint(max_num_seqs=max_num_seqs),
            on_join=self._instance_joined,
            on_gone=self.metrics.forget_instance,
            clock=clock,
        )
        self.discovery = (
            DiscoveryLoop(source, self._instances_found) if source is not None else None
        )
        self._scrape = scrape
        self.session: aiohttp.ClientSession | None = None
        self.upstream: Upstream | None = None  # the proxy's client to the engines
        self.scraper: TelemetryScraper | None = None
        self.handler: CompletionsHandler | None = None
        self.engine_calls: EngineCalls | None = None
        # where each stored response lives (previous_response_id): in the store
        self.placement = ResponsePlacement(self.stores.responses)
        self.max_model_len_tokens: int | None = config.model.max_model_len_tokens
        # what each engine's prefix cache holds, from its KV events (router/prefix)
        # (a discovering launcher's engines that publish join later: `_instances_found`)
        kv_events = [s for s in instances if s.kv_events is not None]
        follows = bool(kv_events) or (source is not None and config.engines.kv_events_on)
        self.prefix_cache = PrefixCache(kv_events, clock=clock) if follows else None
        # a chat prompt's token ids as vLLM renders them, to look it up there (placement)
        chat_prompt = (
            ChatPrompt.from_model_dir(config.model.path) if self.prefix_cache is not None else None
        )
        self.prefix_lookup = prefix_lookup or (
            PrefixLookup(self.prefix_cache, chat_prompt)
            if self.prefix_cache is not None and chat_prompt is not None
            else None
        )
        # what operators read: GET /admin/pools, /ready, the gauges of GET /metrics
        self.ops_view = PoolsView(
            config,
            self.fleet,
            self.pool_map,
            self.admitter,
            self.rebalancer,
            self.metrics,
            clock=clock,
            prefix_cache=self.prefix_cache,
        )
        # the last hour for the status page's plots (GET /admin/history)
        self.history = History(lambda: reading_from(self.pools_view(), self.metrics.registry))
        self.api = self._build_api()
        self._stack: contextlib.AsyncExitStack | None = None  # the started components' closes

    # ------------------------------------------------------------------ lifecycle

    @property
    def started(self) -> bool:
        return self._stack is not None

    async def start(self) -> None:
        """Start the components in dependency order. Each one's close goes on an exit stack as
        soon as its start succeeds: a start that raises closes what had started, in reverse
        order, and raises; `aclose` is the reverse of `start`. No-op when started."""
        if self._stack is not None:
            return
        async with contextlib.AsyncExitStack() as stack:
            await self._start_components(stack)
            self._stack = stack.pop_all()

    async def _start_components(self, stack: contextlib.AsyncExitStack) -> None:
        rc = self.config.router
        now = self.clock()
        allocation = self.pool_map.current
        for state in self.fleet:
            iid = state.spec.instance_id
            self.accountant.add_instance(
                iid, float(state.spec.gpus), dict(allocation.pools_of(iid)), now
            )
        self.pool_map.on_change(self._shares_changed)
        await asyncio.to_thread(self.stores.open)
        stack.push_async_callback(asyncio.to_thread, self.stores.close)
        for component in (
            self.rebalancer,
            self.ledger,
            self.gpu_sampler,
            self.governor,
            self.placement,
        ):
            await _start(stack, component)
        if self.admitter.peers is not None:  # after the governor: its migrations hold the table
            await _start(stack, self.admitter.peers)
        if self.tracing is not None:
            await _start(stack, self.tracing)
        self._seed_operating_points()
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",)
        )
        stack.push_async_callback(self.session.close)
        self.upstream = Upstream(keepalive_s=_UPSTREAM_KEEPALIVE_S)
        stack.push_async_callback(self.upstream.aclose)
        self.scraper = TelemetryScraper(
            self.fleet,
            self.session,
            interval_s=rc.scrape_interval_s,
            timeout_s=rc.scrape_timeout_s,
            clock=self.clock,
        )
        if self._scrape:
            await _start(stack, self.scraper)
        if self.discovery is not None:
            await _start(stack, self.discovery)
        if self.prefix_cache is not None:
            await _start(stack, self.prefix_cache)
        self.handler = CompletionsHandler(
            config=self.config,
            tenants=self.tenants,
            fleet=self.fleet,
            admitter=self.admitter,
            estimator=self.estimator,
            settlement=self.settlement,
            upstream=self.upstream,
            metrics=self.metrics,
            clock=self.clock,
            governor=self.governor,
            placement=self.placement,
            tracing=self.tracing,
            prefix_lookup=self.prefix_lookup,
        )
        self.engine_calls = EngineCalls(
            config=self.config,
            tenants=self.tenants,
            fleet=self.fleet,
            admitter=self.admitter,
            session=self.session,
            metrics=self.metrics,
            placement=self.placement,
            clock=self.clock,
            tracing=self.tracing,
        )
        if self.tenants.open:
            log.warning("no API keys configured: the router is open to anyone who can reach it")
        await _start(stack, self.history)

    def _seed_operating_points(self) -> None:
        """On a known GPU, start each instance's operating point from the roofline prior
        (`kvcache_model.LatencyPrior`) as a line TPOT(n) = a + b·n through its predictions at
        batch 1 and 64 for a context of `_PRIOR_CONTEXT_TOKENS`; measurements replace it."""
        spec_name = next((d.spec_name for d in self.gpu_sampler.devices if d.spec_name), None)
        if spec_name is None:
            return
        try:
            prior = LatencyPrior(
                load_geometry(self.config.model.path),
                gpu_spec(spec_name),
                tensor_parallel_size=self.config.engines.gpus_per_instance,
            )
            one = prior.tpot_s(1, _PRIOR_CONTEXT_TOKENS)
            many = prior.tpot_s(64, _PRIOR_CONTEXT_TOKENS)
        except KVCacheModelError as err:
            log.info("no roofline prior for the operating point: %s", err)
            return
        slope = (many - one) / 63
        line = TpotLine(one - slope, slope)
        for state in self.fleet:
            state.op.prior = line
        log.info(
            "operating point prior on %s: TPOT %.1f ms + %.3f ms per running sequence",
            spec_name,
            line.intercept_s * 1e3,
            line.slope_s * 1e3,
        )

    async def aclose(self) -> None:
        """Close what `start` started, in reverse order. Idempotent."""
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    def _run_usage(self, run_key: Hashable, now_s: float) -> RunUsage | None:
        """A run's attained service for `queue.order: run_las`: the accountant's, plus what
        the run had before the router's last restart (the governance store keeps it)."""
        live = self.accountant.run_usage(run_key, now_s)
        if not isinstance(run_key, tuple) or len(run_key) != 2:
            return live
        tenant, run_id = run_key
        return with_restored(live, self.governor.restored_service(tenant, run_id))

    def _instances_found(self, specs: list[InstanceSpec]) -> None:
        """One whole answer of the discovery loop: the fleet and the KV event subscribers
        follow it (a Ray engine restarted elsewhere publishes at its new ports)."""
        self.membership.reconcile(specs)
        if self.prefix_cache is not None:
            self.prefix_cache.follow(specs)

    def _instance_joined(self, instance_id: str) -> None:
        self.metrics.instance_joined(instance_id)
        if self.scraper is not None:
            self.scraper.track(instance_id)

    def _shares_changed(self, allocation: Any) -> None:
        now = self.clock()
        for state in self.fleet:
            iid = state.spec.instance_id
            self.accountant.set_shares(iid, dict(allocation.pools_of(iid)), now)

    # ------------------------------------------------------------------ ASGI

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _basic_credentials_on_a_change(scope):
            # a browser sends the status page's Basic credentials with any request to this
            # origin, a cross-site form's POST too: they may read, never change (CSRF)
            err = Unauthorized(
                "Basic credentials only read (the status page, GET); send "
                "`Authorization: Bearer <key>` to change anything",
                "basic_read_only",
            )
            await _error_response(err, scope["path"])(scope, receive, send)
            return
        if scope["type"] == "http" and self.handler is not None:
            path = scope["path"]
            method = scope["method"]
            if method == "POST" and (adapter := ADAPTERS.get(path)) is not None:
                await self.handler(scope, receive, send, adapter=adapter)
                return
            calls = self.engine_calls
            if calls is not None and path.startswith("/v1/"):
                if method == "POST" and path == "/v1/messages/count_tokens":
                    await calls.count_tokens(scope, receive, send, _MESSAGES)
                    return
                response_id, cancel = _response_path(path)
                if response_id is not None and method == ("POST" if cancel else "GET"):
                    await calls.response(
                        scope, receive, send, _RESPONSES, response_id, cancel=cancel
                    )
                    return
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        await self.api(scope, receive, send)

    def hot_route(
        self, scope: Scope, receive: Receive, send: Send
    ) -> Coroutine[Any, Any, None] | None:
        """The handler's coroutine for a POST to a generation endpoint, exactly what
        `__call__` awaits for it, for gpupool's server (router/gateway/server.py) to
        run as the request's task itself: a frame fewer on every wake-up of every request.
        None for anything else (`__call__` serves it)."""
        handler = self.handler
        if handler is None or scope["method"] != "POST":
            return None
        adapter = ADAPTERS.get(scope["path"])
        if adapter is None or _basic_credentials_on_a_change(scope):
            return None
        return handler(scope, receive, send, adapter=adapter)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message: Message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.start()
                except Exception as err:
                    await send({"type": "lifespan.startup.failed", "message": str(err)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ------------------------------------------------------------------ the API

    def pools_view(self) -> dict[str, Any]:
        """`GET /admin/pools` (router.ops.pools_view.PoolsView)."""
        return self.ops_view.view()

    def _refresh_metrics(self) -> None:
        """Every gauge `GET /metrics` exports, set now."""
        self.ops_view.refresh_gauges()
        self.governor.refresh_gauges()
        self.accounting_metrics.update(self.accountant.conservation(self.clock()))

    def _build_api(self) -> FastAPI:
        api = FastAPI(
            title="gpupool",
            docs_url=None,
            redoc_url=None,
            openapi_url=None,
            redirect_slashes=False,  # `/v1/runs/` is an unknown path (404), not a 307
        )
        access = OperatorAccess.from_config(self.tenants, self.config.router)

        # Every error answers OpenAI's shape (Anthropic's under /v1/messages); routing's own
        # 404/405 and validation too.
        @api.exception_handler(GpupoolError)
        async def _gpupool_error(request: Request, err: GpupoolError) -> Response:
            return _error_response(err, request.url.path)

        @api.exception_handler(HTTPException)
        async def _http_error(request: Request, err: HTTPException) -> Response:
            return _error_response(_framework_error(request, err), request.url.path)

        @api.exception_handler(RequestValidationError)
        async def _validation_error(request: Request, err: RequestValidationError) -> Response:
            return _error_response(BadRequest(_validation_message(err), "invalid_request"))

        @api.exception_handler(Exception)
        async def _internal_error(request: Request, err: Exception) -> Response:
            # the server logs the exception; the client learns nothing of the internals
            return _error_response(GpupoolError("internal error", "internal_error"))

        @api.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @api.get("/ready")
        async def ready() -> Response:
            view = self.pools_view()
            not_ready = [p for p, v in view["pools"].items() if v["healthy_instances"] == 0]
            body = {"ready": not not_ready, "pools_without_healthy_instance": not_ready}
            return JSONResponse(body, status_code=503 if not_ready else 200)

        @api.get("/v1/models")
        async def models(request: Request) -> dict[str, Any]:
            self.tenants.caller(request.headers)
            entry: dict[str, Any] = {
                "id": self.config.model.name,
                "object": "model",
                "created": 0,
                "owned_by": "gpupool",
            }
            if self.max_model_len_tokens is not None:
                entry["max_model_len"] = self.max_model_len_tokens
            return {"object": "list", "data": [entry]}

        # each feature's own routes
        ops_routes.register(
            api,
            access,
            document=openapi_document(self.config, access),
            pools=self.ops_view,
            refresh_metrics=self._refresh_metrics,
            registry=self.metrics.registry,
            history=self.history,
            gpu_sampler=self.gpu_sampler,
        )
        rebalancer_routes.register(api, access, self.rebalancer)
        governance_routes.register(
            api, access, self.tenants, self.governor, config_source=self.config.source
        )
        accounting_routes.register(
            api,
            access,
            self.tenants,
            self.ledger,
            live=lambda: self.accountant.conservation(self.clock()),
            session=self.governor.session,
        )

        # The Gateway serves these itself once started; declared here so that another
        # method on them answers 405 (an unknown path answers 404 through _http_error).
        @api.post("/v1/chat/completions")
        @api.post("/v1/completions")
        @api.post("/v1/responses")
        @api.post("/v1/messages")
        @api.post("/v1/messages/count_tokens")
        @api.get("/v1/responses/{response_id}")
        @api.post("/v1/responses/{response_id}/cancel")
        async def not_started() -> Response:
            raise NoHealthyInstance("the router has not started yet", "not_started")

        return api


_MESSAGES = MessagesAdapter()
_RESPONSES = ResponsesAdapter()


def _response_path(path: str) -> tuple[str | None, bool]:
    """(response id, cancel) of `/v1/responses/{id}` and `/v1/responses/{id}/cancel`."""
    if not path.startswith("/v1/responses/"):
        return None, False
    rest = path[len("/v1/responses/") :]
    cancel = rest.endswith("/cancel")
    if cancel:
        rest = rest[: -len("/cancel")]
    if not rest or "/" in rest:
        return None, False
    return rest, cancel


def _tracing(
    config: Config, runs: RunTable, clock: Callable[[], float], registry: CollectorRegistry
) -> Tracing | None:
    """The router's tracer when `observability.otlp_endpoint` is set, else None (and the
    OpenTelemetry SDK is not even imported)."""
    if config.observability.otlp_endpoint is None:
        return None
    from router.ops.tracing.tracer import Tracing

    return Tracing(config.observability, runs=runs, clock=clock, registry=registry)


def create_app(
    config: Config,
    instances: list[InstanceSpec],
    **kwargs: Any,
) -> Gateway:
    """Build the router for `config` over `instances` (from a launcher)."""
    return Gateway(config, instances, **kwargs)


# ---------------------------------------------------------------------------------------------
# Error responses of the API above
# ---------------------------------------------------------------------------------------------


def _basic_credentials_on_a_change(scope: Scope) -> bool:
    """A request other than GET/HEAD whose Authorization header is `Basic ...`."""
    if scope["method"] in ("GET", "HEAD"):
        return False
    for name, value in scope["headers"]:
        if name == b"authorization":
            return bool(value[:6].lower() == b"basic ")
    return False


def _error_response(err: GpupoolError, path: str = "") -> Response:
    """`err` in the shape of the API `path` belongs to (Anthropic's under /v1/messages)."""
    adapter = _MESSAGES if path.startswith("/v1/messages") else _RESPONSES
    status, body, headers = adapter.error_response(err)
    return Response(
        body,
        status_code=status,
        media_type="application/json",
        headers={k.decode(): v.decode() for k, v in headers},
    )


def _framework_error(request: Request, err: HTTPException) -> GpupoolError:
    """Routing's own errors (an unknown path, a method the path does not take) as ours."""
    path = request.url.path
    if err.status_code == 404:
        return NotFound(f"{path[:200]} is not served by gpupool", "unknown_endpoint")
    if err.status_code == 405:
        return MethodNotAllowed(
            f"{request.method} is not allowed on {path[:200]}",
            "method_not_allowed",
            allow=(err.headers or {}).get("Allow"),
        )
    return error_for_status(err.status_code, str(err.detail), "http_error")


def _validation_message(err: RequestValidationError) -> str:
    problems = []
    for item in err.errors()[:5]:
        where = ".".join(str(p) for p in item.get("loc", ())) or "request"
        problems.append(f"{where}: {item.get('msg', 'invalid')}")
    return "; ".join(problems) or "invalid request"
