"""The request path for every generation endpoint, as a raw ASGI handler: `/v1/chat/completions`,
`/v1/completions`, `/v1/responses` and `/v1/messages`.

authenticate -> read -> parse -> classify -> estimate -> admit (queue or 429) -> pick and lease
-> proxy -> settle -> release. From dispatch on, the request's end has one owner,
`router.settlement.Settlement` (meter, governance, ledger, learners, in that order). Each arrow
is one call; a retry re-picks within the admission grant. What differs between the protocols
(required fields, what the estimate counts, the first generated token, the usage, the last
event, the error shape) is each protocol adapter's (`router.gateway.protocols`); the path itself is
one. It runs outside FastAPI's routing and middleware on purpose: it sits on every token of
every request, and the ASGI stack is most of what a Python proxy costs
(benchmarks/results/router_overhead.md).

Proxy rules:
- the API key is checked from the headers before the body is read; the body is read within
  `router.body_read_timeout_s` (408) and `router.max_body_bytes` (413);
- bytes pass through; the router parses the request body once, the first generated token's
  event (for TTFT: text, a tool call or reasoning) and the usage event (tokens); nothing else
  of the stream;
- once a stream's first token has been seen and nothing else needs reading, its chunks go to
  the client from the engine connection's own callback (`_Splice`: no task step per chunk) until
  one may hold the usage or the last event, or the client cannot take it now;
- a streaming chat or completions request always asks vLLM for `stream_options.include_usage`;
  the usage event is stripped again when the client did not ask for it;
- a request that can never be served answers 400 before admission: its prompt alone over the
  model's context (`context_length_exceeded`; an output limit past the context's end is
  served as vLLM serves it, stopping there; one over the whole context, which vLLM refuses,
  is lowered to it first), its sequence over every
  instance's whole KV cache (`kv_capacity_exceeded`), a `previous_response_id` the router
  does not know or whose engine is gone (`previous_response_not_found`);
- a follow-up response (`previous_response_id`) goes only to the instance that stored the
  response it continues (`router.gateway.response_placement`), waiting for it when it is busy;
- a client that disconnects aborts the upstream request (the connection to the engine is
  closed, and vLLM aborts the sequence), or leaves the admission queue if it was waiting;
- a connect failure before any byte was sent marks the instance unhealthy and re-picks another
  instance the request fits on; a failure mid-stream ends the stream with an OpenAI-shaped error
  event; an engine 5xx becomes a 502; an engine 4xx (prompt too long, ...) passes through;
- each request holds one `Lease` on its instance at a time, released in a `finally`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from pools.config import Config, TenantConfig
from pools.fleet import Fleet, Lease
from router.admission.admitter import Admitter
from router.admission.estimate import Estimate, TokenEstimator
from router.errors import (
    BadRequest,
    DeadlineExceeded,
    EngineFailure,
    GpupoolError,
    ModelNotFound,
    PayloadTooLarge,
    RequestTimeout,
)
from router.gateway.classify import classify
from router.gateway.http_protocol import CLIENT_LINK, ClientLink
from router.gateway.protocols import ProtocolAdapter
from router.gateway.response_placement import (
    PlacementWrite,
    ResponsePlacement,
    StoredResponse,
)
from router.gateway.upstream import ConnectFailed, Response, Upstream
from router.gateway.wait_comments import HEADER as WAIT_COMMENTS_HEADER
from router.gateway.wait_comments import WaitComments, wait_comments_after_s
from router.governance import StepSignals
from router.governance.speculation import Speculation
from router.identity import Tenants
from router.metrics import RouterMetrics
from router.prefix.lookup import PrefixLookup
from router.request import (
    Message,
    Receive,
    RequestContext,
    RequestOutcome,
    Scope,
    Send,
)
from router.settlement import Settlement
from router.settlement import outcome_of as _outcome_of

if TYPE_CHECKING:
    from router.ops.tracing.tracer import Tracing

__all__ = [
    "CompletionsHandler",
    "RequestGovernor",
    "parse_request_body",
    "read_request_body",
    "request_headers",
]

log = logging.getLogger(__name__)

_SSE_SEP = b"\n\n"
_DEFAULT_BLOCK_SIZE = 16  # vLLM's, until an engine reports its own
_ID_MASK = (1 << 64) - 1  # request ids: 64 bits
_NO_PINS: frozenset[str] = frozenset()
_CLASS_HEADERS_KEPT = 1024  # (pool, class, priority) header sets kept encoded


def request_headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}


class RequestGovernor(Protocol):
    """What the request path needs of the governor (router.governance.Governor): a Protocol,
    so a compiled build accepts any object with these methods."""

    def prepare(
        self,
        ctx: RequestContext,
        tenant: TenantConfig,
        headers: Mapping[str, str],
        body: dict[str, Any],
    ) -> tuple[RequestContext, StepSignals]: ...

    def abandon(self, request_id: str) -> None: ...

    def rate_headers(self, tenant: str) -> list[tuple[bytes, bytes]]: ...

    def enter_now(self, ctx: RequestContext, signals: StepSignals) -> bool: ...

    async def enter(
        self,
        ctx: RequestContext,
        estimate: Estimate,
        signals: StepSignals,
        *,
        speculate: bool = False,
    ) -> float: ...

    def speculation(self, request_id: str) -> Speculation | None: ...


class CompletionsHandler:
    """Serves the generation endpoints through the pools, each through its protocol adapter."""

    def __init__(
        self,
        *,
        config: Config,
        tenants: Tenants,
        fleet: Fleet,
        admitter: Admitter,
        estimator: TokenEstimator,
        settlement: Settlement,
        upstream: Upstream,
        metrics: RouterMetrics,
        clock: Callable[[], float] = time.monotonic,
        governor: RequestGovernor | None = None,
        placement: ResponsePlacement | None = None,
        tracing: Tracing | None = None,
        prefix_lookup: PrefixLookup | None = None,
    ) -> None:
        self.config = config
        # a chat prompt's cached prefix per instance (router/prefix); None: no engine publishes
        self.prefix_lookup = prefix_lookup
        self.governor = governor
        self.tracing = tracing  # None: traces are off (router.ops.tracing)
        self.placement = placement if placement is not None else ResponsePlacement(None)
        self.tenants = tenants
        self.fleet = fleet
        self.admitter = admitter
        self.estimator = estimator
        self.settlement = settlement
        self.upstream = upstream
        self.metrics = metrics
        self.clock = clock
        # request ids: consecutive 64-bit numbers from a random start (os.urandom) per handler.
        # Unique across routers and restarts as two random runs of this length never meet;
        # no system call per request (os.urandom's getrandom was ~3 % of the router's CPU at
        # c=64); and the ledger's primary key takes them in order, near its last page, where
        # random ones each touched a random page of its index (SQLite's CPU per row 25 -> 15
        # us at 20k rows, the gap growing with the ledger)
        self._next_id = random.SystemRandom().getrandbits(64)
        rc = config.router
        self._connect_timeout_s = rc.connect_timeout_s
        self._upstream_timeout_s = rc.upstream_timeout_s
        self._max_retries = rc.max_connect_retries
        self._max_body_bytes = rc.max_body_bytes
        self._body_timeout_s = rc.body_read_timeout_s
        self._engine_priority = {p.name: p.engine_priority for p in config.pools}
        self._class_heads: dict[tuple[str, str, int], tuple[tuple[bytes, bytes], ...]] = {}

    # ----------------------------------------------------------------------------- entry

    async def __call__(
        self, scope: Scope, receive: Receive, send: Send, *, adapter: ProtocolAdapter
    ) -> None:
        now = self.clock()
        number = self._next_id
        self._next_id = (number + 1) & _ID_MASK
        request_id = f"gp-{number:016x}"
        headers = request_headers(scope)
        tracing = self.tracing
        trace = None if tracing is None else tracing.request(headers, now, scope["path"])
        signals: StepSignals | None = None
        tenant_name: str | None = None
        try:
            tenant = self.tenants.authenticate(
                headers.get("authorization"), headers.get("x-api-key")
            )
            tenant_name = tenant.name
            link = scope.get(CLIENT_LINK)  # served by gpupool's own server (http_protocol)
            if isinstance(link, ClientLink) and (whole := link.take_body()) is not None:
                if len(whole) > self._max_body_bytes:
                    raise _too_large(self._max_body_bytes)
                body_bytes = whole
            elif isinstance(link, ClientLink) and link.body_arrived:
                body_bytes = await read_request_body(receive, self._max_body_bytes)
            else:
                body_bytes = await self._read_body(receive)
            read_s = self.clock()
            body = self._parse(body_bytes, adapter)
            ctx = classify(
                headers,
                body,
                tenant,
                self.config,
                request_id=request_id,
                now_s=now,
                protocol=adapter.name,
            )
            stored = None
            if adapter.stateful and (previous := body.get("previous_response_id")):
                ctx, stored = await self._follow_up(ctx, previous)
            try:
                parsed = adapter.estimate_input(body)
                if (needed := self.estimator.context_exceeded_early(parsed)) is not None:
                    raise self._context_error(needed)
                if self.governor is not None:
                    ctx, signals = self.governor.prepare(ctx, tenant, headers, body)
                wait_after_s = wait_comments_after_s(headers.get(WAIT_COMMENTS_HEADER))
                estimate = self.estimator.estimate_input_now(parsed, class_name=ctx.class_name)
                if estimate is None:  # more never-counted text than the loop should count
                    estimate = await self.estimator.estimate_input_thread(
                        parsed, class_name=ctx.class_name
                    )
            except RecursionError:  # it re-encodes JSON it reads (tools): a body nested too deep
                raise _too_deep() from None
            if self.prefix_lookup is not None and adapter.name == "chat":
                prefix = await self.prefix_lookup.lookup(body, len(body_bytes))
                if prefix is not None:
                    estimate = replace(estimate, prefix=prefix)
            if stored is not None:  # the engine renders the stored conversation before it
                estimate = replace(
                    estimate,
                    prompt_tokens=estimate.prompt_tokens + stored.context_tokens,
                    exact_prompt_tokens=estimate.exact_prompt_tokens + stored.context_tokens,
                )
            self._check_servable(ctx, estimate)
        except GpupoolError as err:
            extra = [(b"x-gpupool-request-id", request_id.encode())]
            if self.governor is not None:
                self.governor.abandon(request_id)  # its slot, if `prepare` asked for one
            if self.governor is not None and tenant_name is not None:
                extra += self.governor.rate_headers(tenant_name)
            await _send_error(send, err, extra, adapter)
            if trace is not None:
                trace.refused(err.status, err.code, tenant_name, self.clock())
            self.metrics.request_done(
                "none",
                "none",
                _outcome_of(err.status),
                err.code,
                self.clock() - now,
                adapter.name,
            )
            return
        except ConnectionError:
            return  # the client left while sending its body
        outcome = RequestOutcome(ctx=ctx, estimate=estimate, endpoint=adapter.name)
        if trace is not None:
            trace.begin(ctx, estimate, self.clock())
            outcome.trace = trace
        client = link if isinstance(link, ClientLink) else None
        serving = self._serve(
            ctx,
            body,
            body_bytes,
            adapter,
            send,
            outcome,
            read_s,
            signals,
            wait_after_s,
            stored,
            client,
        )
        try:
            if client is None:  # another ASGI server (tests' in-process transport): watch
                await _serve_in_a_task(serving, receive, outcome)  # for the disconnect
            elif client.lost:  # it left while the request was being read and estimated
                serving.close()
                _client_left(outcome)
            else:
                # served in the server's task, which the server cancels when the client
                # leaves (written here, not in a coroutine of its own: one frame fewer for
                # each of the request's wake-ups to resume)
                task = client.task = asyncio.current_task()
                try:
                    await serving
                except asyncio.CancelledError:
                    if not client.lost or task is None:
                        raise  # not the client: the server is shutting down
                    task.uncancel()
                    _client_left(outcome)
                finally:
                    client.task = None
        finally:
            outcome.ended_at_s = self.clock()
            self.settlement.finish(outcome)

    async def _read_body(self, receive: Receive) -> bytes:
        try:
            async with asyncio.timeout(self._body_timeout_s):
                return await read_request_body(receive, self._max_body_bytes)
        except TimeoutError:
            raise RequestTimeout(
                f"the request body did not arrive within {self._body_timeout_s:g} s",
                "body_timeout",
            ) from None

    def _parse(self, raw: bytes, adapter: ProtocolAdapter) -> dict[str, Any]:
        body = parse_request_body(raw, self.config.model.name, adapter.validate)
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise BadRequest("'stream' must be a boolean", "invalid_field", param="stream")
        return body

    async def _follow_up(
        self, ctx: RequestContext, previous: object
    ) -> tuple[RequestContext, StoredResponse | None]:
        """A follow-up response (`previous_response_id`): where the response it continues is
        stored (this replica's memory, else, with a shared store, the store: it may have been
        made on another replica), which must be a healthy instance of the fleet; the chain is
        the request's run when it names no other, and its pool is one the instance serves."""
        if not isinstance(previous, str):
            return ctx, None
        stored = self.placement.get(previous)
        if stored is None and self.placement.shared:
            stored = await self.placement.fetch(previous)  # StoreUnavailable: 503
        if stored is None or stored.tenant != ctx.tenant:
            raise BadRequest(
                f"previous response {previous[:80]!r} was not made through gpupool, was made "
                "with `store: false`, or is too old to be remembered; send the whole "
                "conversation as `input` instead",
                "previous_response_not_found",
                param="previous_response_id",
            )
        state = self.fleet.get(stored.instance_id)
        if state is None or not state.healthy or state.leaving:
            raise BadRequest(
                f"previous response {previous[:80]!r} was stored by engine "
                f"{stored.instance_id!r}, which is gone; send the whole conversation as "
                "`input` instead",
                "previous_response_not_found",
                param="previous_response_id",
            )
        if ctx.run_id is None:
            ctx = replace(ctx, run_id=stored.chain_root)
        pools = dict(self.admitter.pool_map.current.pools_of(stored.instance_id))
        if pools.get(ctx.pool, 0.0) <= 0.0 and pools:
            ctx = replace(ctx, pool=max(pools, key=lambda p: pools[p]))
        return ctx, stored

    def _check_servable(self, ctx: RequestContext, estimate: Estimate) -> None:
        """Refuse (400, before admission) a request no instance can ever serve: over the
        model's context, or over the whole KV cache of every instance of its pool."""
        needed = self.estimator.context_needed(estimate)
        if needed is not None:
            raise self._context_error(needed)
        capacity = self._largest_kv_tokens(ctx.pool)
        if capacity is not None and estimate.total_tokens > capacity:
            raise BadRequest(
                f"the request needs about {estimate.total_tokens} tokens of KV cache (prompt "
                f"and expected output); the largest instance of pool {ctx.pool!r} holds "
                f"{capacity}. Reduce the prompt or the output limit.",
                "kv_capacity_exceeded",
                param="messages",
            )

    def _context_error(self, needed: int) -> BadRequest:
        limit = self.estimator.max_model_len_tokens
        return BadRequest(
            f"prompt is too long: {needed} tokens > {limit} maximum. This model's maximum "
            f"context length is {limit} tokens; the prompt alone takes about {needed - 1}, "
            "leaving no room for a single output token. Reduce the prompt.",
            "context_length_exceeded",
            param="messages",
        )

    def _largest_kv_tokens(self, pool: str) -> int | None:
        """The most tokens one sequence may hold on any healthy instance of `pool` (its KV
        blocks less admission's margin); None while any of them has not reported its blocks."""
        largest: int | None = None
        for instance_id in self.admitter.instances_for(pool):
            state = self.fleet.get(instance_id)
            if state is None or not state.healthy:
                continue
            blocks = state.capacity_blocks
            if blocks is None or state.reading is None:
                return None
            block_size = state.reading.block_size or _DEFAULT_BLOCK_SIZE
            tokens = int(blocks * (1.0 - self.admitter.margin_frac)) * block_size
            largest = tokens if largest is None else max(largest, tokens)
        return largest

    # ----------------------------------------------------------------------------- serving

    async def _serve(
        self,
        ctx: RequestContext,
        body: dict[str, Any],
        body_bytes: bytes,
        adapter: ProtocolAdapter,
        send: Send,
        outcome: RequestOutcome,
        read_s: float,
        signals: StepSignals | None = None,
        wait_after_s: float | None = None,
        stored: StoredResponse | None = None,
        client: ClientLink | None = None,
    ) -> None:
        request_id = ctx.request_id.encode()
        gp_headers = [(b"x-gpupool-request-id", request_id), *self._class_headers(ctx)]
        changed = adapter.prepare(body, ctx)
        max_len = self.estimator.max_model_len_tokens
        if max_len is not None and adapter.clamp_output(body, max_len):
            changed = True  # vLLM refuses a limit over the context, served clamped
        outcome.response_kept = adapter.stores_response(body)
        engine_priority = self._engine_priority.get(ctx.pool)
        if engine_priority is not None and "priority" not in body and adapter.engine_priority:
            body["priority"] = engine_priority  # vLLM schedules lower values first
            changed = True
        elif "priority" in body:
            changed = True  # the client's own, which classify may have clamped (max_priority)
        path = adapter.path
        # a follow-up goes to the instance that stored its previous response, nowhere else
        pinned = (
            frozenset(s.spec.instance_id for s in self.fleet) - {stored.instance_id}
            if stored is not None
            else _NO_PINS
        )
        estimate = outcome.estimate
        assert estimate is not None
        refused: set[str] = set()  # refused the connection: never retried for this request
        tried: set[str] = set()  # failed otherwise: retried only when nothing else is left
        attempts = 0
        lease: Lease | None = None
        waiter: WaitComments | None = None
        spec: Speculation | None = None  # a run's step sent on before the store's answer
        # what a failed attempt raised: ConnectFailed (refused), or UpstreamClosed or another
        # OSError (reset or closed before the response head); one variable for both handlers
        err: OSError
        if ctx.stream and wait_after_s is not None:
            waiter = WaitComments(send, gp_headers, wait_after_s, clock=self.clock)
            waiter.start()
        try:
            if changed:
                try:
                    body_bytes = orjson.dumps(body)
                except orjson.JSONEncodeError:  # nested deeper than orjson writes (254 levels)
                    raise _too_deep() from None
            governed_s = 0.0  # waited for the tenant's budget (not router overhead)
            governor = self.governor
            # `enter_now`: a tenant with nothing to enforce, a request outside any run (no
            # wait, no rate-limit headers, no speculation)
            if (
                governor is not None
                and signals is not None
                and not governor.enter_now(ctx, signals)
            ):
                if waiter is not None:
                    waiter.reason = "token budget"
                try:
                    # a known run's step may go on before the shared store's answer, which
                    # is awaited before the response's first byte (not with wait comments:
                    # they may send bytes before dispatch)
                    governed_s = await governor.enter(
                        ctx, estimate, signals, speculate=waiter is None
                    )
                finally:
                    gp_headers.extend(governor.rate_headers(ctx.tenant))
                spec = governor.speculation(ctx.request_id)
                if spec is not None:  # its refusal cancels this task (the engine request)
                    spec.watch(asyncio.current_task())
            if waiter is not None:
                waiter.reason = "queue"
            admit_start_s = outcome.admission_started_at_s = self.clock()
            lease = await self.admitter.admit(ctx, estimate, exclude=pinned)
            if waiter is not None:
                await self._stop_waiting(waiter, outcome)
            outcome.admitted_at_s = self.clock()
            queued_s = outcome.admitted_at_s - admit_start_s + governed_s
            self.metrics.observe_overhead(outcome.admitted_at_s - read_s - queued_s)
            while True:
                instance = lease.state
                instance_id = lease.instance_id
                outcome.instance_id = instance_id
                tried.add(instance_id)
                attempts += 1
                headers = [*gp_headers, (b"x-gpupool-instance", instance_id.encode())]
                if estimate.prefix is not None and instance_id in estimate.prefix.tokens:
                    # prompt tokens the index says this instance holds (whole blocks)
                    cached = str(estimate.prefix.tokens[instance_id]).encode()
                    headers.append((b"x-gpupool-cached-tokens", cached))
                remaining_s = ctx.deadline_s - self.clock()
                if remaining_s <= 0:
                    raise DeadlineExceeded(
                        "the request's deadline passed before dispatch", "deadline_exceeded"
                    )
                outcome.dispatched_at_s = self.clock()
                self.settlement.dispatched(outcome)
                # the engine request's header lines, encoded once
                upstream_head = b"content-type: application/json\r\nx-request-id: %b\r\n" % (
                    request_id
                )
                if instance.spec.api_key:
                    key = instance.spec.api_key.encode("latin-1")
                    upstream_head += b"authorization: Bearer %b\r\n" % key
                if (trace := outcome.trace) is not None and trace.traceparent is not None:
                    upstream_head += b"traceparent: %b\r\n" % trace.traceparent.encode("latin-1")
                try:
                    resp = await self.upstream.post(
                        instance.spec.url,
                        path,
                        body_bytes,
                        upstream_head,
                        total_s=min(remaining_s, self._upstream_timeout_s),
                        connect_s=self._connect_timeout_s,
                    )
                except ConnectFailed as err:
                    # nothing reached the engine: it is down or not listening
                    refused.add(instance_id)
                    self.fleet.record_failure(instance_id, f"connect failed: {err}", immediate=True)
                    if stored is not None:  # the stored response went with the engine
                        raise _engine_gone(body, instance_id) from None
                    lease = await self._retry(ctx, estimate, lease, refused, tried, attempts, err)
                    continue
                except TimeoutError:
                    raise DeadlineExceeded(
                        "the engine did not answer before the deadline", "deadline_exceeded"
                    ) from None
                except OSError as err:
                    # reset or closed before the response head (often a stale pooled
                    # connection); no byte has reached the client, so try again
                    lease = await self._retry(
                        ctx, estimate, lease, refused, tried, attempts, err, pinned
                    )
                    continue
                try:
                    if spec is not None:  # the store's answer, before the first byte
                        await _confirmed(spec, outcome)
                    self.settlement.answered(outcome)
                    await self._relay(
                        ctx, resp, send, headers, outcome, lease, adapter, stored, client
                    )
                except BaseException:
                    resp.close()  # drop the connection: vLLM aborts the sequence
                    raise
                else:
                    resp.release()  # fully read: the connection goes back to the pool
                return
        except (Exception, asyncio.CancelledError) as exc:
            caught: BaseException = exc
            if isinstance(exc, asyncio.CancelledError):  # a refused speculation's, or raise
                refusal = None if spec is None else spec.refusal(asyncio.current_task())
                if refusal is None:
                    raise
                caught = refusal
            if spec is not None and caught is not spec.error:  # failed before the answer:
                spec.unwatch()  # the store's refusal is the answer the client would have got
                await spec.wait()
                if spec.error is not None:
                    caught = spec.error
            if spec is not None and caught is spec.error:  # refused as `enter` would have
                outcome.instance_id = outcome.step_index = outcome.dispatched_at_s = None
            await self._stop_waiting(waiter, outcome)
            if isinstance(caught, GpupoolError):
                failure = caught
            else:  # a bug: answer in OpenAI's shape, never with a stack trace
                log.exception("%s: internal error", ctx.request_id)
                failure = GpupoolError(
                    f"gpupool internal error (request {ctx.request_id}); see the router log",
                    "internal_error",
                )
            outcome.status = failure.status
            outcome.outcome = _outcome_of(failure.status)
            outcome.reason = failure.code
            outcome.error_type = failure.type
            if outcome.wait_stream_open:  # the wait's comments started the stream: an event
                outcome.wait_stream_open = False
                await send(_error_event(failure, adapter))
            if outcome.response_started:
                return
            await _send_error(
                send,
                failure,
                gp_headers
                + (
                    [(b"x-gpupool-instance", outcome.instance_id.encode())]
                    if outcome.instance_id
                    else []
                ),
                adapter,
            )
        finally:
            if waiter is not None:
                waiter.cancel()  # cancelled (the client left) while waiting
            if lease is not None:
                lease.release()  # the inflight gauge is set at each scrape (pools_view)

    def _class_headers(self, ctx: RequestContext) -> tuple[tuple[bytes, bytes], ...]:
        """The response headers naming the request's pool, class and priority, encoded once
        per combination (a few per config; cleared past `_CLASS_HEADERS_KEPT`, as a client's
        priority header may name any number)."""
        key = (ctx.pool, ctx.class_name, ctx.priority)
        found = self._class_heads.get(key)
        if found is None:
            if len(self._class_heads) >= _CLASS_HEADERS_KEPT:
                self._class_heads.clear()
            found = self._class_heads[key] = (
                (b"x-gpupool-pool", ctx.pool.encode()),
                (b"x-gpupool-class", ctx.class_name.encode()),
                (b"x-gpupool-priority", str(ctx.priority).encode()),
            )
        return found

    @staticmethod
    async def _stop_waiting(waiter: WaitComments | None, outcome: RequestOutcome) -> None:
        """Stop the wait's comments; from then on the relay writes the stream they started."""
        if waiter is None:
            return
        await waiter.stop()  # idempotent
        if waiter.started and not outcome.response_started:
            outcome.response_started = outcome.wait_stream_open = True

    async def _retry(
        self,
        ctx: RequestContext,
        estimate: Estimate,
        lease: Lease,
        refused: set[str],
        tried: set[str],
        attempts: int,
        err: BaseException,
        pinned: frozenset[str] = frozenset(),
    ) -> Lease:
        """A new lease for another attempt: another instance the request fits on now, else
        one that failed without refusing, else the queue again (never a refused instance).
        A pinned request (`pinned`: every instance but its own) only ever retries its own."""
        lease.release()
        if attempts > self._max_retries:
            raise EngineFailure(
                f"could not reach an engine in pool {ctx.pool!r} after {attempts} attempt(s): "
                f"{err or type(err).__name__}",
                "engine_unreachable",
            ) from None
        self.metrics.retries.labels(ctx.pool).inc()
        if pinned:
            return await self.admitter.admit(ctx, estimate, exclude=pinned)
        log.info(
            "%s: %s failed before answering (%s); retrying",
            ctx.request_id,
            lease.instance_id,
            type(err).__name__,
        )
        new = self.admitter.repick(ctx, estimate, frozenset(tried))
        # An instance that failed without refusing is tried again only when no other healthy
        # one serves the pool; else the request waits for one (a dead engine's pooled
        # connections fail one by one: retrying it would spend the retries there).
        others = self._others_healthy(ctx.pool, tried)
        if new is None and tried != refused and not others:
            new = self.admitter.repick(ctx, estimate, frozenset(refused))
        if new is None:
            exclude = tried if others else refused
            new = await self.admitter.admit(ctx, estimate, exclude=frozenset(exclude))
        return new

    def _others_healthy(self, pool: str, tried: set[str]) -> bool:
        """A healthy instance of `pool` this request has not tried (it may be busy now)."""
        for instance_id in self.admitter.instances_for(pool):
            state = self.fleet.get(instance_id)
            if instance_id not in tried and state is not None and state.healthy:
                return True
        return False

    def _relay(
        self,
        ctx: RequestContext,
        resp: Response,
        send: Send,
        headers: list[tuple[bytes, bytes]],
        outcome: RequestOutcome,
        lease: Lease,
        adapter: ProtocolAdapter,
        stored: StoredResponse | None = None,
        client: ClientLink | None = None,
    ) -> Coroutine[Any, Any, None]:
        """The relay of the engine's answer, for the caller to await: a refusal, a stream or
        a whole body (returned, not awaited here: one coroutine fewer in the await chain that
        every later wake-up of the request resumes)."""
        outcome.status = resp.status
        if resp.status != 200:
            return self._relay_refusal(resp, send, headers, outcome, adapter, stored)
        if ctx.stream:
            return self._relay_stream(
                ctx, resp, send, headers, outcome, lease, adapter, stored, client
            )
        return self._relay_body(ctx, resp, send, headers, outcome, adapter, stored, client)

    async def _relay_refusal(
        self,
        resp: Response,
        send: Send,
        headers: list[tuple[bytes, bytes]],
        outcome: RequestOutcome,
        adapter: ProtocolAdapter,
        stored: StoredResponse | None,
    ) -> None:
        """An engine's answer other than 200: a 5xx as our 502, a 4xx passed through."""
        status = resp.status
        raw = await _read_upstream(resp)
        if status >= 500:
            detail = _engine_message(raw)
            # this request's failure, not the engine's health: a client's bad input that
            # the engine did not catch must not take it out (scrapes and connects decide)
            log.warning("engine %s answered %d", outcome.instance_id, status)
            raise EngineFailure(f"engine {outcome.instance_id} failed: {detail}", "engine_error")
        if status == 404 and stored is not None:
            # the engine no longer holds the response (it restarted since): never a 404
            # that reads like a wrong path, nor a silent answer without the history
            outcome.status = 400
            raise _engine_gone(None, outcome.instance_id or "?")
        outcome.outcome, outcome.reason = "client_error", str(status)
        raw = adapter.engine_error(status, raw)
        if outcome.wait_stream_open:  # the engine's refusal, as the stream's one event
            outcome.wait_stream_open = False
            body = adapter.refusal_event(raw)
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        ctype = (resp.content_type or "application/json").encode()
        outcome.response_started = True
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", ctype), *headers],
            }
        )
        await send({"type": "http.response.body", "body": raw})

    async def _relay_body(
        self,
        ctx: RequestContext,
        resp: Response,
        send: Send,
        headers: list[tuple[bytes, bytes]],
        outcome: RequestOutcome,
        adapter: ProtocolAdapter,
        stored: StoredResponse | None = None,
        client: ClientLink | None = None,
    ) -> None:
        try:
            raw = await resp.read()
        except TimeoutError:
            raise DeadlineExceeded(
                "the engine did not finish before the deadline", "deadline_exceeded"
            ) from None
        except OSError as err:
            raise EngineFailure(
                f"engine {outcome.instance_id} failed mid-response: {err}", "engine_error"
            ) from None
        outcome.ended_at_s = self.clock()  # a whole body: no first token to observe
        data: Any
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            data = None
        if isinstance(data, dict):
            tokens = adapter.body_usage(data)  # odd counts read as 0 (protocols' token_count)
            if tokens is not None:
                outcome.prompt_tokens, outcome.completion_tokens = tokens
            outcome.response_id = adapter.body_response_id(data)
        extra = self.settlement.usage_extra(outcome)
        extra_headers = [(_extra_header(key), str(value).encode()) for key, value in extra.items()]
        if (
            ctx.want_gpu_usage
            and extra
            and isinstance(data, dict)
            and adapter.add_body_usage(data, extra)
        ):
            raw = orjson.dumps(data)
        placed = self._remember_response(outcome, ctx, stored)
        refusal = await self.settlement.settle(outcome)
        if placed is not None:  # a shared store: in it before the final bytes
            await placed
        if refusal is not None:  # a run's step the store refused as it numbered it
            raise refusal
        outcome.response_started = True
        head = [(b"content-type", b"application/json"), *headers, *extra_headers]
        if client is None or not client.respond(200, head, raw):
            head.append((b"content-length", b"%d" % len(raw)))
            await send({"type": "http.response.start", "status": 200, "headers": head})
            await send({"type": "http.response.body", "body": raw})

    async def _relay_stream(
        self,
        ctx: RequestContext,
        resp: Response,
        send: Send,
        headers: list[tuple[bytes, bytes]],
        outcome: RequestOutcome,
        lease: Lease,
        adapter: ProtocolAdapter,
        stored: StoredResponse | None = None,
        client: ClientLink | None = None,
    ) -> None:
        if outcome.wait_stream_open:  # the wait's comments sent the status line already
            outcome.wait_stream_open = False
        else:
            outcome.response_started = True
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream"),
                        (b"cache-control", b"no-cache"),
                        *headers,
                    ],
                }
            )
        buf = b""
        tail = b""  # the stream's last event and anything after it: sent after the settle
        first_token_seen = False
        want_id = adapter.stateful
        marker = adapter.usage_marker
        finals = adapter.final_markers
        has_final = _final_finder(finals)
        extras = lambda: self.settlement.usage_extra(outcome)  # noqa: E731
        splice = None if client is None else _Splice(client, marker, has_final)
        try:
            async for chunk in resp:
                if splice is not None and splice.pending:  # what it held when it declined
                    buf, splice.pending = splice.pending + buf, b""
                buf += chunk
                if (
                    first_token_seen
                    and finals
                    and not want_id
                    and not tail
                    and marker not in buf
                    and not has_final(buf)
                ):
                    # no event here needs reading (no first token, id, usage or end to find):
                    # the complete ones go out as they came, one scan of the bytes per chunk
                    end = buf.rfind(_SSE_SEP) + 2
                    if end > 1:
                        body, buf = buf[:end], buf[end:]
                        if client is None or not client.write_more(body):
                            await send(
                                {"type": "http.response.body", "body": body, "more_body": True}
                            )
                    if splice is not None:  # the next chunks, while the same holds, without us
                        splice.pending, buf = buf, b""
                        resp.splice(splice)
                    continue
                out: list[bytes] = []
                start = 0
                while (end := buf.find(_SSE_SEP, start)) >= 0:
                    event = buf[start : end + 2]
                    start = end + 2
                    if not first_token_seen and adapter.is_first_token(event):
                        first_token_seen = True
                        outcome.first_token_at_s = self.clock()
                        lease.first_token(outcome.first_token_at_s)
                    if want_id and (rid := adapter.response_id(event)) is not None:
                        outcome.response_id = rid
                        want_id = False
                    if marker in event:
                        event = adapter.usage_event(ctx, event, outcome, extras)
                    if tail or adapter.is_final_event(event):
                        tail += event
                    elif event:
                        out.append(event)
                if start:
                    buf = buf[start:]
                if out:
                    body = b"".join(out)
                    if client is None or not client.write_more(body):
                        await send({"type": "http.response.body", "body": body, "more_body": True})
        except OSError as err:  # UpstreamClosed, TimeoutError (the deadline)
            error: GpupoolError
            if isinstance(err, TimeoutError):
                error = DeadlineExceeded(
                    "the request's deadline passed mid-stream", "deadline_exceeded"
                )
            else:
                error = EngineFailure(
                    f"engine {outcome.instance_id} failed mid-stream: {err or type(err).__name__}",
                    "engine_error",
                )
            outcome.outcome = _outcome_of(error.status)
            outcome.reason = "midstream" if error.status == 502 else error.code
            outcome.status = error.status
            await send(_error_event(error, adapter))
            return
        if splice is not None and splice.pending:  # the body ended while it held these
            buf, splice.pending = splice.pending + buf, b""
        outcome.ended_at_s = self.clock()
        placed = self._remember_response(outcome, ctx, stored)
        await self.settlement.settle(outcome)
        if placed is not None:  # a shared store: in it before the final bytes
            await placed
        await send({"type": "http.response.body", "body": tail + buf, "more_body": False})

    def _remember_response(
        self, outcome: RequestOutcome, ctx: RequestContext, previous: StoredResponse | None
    ) -> PlacementWrite | None:
        """A stored response's place, before the client can send a follow-up to it; its
        chain is the previous response's, or starts with it. With a shared store, the write
        for the final bytes to wait for, offered to the ledger's commit of the record."""
        rid = outcome.response_id
        if rid is None or outcome.instance_id is None or not outcome.response_kept:
            return None
        placed = self.placement.remember(
            rid,
            StoredResponse(
                tenant=ctx.tenant,
                instance_id=outcome.instance_id,
                chain_root=previous.chain_root if previous is not None else rid,
                context_tokens=outcome.prompt_tokens + outcome.completion_tokens,
            ),
        )
        outcome.with_record = placed
        return placed


