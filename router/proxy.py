"""The request path for `/v1/chat/completions` and `/v1/completions`, as a raw ASGI handler.

authenticate -> read -> parse -> classify -> estimate -> admit (queue or 429) -> pick and lease
-> proxy -> settle -> release (DESIGN.md, "The request path"). Each arrow is one call; a retry
re-picks within the admission grant. It runs outside FastAPI's routing and middleware on
purpose: it sits on every token of every request, and the ASGI stack is most of what a Python
proxy costs (benchmarks/results/router_overhead.md).

Proxy rules:
- the API key is checked from the headers before the body is read; the body is read within
  `router.body_read_timeout_s` (408) and `router.max_body_bytes` (413);
- bytes pass through; the router parses the request body once, the first content event (for
  TTFT) and the usage event (tokens); nothing else of the stream;
- a streaming request always asks vLLM for `stream_options.include_usage`; the usage event is
  stripped again when the client did not ask for it;
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
import math
import os
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from pools.config import Config
from pools.fleet import Fleet, Lease
from router.admitter import Admitter
from router.classify import classify
from router.errors import (
    BadRequest,
    DeadlineExceeded,
    EngineFailure,
    GpupoolError,
    ModelNotFound,
    PayloadTooLarge,
    RequestTimeout,
)
from router.estimate import Estimate, TokenEstimator
from router.governance import Governor, StepSignals
from router.identity import Tenants
from router.metrics import RouterMetrics
from router.picking import RunAffinity
from router.request import (
    Message,
    Receive,
    RequestContext,
    RequestObserver,
    RequestOutcome,
    Scope,
    Send,
)
from router.wait_comments import HEADER as WAIT_COMMENTS_HEADER
from router.wait_comments import WaitComments, wait_comments_after_s

__all__ = ["CompletionsHandler"]

log = logging.getLogger(__name__)

_SSE_SEP = b"\n\n"


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}


def _is_first_token(event: bytes) -> bool:
    """True for an event carrying output (not vLLM's role-only opening event)."""
    if event.startswith(b"data: [DONE]"):
        return False
    if b'"content":""' in event or b'"choices":[]' in event:
        return b'"tool_calls"' in event
    return b'"content":' in event or b'"text":' in event or b'"tool_calls"' in event


class CompletionsHandler:
    """Serves one OpenAI generation endpoint (`chat` or `completions`) through the pools."""

    def __init__(
        self,
        *,
        config: Config,
        tenants: Tenants,
        fleet: Fleet,
        admitter: Admitter,
        estimator: TokenEstimator,
        affinity: RunAffinity,
        session: aiohttp.ClientSession,
        metrics: RouterMetrics,
        observers: list[RequestObserver] | None = None,
        clock: Callable[[], float] = time.monotonic,
        governor: Governor | None = None,
    ) -> None:
        self.config = config
        self.governor = governor
        self.tenants = tenants
        self.fleet = fleet
        self.admitter = admitter
        self.estimator = estimator
        self.affinity = affinity
        self.session = session
        self.metrics = metrics
        self.observers = observers or []
        self.clock = clock
        rc = config.router
        self._connect_timeout_s = rc.connect_timeout_s
        self._upstream_timeout_s = rc.upstream_timeout_s
        self._max_retries = rc.max_connect_retries
        self._max_body_bytes = rc.max_body_bytes
        self._body_timeout_s = rc.body_read_timeout_s
        self._engine_priority = {p.name: p.engine_priority for p in config.pools}

    # ----------------------------------------------------------------------------- entry

    async def __call__(self, scope: Scope, receive: Receive, send: Send, *, chat: bool) -> None:
        now = self.clock()
        request_id = "gp-" + os.urandom(8).hex()
        headers = _headers(scope)
        signals: StepSignals | None = None
        tenant_name: str | None = None
        try:
            tenant = self.tenants.authenticate(headers.get("authorization"))
            tenant_name = tenant.name
            body_bytes = await self._read_body(receive)
            read_s = self.clock()
            body = self._parse(body_bytes, chat)
            ctx = classify(headers, body, tenant, self.config, request_id=request_id, now_s=now)
            if self.governor is not None:
                ctx, signals = self.governor.prepare(ctx, tenant, headers, body)
            wait_after_s = wait_comments_after_s(headers.get(WAIT_COMMENTS_HEADER))
            try:
                estimate = await self.estimator.estimate_async(
                    body, chat=chat, class_name=ctx.class_name
                )
            except RecursionError:  # it re-encodes JSON it reads (tools): a body nested too deep
                raise _too_deep() from None
        except GpupoolError as err:
            extra = [(b"x-gpupool-request-id", request_id.encode())]
            if self.governor is not None and tenant_name is not None:
                extra += self.governor.rate_headers(tenant_name)
            await _send_error(send, err, extra)
            self.metrics.request_done(
                "none", "none", _outcome_of(err.status), err.code, self.clock() - now
            )
            return
        except ConnectionError:
            return  # the client left while sending its body
        outcome = RequestOutcome(ctx=ctx, estimate=estimate)
        task = asyncio.ensure_future(
            self._serve(ctx, body, body_bytes, chat, send, outcome, read_s, signals, wait_after_s)
        )
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if task not in done:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                outcome.outcome, outcome.reason = "aborted", "client_disconnect"
                outcome.status = 499
            else:
                task.result()
        finally:
            watcher.cancel()
            outcome.ended_at_s = self.clock()
            self._finish(outcome)

    async def _read_body(self, receive: Receive) -> bytes:
        try:
            async with asyncio.timeout(self._body_timeout_s):
                return await _read_body(receive, self._max_body_bytes)
        except TimeoutError:
            raise RequestTimeout(
                f"the request body did not arrive within {self._body_timeout_s:g} s",
                "body_timeout",
            ) from None

    def _parse(self, raw: bytes, chat: bool) -> dict[str, Any]:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as err:
            raise BadRequest(f"request body is not valid JSON: {err}", "invalid_json") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object", "invalid_body")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise BadRequest("missing required field 'model'", "missing_field", param="model")
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest(
                    "'messages' must be a non-empty list", "missing_field", param="messages"
                )
        elif "prompt" not in body:
            raise BadRequest("missing required field 'prompt'", "missing_field", param="prompt")
        if model != self.config.model.name:
            raise ModelNotFound(
                f"The model `{model}` does not exist. Served models: {self.config.model.name}.",
                "model_not_found",
                param="model",
            )
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise BadRequest("'stream' must be a boolean", "invalid_field", param="stream")
        return body

    # ----------------------------------------------------------------------------- serving

    async def _serve(
        self,
        ctx: RequestContext,
        body: dict[str, Any],
        body_bytes: bytes,
        chat: bool,
        send: Send,
        outcome: RequestOutcome,
        read_s: float,
        signals: StepSignals | None = None,
        wait_after_s: float | None = None,
    ) -> None:
        gp_headers = [
            (b"x-gpupool-request-id", ctx.request_id.encode()),
            (b"x-gpupool-pool", ctx.pool.encode()),
            (b"x-gpupool-class", ctx.class_name.encode()),
        ]
        changed = False
        if ctx.stream:
            options = body.get("stream_options")
            if not isinstance(options, dict) or not options.get("include_usage"):
                body["stream_options"] = {
                    **(options if isinstance(options, dict) else {}),
                    "include_usage": True,
                }
                changed = True
        engine_priority = self._engine_priority.get(ctx.pool)
        if engine_priority is not None and "priority" not in body:
            body["priority"] = engine_priority  # vLLM schedules lower values first
            changed = True
        path = "/v1/chat/completions" if chat else "/v1/completions"
        estimate = outcome.estimate
        assert estimate is not None
        refused: set[str] = set()  # refused the connection: never retried for this request
        tried: set[str] = set()  # failed otherwise: retried only when nothing else is left
        attempts = 0
        lease: Lease | None = None
        waiter: WaitComments | None = None
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
            if self.governor is not None and signals is not None:
                if waiter is not None:
                    waiter.reason = "token budget"
                try:
                    governed_s = await self.governor.enter(ctx, estimate, signals)
                finally:
                    gp_headers.extend(self.governor.rate_headers(ctx.tenant))
            if waiter is not None:
                waiter.reason = "queue"
            admit_start_s = outcome.admission_started_at_s = self.clock()
            lease = await self.admitter.admit(ctx, estimate)
            await self._stop_waiting(waiter, outcome)
            outcome.admitted_at_s = self.clock()
            queued_s = outcome.admitted_at_s - admit_start_s + governed_s
            self.metrics.overhead.observe(outcome.admitted_at_s - read_s - queued_s)
            while True:
                instance = lease.state
                instance_id = lease.instance_id
                outcome.instance_id = instance_id
                tried.add(instance_id)
                attempts += 1
                headers = [*gp_headers, (b"x-gpupool-instance", instance_id.encode())]
                remaining_s = ctx.deadline_s - self.clock()
                if remaining_s <= 0:
                    raise DeadlineExceeded(
                        "the request's deadline passed before dispatch", "deadline_exceeded"
                    )
                timeout = aiohttp.ClientTimeout(
                    total=min(remaining_s, self._upstream_timeout_s),
                    sock_connect=self._connect_timeout_s,
                    # aiohttp rounds timeouts over 5 s up to the next whole second: a deadline
                    # would end up to 1 s late
                    ceil_threshold=math.inf,
                )
                self.metrics.set_inflight(instance_id, instance.inflight)
                outcome.dispatched_at_s = self.clock()
                for obs in self.observers:
                    obs.dispatched(outcome)
                upstream_headers = {
                    "content-type": "application/json",
                    "x-request-id": ctx.request_id,
                }
                if instance.spec.api_key:
                    upstream_headers["authorization"] = "Bearer " + instance.spec.api_key
                try:
                    resp = await self.session.post(
                        instance.spec.url + path,
                        data=body_bytes,
                        headers=upstream_headers,
                        timeout=timeout,
                    )
                except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as err:
                    # nothing reached the engine: it is down or not listening
                    refused.add(instance_id)
                    self.fleet.record_failure(instance_id, f"connect failed: {err}", immediate=True)
                    lease = await self._retry(ctx, estimate, lease, refused, tried, attempts, err)
                    continue
                except TimeoutError:
                    raise DeadlineExceeded(
                        "the engine did not answer before the deadline", "deadline_exceeded"
                    ) from None
                except (aiohttp.ClientError, OSError) as err:
                    # reset or closed before the response head (often a stale pooled
                    # connection); no byte has reached the client, so try again
                    lease = await self._retry(ctx, estimate, lease, refused, tried, attempts, err)
                    continue
                try:
                    self.affinity.record(ctx.run_key, instance_id)
                    await self._relay(ctx, resp, send, headers, outcome, lease)
                except BaseException:
                    resp.close()  # drop the connection: vLLM aborts the sequence
                    raise
                else:
                    resp.release()  # fully read: the connection goes back to the pool
                return
        except Exception as exc:
            await self._stop_waiting(waiter, outcome)
            if isinstance(exc, GpupoolError):
                failure = exc
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
                await send(_error_event(failure))
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
            )
        finally:
            if waiter is not None:
                waiter.cancel()  # cancelled (the client left) while waiting
            if lease is not None:
                lease.release()
                self.metrics.set_inflight(lease.instance_id, lease.state.inflight)

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
    ) -> Lease:
        """A new lease for another attempt: another instance the request fits on now, else
        one that failed without refusing, else the queue again (never a refused instance)."""
        lease.release()
        self.metrics.set_inflight(lease.instance_id, lease.state.inflight)
        if attempts > self._max_retries:
            raise EngineFailure(
                f"could not reach an engine in pool {ctx.pool!r} after {attempts} attempt(s): "
                f"{err or type(err).__name__}",
                "engine_unreachable",
            ) from None
        self.metrics.retries.labels(ctx.pool).inc()
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
        for instance_id in self.admitter.pool_map.current.instances_for(pool):
            state = self.fleet.get(instance_id)
            if instance_id not in tried and state is not None and state.healthy:
                return True
        return False

    async def _relay(
        self,
        ctx: RequestContext,
        resp: aiohttp.ClientResponse,
        send: Send,
        headers: list[tuple[bytes, bytes]],
        outcome: RequestOutcome,
        lease: Lease,
    ) -> None:
        status = resp.status
        outcome.status = status
        if status != 200:
            raw = await _read_upstream(resp)
            if status >= 500:
                detail = _engine_message(raw)
                # this request's failure, not the engine's health: a client's bad input that
                # the engine did not catch must not take it out (scrapes and connects decide)
                log.warning("engine %s answered %d", outcome.instance_id, status)
                raise EngineFailure(
                    f"engine {outcome.instance_id} failed: {detail}", "engine_error"
                )
            outcome.outcome, outcome.reason = "client_error", str(status)
            if outcome.wait_stream_open:  # the engine's refusal, as the stream's one event
                outcome.wait_stream_open = False
                body = b"data: " + raw.strip() + b"\n\ndata: [DONE]\n\n"
                await send({"type": "http.response.body", "body": body, "more_body": False})
                return
            ctype = resp.headers.get("content-type", "application/json").encode()
            outcome.response_started = True
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [(b"content-type", ctype), *headers],
                }
            )
            await send({"type": "http.response.body", "body": raw})
            return
        if ctx.stream:
            await self._relay_stream(ctx, resp, send, headers, outcome, lease)
        else:
            await self._relay_body(ctx, resp, send, headers, outcome)

    async def _relay_body(
        self,
        ctx: RequestContext,
        resp: aiohttp.ClientResponse,
        send: Send,
        headers: list[tuple[bytes, bytes]],
        outcome: RequestOutcome,
    ) -> None:
        try:
            raw = await resp.read()
        except (aiohttp.ClientError, OSError) as err:
            raise EngineFailure(
                f"engine {outcome.instance_id} failed mid-response: {err}", "engine_error"
            ) from None
        except TimeoutError:
            raise DeadlineExceeded(
                "the engine did not finish before the deadline", "deadline_exceeded"
            ) from None
        outcome.ended_at_s = self.clock()  # a whole body: no first token to observe
        extra_headers: list[tuple[bytes, bytes]] = []
        try:
            usage = orjson.loads(raw).get("usage") or {}
            outcome.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            outcome.completion_tokens = int(usage.get("completion_tokens") or 0)
        except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
            pass
        extra: dict[str, Any] = {}
        for obs in self.observers:
            extra.update(obs.usage_extra(outcome))
        for key, value in extra.items():
            extra_headers.append(
                (f"x-gpupool-{key.replace('_', '-')}".encode(), str(value).encode())
            )
        if ctx.want_gpu_usage and extra:
            raw = _add_usage(raw, extra)
        await self._settle_before_final(outcome)
        outcome.response_started = True
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), *headers, *extra_headers],
            }
        )
        await send({"type": "http.response.body", "body": raw})

    async def _relay_stream(
        self,
        ctx: RequestContext,
        resp: aiohttp.ClientResponse,
        send: Send,
        headers: list[tuple[bytes, bytes]],
        outcome: RequestOutcome,
        lease: Lease,
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
        tail = b""  # the stream's `[DONE]` and anything after it: sent after the settle
        first_token_seen = False
        try:
            async for chunk in resp.content.iter_any():
                buf += chunk
                out: list[bytes] = []
                start = 0
                while (end := buf.find(_SSE_SEP, start)) >= 0:
                    event = buf[start : end + 2]
                    start = end + 2
                    if not first_token_seen and _is_first_token(event):
                        first_token_seen = True
                        outcome.first_token_at_s = self.clock()
                        lease.first_token(outcome.first_token_at_s)
                    if b'"usage"' in event:
                        event = self._usage_event(ctx, event, outcome)
                    if tail or event.startswith(b"data: [DONE]"):
                        tail += event
                    elif event:
                        out.append(event)
                if start:
                    buf = buf[start:]
                if out:
                    await send(
                        {"type": "http.response.body", "body": b"".join(out), "more_body": True}
                    )
        except (aiohttp.ClientError, OSError, TimeoutError) as err:
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
            await send(_error_event(error))
            return
        await self._settle_before_final(outcome)
        await send({"type": "http.response.body", "body": tail + buf, "more_body": False})

    async def _settle_before_final(self, outcome: RequestOutcome) -> None:
        """Awaited right before a response's final bytes (the non-streaming body, the
        stream's `[DONE]`): the observers' `settling` hooks, e.g. the ledger's durable commit
        (router/accounting_observer.py). A failing hook is logged; the response still ends."""
        for obs in self.observers:
            settling = getattr(obs, "settling", None)  # optional: RequestObserver's docstring
            if settling is None:
                continue
            try:
                await settling(outcome)
            except Exception:
                log.exception("request observer failed to settle %s", outcome.ctx.request_id)

    def _usage_event(self, ctx: RequestContext, event: bytes, outcome: RequestOutcome) -> bytes:
        """Record the usage; drop the usage-only event unless the client asked for it."""
        try:
            data = orjson.loads(event[5:].strip()) if event.startswith(b"data:") else None
        except orjson.JSONDecodeError:
            return event
        if not isinstance(data, dict) or not isinstance(data.get("usage"), dict):
            return event
        usage = data["usage"]
        outcome.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        outcome.completion_tokens = int(usage.get("completion_tokens") or 0)
        if data.get("choices"):
            return event  # continuous usage stats on a content event: keep it
        if not (ctx.client_wants_usage or ctx.want_gpu_usage):
            return b""
        outcome.ended_at_s = self.clock()
        if not ctx.want_gpu_usage:
            return event
        extra: dict[str, Any] = {}
        for obs in self.observers:
            extra.update(obs.usage_extra(outcome))
        if not extra:
            return event
        usage.update(extra)
        return b"data: " + orjson.dumps(data) + b"\n\n"

    def _finish(self, outcome: RequestOutcome) -> None:
        ctx = outcome.ctx
        if outcome.outcome == "ok" and outcome.status != 200:
            outcome.outcome = _outcome_of(outcome.status)
            outcome.reason = str(outcome.status)
        self.metrics.request_done(
            ctx.pool,
            ctx.class_name,
            outcome.outcome,
            outcome.reason,
            outcome.ended_at_s - ctx.received_at_s,
        )
        if outcome.outcome == "ok":
            if (ttft := outcome.ttft_s) is not None:
                self.metrics.observe_ttft(ctx.class_name, ttft)
            if (tpot := outcome.tpot_s) is not None:
                self.metrics.observe_tpot(ctx.class_name, tpot)
            if ctx.run_key is not None and outcome.instance_id is not None:
                self.affinity.record(
                    ctx.run_key,
                    outcome.instance_id,
                    outcome.prompt_tokens + outcome.completion_tokens,
                )
            if outcome.estimate is not None and outcome.prompt_tokens > 0:
                error = self.estimator.observe(
                    outcome.estimate,
                    class_name=ctx.class_name,
                    prompt_tokens=outcome.prompt_tokens,
                    completion_tokens=outcome.completion_tokens,
                )
                if error is not None:
                    self.metrics.observe_estimate_error(outcome.estimate.source, error)
        for obs in self.observers:
            try:
                obs.finished(outcome)
            except Exception:
                log.exception("request observer failed for %s", ctx.request_id)


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


def _outcome_of(status: int) -> str:
    if status == 429:
        return "rejected"
    if status == 504:
        return "timeout"
    if status == 499:
        return "aborted"
    if 400 <= status < 500:
        return "client_error"
    if status >= 500:
        return "engine_error"
    return "ok"


async def _read_body(receive: Receive, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionError("client disconnected")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLarge(
                f"request body larger than {max_bytes} bytes (router.max_body_bytes)",
                "body_too_large",
            )
        chunks.append(chunk)
        if not message.get("more_body"):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _read_upstream(resp: aiohttp.ClientResponse) -> bytes:
    try:
        return await resp.read()
    except (aiohttp.ClientError, OSError, TimeoutError):
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


def _error_event(err: GpupoolError) -> Message:
    """The last message of a started stream that failed: an OpenAI-shaped error event."""
    body = b"data: " + err.body() + b"\n\ndata: [DONE]\n\n"
    return {"type": "http.response.body", "body": body, "more_body": False}


async def _send_error(send: Send, err: GpupoolError, headers: list[tuple[bytes, bytes]]) -> None:
    body = err.body()
    await send(
        {
            "type": "http.response.start",
            "status": err.status,
            "headers": [(b"content-type", b"application/json"), *headers, *err.headers()],
        }
    )
    await send({"type": "http.response.body", "body": body})
