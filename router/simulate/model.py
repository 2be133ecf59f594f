"""A modelled engine for the what-if simulator: continuous batching as processor sharing.

Every running sequence first has its uncached prompt prefilled (one at a time, first come first
served, at `prefill_tokens_per_s`), then decodes one token per TPOT(n) = `tpot_intercept_s` +
`tpot_slope_s` × n, where n is the number of sequences running on the engine. The engine keeps
vLLM's cumulative counters (ITL sum and count, prompt tokens and prefill time, KV use) so the
simulator can hand the router's fleet the same readings a scrape would.

Pure state machine, moved only by `sync(now_s)`, and lazily: between two changes of its batch
every decoding sequence gets the same number of tokens, so the engine keeps one running count
of tokens per sequence (`_decoded_tokens`) and a heap of the counts at which sequences end; a
sync costs O(log n) per sequence that ends, not O(n) per event, and an engine nothing happened
to is not touched at all. `next_event_at_s` (absolute) is exact until the next `add`.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
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
    # per traffic class, where measured: (class name, its samples)
    overhead_samples_by_class_s: tuple[tuple[str, tuple[float, ...]], ...] = ()

    def tpot_s(self, running: int) -> float:
        return self.tpot_intercept_s + self.tpot_slope_s * max(1, running)

    def overhead_samples(self, class_name: str) -> tuple[float, ...]:
        """The overhead samples to draw a request of `class_name`'s from: its class's, else
        all of them (empty: use `overhead_s`)."""
        for name, samples in self.overhead_samples_by_class_s:
            if name == class_name and samples:
                return samples
        return self.overhead_samples_s


@dataclass(eq=False, slots=True)
class SimSequence:
    prefill_left_tokens: float
    output_tokens: int
    blocks: int
    payload: Any = None
    first_token_at_s: float | None = None
    done_at_s: float | None = None
    prompt_tokens: int = 0
    overhead_s: float = 0.0
    order: int = 0  # the engine's arrival order (set by `add`)


class EngineModel:
    def __init__(self, latency: LatencyModel, capacity_blocks: int) -> None:
        self.latency = latency
        self.capacity_blocks = capacity_blocks
        self.running = 0  # sequences on the engine (prefilling or decoding)
        self.used_blocks = 0
        # vLLM-style cumulative counters
        self.itl_sum_s = 0.0
        self.itl_count = 0.0
        self.prompt_tokens_sum = 0.0
        self.prefill_time_sum_s = 0.0
        self.next_event_at_s = math.inf
        self._prefill_next = False  # the next event is the head's prefill ending
        self._at_s = 0.0  # the time the state below is for
        self._prefill: deque[SimSequence] = deque()  # FCFS; the head is being prefilled
        self._decoding = 0
        self._decoded_tokens = 0.0  # tokens each decoding sequence got since the start
        self._ends: list[tuple[float, int, SimSequence]] = []  # (token count at its end, ...)
        self._order = 0

    def add(self, seq: SimSequence, now_s: float) -> tuple[list[SimSequence], list[SimSequence]]:
        """Bring the engine to `now_s`, then put `seq` on it; returns `sync`'s answer."""
        changed = self.sync(now_s)
        seq.order = self._order
        self._order += 1
        self._prefill.append(seq)
        self.running += 1
        self.used_blocks += seq.blocks
        self._plan()
        return changed

    def sync(self, now_s: float) -> tuple[list[SimSequence], list[SimSequence]]:
        """Move the engine to `now_s` (never past `next_event_at_s`): returns the sequences
        whose first token came and those that ended, each in arrival order. At
        `next_event_at_s` its event happens even if the float sums leave a sliver of work
        (late in a long simulation the clock's resolution, 15 ps at 86,400 s, is close to a
        sliver's time; no extra sliver-sized events)."""
        dt_s = now_s - self._at_s
        due = now_s >= self.next_event_at_s
        self._at_s = max(self._at_s, now_s)
        if self.running == 0 or (dt_s <= 0 and not due):
            return [], []
        dt_s = max(0.0, dt_s)
        rate = self.latency.prefill_tokens_per_s
        first: list[SimSequence] = []
        ended: list[SimSequence] = []
        if self._decoding:
            tokens = dt_s / self.latency.tpot_s(self.running)
            self._decoded_tokens += tokens
            self.itl_sum_s += dt_s * self._decoding
            self.itl_count += tokens * self._decoding
        if self._prefill:
            head = self._prefill[0]
            done = min(head.prefill_left_tokens, dt_s * rate)
            head.prefill_left_tokens -= done
            self.prompt_tokens_sum += done
            self.prefill_time_sum_s += done / rate
            if head.prefill_left_tokens <= _EPS_TOKENS or (due and self._prefill_next):
                self._prefill.popleft()
                head.prefill_left_tokens = 0.0
                head.first_token_at_s = now_s + head.overhead_s
                first.append(head)
                self._decoding += 1
                # the first token comes with the prefill; the rest decode from here
                end = self._decoded_tokens + head.output_tokens - 1
                heapq.heappush(self._ends, (end, head.order, head))
        if due and not self._prefill_next and self._ends:
            self._decoded_tokens = max(self._decoded_tokens, self._ends[0][0])
        while self._ends and self._ends[0][0] <= self._decoded_tokens + _EPS_TOKENS:
            _, _, seq = heapq.heappop(self._ends)
            seq.done_at_s = now_s
            self._decoding -= 1
            self.running -= 1
            self.used_blocks -= seq.blocks
            ended.append(seq)
        if len(ended) > 1:
            ended.sort(key=lambda s: s.order)
        self._plan()
        return first, ended

    def _plan(self) -> None:
        """`next_event_at_s`: the head's prefill ending or a sequence ending, whichever first."""
        prefill_s = decode_s = math.inf
        if self._prefill:
            prefill_s = self._prefill[0].prefill_left_tokens / self.latency.prefill_tokens_per_s
        if self._ends:
            left = max(0.0, self._ends[0][0] - self._decoded_tokens)
            decode_s = left * self.latency.tpot_s(self.running)
        self._prefill_next = prefill_s <= decode_s
        self.next_event_at_s = self._at_s + min(prefill_s, decode_s)
