"""The rig the hostile-input tests share: the router served by gpupool's own server
(router/gateway/server.py) as `gpupool serve` serves it (httptools, the lifespan,
`router.max_connections`) on an event loop in a
thread of its own, in front of fake engines that refuse what vLLM refuses.

The thread lets synchronous clients (schemathesis, raw sockets, hypothesis) drive a real
server, and lets tests call the `Gateway` as raw ASGI on the loop it runs on
(`LiveRouter.asgi`), which is how bytes no HTTP client would send (CR/LF, NUL) reach it.

The fake engine (pools/testing/fake_engine.py) trusts its input: `max_tokens: "x"` makes it
answer 500 and `max_tokens: 10**9` makes it stream for ever. `vllm_like` puts vLLM's request
validation in front of it (400 in vLLM's error shape), so what the router forwards is judged
as a real engine would judge it. The tests below hold the rig itself to that.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import orjson

from pools.config import Config
from pools.launchers.base import InstanceSpec
from pools.testing.config import REMOVE, config_for_test, default_pools
from pools.testing.fake_engine import FakeEngineState, make_fake_engine
from pools.testing.serve import serve_asgi
from router.cli.stack import CLIENT_KEEP_ALIVE_S, REPLICA_HEADER
from router.gateway.app import Gateway, create_app
from router.gateway.server import Server, ServerSettings
from router.request import Message

T = TypeVar("T")
ASGIApp = Callable[..., Awaitable[None]]

TENANT_KEY = "sk-hostile-tenant"  # an ordinary tenant
ADMIN_KEY = "sk-hostile-admin"  # a tenant with `admin: true`: /admin/* and /metrics too
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
MAX_MODEL_LEN_TOKENS = 4096


def hostile_config(tmp_path: Path, *, keys: bool = True, **router: Any) -> Config:
    """DEFAULT_CPU_CONFIG with its ledger in `tmp_path`, one engine per pool and two tenants."""
    router = {
        "ledger_path": str(tmp_path / "ledger.sqlite"),
        "state_path": str(tmp_path / "state.json"),
        "scrape_interval_s": 0.2,
        # input handling is under test here, not telemetry: on a loaded CI machine the scrape
        # loop (in the router's thread) can lag past the 5 s default while hypothesis holds the
        # GIL, and stale telemetry would queue a request past the rig's 30 s wait
        "stale_after_s": 600,
        **router,
    }
    half = {"share": {"initial_frac": 0.5, "floor_frac": REMOVE, "ceiling_frac": REMOVE}}
    tenants = [
        {"name": "team-a", "api_key": TENANT_KEY},
        {"name": "ops", "api_key": ADMIN_KEY, "admin": True},
    ]
    pools = default_pools(agent=half, normal=half)
    return config_for_test(pools=pools, router=router, tenants=tenants if keys else REMOVE)


# ------------------------------------------------------------------------------------------------
# An engine that validates like vLLM
# ------------------------------------------------------------------------------------------------


def _whole(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def vllm_refusal(body: Any, *, chat: bool) -> str | None:
    """Why vLLM would answer 400 to this body (the fields the fake engine reads), else None."""
    if not isinstance(body, dict):
        return "body must be an object"
    for name, low in (("max_tokens", 1), ("max_completion_tokens", 1), ("min_tokens", 0)):
        value = body.get(name)
        if value is not None and not _whole(value, low, MAX_MODEL_LEN_TOKENS):
            return f"{name} must be a whole number from {low} to {MAX_MODEL_LEN_TOKENS}"
    for name in ("n", "best_of"):
        value = body.get(name)
        if value is not None and not _whole(value, 1, 16):
            return f"{name} must be a whole number from 1 to 16"
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        return "stream must be a boolean"
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            return "stream_options can only be defined when stream=True"
        if not isinstance(options, dict) or not isinstance(options.get("include_usage"), bool):
            return "stream_options must be an object with a boolean include_usage"
    if body.get("model") is None:
        return "model is required"
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "messages must be a non-empty list"
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                return "each message must be an object with a string role"
    else:
        prompt = body.get("prompt")
        texts = isinstance(prompt, list) and all(isinstance(p, str) for p in prompt)
        ids = isinstance(prompt, list) and all(_whole(p, 0, 2**31) for p in prompt)
        if not (isinstance(prompt, str) or (prompt and (texts or ids))):
            return "prompt must be a string, a list of strings or a list of token ids"
    return None


def vllm_like(engine: ASGIApp, seen_headers: list[dict[bytes, bytes]] | None = None) -> ASGIApp:
    """`engine` behind vLLM's request validation; `seen_headers` collects what reached it."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path not in ("/v1/chat/completions", "/v1/completions"):
            await engine(scope, receive, send)
            return
        if seen_headers is not None:
            seen_headers.append(dict(scope["headers"]))
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        raw = b"".join(chunks)
        try:
            refusal = vllm_refusal(orjson.loads(raw), chat=path == "/v1/chat/completions")
        except orjson.JSONDecodeError:
            refusal = "invalid JSON"
        if refusal is not None:
            error = {"message": refusal, "type": "BadRequestError", "param": None, "code": 400}
            await send(
                {
                    "type": "http.response.start",
                    "status": 400,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": orjson.dumps({"error": error})})
            return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            result: dict[str, Any] = await receive()
            return result

        await engine(scope, replay, send)

    return app


# ------------------------------------------------------------------------------------------------
# The router on a real socket, in a thread
# ------------------------------------------------------------------------------------------------


def router_server(gateway: Gateway, config: Config) -> Server:
    """gpupool's server configured as router/cli/stack.py configures it for `gpupool serve`."""
    rc = config.router
    settings = ServerSettings(
        head_timeout_s=rc.head_timeout_s,
        max_head_bytes=rc.max_header_bytes,
        keep_alive_s=CLIENT_KEEP_ALIVE_S,
        max_connections=rc.max_connections,
    )
    replica = gateway.rebalancer.replica.encode("ascii", "replace")
    return Server(gateway, settings, shutdown_grace_s=1.0, headers=[(REPLICA_HEADER, replica)])


@dataclass
class LiveRouter:
    url: str
    host: str
    port: int
    gateway: Gateway
    states: list[FakeEngineState]
    loop: asyncio.AbstractEventLoop
    engine_headers: list[dict[bytes, bytes]] = field(default_factory=list)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        """Run `coro` on the router's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def asgi(
        self,
        method: str,
        path: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes = b"",
        *,
        timeout_s: float = 30.0,
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """One request straight into the `Gateway` as ASGI: (status, headers, body)."""
        return self.run(_asgi_call(self.gateway, method, path, headers, body), timeout_s)


async def _asgi_call(
    app: Gateway, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    sent = False
    done = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    messages: list[dict[str, Any]] = []

    async def send(message: Message) -> None:
        messages.append(dict(message))
        if message["type"] == "http.response.body" and not message.get("more_body"):
            done.set()

    path_only, _, query = path.partition("?")
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path_only,
        "raw_path": path_only.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    await app(scope, receive, send)
    start = next(m for m in messages if m["type"] == "http.response.start")
    out = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    return start["status"], list(start.get("headers", [])), out


@contextlib.contextmanager
def live_router(config: Config, *, ttft_s: float = 0.0, itl_s: float = 0.0) -> Iterator[LiveRouter]:
    """Two vLLM-like fake engines (one per pool) and the router in front, over real HTTP."""
    states = [FakeEngineState(ttft_s=ttft_s, itl_s=itl_s, keep_requests=False) for _ in range(2)]
    engine_headers: list[dict[bytes, bytes]] = []
    ready: list[LiveRouter] = []
    failed: list[BaseException] = []
    started = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def main() -> None:
        async with contextlib.AsyncExitStack() as stack:
            urls = [
                await stack.enter_async_context(
                    serve_asgi(vllm_like(make_fake_engine(state), engine_headers))
                )
                for state in states
            ]
            specs = [InstanceSpec(f"engine-{i}", url, 1) for i, url in enumerate(urls)]
            gateway = create_app(config, specs)
            server = router_server(gateway, config)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
            sock.listen(2048)
            sock.setblocking(False)
            port = sock.getsockname()[1]
            await server.start(sock)
            try:
                await _wait_fresh(gateway)
                ready.append(
                    LiveRouter(
                        f"http://127.0.0.1:{port}",
                        "127.0.0.1",
                        port,
                        gateway,
                        states,
                        loop,
                        engine_headers,
                    )
                )
                started.set()
                await stop.wait()
            finally:
                await asyncio.wait_for(server.aclose(), timeout=5)
                sock.close()

    def thread_main() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(main())
        except BaseException as err:
            failed.append(err)
        finally:
            started.set()
            loop.close()

    thread = threading.Thread(target=thread_main, name="live-router", daemon=True)
    thread.start()
    started.wait(30)
    if not ready:
        raise RuntimeError(f"the live router did not start: {failed!r}")
    try:
        yield ready[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(15)
        assert not failed, failed


async def _wait_fresh(gateway: Gateway, timeout_s: float = 10.0) -> None:
    """Until every instance has a scraped reading (admission needs fresh telemetry)."""
    async with asyncio.timeout(timeout_s):
        # the fleet exposes no event for a reading
        while not all(state.reading is not None for state in gateway.fleet):  # noqa: ASYNC110
            await asyncio.sleep(0.02)


# ------------------------------------------------------------------------------------------------
# The rig itself
# ------------------------------------------------------------------------------------------------


def test_vllm_like_refuses_what_vllm_refuses() -> None:
    assert vllm_refusal(CHAT, chat=True) is None
    assert vllm_refusal({"model": "tiny", "prompt": [1, 2]}, chat=False) is None
    assert vllm_refusal({**CHAT, "max_tokens": "2"}, chat=True)
    assert vllm_refusal({**CHAT, "max_tokens": 10**9}, chat=True)
    assert vllm_refusal({**CHAT, "messages": [1]}, chat=True)
    assert vllm_refusal({**CHAT, "stream_options": {"include_usage": True}}, chat=True)
    assert vllm_refusal({"model": "tiny", "prompt": [[1], "a"]}, chat=False)


def test_live_router_serves_and_the_engine_sees_only_router_headers(tmp_path: Path) -> None:
    import httpx

    with live_router(hostile_config(tmp_path)) as live:
        auth = {"authorization": f"Bearer {TENANT_KEY}"}
        ok = httpx.post(f"{live.url}/v1/chat/completions", json=CHAT, headers=auth)
        assert ok.status_code == 200, ok.text
        bad = httpx.post(
            f"{live.url}/v1/chat/completions", json={**CHAT, "max_tokens": "x"}, headers=auth
        )
        assert bad.status_code == 400 and bad.json()["error"]["code"] == 400
        status, _, _ = live.asgi("GET", "/health", [])
        assert status == 200
        (seen, *_) = live.engine_headers
        assert TENANT_KEY.encode() not in b"".join(seen.values())
