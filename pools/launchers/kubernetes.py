"""The `kubernetes` launcher: engines run as the Helm chart's engine groups (StatefulSets with
a headless Service each); gpupool starts nothing and follows their endpoints.

`start()` answers the engines ready now, possibly none (the router then answers /ready with
503 until a pool has a healthy engine); `source` is what the router's discovery loop polls
from then on, so engines that come and go join and leave without a router restart.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from pools.config import KubernetesEnginesConfig
from pools.discovery.base import DiscoveryError
from pools.discovery.kubernetes import (
    SERVICE_ACCOUNT_DIR,
    DnsSource,
    EndpointSliceSource,
    make_kubernetes_source,
)
from pools.launchers.base import InstanceSpec, LauncherError, ProgressFn

__all__ = ["KubernetesLauncher"]


class KubernetesLauncher:
    def __init__(
        self,
        config: KubernetesEnginesConfig,
        *,
        progress: ProgressFn | None = None,
        environ: Mapping[str, str] | None = None,
        account_dir: Path = SERVICE_ACCOUNT_DIR,
        source: EndpointSliceSource | DnsSource | None = None,
    ) -> None:
        if source is None:
            try:
                source = make_kubernetes_source(
                    config, os.environ if environ is None else environ, account_dir
                )
            except DiscoveryError as err:
                raise LauncherError(str(err)) from None
        self.source = source
        self._progress = progress
        self._instances: list[InstanceSpec] = []

    @property
    def instances(self) -> list[InstanceSpec]:
        return list(self._instances)

    async def start(self) -> list[InstanceSpec]:
        try:
            self._instances = await self.source.poll()
        except DiscoveryError as err:
            self._instances = []
            self._say(f"engines not found yet ({err}); the router keeps looking")
            return []
        self._say(f"found {len(self._instances)} ready engine(s) in Kubernetes")
        return self.instances

    def _say(self, message: str) -> None:
        if self._progress is not None:
            self._progress(message)

    async def aclose(self) -> None:
        """The engines are not ours to stop; closes the API session."""
        await self.source.aclose()
