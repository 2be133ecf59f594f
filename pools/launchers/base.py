"""What every engine launcher provides: a list of running instances and a way to stop them.

A launcher is a component with an explicit lifecycle: `await start()` returns the instances
once each answers `/health` (or raises `LauncherError`), `await aclose()` stops whatever it
started. `local` starts vLLM processes here, `static` adopts engines that run elsewhere, and
`ray` (a later addition) places them on a Ray cluster; all hand the router the same
`InstanceSpec`s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["InstanceSpec", "KvEventsSpec", "Launcher", "LauncherError", "ProgressFn"]

ProgressFn = Callable[[str], None]


class LauncherError(Exception):
    """Engines could not be started or reached; the message says which and why."""


@dataclass(frozen=True, slots=True)
class KvEventsSpec:
    """Where an engine publishes its KV cache events (docs/prefix_cache.md)."""

    endpoint: str  # its ZMQ PUB socket, e.g. "ipc:///run/engine-0.kv-pub"
    replay_endpoint: str | None  # its ZMQ ROUTER socket for missed batches; None: none
    hash_seed: str | None = None  # the engine's PYTHONHASHSEED; None: unset (vLLM's fixed seed)
    topic: str = ""


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """One engine the router can send requests to."""

    instance_id: str  # stable name, e.g. "engine-0"; used as a metric label
    url: str  # base URL without trailing slash, e.g. "http://127.0.0.1:8100"
    gpus: int  # GPUs the engine holds (a CPU engine counts as configured, default 1)
    # the engine's own API key (VLLM_API_KEY); the router sends it; never printed
    api_key: str | None = field(default=None, repr=False)
    kv_events: KvEventsSpec | None = None  # None: the engine publishes none gpupool knows of


class Launcher(Protocol):
    async def start(self) -> list[InstanceSpec]: ...

    @property
    def instances(self) -> list[InstanceSpec]: ...

    async def aclose(self) -> None: ...
