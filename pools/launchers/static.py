"""The `static` launcher: engines run elsewhere (Kubernetes, another host); gpupool only adopts
their URLs, and their key (`engines.static.api_key_env`) when they require one. `start()` waits
until each answers `/health`, with progress, or raises."""

from __future__ import annotations

import time

from pools.config import StaticEnginesConfig
from pools.launchers.base import InstanceSpec, LauncherError, ProgressFn
from pools.launchers.health import wait_healthy

__all__ = ["StaticLauncher"]


class StaticLauncher:
    def __init__(
        self,
        config: StaticEnginesConfig,
        *,
        wait_s: float = 60.0,
        progress: ProgressFn | None = None,
    ) -> None:
        self._specs = [
            InstanceSpec(
                instance_id=f"engine-{i}",
                url=url,
                gpus=config.gpus_per_instance,
                api_key=config.api_key,
            )
            for i, url in enumerate(config.urls)
        ]
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
