"""Engine launchers: `local` (child processes here), `static` (URLs of engines run elsewhere),
`kubernetes` (the Helm chart's engine groups, followed at run time) and `ray` (engines as Ray
actors). `make_launcher(config)` picks one from `engines.launcher`. The last two are
`DiscoveringLauncher`s: their `source` tells the router when engines come and go."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from pools.config import Config
from pools.launchers.base import InstanceSpec, Launcher, LauncherError, ProgressFn
from pools.launchers.engine_args import EngineTraces
from pools.launchers.local import LocalLauncher
from pools.launchers.prefill_slice import with_prefill_slice
from pools.launchers.static import StaticLauncher

if TYPE_CHECKING:  # pools.discovery imports this package's base
    from pools.discovery.base import EngineSource

__all__ = [
    "DiscoveringLauncher",
    "InstanceSpec",
    "Launcher",
    "LauncherError",
    "LocalLauncher",
    "StaticLauncher",
    "make_launcher",
]


@runtime_checkable
class DiscoveringLauncher(Protocol):
    """A launcher whose engines change at run time: the router polls its `source`."""

    @property
    def source(self) -> EngineSource: ...


def make_launcher(config: Config, progress: ProgressFn | None = None) -> Launcher:
    kind = config.engines.launcher
    # admission.prefill_slice_tokens: every engine gpupool starts gets vLLM's long-prefill cap
    slice_tokens = config.admission.prefill_slice_tokens
    if kind == "local":
        local = config.engines.local
        local = dataclasses.replace(
            local, vllm_args=with_prefill_slice(local.vllm_args, slice_tokens)
        )
        return LocalLauncher(
            local,
            config.model,
            progress=progress,
            kv_events=config.engines.kv_events_on,
            traces=EngineTraces.of(config.observability, kind),
        )
    if kind == "static":
        return StaticLauncher(
            config.engines.static, progress=progress, kv_events=config.engines.kv_events_on
        )
    if kind == "kubernetes":
        # imported here: pools.discovery (which it uses) imports this package's base
        from pools.launchers.kubernetes import KubernetesLauncher

        return KubernetesLauncher(config.engines.kubernetes, progress=progress)
    if kind == "ray":
        from pools.launchers.ray import RayLauncher

        ray = config.engines.ray
        ray = dataclasses.replace(ray, vllm_args=with_prefill_slice(ray.vllm_args, slice_tokens))
        return RayLauncher(
            ray,
            config.model,
            progress=progress,
            traces=EngineTraces.of(config.observability, kind),
            kv_events=config.engines.kv_events_on,
        )
    raise LauncherError(f"engines.launcher {kind!r} is not one of local, static, kubernetes, ray")
