"""The `static` launcher: engines run elsewhere (Kubernetes, another host); gpupool only adopts
their URLs, and their key (`engines.static.api_key_env`) when they require one. `start()` waits
until each answers `/health`, with progress, or raises. An engine listed in
`engines.static.kv_events` publishes its KV cache events where that entry says (opt-in;
docs/prefix_cache.md); the others publish none the router knows of."""

from __future__ import annotations

import time

from pools.config import StaticEnginesConfig
from pools.launchers.base import InstanceSpec, KvEventsSpec, LauncherError, ProgressFn
from pools.launchers.health import wait_healthy

__all__ = ["StaticLauncher", "static_instances"]


def static_instances(config: StaticEnginesConfig, *, kv_events: bool = True) -> list[InstanceSpec]:
    """The engines `config` lists (`engine-<i>` in its order), each with where it publishes
    its KV events when it has an entry in `kv_events` and `kv_events` (engines.kv_events) is on."""
    events = {e.url: e for e in config.kv_events} if kv_events else {}
    specs = []
    for i, url in enumerate(config.urls):
        entry = events.get(url)
        spec = (
            None
            if entry is None
            else KvEventsSpec(
                endpoint=entry.endpoint,
                replay_endpoint=entry.replay_endpoint,
                hash_seed=entry.hash_seed,
            )
        )
        specs.append(
            InstanceSpec(
                instance_id=f"engine-{i}",
                url=url,
                gpus=config.gpus_per_instance,
                api_key=config.api_key,
                kv_events=spec,
            )
        )
    return specs


class StaticLauncher:
    def __init__(
        self,
        config: StaticEnginesConfig,
        *,
        wait_s: float = 60.0,
        progress: ProgressFn | None = None,
        kv_events: bool = True,
    ) -> None:
        self._specs = static_instances(config, kv_events=kv_events)
        self._wait_s = wait_s
        self._progress = progress

    @property
    def instances(self) -> list[InstanceSpec]:
        return list(self._specs)

    async def start(self) -> list[InstanceSpec]:
        deadline = time.monotonic() + self._wait_s
        missing = await wait_healthy(
            {s.instance_id: s.url for s in self._specs}, deadline, self._progress
        )
        if missing:
            raise LauncherError(
                "engines did not answer /health within "
                f"{self._wait_s:.0f} s: " + ", ".join(f"{i} ({self._url(i)})" for i in missing)
            )
        return self.instances

    def _url(self, instance_id: str) -> str:
        return next(s.url for s in self._specs if s.instance_id == instance_id)

    async def aclose(self) -> None:
        """Nothing to stop: these engines are not ours."""