class _StreamWriter(Protocol):
    """What `_Splice` needs of a ClientLink (a Protocol: a compiled build takes any writer)."""

    def write_more(self, body: bytes) -> bool: ...


class _Splice:
    """A stream's relay while no event needs reading, run in the engine connection's callback
    (`Response.splice`): each chunk's complete events go straight to the client as they came
    (`ClientLink.write_more`), the incomplete rest is held in `pending`. It declines (False,
    having written nothing) a chunk that may hold the usage or the last event, or one the
    client cannot take now (it reads slowly, it left): the relay's task then takes `pending`
    and that chunk and goes on as without it."""

    __slots__ = ("_client", "_has_final", "_marker", "pending")

    def __init__(
        self, client: _StreamWriter, marker: bytes, has_final: Callable[[bytes], object]
    ) -> None:
        self._client = client
        self._marker = marker
        self._has_final = has_final
        self.pending = b""

    def __call__(self, data: bytes) -> bool:
        buf = self.pending + data if self.pending else data
        if self._marker in buf or self._has_final(buf):
            return False
        end = buf.rfind(_SSE_SEP) + 2
        if end > 1:
            try:
                if not self._client.write_more(buf[:end]):
                    return False
            except Exception:  # never into the engine's parser callback; the task will see it
                return False
            self.pending = buf[end:]
        else:
            self.pending = buf
        return True


