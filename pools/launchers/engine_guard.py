"""The ASGI middleware gpupool adds to every vLLM engine it starts (`--middleware
pools.launchers.engine_guard.EngineKeyGuard`): each request needs `Authorization: Bearer
<the engine's key>` (`VLLM_API_KEY` in the engine's environment), except `/health` and
`/metrics`.

Why vLLM's own key is not enough: its `--api-key` / `VLLM_API_KEY` check covers only paths under
`/v1`, `/v2`, `/inference` and `/cohere` (vllm/entrypoints/serve/middleware/authenticate.py,
vLLM 0.32). `/invocations` (SageMaker's entry to the same chat and completion handlers),
`/tokenize`, `/detokenize`, `/pooling`, `/classify`, `/score`, `/rerank`, `/ping`, `/version`
and the rest answer anyone, so a local process could use the engine around the router's
authentication and accounting. Left open here: `/health` (liveness probes) and `/metrics`
(engine counters, no prompts or tenants; the router scrapes it).

Runs inside the engine's process, which imports it from the gpupool installation it was
started from (the same Python); standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["GUARD_MIDDLEWARE", "OPEN_PATHS", "EngineKeyGuard"]

GUARD_MIDDLEWARE = "pools.launchers.engine_guard.EngineKeyGuard"  # for vLLM's --middleware
OPEN_PATHS = frozenset({"/health", "/metrics", "/metrics/"})

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_REFUSAL = json.dumps(
    {
        "error": {
            "message": "this engine needs its API key (Authorization: Bearer ...); send requests"
            " through the gpupool router",
            "type": "invalid_request_error",
            "code": "invalid_api_key",
        }
    }
).encode()


class EngineKeyGuard:
    """Refuses (401) every HTTP request without the key, and closes such websockets (1008)."""

    def __init__(self, app: ASGIApp, key: str | None = None) -> None:
        key = key if key is not None else os.environ.get("VLLM_API_KEY")
        if not key:
            raise RuntimeError("EngineKeyGuard needs the engine's key in VLLM_API_KEY")
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    def _authorized(self, scope: Scope) -> bool:
        value = b""
        for name, header in scope.get("headers", ()):
            if name.lower() == b"authorization":
                value = header
        scheme, _, token = value.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = hashlib.sha256(token.strip().encode("latin-1")).digest()
        return hmac.compare_digest(given, self._digest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        if path in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b"Bearer"),
                    (b"content-length", str(len(_REFUSAL)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _REFUSAL})
