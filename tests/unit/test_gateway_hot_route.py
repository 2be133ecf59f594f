"""The gateway's hot route (router/gateway/app.py, `Gateway.hot_route`): gpupool's server runs
the completions handler's coroutine as a request's task for a POST to a generation endpoint,
and leaves everything else, Basic credentials on a POST included (refused as read-only by the
gateway's dispatch), to the gateway's `__call__`."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from pools.testing.config import config_for_test, even_pools
from pools.testing.gateway import gateway_over_fakes
from router.request import Message


def _scope(method: str, path: str, authorization: bytes = b"Bearer k") -> dict[str, Any]:
    return {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [(b"authorization", authorization)],
    }


async def _no_receive() -> Message:
    raise AssertionError("not called")


async def _no_send(message: Message) -> None:
    raise AssertionError("not called")


async def test_only_a_post_to_a_generation_endpoint_takes_the_hot_route(tmp_path: Path) -> None:
    basic = b"Basic " + base64.b64encode(b"user:k")
    async with gateway_over_fakes(config_for_test(tmp_path, pools=even_pools())) as rig:
        gateway = rig.gateway
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"):
            coro = gateway.hot_route(_scope("POST", path), _no_receive, _no_send)
            assert coro is not None, path
            coro.close()  # not run here: the server would run it as the request's task
        cold = [
            _scope("GET", "/v1/chat/completions"),
            _scope("POST", "/v1/models"),
            _scope("POST", "/v1/messages/count_tokens"),
            _scope("POST", "/v1/chat/completions", basic),
        ]
        for scope in cold:
            assert gateway.hot_route(scope, _no_receive, _no_send) is None, scope


async def test_before_the_gateway_starts_nothing_takes_the_hot_route(tmp_path: Path) -> None:
    config = config_for_test(tmp_path, pools=even_pools())
    async with gateway_over_fakes(config, start=False) as rig:
        scope = _scope("POST", "/v1/chat/completions")
        assert rig.gateway.hot_route(scope, _no_receive, _no_send) is None
