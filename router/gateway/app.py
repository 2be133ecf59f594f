"""`create_app(config, instances)`: every router component built in one place and passed in.

The returned `Gateway` is the ASGI app. The two generation endpoints go straight to the
`CompletionsHandler` (raw ASGI, the hot path); everything else (`/v1/models`, `/health`,
`/ready`, `/metrics`, `/admin/...`) is a small FastAPI app. Lifecycle is explicit:
`await gateway.start()` opens the upstream session and starts telemetry, `await
gateway.aclose()` stops them; the ASGI lifespan calls both, and tests may call them directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import aiohttp
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from gpu_probe.nvml import NvmlApi
from gpu_probe.sampler import GpuSampler
from kvcache_model import KVCacheModelError, LatencyPrior, gpu_spec, load_geometry
from pools.config import Config, ConfigError, TenantConfig, contract_problems, load_config
from pools.discovery import DiscoveryLoop, EngineSource
from pools.launchers.base import InstanceSpec
from pools.operating_point import OperatingPoint, TpotLine
from pools.telemetry import TelemetryScraper
from router.accounting.accountant import Accountant, with_restored
from router.accounting.ledger import Ledger
from router.accounting.metrics import AccountingMetrics
from router.accounting.observer import AccountingObserver
from router.admission.estimate import TokenEstimator
from router.admission.membership import Membership
from router.admission.picking import RunAffinity
from router.admission.queueing import RunUsage
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
from router.governance import GovernanceMetrics, Governor
from router.governance.store import GovernanceStore
from router.identity import OperatorAccess, Tenants
from router.ops.history import History, reading_from
from router.ops.openapi import openapi_document
from router.ops.ui import register_ui
from router.rebalancer.routes import register_pools_admin
from router.request import Message, Receive, RequestObserver, Scope, Send
from router.runtable import RunTable
from router.settlement import Settlement

__all__ = ["Gateway", "create_app"]

log = logging.getLogger(__name__)

_PRIOR_CONTEXT_TOKENS = 2048  # context at which the roofline prior's TPOT line is drawn


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
    ) -> None:
        self.config = config
        self.clock = clock
        self.tenants = Tenants.from_config(config.tenants)
        rc = config.router
        # everything kept per run (home, attained service, step numbers, span): one bound
        self.runs = RunTable()
        # fleet, pool map, affinity, picker, admitter, rebalancer: wired as the simulator
        # wires them (router/core.py)
        core = build_core(
            config,
            instances,
            clock,
            rng or random.Random(),
            affinity=RunAffinity(runs=self.runs),
            run_usage=self._run_usage,
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
            rc, snapshot_source=lambda: self.accountant.conservation(self.clock()), runs=self.runs
        )
        self.gpu_sampler = GpuSampler(registry=self.metrics.registry, nvml=nvml)
        # budgets and run states survive a restart: a file next to the ledger
        ledger_path = rc.ledger_path
        self.governor = Governor(
            config,
            GovernanceMetrics(self.metrics.registry),
            clock=clock,
            store=GovernanceStore(ledger_path.with_name(ledger_path.stem + ".governance.sqlite")),
        )
        self.accounting_observer = AccountingObserver(
            self.accountant, self.ledger, self.accounting_metrics, clock=clock
        )
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
            DiscoveryLoop(source, self.membership.reconcile) if source is not None else None
        )
        self._scrape = scrape
        self.session: aiohttp.ClientSession | None = None
        self.scraper: TelemetryScraper | None = None
        self.handler: CompletionsHandler | None = None
        self.engine_calls: EngineCalls | None = None
        # where each stored response lives (previous_response_id): a file next to the ledger
        self.placement = ResponsePlacement(
            ledger_path.with_name(ledger_path.stem + ".responses.sqlite")
        )
        self.max_model_len_tokens: int | None = config.model.max_model_len_tokens
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
        for component in (
            self.rebalancer,
            self.ledger,
            self.gpu_sampler,
            self.governor,
            self.placement,
        ):
            await _start(stack, component)
        self._seed_operating_points()
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",)
        )
        stack.push_async_callback(self.session.close)
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
        self.handler = CompletionsHandler(
            config=self.config,
            tenants=self.tenants,
            fleet=self.fleet,
            admitter=self.admitter,
            estimator=self.estimator,
            settlement=self.settlement,
            session=self.session,
            metrics=self.metrics,
            clock=self.clock,
            governor=self.governor,
            placement=self.placement,
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

    # ------------------------------------------------------------------ the rest of the API

    def pools_view(self) -> dict[str, Any]:
        allocation = self.pool_map.current
        capacity = self.fleet.capacity_gpus()
        pools = {}
        for pool in self.config.pools:
            ids = allocation.instances_for(pool.name)
            pools[pool.name] = {
                "classes": list(pool.classes),
                "share_frac": round(allocation.share_of(pool.name, capacity), 4),
                "floor_frac": pool.share.floor_frac,
                "ceiling_frac": pool.share.ceiling_frac,
                "instances": {i: round(allocation.frac(i, pool.name), 4) for i in ids},
                "healthy_instances": sum(
                    1 for i in ids if (s := self.fleet.get(i)) is not None and s.healthy
                ),
                "slo": {"ttft_p95_ms": pool.slo.ttft_p95_ms, "tpot_p95_ms": pool.slo.tpot_p95_ms},
                "queue": self._queue_view(pool.name),
            }
        instances = {}
        for state in self.fleet:
            r = state.reading
            instances[state.spec.instance_id] = {
                "url": state.spec.url,
                "gpus": state.spec.gpus,
                "healthy": state.healthy,
                "last_error": state.last_error,
                "inflight": state.inflight,
                "pools": dict(allocation.pools_of(state.spec.instance_id)),
                "telemetry_age_s": None if r is None else round(self.fleet.age_s(state) or 0, 3),
                "kv_usage_frac": None if r is None else r.kv_usage_frac,
                "running": None if r is None else r.running,
                "waiting": None if r is None else r.waiting,
                "num_gpu_blocks": None if r is None else r.num_gpu_blocks,
                "kv_capacity": state.kv_capacity,  # known | unknown | None (not reported)
                "block_size": None if r is None else r.block_size,
                "kv_reserved_blocks": state.reserved_blocks,
                "kv_reserved_blocks_by_pool": dict(state.reserved_by_pool),
                "kv_used_blocks": round(state.used_blocks(), 1),
                "running_by_pool": dict(state.running_by_pool),
                "operating_point": {
                    "limit": self.admitter.instance_limit(state),
                    "source": state.op.source,
                    "samples": state.op.samples,
                    "tpot_line_ms": None
                    if (line := state.op.line) is None
                    else {
                        "intercept": round(line.intercept_s * 1e3, 3),
                        "per_sequence": round(line.slope_s * 1e3, 4),
                    },
                },
                "prefill_tokens_per_s": None
                if state.prefill_tokens_per_s is None
                else round(state.prefill_tokens_per_s, 1),
                "preemptions_seen": state.preemptions_seen,
            }
        return {
            "allocation_version": allocation.version,
            "admission": self.config.router.admission,
            "pools": pools,
            "instances": instances,
            "rebalancer": self.rebalancer.view(),
        }

    def _queue_view(self, pool: str) -> dict[str, Any]:
        queue = self.admitter.queues[pool]
        now = self.clock()
        p = self.config.pool(pool)
        return {
            "depth": len(queue),
            "max_depth": p.queue.max_depth,
            "max_wait_s": p.queue.max_wait_s,
            "order": p.queue.order,
            "drain_rate_per_s": round(queue.drain_rate_per_s(now), 3),
        }

    def _refresh_gauges(self) -> None:
        m = self.metrics
        m.asyncio_tasks.set(len(asyncio.all_tasks()))
        allocation = self.pool_map.current
        capacity = self.fleet.capacity_gpus()
        for pool in self.config.pools:
            m.pool_share.labels(pool.name).set(allocation.share_of(pool.name, capacity))
            m.queue_depth(pool.name, len(self.admitter.queues[pool.name]))
        self.rebalancer.refresh_gauges()
        for state in self.fleet:
            iid = state.spec.instance_id
            m.healthy.labels(iid).set(1 if state.healthy else 0)
            m.set_inflight(iid, state.inflight)
            m.kv_reserved.labels(iid).set(state.reserved_blocks)
            m.op_limit.labels(iid).set(self.admitter.instance_limit(state))
            m.set_preemptions(iid, state.preemptions_seen)
            if state.reading is not None:
                if state.reading.num_gpu_blocks is not None:
                    blocks = state.reading.num_gpu_blocks
                    m.kv_capacity.labels(iid).set(blocks)
                    m.kv_measured.labels(iid).set(state.reading.kv_usage_frac * blocks)
                m.kv_usage.labels(iid).set(state.reading.kv_usage_frac)
                m.engine_running.labels(iid).set(state.reading.running)
                m.engine_waiting.labels(iid).set(state.reading.waiting)
                m.telemetry_age.labels(iid).set(self.fleet.age_s(state) or 0.0)

    def _tenant_of(self, request: Request) -> TenantConfig:
        """The calling tenant: `Authorization: Bearer KEY`, or `x-api-key` (Anthropic's
        clients). Raises `Unauthorized`."""
        return self.tenants.authenticate(
            request.headers.get("authorization"), request.headers.get("x-api-key")
        )

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

        document = openapi_document(self.config, access)

        @api.get("/openapi.json")
        async def openapi() -> dict[str, Any]:
            return document

        @api.get("/ready")
        async def ready() -> Response:
            view = self.pools_view()
            not_ready = [p for p, v in view["pools"].items() if v["healthy_instances"] == 0]
            body = {"ready": not not_ready, "pools_without_healthy_instance": not_ready}
            return JSONResponse(body, status_code=503 if not_ready else 200)

        @api.get("/v1/models")
        async def models(request: Request) -> dict[str, Any]:
            self._tenant_of(request)
            entry: dict[str, Any] = {
                "id": self.config.model.name,
                "object": "model",
                "created": 0,
                "owned_by": "gpupool",
            }
            if self.max_model_len_tokens is not None:
                entry["max_model_len"] = self.max_model_len_tokens
            return {"object": "list", "data": [entry]}

        @api.get("/metrics")
        async def metrics(request: Request) -> Response:
            access.authorize_metrics(request.headers.get("authorization"))
            self._refresh_gauges()
            self.accounting_metrics.update(self.accountant.conservation(self.clock()))
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @api.get("/admin/pools")
        async def admin_pools(request: Request) -> dict[str, Any]:
            access.authorize_admin(request.headers.get("authorization"))
            return self.pools_view()

        register_pools_admin(api, access, self.rebalancer)

        @api.get("/admin/history")
        async def admin_history(request: Request) -> dict[str, Any]:
            access.authorize_admin(request.headers.get("authorization"))
            since_s = _float_param(request.query_params.get("since_s"), "since_s")
            return self.history.view(since_s)

        register_ui(api, access)

        @api.get("/admin/gpus")
        async def admin_gpus(request: Request) -> dict[str, Any]:
            access.authorize_admin(request.headers.get("authorization"))
            latest = self.gpu_sampler.latest
            return {
                "object": "gpupool.gpus",
                "snapshot": None if latest is None else latest.to_dict(),
            }

        @api.post("/admin/governance/reload")
        async def governance_reload(request: Request) -> dict[str, Any]:
            """Re-read the config file the router started from and apply its tenants' budgets,
            tiers, cost caps and run guards (for new runs) without dropping a request."""
            access.authorize_admin(request.headers.get("authorization"))
            source = self.config.source
            if not source or source.startswith("<"):
                raise BadRequest(
                    "the router was started without a config file: nothing to reload",
                    "no_config_file",
                )
            try:
                fresh = await asyncio.to_thread(load_config, source)
            except ConfigError as err:
                raise BadRequest("; ".join(err.problems)[:2000], "invalid_config") from None
            problems = contract_problems(fresh)
            if problems:
                raise BadRequest("; ".join(problems)[:2000], "inconsistent_config")
            tenants = self.governor.reload(fresh)
            return {"object": "gpupool.governance_reload", "source": source, "tenants": tenants}

        @api.get("/v1/budget")
        async def budget(request: Request) -> dict[str, Any]:
            tenant = self._tenant_of(request)
            return self.governor.budget(tenant)

        @api.post("/v1/runs/{run_id}/end")
        async def end_run(run_id: str, request: Request) -> dict[str, Any]:
            tenant = self._tenant_of(request)
            run = self.governor.end_run(tenant.name, run_id)
            if run is None:
                raise NotFound(
                    f"no active or recent run {run_id[:64]!r} for tenant {tenant.name!r}",
                    "run_not_found",
                )
            return {
                "object": "gpupool.run_end",
                "run_id": run.run_id,  # a session's id ends its current run, `<session>:<n>`
                "reason": run.ended,
                "steps": run.steps,
                "tokens": run.tokens,
                "gpu_seconds": round(run.gpu_seconds, 6),
            }

        @api.get("/v1/runs/{run_id}")
        async def run_detail(run_id: str, request: Request) -> dict[str, Any]:
            tenant = self._tenant_of(request)
            summary = await self.ledger.run_summary(run_id, tenant.name)
            session = None if summary else self.governor.session(tenant.name, run_id)
            if session is not None:  # a session id: its runs, and its current run's summary
                current = session["current_run"]
                latest = current and await self.ledger.run_summary(current, tenant.name)
                return {**session, "current": latest or None}
            if summary is None:
                raise NotFound(f"no run {run_id!r} for tenant {tenant.name!r}", "run_not_found")
            return summary

        @api.get("/v1/runs")
        async def runs(request: Request) -> dict[str, Any]:
            tenant = self._tenant_of(request)
            q = request.query_params
            since_s = _float_param(q.get("since_s", q.get("since")), "since_s")
            limit = _int_param(q.get("limit"), "limit", default=50, low=1, high=1000)
            data = await self.ledger.list_runs(
                tenant.name, since_s=since_s, limit=limit, class_name=q.get("class")
            )
            return {"object": "list", "data": data}

        @api.get("/admin/accounting")
        async def admin_accounting(request: Request) -> dict[str, Any]:
            access.authorize_admin(request.headers.get("authorization"))
            q = request.query_params
            top = _int_param(q.get("top"), "top", default=10, low=1, high=1000)
            report: dict[str, Any] = await self.ledger.admin_report(
                top_n=top,
                tenant=q.get("tenant"),
                since_s=_float_param(q.get("since_s"), "since_s"),
                live=self.accountant.conservation(self.clock()),
            )
            return report

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


def _float_param(raw: str | None, name: str) -> float | None:
    """A number of magnitude at most 2**53 (SQLite's integers hold it, and it is finite) from a
    query parameter; None when absent. Raises `BadRequest`."""
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not abs(value) <= 2**53:  # nan fails too
        raise BadRequest(
            f"query parameter {name} must be a finite number (at most 2**53 either side of 0),"
            f" got {raw[:40]!r}",
            "invalid_param",
            param=name,
        )
    return value


def create_app(
    config: Config,
    instances: list[InstanceSpec],
    **kwargs: Any,
) -> Gateway:
    """Build the router for `config` over `instances` (from a launcher)."""
    return Gateway(config, instances, **kwargs)


# ---------------------------------------------------------------------------------------------
# Query parameters and error responses of the API above
# ---------------------------------------------------------------------------------------------


def _int_param(raw: str | None, name: str, *, default: int, low: int, high: int) -> int:
    """A whole number in [low, high] from a query parameter (`1e2` is 100); `default` when
    absent. Raises `BadRequest`."""
    value = _float_param(raw, name)
    if value is None:
        return default
    if value != int(value) or not low <= value <= high:
        raise BadRequest(
            f"query parameter {name} must be a whole number from {low} to {high}",
            "invalid_param",
            param=name,
        )
    return int(value)


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
