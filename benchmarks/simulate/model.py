"""A modelled engine for the what-if simulator: continuous batching as processor sharing.

Every running sequence first has its uncached prompt prefilled (one at a time, first come first
served, at `prefill_tokens_per_s`), then decodes one token per TPOT(n) = `tpot_intercept_s` +
`tpot_slope_s` × n, where n is the number of sequences running on the engine. The engine keeps
vLLM's cumulative counters (ITL sum and count, prompt tokens and prefill time, KV use) so the
simulator can hand the router's fleet the same readings a scrape would. Pure state machine:
time only moves by `advance(dt_s)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EngineModel", "LatencyModel", "SimSequence"]

_EPS_TOKENS = 1e-6  # float slack: a sequence this close to its end has ended


@dataclass(frozen=True, slots=True)
class LatencyModel:
    tpot_intercept_s: float = 0.004
    tpot_slope_s: float = 0.0006
    prefill_tokens_per_s: float = 6000.0
    # time before a request's prefill shows (HTTP, router, engine scheduling), added to its
    # time to first token: fixed, or drawn per request from measured samples when given
    overhead_s: float = 0.0
    overhead_samples_s: tuple[float, ...] = ()

    def tpot_s(self, running: int) -> float:
        return self.tpot_intercept_s + self.tpot_slope_s * max(1, running)


@dataclass(eq=False, slots=True)
class SimSequence:
    prefill_left_tokens: float
    output_tokens: int
    blocks: int
    payload: Any = None
    decoded: float = 0.0
    first_token_at_s: float | None = None
    done_at_s: float | None = None
    prompt_tokens: int = 0
    overhead_s: float = 0.0


@dataclass(slots=True)
class EngineModel:
    latency: LatencyModel
    capacity_blocks: int
    running: list[SimSequence] = field(default_factory=list)
    # vLLM-style cumulative counters
    itl_sum_s: float = 0.0
    itl_count: float = 0.0
    prompt_tokens_sum: float = 0.0
    prefill_time_sum_s: float = 0.0

    def add(self, seq: SimSequence) -> None:
        self.running.append(seq)

    def used_blocks(self) -> int:
        return sum(s.blocks for s in self.running)

    def _prefilling(self) -> SimSequence | None:
        return next((s for s in self.running if s.prefill_left_tokens > 0), None)

    def next_event_s(self) -> float:
        """Time until the next prefill ends or a sequence finishes (inf when idle)."""
        best = math.inf
        head = self._prefilling()
        if head is not None:
            best = head.prefill_left_tokens / self.latency.prefill_tokens_per_s
        decoding = [s for s in self.running if s.prefill_left_tokens <= 0]
        if decoding:
            tpot = self.latency.tpot_s(len(self.running))
            left = min(s.output_tokens - s.decoded for s in decoding)
            best = min(best, max(0.0, left) * tpot)
        return best

    def advance(self, dt_s: float, now_s: float) -> list[SimSequence]:
        """Move `dt_s` forward (ending at `now_s`); returns the sequences that finished."""
        if not self.running:
            return []
        dt_s = max(0.0, dt_s)
        n = len(self.running)
        tpot = self.latency.tpot_s(n)
        head = self._prefilling()
        decoding = [s for s in self.running if s.prefill_left_tokens <= 0]
        if head is not None:
            done = min(head.prefill_left_tokens, dt_s * self.latency.prefill_tokens_per_s)
            head.prefill_left_tokens -= done
            self.prompt_tokens_sum += done
            self.prefill_time_sum_s += done / self.latency.prefill_tokens_per_s
            if head.prefill_left_tokens <= _EPS_TOKENS:
                head.prefill_left_tokens = 0.0
                head.first_token_at_s = now_s + head.overhead_s
                head.decoded = 1.0
        tokens = dt_s / tpot
        finished = []
        for s in decoding:
            step = min(tokens, s.output_tokens - s.decoded)
            s.decoded += step
            self.itl_sum_s += step * tpot
            self.itl_count += step
        for s in list(self.running):
            if s.prefill_left_tokens <= 0 and s.decoded >= s.output_tokens - _EPS_TOKENS:
                s.done_at_s = now_s
                self.running.remove(s)
                finished.append(s)
        return finished
