"""How much load each phase drives and where everything runs: the full run (~4-6 minutes with
the real-engine phase) and `--quick` (a ~1-minute smoke, most of it LiteLLM's start-up)."""

from __future__ import annotations

import socket
from contextlib import ExitStack
from dataclasses import dataclass

__all__ = ["PORTS", "Plan"]

# Every port this benchmark listens on: free ones, chosen when the benchmark is imported (all
# bound at once, so no two are the same), so that two runs on one machine do not answer each
# other's requests (the ports were fixed, 8500-8599, before).
_NAMES = (
    "real-vllm",
    "engine",
    "gpupool",
    "gpupool-real",
    "gpupool-admission-off",
    "gpupool-ledger-batched",
    "gpupool-baseline",
    "gpupool-trace-1",  # observability on, sample_ratio 1.0
    "gpupool-trace-0.01",  # sample_ratio 0.01
    "otlp-sink",  # their collector (benchmarks.router_overhead.otlp_sink)
    "gpupool-trace-0",  # observability on, sample_ratio 0: every request dropped
    "vllm-router",
    "vllm-router-metrics",
    "vllm-router-real",
    "vllm-router-real-metrics",
    "production-stack",
    "litellm",
    # benchmarks.router_overhead.protocols: its own engine and router, apart from the above
    "protocols-engine",
    "protocols-gpupool",
)


def _free_ports(names: tuple[str, ...]) -> dict[str, int]:
    """A distinct port free on 127.0.0.1 for each name (another process may take one before
    the benchmark binds it: its start then fails, naming the port)."""
    with ExitStack() as held:
        ports = {}
        for name in names:
            s = held.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            ports[name] = int(s.getsockname()[1])
        return ports


PORTS: dict[str, int] = _free_ports(_NAMES)


@dataclass(frozen=True)
class Plan:
    """Load per phase. Rounds interleave the targets (the order rotates every round)."""

    # The fake engine waits itl_ms between streamed tokens, so each SSE event reaches a proxy
    # as its own write (as a real engine's do) instead of one burst; non-streaming requests ask
    # for one token, so they cost the engine no waiting at all.
    engine_itl_ms: float = 1.0
    max_tokens: int = 1  # non-streaming requests
    warmup_requests: int = 100
    c1_rounds: int = 6
    c1_requests: int = 200  # per target per round
    hi_concurrency: int = 64
    hi_rounds: int = 5
    hi_window_s: float = 2.5
    stream_concurrency: int = 16
    stream_tokens: int = 256
    stream_rounds: int = 5
    stream_window_s: float = 2.5
    settle_s: float = 0.3
    idle_window_s: float = 4.0  # every proxy at rest, to measure its background CPU
    profile_window_s: float = 8.0
    profile_rate_hz: int = 250  # py-spy's samples per second
    real_vllm: bool = True
    real_rounds: int = 8
    real_requests: int = 30  # per target per round, concurrency 1
    real_max_tokens: int = 8
    real_start_timeout_s: float = 300.0

    @classmethod
    def quick(cls) -> Plan:
        return cls(
            idle_window_s=1.0,
            warmup_requests=30,
            c1_rounds=2,
            c1_requests=50,
            hi_rounds=1,
            hi_window_s=2.0,
            stream_rounds=1,
            stream_window_s=2.0,
            profile_window_s=3.0,
            real_vllm=False,
        )
