"""Test seams for the harness: `serve_asgi` (from `pools.testing.serve`: the runner speaks
aiohttp, so tests need a real socket) and a gpupool-like wrapper around the fake engine that
answers `GET /v1/runs/{run_id}`, tags responses with `x-gpupool-*` headers and can reject a
class with gpupool's 429 body and `Retry-After`.

    async with serve_asgi(GpupoolLike(make_fake_engine(state))) as url:
        result = await Runner(plan, Target("t", url), run_id_prefix="t").run()
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from pools.testing.serve import serve_asgi

__all__ = ["GpupoolLike", "serve_asgi"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass
class GpupoolLike:
    """Wraps an engine ASGI app with the parts of gpupool's surface the harness reads."""

    engine: App
    reject_agent: bool = False  # answer requests with `tools` with a 429
    retry_after_s: int = 2
    gpu_seconds_per_step: float = 0.25
    steps_by_run: dict[str, int] = field(default_factory=dict)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.engine(scope, receive, send)
            return
        path: str = scope["path"]
        if scope["method"] == "GET" and path.startswith("/v1/runs/"):
            run_id = path.removeprefix("/v1/runs/")
            steps = self.steps_by_run.get(run_id)
            if steps is None:
                await _json(send, 404, {"error": {"code": "run_not_found", "message": "no run"}})
            else:
                totals = {"requests": steps, "gpu_seconds": steps * self.gpu_seconds_per_step}
                await _json(
                    send, 200, {"object": "gpupool.run", "run_id": run_id, "totals": totals}
                )
            return
        if not (scope["method"] == "POST" and path == "/v1/chat/completions"):
            await self.engine(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        raw = b"".join(chunks)
        body = orjson.loads(raw)
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        is_agent = bool(body.get("tools"))
        if is_agent and self.reject_agent:
            await _json(
                send,
                429,
                {
                    "error": {
                        "type": "capacity_exceeded",
                        "code": "queue_full",
                        "message": "agent pool queue is full",
                        "retryable": True,
                        "retry_after_seconds": self.retry_after_s,
                    }
                },
                extra=[(b"retry-after", str(self.retry_after_s).encode())],
            )
            return
        step_run_id = headers.get("x-gpupool-run-id")
        if step_run_id:
            self.steps_by_run[step_run_id] = self.steps_by_run.get(step_run_id, 0) + 1
        pool = b"agent" if is_agent else b"normal"

        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        async def tag(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-gpupool-pool", pool),
                    (b"x-gpupool-instance", b"fake-0"),
                ]
            await send(message)

        await self.engine(scope, replay, tag)


async def _json(
    send: Send, status: int, data: Any, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = orjson.dumps(data)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(extra or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
