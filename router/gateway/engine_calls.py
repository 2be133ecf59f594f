"""Engine calls that generate nothing, so they skip admission (they hold no KV cache):

- `POST /v1/messages/count_tokens`: forwarded to the least busy healthy instance of the pool
  the request classifies to (any healthy instance when that pool has none);
- `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`: forwarded to the instance that
  stored the response (`router.gateway.response_placement`); an id the router does not know, another
  tenant's, or one whose engine is gone answers 404 `response_not_found`.

Each is authenticated like a generation request, answers errors in its protocol's shape
(Anthropic's on count_tokens), counts in `gpupool_requests_total` under its own `endpoint`, and
with traces on has a server span and an engine span (router.ops.tracing.call_trace).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp

from pools.config import Config
from pools.fleet import Fleet, InstanceState
from router.admission.admitter import Admitter
from router.errors import EngineFailure, GpupoolError, NoHealthyInstance, NotFound
from router.gateway.classify import classify
from router.gateway.protocols import ChatAdapter, ProtocolAdapter
from router.gateway.proxy import parse_request_body, read_request_body, request_headers
from router.gateway.response_placement import ResponsePlacement
from router.identity import Tenants
from router.metrics import RouterMetrics
from router.request import Receive, Scope, Send

if TYPE_CHECKING:  # opentelemetry is imported only when traces are on
    from router.ops.tracing.call_trace import CallTrace
    from router.ops.tracing.tracer import Tracing

__all__ = ["EngineCalls"]

log = logging.getLogger(__name__)

_PASSED_HEADERS = frozenset({"content-type", "content-encoding"})
_CHAT = ChatAdapter()  # its check: `messages`, a non-empty list


class EngineCalls:
    def __init__(
        self,
        *,
        config: Config,
        tenants: Tenants,
        fleet: Fleet,
        admitter: Admitter,
        session: aiohttp.ClientSession,
        metrics: RouterMetrics,
        placement: ResponsePlacement,
        clock: Callable[[], float] = time.monotonic,
        tracing: Tracing | None = None,
    ) -> None:
        self.config = config
        self.tenants = tenants
        self.fleet = fleet
        self.admitter = admitter
        self.session = session
        self.metrics = metrics
        self.placement = placement
        self.clock = clock
        self.tracing = tracing  # each call's server and engine spans, when traces are on
        self._timeout = aiohttp.ClientTimeout(
            total=config.router.upstream_timeout_s, sock_connect=config.router.connect_timeout_s
        )

    async def count_tokens(
        self, scope: Scope, receive: Receive, send: Send, adapter: ProtocolAdapter
    ) -> None:
        now = self.clock()
        pool = cls = "none"
        trace: CallTrace | None = None
        code: str | None = None
        try:
            headers = request_headers(scope)
            if self.tracing is not None:
                trace = self.tracing.call(
                    headers, now, "POST /v1/messages/count_tokens", "count_tokens"
                )
            tenant = self.tenants.authenticate(
                headers.get("authorization"), headers.get("x-api-key")
            )
            raw = await read_request_body(receive, self.config.router.max_body_bytes)
            body = self._parse(raw)
            ctx = classify(
                headers,
                body,
                tenant,
                self.config,
                request_id="gp-" + os.urandom(8).hex(),
                now_s=now,
                protocol="messages",
            )
            pool, cls = ctx.pool, ctx.class_name
            if trace is not None:
                trace.classified(tenant.name, pool, cls)
            state = self._least_busy(ctx.pool)
            status = await self._forward(
                send,
                state,
                "POST",
                "/v1/messages/count_tokens",
                raw,
                stream=False,
                trace=trace,
                refusal=adapter.engine_error,  # vLLM's refusals, in Anthropic's types
            )
        except GpupoolError as err:
            status, code = await _send_error(send, err, adapter), err.code
        except ConnectionError:
            if trace is not None:
                trace.end(499, "client_disconnect")
            return
        if trace is not None:
            trace.end(status, code)
        self._count(pool, cls, status, now, "count_tokens")

    async def response(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        adapter: ProtocolAdapter,
        response_id: str,
        *,
        cancel: bool,
    ) -> None:
        now = self.clock()
        endpoint = "responses_cancel" if cancel else "responses_get"
        trace: CallTrace | None = None
        code: str | None = None
        try:
            headers = request_headers(scope)
            if self.tracing is not None:
                name = "POST /v1/responses/{id}/cancel" if cancel else "GET /v1/responses/{id}"
                trace = self.tracing.call(headers, now, name, endpoint)
            tenant = self.tenants.authenticate(
                headers.get("authorization"), headers.get("x-api-key")
            )
            if trace is not None:
                trace.classified(tenant.name, "none", "none")
            if cancel:
                await read_request_body(receive, self.config.router.max_body_bytes)
            stored = self.placement.get(response_id)
            if stored is None and self.placement.shared:  # made on another router replica
                stored = await self.placement.fetch(response_id)  # StoreUnavailable: 503
            state = self.fleet.get(stored.instance_id) if stored is not None else None
            if stored is None or stored.tenant != tenant.name:
                raise NotFound(
                    f"response {response_id[:80]!r} was not made through gpupool by this "
                    "tenant, or is too old to be remembered",
                    "response_not_found",
                )
            if state is None or not state.healthy:
                raise NotFound(
                    f"response {response_id[:80]!r} was stored by engine "
                    f"{stored.instance_id!r}, which is gone",
                    "response_not_found",
                )
            path = f"/v1/responses/{response_id}" + ("/cancel" if cancel else "")
            query = scope.get("query_string", b"")
            if query:
                path += "?" + query.decode("latin-1")
            status = await self._forward(
                send,
                state,
                "POST" if cancel else "GET",
                path,
                b"" if not cancel else b"{}",
                stream=True,
                trace=trace,
            )
        except GpupoolError as err:
            status, code = await _send_error(send, err, adapter), err.code
        except ConnectionError:
            if trace is not None:
                trace.end(499, "client_disconnect")
            return
        if trace is not None:
            trace.end(status, code)
        self._count("none", "none", status, now, endpoint)

    # ------------------------------------------------------------------ helpers

    def _parse(self, raw: bytes) -> dict[str, Any]:
        """A count_tokens body: `model` and a non-empty `messages` list (no `max_tokens`)."""
        return parse_request_body(raw, self.config.model.name, _CHAT.validate)

    def _least_busy(self, pool: str) -> InstanceState:
        def healthy(ids: Any) -> list[InstanceState]:
            states = (self.fleet.get(i) for i in ids)
            return [s for s in states if s is not None and s.healthy and not s.leaving]

        cands = healthy(self.admitter.pool_map.current.instances_for(pool))
        if not cands:
            cands = healthy(s.spec.instance_id for s in self.fleet)
        if not cands:
            raise NoHealthyInstance("no healthy instance to count tokens on", "no_healthy_instance")
        return min(cands, key=lambda s: s.inflight)

    async def _forward(
        self,
        send: Send,
        state: InstanceState,
        method: str,
        path: str,
        data: bytes,
        *,
        stream: bool,
        trace: CallTrace | None = None,
        refusal: Callable[[int, bytes], bytes] | None = None,
    ) -> int:
        headers = {"content-type": "application/json"}
        if state.spec.api_key:
            headers["authorization"] = "Bearer " + state.spec.api_key
        if trace is not None:  # vLLM's own span (its tracing on) hangs below the engine span
            headers["traceparent"] = trace.engine_started(state.spec.instance_id)
        try:
            resp = await self.session.request(
                method, state.spec.url + path, data=data, headers=headers, timeout=self._timeout
            )
        except (aiohttp.ClientError, OSError, TimeoutError) as err:
            if trace is not None:
                trace.engine_ended(None, "engine_unreachable")
            raise EngineFailure(
                f"engine {state.spec.instance_id} did not answer: {err or type(err).__name__}",
                "engine_unreachable",
            ) from None
        try:
            out = [(k.lower().encode(), v.encode()) for k, v in resp.headers.items()]
            out = [(k, v) for k, v in out if k.decode() in _PASSED_HEADERS]
            out.append((b"x-gpupool-instance", state.spec.instance_id.encode()))
            await send({"type": "http.response.start", "status": resp.status, "headers": out})
            if not stream:
                body = await resp.read()
                if refusal is not None and resp.status >= 400:
                    body = refusal(resp.status, body)
                if trace is not None:
                    trace.engine_ended(resp.status)
                await send({"type": "http.response.body", "body": body})
                return resp.status
            async for chunk in resp.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if trace is not None:
                trace.engine_ended(resp.status)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return resp.status
        except (aiohttp.ClientError, OSError, TimeoutError, asyncio.CancelledError):
            resp.close()
            raise
        finally:
            resp.release()

    def _count(self, pool: str, cls: str, status: int, start_s: float, endpoint: str) -> None:
        outcome = "ok" if status < 400 else "client_error" if status < 500 else "engine_error"
        self.metrics.request_done(pool, cls, outcome, str(status), self.clock() - start_s, endpoint)


async def _send_error(send: Send, err: GpupoolError, adapter: ProtocolAdapter) -> int:
    status, body, headers = adapter.error_response(err)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})
    return status