_EXTRA_HEADERS: dict[str, bytes] = {}


def _extra_header(key: str) -> bytes:
    """The response header of a usage extra (`gpu_seconds` -> `x-gpupool-gpu-seconds`)."""
    name = _EXTRA_HEADERS.get(key)
    if name is None:
        name = _EXTRA_HEADERS[key] = f"x-gpupool-{key.replace('_', '-')}".encode()
    return name


_FINDERS: dict[tuple[bytes, ...], Callable[[bytes], object]] = {}


def _final_finder(finals: tuple[bytes, ...]) -> Callable[[bytes], object]:
    """A test for whether bytes hold any of `finals` (a protocol's final-event markers): one C
    call per chunk (a compiled alternation), not a generator over the markers."""
    finder = _FINDERS.get(finals)
    if finder is None:
        pattern = b"|".join(re.escape(f) for f in finals) if finals else b"(?!)"
        finder = _FINDERS[finals] = re.compile(pattern).search
    return finder


def parse_request_body(
    raw: bytes, served_model: str, validate: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """A request body: a JSON object with a `model`, checked by `validate` (the protocol's
    required fields), then the model checked against the served one."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        raise BadRequest(f"request body is not valid JSON: {err}", "invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", "invalid_body")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("missing required field 'model'", "missing_field", param="model")
    validate(body)
    if model != served_model:
        raise ModelNotFound(
            f"The model `{model}` does not exist. Served models: {served_model}.",
            "model_not_found",
            param="model",
        )
    return body


def _too_deep() -> BadRequest:
    return BadRequest("request body is nested too deeply", "invalid_body")


def _add_usage(raw: bytes, extra: dict[str, Any]) -> bytes:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw
    if isinstance(data, dict) and isinstance(data.get("usage"), dict):
        data["usage"].update(extra)
        return orjson.dumps(data)
    return raw


def _too_large(max_bytes: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"request body larger than {max_bytes} bytes (router.max_body_bytes)", "body_too_large"
    )


async def read_request_body(receive: Receive, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionError("client disconnected")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
        if not message.get("more_body"):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _confirmed(spec: Speculation, outcome: RequestOutcome) -> None:
    """The store's answer to a step sent on before it: its refusal raised (the caller closes
    the engine's response), else its number is the step's."""
    spec.unwatch()
    await spec.wait()
    if spec.error is not None:
        raise spec.error
    outcome.step_index = spec.step


async def _serve_in_a_task(
    serving: Coroutine[Any, Any, None], receive: Receive, outcome: RequestOutcome
) -> None:
    """Serve in a task of its own beside one that waits for the client's disconnect."""
    task = asyncio.ensure_future(serving)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            _client_left(outcome)
        else:
            task.result()
    finally:
        watcher.cancel()


def _client_left(outcome: RequestOutcome) -> None:
    outcome.outcome, outcome.reason = "aborted", "client_disconnect"
    outcome.status = 499


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _read_upstream(resp: Response) -> bytes:
    try:
        return await resp.read()
    except OSError:  # UpstreamClosed, TimeoutError
        return b""


def _engine_message(raw: bytes) -> str:
    try:
        data = orjson.loads(raw)
        message = data.get("error", {}).get("message") or data.get("message")
        if isinstance(message, str):
            return message[:500]
    except (orjson.JSONDecodeError, AttributeError):
        pass
    return raw[:200].decode("utf-8", "replace") or "empty response"


def _engine_gone(body: dict[str, Any] | None, instance_id: str) -> BadRequest:
    previous = (body or {}).get("previous_response_id")
    what = f"previous response {str(previous)[:80]!r}" if previous else "the previous response"
    return BadRequest(
        f"{what} was stored by engine {instance_id!r}, which no longer holds it (it stopped or "
        "restarted); send the whole conversation as `input` instead",
        "previous_response_not_found",
        param="previous_response_id",
    )


def _error_event(err: GpupoolError, adapter: ProtocolAdapter) -> Message:
    """The last message of a started stream that failed: an error event in the protocol's
    shape."""
    return {"type": "http.response.body", "body": adapter.error_event(err), "more_body": False}


async def _send_error(
    send: Send,
    err: GpupoolError,
    headers: list[tuple[bytes, bytes]],
    adapter: ProtocolAdapter,
) -> None:
    status, body, err_headers = adapter.error_response(err)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), *headers, *err_headers],
        }
    )
    await send({"type": "http.response.body", "body": body})
