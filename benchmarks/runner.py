"""The open-loop runner: sends a `Plan` to one target on schedule and records every request.

Arrivals never wait for completions: each chat request and each agent run is its own task,
started at its planned offset. An agent run sends its steps one after another (context grows
by the answer and a tool result; a tool wait in between), with `tools` in the body and an
`x-gpupool-run-id` header. Arrivals stop at `duration_s`; in-flight work (later steps of runs
included) then has `drain_timeout_s` before it is cancelled and recorded as
`cancelled_at_drain`. Afterwards each run's GPU-seconds are read from the target's
`GET /v1/runs/{run_id}` where it answers 200 with a number `totals.gpu_seconds` (gpupool's
shape) or `gpu_seconds`.

The HTTP client is aiohttp with no connection limit, so thousands of requests can be in flight;
the harness's own lateness against the schedule is reported as `max_send_lag_ms`.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from benchmarks.client import stream_chat
from benchmarks.records import RequestRecord, RunRecord, TargetResult
from router.simulate.workload import AgentRunPlan, ChatRequestPlan, Plan

__all__ = ["Runner", "Target", "gpu_seconds_of"]

log = logging.getLogger(__name__)

_RUN_QUERY_TIMEOUT_S = 5.0
_CONTEXT_MARGIN_TOKENS = 32  # template tokens a new assistant + tool turn adds


@dataclass(frozen=True)
class Target:
    """An OpenAI-compatible endpoint. `url` is the base (a trailing `/v1` is accepted)."""

    name: str
    url: str
    model: str = "tiny"
    api_key: str | None = None
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def base_url(self) -> str:
        base = self.url.rstrip("/")
        return base[: -len("/v1")] if base.endswith("/v1") else base

    @property
    def chat_url(self) -> str:
        return f"{self.base_url}/v1/chat/completions"

    def run_url(self, run_id: str) -> str:
        return f"{self.base_url}/v1/runs/{run_id}"

    def request_headers(self, extra: tuple[tuple[str, str], ...] = ()) -> dict[str, str]:
        headers = {"content-type": "application/json", **dict(self.headers), **dict(extra)}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        return headers


def gpu_seconds_of(run: Any) -> float | None:
    """GPU-seconds from a `GET /v1/runs/{run_id}` answer: gpupool's `totals.gpu_seconds`, or a
    top-level `gpu_seconds`; None when neither is a number."""
    if not isinstance(run, dict):
        return None
    totals = run.get("totals")
    for value in (
        totals.get("gpu_seconds") if isinstance(totals, dict) else None,
        run.get("gpu_seconds"),
    ):
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class Runner:
    """Runs one plan against one target. Single use: build, `await run()`, read the result."""

    def __init__(
        self,
        plan: Plan,
        target: Target,
        *,
        run_id_prefix: str,
        clock: Callable[[], float] = time.perf_counter,
        progress: bool = True,
        settle_s: float = 1.0,
    ) -> None:
        self._plan = plan
        self._target = target
        self._prefix = run_id_prefix
        self._clock = clock
        self._progress = progress
        self._settle_s = settle_s
        self._requests: list[RequestRecord] = []
        self._runs: list[RunRecord] = []
        self._start = 0.0
        self._max_lag_s = 0.0
        self._bar: Any = _NoProgress()
        self._session: aiohttp.ClientSession | None = None

    # --- requests -------------------------------------------------------------------------

    def _body(
        self,
        messages: list[dict[str, Any]],
        max_tokens: int,
        tools: tuple[dict[str, Any], ...] = (),
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self._target.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "ignore_eos": True,  # vLLM: exact output lengths
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if tools:
            body["tools"] = list(tools)
            body["tool_choice"] = "auto"
        return body

    async def _send(
        self,
        record: RequestRecord,
        body: dict[str, Any],
        extra_headers: tuple[tuple[str, str], ...],
    ) -> str:
        assert self._session is not None
        self._requests.append(record)
        self._max_lag_s = max(self._max_lag_s, self._clock() - self._start - record.scheduled_s)
        try:
            return await stream_chat(
                self._session,
                self._target.chat_url,
                self._target.request_headers(extra_headers),
                body,
                record,
                self._clock,
                self._start,
                self._plan.scenario.request_timeout_s,
            )
        finally:
            self._bar.update(1)

    async def _chat(self, plan: ChatRequestPlan) -> None:
        spec = self._plan.class_spec(plan.class_name)
        record = RequestRecord(
            plan.class_name,
            "chat",
            plan.t_s,
            planned_prompt_tokens=plan.prompt_tokens,
            planned_output_tokens=plan.output_tokens,
        )
        body = self._body([{"role": "user", "content": plan.prompt_text}], plan.output_tokens)
        await self._send(record, body, spec.headers)

    async def _agent_run(self, plan: AgentRunPlan) -> None:
        spec = self._plan.class_spec(plan.class_name)
        run_id = f"{self._prefix}-{plan.class_name}-{plan.index:05d}"
        run = RunRecord(
            plan.class_name, run_id, plan.t_s, len(plan.steps), start_s=self._clock() - self._start
        )
        self._runs.append(run)
        headers = (*spec.headers, ("x-gpupool-run-id", run_id))
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": plan.system_text},
            {"role": "user", "content": plan.user_text},
        ]
        scheduled_s = plan.t_s
        try:
            for k, step in enumerate(plan.steps, start=1):
                record = RequestRecord(
                    plan.class_name,
                    "agent",
                    scheduled_s,
                    run_id=run_id,
                    step=k,
                    planned_prompt_tokens=plan.prompt_tokens if k == 1 else 0,
                    planned_output_tokens=step.output_tokens,
                )
                run.steps_sent += 1
                text = await self._send(
                    record, self._body(messages, step.output_tokens, plan.tools), headers
                )
                if not record.ok:
                    run.outcome = "failed"
                    self._bar.update(len(plan.steps) - k)
                    return
                run.steps_ok += 1
                run.end_s = record.end_s
                if k == len(plan.steps):
                    run.outcome = "completed"
                    return
                call_id = f"call_{k}"
                messages.append(
                    {
                        "role": "assistant",
                        "content": text,
                        "tool_calls": [
                            {
                                "id": call_id,
                                "type": "function",
                                "function": {
                                    "name": step.tool_name,
                                    "arguments": orjson.dumps({"arg": f"step {k}"}).decode(),
                                },
                            }
                        ],
                    }
                )
                messages.append(
                    {"role": "tool", "tool_call_id": call_id, "content": step.tool_result_text}
                )
                context = (
                    (record.prompt_tokens or record.planned_prompt_tokens)
                    + (record.output_tokens or step.output_tokens)
                    + step.tool_result_tokens
                    + _CONTEXT_MARGIN_TOKENS
                )
                if context + plan.steps[k].output_tokens > plan.max_context_tokens:
                    run.outcome = "context_limit"
                    self._bar.update(len(plan.steps) - k)
                    return
                await asyncio.sleep(step.tool_wait_s)
                scheduled_s = self._clock() - self._start
        except asyncio.CancelledError:
            run.outcome = "cancelled"
            raise

    # --- the schedule ---------------------------------------------------------------------

    async def _query_run(self, run: RunRecord, limit: asyncio.Semaphore) -> None:
        assert self._session is not None
        async with limit:
            try:
                async with (
                    asyncio.timeout(_RUN_QUERY_TIMEOUT_S),
                    self._session.get(
                        self._target.run_url(run.run_id), headers=self._target.request_headers()
                    ) as resp,
                ):
                    if resp.status != 200:
                        return
                    data = orjson.loads(await resp.read())
            except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError):
                return
        run.gpu_seconds = gpu_seconds_of(data)

    async def run(self) -> TargetResult:
        plan = self._plan
        events: list[tuple[float, ChatRequestPlan | AgentRunPlan]] = sorted(
            [(c.t_s, c) for c in plan.chat] + [(r.t_s, r) for r in plan.runs],
            key=lambda e: e[0],
        )
        if self._progress:
            from tqdm import tqdm

            self._bar = tqdm(
                total=plan.total_requests,
                file=sys.stderr,
                unit="req",
                desc=self._target.name,
                dynamic_ncols=True,
            )
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
        tasks: set[asyncio.Task[None]] = set()
        cancelled = 0
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            self._session = session
            self._start = self._clock()
            deadline = self._start + plan.scenario.duration_s + plan.scenario.drain_timeout_s
            for t_s, item in events:
                delay = self._start + t_s - self._clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                coro = (
                    self._chat(item)
                    if isinstance(item, ChatRequestPlan)
                    else (self._agent_run(item))
                )
                tasks.add(asyncio.create_task(coro))
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - self._clock()))
                for task in pending:
                    task.cancel()
                cancelled = len(pending)
                if pending:
                    log.warning(
                        "%s: %d tasks still running at the drain deadline; cancelled",
                        self._target.name,
                        cancelled,
                    )
                    await asyncio.gather(*pending, return_exceptions=True)
                for task in tasks - pending:
                    if task.exception() is not None:  # a bug in the harness, not the target
                        raise task.exception()  # type: ignore[misc]
            wall_s = self._clock() - self._start
            self._bar.close()
            if self._runs:
                await asyncio.sleep(self._settle_s)  # the ledger writes in batches
                limit = asyncio.Semaphore(32)
                await asyncio.gather(*(self._query_run(r, limit) for r in self._runs))
        self._requests.sort(key=lambda r: r.send_s)
        self._runs.sort(key=lambda r: r.scheduled_s)
        return TargetResult(
            name=self._target.name,
            url=self._target.url,
            wall_s=wall_s,
            requests=self._requests,
            runs=self._runs,
            cancelled_at_drain=cancelled,
            max_send_lag_ms=self._max_lag_s * 1e3,
        )
