"""The gateway hands each discovery answer to the prefix-cache index (issue 27): an engine
that joins after the router started is followed at the endpoint it publishes on, one that
moves (a Ray engine restarted elsewhere) at its new one, one that leaves is dropped."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pools.launchers.base import InstanceSpec
from pools.testing.config import config_for_test, even_pools
from router.gateway.app import create_app
from tests.unit.test_k8s_discovery import ScriptedSource
from tests.unit.test_prefix_cache import Engine


async def test_engines_found_later_are_followed_where_they_publish(tmp_path: Path) -> None:
    first, second = Engine(tmp_path / "a", tcp=True), Engine(tmp_path / "b", tcp=True)
    source = ScriptedSource()
    config = config_for_test(tmp_path, pools=even_pools())
    gateway = create_app(config, [], source=source)  # no engine when the router starts
    await gateway.start()
    try:
        cache = gateway.prefix_cache
        assert cache is not None and cache.engines == {}
        assert gateway.discovery is not None
        spec = InstanceSpec("ray-engine-0", "http://127.0.0.1:9", 1, kv_events=first.spec)
        source.answer = [spec, InstanceSpec("ray-engine-1", "http://127.0.0.1:10", 1)]
        await gateway.discovery.poll_once()
        assert {i: e.spec for i, e in cache.engines.items()} == {"ray-engine-0": first.spec}
        source.answer = [dataclasses.replace(spec, kv_events=second.spec)]  # restarted elsewhere
        await gateway.discovery.poll_once()
        assert cache.engines["ray-engine-0"].spec == second.spec
        source.answer = []
        await gateway.discovery.poll_once()
        assert cache.engines == {}
    finally:
        await gateway.aclose()
        first.close()
        second.close()
