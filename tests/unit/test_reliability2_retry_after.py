"""`Retry-After` on a `queue_timeout` when no drain rate was measured (issue 23): it answered
1 s, where docs/admission.md says `max_wait_s`. A request that waited `max_wait_s` without
capacity freeing learns nothing from retrying a second later; it is told to come back after
as long as it waited. Through the router, against fake engines over real HTTP."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.unit.test_admitter import CHAT, _leases, _wait_until, asgi_post, make_rig

__all__ = ["make_rig"]  # the fixture, used by name


async def test_queue_timeout_without_a_measured_drain_says_max_wait_s(make_rig: Any) -> None:
    rig = await make_rig(max_wait_s=2.0)
    rig.normal.itl_s = 0.025  # 100 tokens: 2.5 s on the engine, longer than the wait
    running = asyncio.ensure_future(asgi_post(rig.gateway, {**CHAT, "max_tokens": 100}))
    await _wait_until(lambda: _leases(rig)[0] == 1)
    late = await asgi_post(rig.gateway, {**CHAT, "max_tokens": 100})
    assert late.status == 429 and late.json()["error"]["code"] == "queue_timeout"
    # nothing left the queue in the last minute: no drain rate to go by
    assert rig.gateway.admitter.queues["normal"].drain_rate_per_s(rig.gateway.clock()) == 0
    assert late.headers["retry-after"] == "2"
    assert late.json()["error"]["retry_after_seconds"] == 2
    assert (await running).status == 200
