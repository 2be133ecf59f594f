"""A fast fake vLLM engine: a raw ASGI app that speaks the OpenAI API and exposes vLLM's metric
names, for unit tests and for measuring the router's own overhead. Never a stand-in for the
integration tests, which run real engines.

What it does, in vLLM 0.32's shapes:
- `POST /v1/chat/completions`, `POST /v1/completions`: streaming (SSE, optional usage chunk with
  `stream_options.include_usage`) and not; `max_tokens` output tokens of one word each;
  prompt tokens counted as whitespace-separated words; a prompt over `max_model_len_tokens`
  gets vLLM's 400; an unknown model gets vLLM's 404.
- `POST /v1/responses` (stream and not; each response is stored: `previous_response_id`
  continues it, an unknown one gets vLLM's 404), `GET /v1/responses/{id}`,
  `POST /v1/responses/{id}/cancel`, `POST /v1/messages` (stream and not),
  `POST /v1/messages/count_tokens` (`pools.testing.fake_protocols`).
- With `reasoning_tokens` > 0 every answer starts with that many reasoning deltas (chat:
  `delta.reasoning`; responses: `response.reasoning_text.delta`; messages: `thinking_delta`)
  before its `max_tokens` output tokens; the first comes after `ttft_s`, each next after
  `itl_s`.
- `GET /v1/models`, `GET /health`, `GET /metrics` (`vllm:kv_cache_usage_perc`,
  `vllm:num_requests_running|waiting`, `vllm:cache_config_info`, `vllm:num_preemptions_total`,
  TTFT and inter-token histograms).
- Behaviour is scripted through `FakeEngineState`: latencies, a failure mode for the next
  requests, and live counters tests can read (running, aborted, served).

Run standalone: `python -m pools.testing.fake_engine --port 9000 [--ttft-ms 0 --itl-ms 0
--reasoning-tokens 0]`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from pools.testing import fake_protocols as fp

__all__ = ["FakeEngineState", "main", "make_fake_engine"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_PID = os.getpid()
_RESPONSE_IDS = itertools.count(1)  # response and message ids, one sequence per process


@dataclass
class _Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(_BUCKETS_S) + 1))
    total: float = 0.0
    n: int = 0

    def observe(self, value_s: float) -> None:
        self.n += 1
        self.total += value_s
        for i, bound in enumerate(_BUCKETS_S):
            if value_s <= bound:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def render(self, name: str, labels: str) -> str:
        lines = [f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, count in zip(_BUCKETS_S, self.counts, strict=False):
            cumulative += count
            lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {float(cumulative)}')
        lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {float(self.n)}')
        lines.append(f"{name}_count{{{labels}}} {float(self.n)}")
        lines.append(f"{name}_sum{{{labels}}} {self.total}")
        return "\n".join(lines)


@dataclass
class FakeEngineState:
    """Scripted behaviour and live counters of one fake engine."""

    model: str = "tiny"
    max_model_len_tokens: int = 4096
    block_size: int = 16
    num_gpu_blocks: int = 1024
    ttft_s: float = 0.0
    itl_s: float = 0.0
    default_max_tokens: int = 16
    # failure scripting: "http500" answers 500; "drop_midstream" closes after the first chunk;
    # "hang" never answers. Applies to the next `fail_next` requests (-1: all).
    failure: str | None = None
    fail_next: int = 0
    metrics_fail: bool = False
    health_fail: bool = False
    legacy_metric_names: bool = False  # vllm:gpu_cache_usage_perc, time_per_output_token
    # False: /metrics has no vllm:cache_config_info (an older vLLM, a proxy, another server)
    cache_config_info: bool = True
    reasoning_tokens: int = 0  # reasoning deltas before the output (a reasoning parser's)
    # merged into every chat/completions usage it reports, streamed or whole: an engine whose
    # counts are not counts ({"prompt_tokens": "many"}), for the router's guards
    usage_override: dict[str, Any] = field(default_factory=dict)
    # while set to an unset event, chat and completions requests hold their sequence (and its
    # KV blocks) before generating, until it is set: a test's "engine busy" without a timer
    gate: asyncio.Event | None = None
    # stored responses (the Responses API): id -> (context tokens, body)
    responses: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    # live counters
    running: int = 0
    peak_running: int = 0  # the most sequences ever running at once
    waiting: int = 0
    served: int = 0
    aborted: int = 0
    preemptions: int = 0
    requests_seen: list[dict[str, Any]] = field(default_factory=list)
    keep_requests: bool = True
    used_blocks: int = 0
    ttft_hist: _Histogram = field(default_factory=_Histogram)
    itl_hist: _Histogram = field(default_factory=_Histogram)
    prompt_hist: _Histogram = field(default_factory=_Histogram)  # request prompt tokens
    prefill_hist: _Histogram = field(default_factory=_Histogram)  # request prefill time

    def take_failure(self) -> str | None:
        if self.failure is None or self.fail_next == 0:
            return None
        if self.fail_next > 0:
            self.fail_next -= 1
        return self.failure

    def metrics_text(self) -> str:
        labels = f'engine="0",model_name="{self.model}"'
        usage = min(1.0, self.used_blocks / self.num_gpu_blocks) if self.num_gpu_blocks else 0.0
        usage_name = (
            "vllm:gpu_cache_usage_perc"
            if self.legacy_metric_names
            else ("vllm:kv_cache_usage_perc")
        )
        itl_name = (
            "vllm:time_per_output_token_seconds"
            if self.legacy_metric_names
            else ("vllm:inter_token_latency_seconds")
        )
        parts = [
            f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{labels}}} "
            f"{float(self.running)}",
            f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{{labels}}} "
            f"{float(self.waiting)}",
            f"# TYPE {usage_name} gauge\n{usage_name}{{{labels}}} {usage}",
            f"# TYPE vllm:num_preemptions_total counter\nvllm:num_preemptions_total{{{labels}}} "
            f"{float(self.preemptions)}",
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{self.block_size}",cache_dtype="auto",'
            f'engine="0",enable_prefix_caching="True",gpu_memory_utilization="0.9",'
            f'num_gpu_blocks="{self.num_gpu_blocks}",num_cpu_blocks="None"}} 1.0'
            if self.cache_config_info
            else "",
            self.ttft_hist.render("vllm:time_to_first_token_seconds", labels),
            self.itl_hist.render(itl_name, labels),
            self.prompt_hist.render("vllm:request_prompt_tokens", labels),
            self.prefill_hist.render("vllm:request_prefill_time_seconds", labels),
        ]
        return "\n".join(parts) + "\n"


def _error_body(message: str, type_: str, code: int, param: str | None = None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


def _prompt_tokens(body: dict[str, Any], chat: bool) -> int:
    if chat:
        text = " ".join(
            str(m.get("content")) if isinstance(m.get("content"), str) else ""
            for m in body.get("messages") or []
            if isinstance(m, dict)
        )
        return len(text.split()) + 4 * len(body.get("messages") or [])
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        prompt = " ".join(str(p) for p in prompt)
    return len(str(prompt).split()) + 1


_PROTOCOLS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
}


def make_fake_engine(state: FakeEngineState | None = None) -> Callable[..., Awaitable[None]]:
    """Build the ASGI app. Pass a `FakeEngineState` to script it and read its counters."""
    st = state or FakeEngineState()

    async def respond(
        send: Send, status: int, body: bytes, ctype: bytes = b"application/json"
    ) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def read_body(receive: Receive) -> bytes:
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ConnectionError("client went away")
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                return b"".join(chunks)

    async def generate(scope: Scope, receive: Receive, send: Send, proto: str) -> None:
        chat = proto == "chat"
        try:
            raw = await read_body(receive)
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            await respond(send, 400, _error_body("invalid JSON", "BadRequestError", 400))
            return
        if not isinstance(body, dict):
            await respond(send, 400, _error_body("not an object", "BadRequestError", 400))
            return
        if st.keep_requests:
            st.requests_seen.append(body)
        if body.get("model") != st.model:
            msg = f"The model `{body.get('model')}` does not exist. Valid aliases: {st.model}."
            await respond(send, 404, _error_body(msg, "NotFoundError", 404, "model"))
            return
        if proto in ("responses", "messages"):
            await _agent_protocol(send, body, proto)
            return
        prompt_tokens = _prompt_tokens(body, chat)
        if prompt_tokens > st.max_model_len_tokens:
            msg = (
                f"This model's maximum context length is {st.max_model_len_tokens} tokens. However,"
                f" your prompt contains at least {prompt_tokens} input tokens, which exceeds this "
                "limit even without any output tokens. Please reduce the length of the input "
                "prompt."
            )
            await respond(send, 400, _error_body(msg, "BadRequestError", 400, "input_tokens"))
            return
        failure = st.take_failure()
        if await _failed(send, failure):
            return
        max_tokens = int(
            body.get("max_tokens") or body.get("max_completion_tokens") or st.default_max_tokens
        )
        if max_tokens > st.max_model_len_tokens:  # vLLM 0.32 refuses it, whatever the prompt
            msg = (
                f"max_tokens={max_tokens} cannot be greater than max_model_len="
                f"{st.max_model_len_tokens}. Please request fewer output tokens."
            )
            await respond(send, 400, _error_body(msg, "BadRequestError", 400, "max_tokens"))
            return
        blocks = math.ceil((prompt_tokens + max_tokens) / st.block_size)
        st.running += 1
        st.peak_running = max(st.peak_running, st.running)
        st.used_blocks += blocks
        started = time.perf_counter()
        try:
            if st.gate is not None:
                await st.gate.wait()
            if body.get("stream"):
                await _stream(send, receive, body, chat, prompt_tokens, max_tokens, failure)
            else:
                await _complete(send, body, chat, prompt_tokens, max_tokens)
            st.served += 1
            st.ttft_hist.observe(st.ttft_s)
            st.prompt_hist.observe(float(prompt_tokens))
            st.prefill_hist.observe(st.ttft_s)
            if max_tokens > 1:
                st.itl_hist.observe(st.itl_s)
        except (ConnectionError, asyncio.CancelledError):
            st.aborted += 1
            raise
        finally:
            st.running -= 1
            st.used_blocks -= blocks
            del started

    async def _complete(
        send: Send, body: dict[str, Any], chat: bool, prompt_tokens: int, max_tokens: int
    ) -> None:
        delay = st.ttft_s + st.itl_s * max(0, max_tokens - 1)
        if delay:
            await asyncio.sleep(delay)
        text = " tok" * max_tokens
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": max_tokens,
            "total_tokens": prompt_tokens + max_tokens,
            **st.usage_override,
        }
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "length",
            }
            out = {
                "id": "chatcmpl-fake",
                "object": "chat.completion",
                "created": 0,
                "model": st.model,
                "choices": [choice],
                "usage": usage,
            }
        else:
            out = {
                "id": "cmpl-fake",
                "object": "text_completion",
                "created": 0,
                "model": st.model,
                "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                "usage": usage,
            }
        await respond(send, 200, orjson.dumps(out))

    async def _stream(
        send: Send,
        receive: Receive,
        body: dict[str, Any],
        chat: bool,
        prompt_tokens: int,
        max_tokens: int,
        failure: str | None,
    ) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        obj = "chat.completion.chunk" if chat else "text_completion"
        cid = "chatcmpl-fake" if chat else "cmpl-fake"

        def chunk(i: int, last: bool) -> bytes:
            if chat:
                delta: dict[str, Any] = (
                    {"reasoning": " think"} if i < st.reasoning_tokens else {"content": " tok"}
                )
                if i == 0:
                    delta["role"] = "assistant"
                choice: dict[str, Any] = {
                    "index": 0,
                    "delta": delta,
                    "finish_reason": "length" if last else None,
                }
            else:
                choice = {"index": 0, "text": " tok", "finish_reason": "length" if last else None}
            data = {"id": cid, "object": obj, "created": 0, "model": st.model, "choices": [choice]}
            return b"data: " + orjson.dumps(data) + b"\n\n"

        if st.ttft_s:
            await asyncio.sleep(st.ttft_s)
        generated = max_tokens + (st.reasoning_tokens if chat else 0)
        for i in range(generated):
            if i and st.itl_s:
                await asyncio.sleep(st.itl_s)
            await send(
                {
                    "type": "http.response.body",
                    "body": chunk(i, i == generated - 1),
                    "more_body": True,
                }
            )
            if failure == "drop_midstream":
                raise ConnectionError("scripted mid-stream failure")
        opts = body.get("stream_options") or {}
        if opts.get("include_usage"):
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": generated,
                "total_tokens": prompt_tokens + generated,
                **st.usage_override,
            }
            data = {
                "id": cid,
                "object": obj,
                "created": 0,
                "model": st.model,
                "choices": [],
                "usage": usage,
            }
            await send(
                {
                    "type": "http.response.body",
                    "body": b"data: " + orjson.dumps(data) + b"\n\n",
                    "more_body": True,
                }
            )
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def _failed(send: Send, failure: str | None) -> bool:
        """Answer a scripted failure before any output ("http500", "hang"); True if it did."""
        if failure == "http500":
            await respond(send, 500, _error_body("EngineCore died", "InternalServerError", 500))
            return True
        if failure == "hang":
            await asyncio.sleep(3600)
            return True
        return False

    async def _agent_protocol(send: Send, body: dict[str, Any], proto: str) -> None:
        """/v1/responses and /v1/messages: checks, counters, the body or the stream."""
        responses = proto == "responses"
        refusal = fp.responses_refusal(body) if responses else fp.messages_refusal(body)
        if refusal is not None:
            await respond(send, *refusal)
            return
        stored_tokens = 0
        previous = body.get("previous_response_id") if responses else None
        if previous is not None:
            if previous not in st.responses:
                msg = f"Response with id '{previous}' not found."
                await respond(send, 404, _error_body(msg, "invalid_request_error", 404, "id"))
                return
            stored_tokens = st.responses[previous][0]
        prompt = (
            fp.responses_prompt_tokens(body, stored_tokens)
            if responses
            else fp.messages_prompt_tokens(body)
        )
        field = "max_output_tokens" if responses else "max_tokens"
        limit = body.get(field)
        output = limit if isinstance(limit, int) and limit > 0 else st.default_max_tokens
        if output > st.max_model_len_tokens:  # vLLM 0.32 refuses it, whatever the prompt
            msg = (
                f"{field}={output} cannot be greater than max_model_len="
                f"{st.max_model_len_tokens}. Please request fewer output tokens."
            )
            await respond(send, *fp.too_long(msg, anthropic=not responses))
            return
        if prompt >= st.max_model_len_tokens:
            msg = f"This model's maximum context length is {st.max_model_len_tokens} tokens."
            await respond(send, *fp.too_long(msg, anthropic=not responses))
            return
        output = min(output, st.max_model_len_tokens - prompt)  # stops at the context's end
        failure = st.take_failure()
        if await _failed(send, failure):
            return
        st.served += 1
        # unique across every fake engine of the process (and of others: the pid), as a real
        # engine's are: `id(st) % 65536` collided between two engines' states on a CI run
        rid = ("resp_" if responses else "msg_") + f"{_PID:x}{next(_RESPONSE_IDS):08x}"
        reasoning = st.reasoning_tokens
        if responses:
            st.responses[rid] = (
                prompt + reasoning + output,
                fp.responses_body(rid, st.model, prompt, reasoning, output),
            )
        blocks = math.ceil((prompt + reasoning + output) / st.block_size)
        st.running += 1
        st.peak_running = max(st.peak_running, st.running)
        st.used_blocks += blocks
        try:
            if not body.get("stream"):
                delay = st.ttft_s + st.itl_s * max(0, reasoning + output - 1)
                if delay:
                    await asyncio.sleep(delay)
                make = fp.responses_body if responses else fp.messages_body
                await respond(send, 200, make(rid, st.model, prompt, reasoning, output))
                return
            events = (fp.responses_events if responses else fp.messages_events)(
                rid, st.model, prompt, reasoning, output
            )
            await _send_events(send, events, failure)
        except (ConnectionError, asyncio.CancelledError):
            st.aborted += 1
            raise
        finally:
            st.running -= 1
            st.used_blocks -= blocks

    async def _send_events(send: Send, events: list[bytes], failure: str | None) -> None:
        """SSE events, the first delta after `ttft_s`, each next one after `itl_s`."""
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        deltas = 0
        for event in events:
            name = event.split(b"\n", 1)[0]
            if name.endswith((b".delta", b"content_block_delta")):
                await asyncio.sleep(st.itl_s if deltas else st.ttft_s)
                deltas += 1
            await send({"type": "http.response.body", "body": event, "more_body": True})
            if failure == "drop_midstream" and deltas:
                raise ConnectionError("scripted mid-stream failure")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def count_tokens(receive: Receive, send: Send) -> None:
        try:
            body = orjson.loads(await read_body(receive))
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            await respond(send, 400, fp.messages_refusal({})[1])  # type: ignore[index]
            return
        await respond(send, 200, orjson.dumps({"input_tokens": fp.messages_prompt_tokens(body)}))

    async def stored_response(send: Send, path: str) -> None:
        rid = path[len("/v1/responses/") :].removesuffix("/cancel")
        stored = st.responses.get(rid)
        if stored is None:
            msg = f"Response with id '{rid}' not found."
            await respond(send, 404, _error_body(msg, "invalid_request_error", 404, "response_id"))
            return
        await respond(send, 200, stored[1])

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        method = scope["method"]
        if method == "POST" and path in _PROTOCOLS:
            await generate(scope, receive, send, _PROTOCOLS[path])
        elif method == "POST" and path == "/v1/messages/count_tokens":
            await count_tokens(receive, send)
        elif path.startswith("/v1/responses/"):
            await stored_response(send, path)
        elif path == "/health":
            await respond(send, 503 if st.health_fail else 200, b"")
        elif path == "/metrics":
            if st.metrics_fail:
                await respond(send, 500, b"metrics unavailable", b"text/plain")
            else:
                await respond(send, 200, st.metrics_text().encode(), b"text/plain; version=0.0.4")
        elif path == "/v1/models":
            models = {
                "object": "list",
                "data": [
                    {
                        "id": st.model,
                        "object": "model",
                        "owned_by": "vllm",
                        "max_model_len": st.max_model_len_tokens,
                    }
                ],
            }
            await respond(send, 200, orjson.dumps(models))
        else:
            await respond(send, 404, _error_body("Not Found", "NotFoundError", 404))

    app.state = st  # type: ignore[attr-defined]
    return app


def main(argv: list[str] | None = None) -> None:
    """Serve a fake engine over HTTP (uvicorn with httptools and uvloop)."""
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--ttft-ms", type=float, default=0.0)
    parser.add_argument("--itl-ms", type=float, default=0.0)
    parser.add_argument(
        "--max-tokens", type=int, default=16, help="default when a request has none"
    )
    parser.add_argument(
        "--num-gpu-blocks", type=int, default=1024, help="KV blocks the engine reports"
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--reasoning-tokens",
        type=int,
        default=0,
        help="reasoning deltas before each answer's output (chat, responses, messages)",
    )
    parser.add_argument(
        "--no-cache-config-info",
        action="store_true",
        help="omit vllm:cache_config_info from /metrics (an engine of unknown KV capacity)",
    )
    args = parser.parse_args(argv)
    state = FakeEngineState(
        model=args.model,
        num_gpu_blocks=args.num_gpu_blocks,
        block_size=args.block_size,
        cache_config_info=not args.no_cache_config_info,
        reasoning_tokens=args.reasoning_tokens,
        ttft_s=args.ttft_ms / 1e3,
        itl_s=args.itl_ms / 1e3,
        default_max_tokens=args.max_tokens,
        keep_requests=False,
    )
    uvicorn.run(
        make_fake_engine(state),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        http="httptools",
        loop="uvloop",
        lifespan="on",
    )


if __name__ == "__main__":
    main()
