"""Engine sources whose members change at run time (Kubernetes Services, Ray actors), and the
loop that polls one and hands each answer to the router's membership."""

from __future__ import annotations

from pools.discovery.base import DiscoveryError, DiscoveryLoop, EngineSource

__all__ = ["DiscoveryError", "DiscoveryLoop", "EngineSource"]
