"""One streaming chat completion over aiohttp, timed the way `vllm bench serve` times it.

`stream_chat` fills a `RequestRecord` in place as bytes arrive (so a request cancelled at the
drain deadline keeps what it measured) and returns the generated text, which an agent run
appends to its context. Every chunk carrying `choices` is a token event: the first sets TTFT,
each later one adds an inter-token gap, the last sets E2E; the usage chunk gives the token
counts. Errors never raise: a non-200 answer records its status, `error.code` (or
`error.type`) and `Retry-After`; a mid-stream error event, a stream without `[DONE]`, a
connect failure or a timeout record an error code of their own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from benchmarks.records import RequestRecord

__all__ = ["parse_error_body", "parse_retry_after_s", "stream_chat"]

_MAX_ERROR_BODY_BYTES = 64 * 1024


def parse_retry_after_s(value: str | None) -> float | None:
    """`Retry-After` in seconds (the delta-seconds form; an HTTP date is not expected here)."""
    if value is None:
        return None
    try:
        return float(value.strip())
    except ValueError:
        return None


def parse_error_body(raw: bytes) -> tuple[str | None, str | None]:
    """(error code, message) from an OpenAI-style error body; the code falls back to the type."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None, raw[:200].decode("utf-8", "replace") or None
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict):
        detail = data.get("detail") if isinstance(data, dict) else None
        return None, str(detail)[:200] if detail is not None else None
    code = err.get("code")
    if code is None:
        code = err.get("type")
    message = err.get("message")
    return (None if code is None else str(code)), (None if message is None else str(message)[:200])


def _delta_text(choice: dict[str, Any]) -> str:
    delta = choice.get("delta") or {}
    parts = [delta.get("content") or "", delta.get("reasoning_content") or ""]
    for call in delta.get("tool_calls") or []:
        fn = call.get("function") or {}
        parts.append(fn.get("arguments") or "")
    return "".join(parts)


async def stream_chat(
    session: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    body: dict[str, Any],
    record: RequestRecord,
    clock: Callable[[], float],
    start: float,
    timeout_s: float,
) -> str:
    """POST `body` (which must ask for `stream` and usage) and time the stream into `record`.

    `clock` is monotonic seconds; `start` is the benchmark's start on that clock, so
    `record.send_s` is an offset from it.
    """
    text: list[str] = []
    sent = clock()
    record.send_s = sent - start
    last_token = sent
    done = False
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url, data=orjson.dumps(body), headers=headers) as resp:
                record.status = resp.status
                record.pool = resp.headers.get("x-gpupool-pool")
                record.instance = resp.headers.get("x-gpupool-instance")
                record.retry_after_s = parse_retry_after_s(resp.headers.get("Retry-After"))
                if resp.status != 200:
                    raw = await resp.content.read(_MAX_ERROR_BODY_BYTES)
                    record.error_code, record.error = parse_error_body(raw)
                    if record.error_code is None:
                        record.error_code = f"http_{resp.status}"
                    return ""
                buffer = b""
                async for chunk in resp.content.iter_any():
                    now = clock()
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        line = line.strip()
                        if not line.startswith(b"data:"):
                            continue  # blank separators, SSE comments (pings), event names
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            done = True
                            continue
                        data = orjson.loads(payload)
                        if choices := data.get("choices"):
                            if record.ttft_ms is None:
                                record.ttft_ms = (now - sent) * 1e3
                            else:
                                record.itl_ms.append((now - last_token) * 1e3)
                            last_token = now
                            record.e2e_ms = (now - sent) * 1e3
                            text.append(_delta_text(choices[0]))
                        elif usage := data.get("usage"):
                            record.prompt_tokens = usage.get("prompt_tokens")
                            record.output_tokens = usage.get("completion_tokens")
                        elif err := data.get("error"):
                            code = err.get("code") if isinstance(err, dict) else None
                            record.error_code = str(code) if code is not None else "stream_error"
                            record.error = (
                                str(err.get("message"))[:200]
                                if isinstance(err, dict)
                                else str(err)[:200]
                            )
        if not done and record.error_code is None:
            record.error_code = "stream_incomplete"
            record.error = "the stream ended without [DONE]"
        elif record.ttft_ms is None and record.error_code is None:
            record.error_code = "no_tokens"
    except TimeoutError:
        record.error_code = "client_timeout"
        record.error = f"no complete answer within {timeout_s:g} s"
    except aiohttp.ClientConnectorError as err:
        record.error_code = "connect_error"
        record.error = str(err)[:200]
    except (aiohttp.ClientError, orjson.JSONDecodeError) as err:
        record.error_code = "transport_error"
        record.error = f"{type(err).__name__}: {err}"[:200]
    except asyncio.CancelledError:
        record.error_code = "cancelled_at_drain"
        record.error = "still running at the drain deadline"
        raise
    return "".join(text)
