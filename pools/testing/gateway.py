"""A router (the Gateway ASGI app) in front of fake engines, each served over real HTTP on a
free local port, with an httpx client that calls the router in process:

    async with gateway_over_fakes(config_for_test(tmp_path, pools=even_pools())) as rig:
        resp = await rig.client.post("/v1/chat/completions", json=body)
        assert rig.state_of(resp.headers["x-gpupool-instance"]).served == 1

The engines are `engine-0`, `engine-1`, ... in the order of their states. The router is the
one thing under `pools/` built from `router`: imported when called, so `pools` keeps not
importing `router` (the router imports `pools`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from pools.config import Config
from pools.launchers import InstanceSpec
from pools.testing.fake_engine import FakeEngineState, make_fake_engine
from pools.testing.serve import serve_asgi

if TYPE_CHECKING:
    from router.gateway.app import Gateway

__all__ = ["GatewayOverFakes", "another_router", "gateway_over_fakes"]


@dataclass
class GatewayOverFakes:
    gateway: Gateway
    client: httpx.AsyncClient  # base URL http://gw, through the ASGI app (no socket)
    states: list[FakeEngineState]  # engine-i's state at index i
    specs: list[InstanceSpec]

    def state_of(self, instance_id: str) -> FakeEngineState:
        return self.states[int(instance_id.rsplit("-", 1)[1])]


@contextlib.asynccontextmanager
async def gateway_over_fakes(
    config: Config,
    engines: int | Sequence[FakeEngineState] = 2,
    *,
    start: bool = True,
    client_timeout_s: float = 5.0,
    **create: Any,
) -> AsyncIterator[GatewayOverFakes]:
    """`engines` fake engines (a count of default ones, or their states) behind
    `create_app(config, specs, **create)`, started unless `start` is false (then the test
    starts it); everything is closed on exit, the router before its engines."""
    from router.gateway.app import create_app

    states = [FakeEngineState() for _ in range(engines)] if isinstance(engines, int) else engines
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serve_asgi(make_fake_engine(s))) for s in states]
        specs = [InstanceSpec(f"engine-{i}", url, 1) for i, url in enumerate(urls)]
        gateway = create_app(config, list(specs), **create)
        stack.push_async_callback(gateway.aclose)
        if start:
            await gateway.start()
        client = await stack.enter_async_context(
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=gateway),
                base_url="http://gw",
                timeout=client_timeout_s,
            )
        )
        yield GatewayOverFakes(gateway, client, list(states), specs)


@contextlib.asynccontextmanager
async def another_router(
    rig: GatewayOverFakes, config: Config, *, client_timeout_s: float = 5.0
) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient]]:
    """A second router, `create_app(config, ...)` over `rig`'s engines (replicas on one shared
    store), started; it and its in-process client (base URL http://gw) are yielded, and the
    router is closed on exit."""
    from router.gateway.app import create_app

    gateway = create_app(config, list(rig.specs))
    await gateway.start()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=gateway),
            base_url="http://gw",
            timeout=client_timeout_s,
        ) as client:
            yield gateway, client
    finally:
        await gateway.aclose()
