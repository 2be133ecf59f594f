"""What a dynamic engine source provides, and `DiscoveryLoop`, the component that polls it.

A source answers `poll()` with every engine that should take traffic now (ready, not
terminating), each under a stable instance id. An engine missing from an answer is leaving:
the router drains it. A failed poll raises `DiscoveryError`; the loop then keeps the last
answer (an API server that blips must not empty the fleet) and says so once per outage.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from pools.periodic import Periodic

if TYPE_CHECKING:
    from pools.launchers.base import InstanceSpec

__all__ = ["DiscoveryError", "DiscoveryLoop", "EngineSource", "TimingFromConfig"]

log = logging.getLogger(__name__)


class DiscoveryError(Exception):
    """The source could not be read this time; the message says where and why."""


class EngineSource(Protocol):
    """Engines that come and go. `poll_interval_s`: how often to ask; `drain_timeout_s`: how
    long a leaving engine keeps its in-flight work before it is dropped from the fleet."""

    @property
    def poll_interval_s(self) -> float: ...

    @property
    def drain_timeout_s(self) -> float: ...

    async def poll(self) -> list[InstanceSpec]: ...


class _Timing(Protocol):
    @property
    def poll_interval_s(self) -> float: ...

    @property
    def drain_timeout_s(self) -> float: ...


class TimingFromConfig:
    """A source's `poll_interval_s` and `drain_timeout_s`, read from its `_config`."""

    _config: _Timing

    @property
    def poll_interval_s(self) -> float:
        return self._config.poll_interval_s

    @property
    def drain_timeout_s(self) -> float:
        return self._config.drain_timeout_s


class DiscoveryLoop:
    """Polls `source` every `poll_interval_s` and calls `on_answer(specs)` with each answer
    (the receiver reconciles; it is called with the same set again when nothing changed)."""

    def __init__(
        self,
        source: EngineSource,
        on_answer: Callable[[list[InstanceSpec]], None],
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._source = source
        self._on_answer = on_answer
        self._loop = Periodic(
            "engine-discovery", self.poll_once, source.poll_interval_s, sleep=sleep
        )
        self._failing = False
        self.polls = 0  # answers handed on
        self.failures = 0  # polls that raised

    async def poll_once(self) -> bool:
        """One poll; True when it answered."""
        try:
            specs = await self._source.poll()
        except DiscoveryError as err:
            self.failures += 1
            if not self._failing:
                log.warning("engine discovery failed, keeping the fleet as it is: %s", err)
            self._failing = True
            return False
        if self._failing:
            log.info("engine discovery answers again")
        self._failing = False
        self.polls += 1
        self._on_answer(specs)
        return True

    async def start(self) -> None:
        await self.poll_once()
        self._loop.start()  # a bug in a receiver is logged; it does not stop discovery

    async def aclose(self) -> None:
        await self._loop.aclose()
