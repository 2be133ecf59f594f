"""Tool pauses: KV blocks held on a run's home while the run waits between steps
(`admission.tool_pause_hold`; docs/admission.md, "Tool pauses"; issue 27 item 5).

When an agent step ends, vLLM frees its blocks but keeps their contents cached (its free queue,
least recently used first), so the run's next step finds its context there, unless the
sequences admitted meanwhile allocate those blocks first. Admission counts free blocks as
free, so while runs wait for their tools a fuller batch evicts their contexts and their next
steps prefill again.

`PauseHolds` (pure, every method takes `now_s`) keeps, per instance, the blocks of each run
paused there: from a step's end (`ended`: the run's context, prompt + expected output, in
blocks) until its next step arrives (`arrived`), the run ends (`forget`), or the predicted
pause passes: the run's own pauses so far (an exponentially weighted mean), else every run's on
that instance's pools, else `max_pause_s`; times (1 + `margin_frac`), at most `max_pause_s`.
`held_blocks(instance, capacity, now_s)` is what admission adds to the instance's used blocks
for every other sequence, at most `max_frac` of the capacity. A run's own next step never
counts its hold: the hold ends when that step arrives, before admission decides it.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["PauseHolds"]

# weight of the newest pause in a run's (and the pool-wide) mean
_ALPHA = 0.5


@dataclass(eq=False, slots=True)
class _Hold:
    instance_id: str
    blocks: int
    ended_at_s: float
    until_s: float
    pool: str


class PauseHolds:
    """The paused runs' holds and the pauses learned (module docstring). Remembers at most
    `max_runs` runs' pauses (least recently used forgotten first). Each call costs O(log n) in
    the holds (per-instance totals, and the holds' ends in a heap), not a walk over them."""

    def __init__(
        self, max_pause_s: float, margin_frac: float, max_frac: float, max_runs: int = 100_000
    ) -> None:
        if max_pause_s <= 0 or margin_frac < 0 or not 0 < max_frac <= 1 or max_runs < 1:
            raise ValueError("max_pause_s > 0, margin_frac >= 0, 0 < max_frac <= 1, max_runs >= 1")
        self.max_pause_s = max_pause_s
        self.margin_frac = margin_frac
        self.max_frac = max_frac
        self.max_runs = max_runs
        self._holds: dict[Hashable, _Hold] = {}
        self._held: Counter[str] = Counter()  # blocks held per instance
        self._ends: list[tuple[float, int, Hashable, _Hold]] = []  # (until, seq, run, hold)
        self._seq = itertools.count()
        self._run_pause_s: OrderedDict[Hashable, float] = OrderedDict()
        self._pool_pause_s: dict[str, float] = {}

    def predicted_pause_s(self, run: Hashable, pool: str) -> float:
        """The run's mean pause, else its pool's, else `max_pause_s` (not yet margined)."""
        pause = self._run_pause_s.get(run)
        if pause is None:
            pause = self._pool_pause_s.get(pool, self.max_pause_s)
        return min(pause, self.max_pause_s)

    def ended(self, run: Hashable, instance_id: str, blocks: int, pool: str, now_s: float) -> float:
        """A step of `run` ended on `instance_id` with `blocks` of context: hold them until
        the returned time (the predicted pause with its margin, at most `max_pause_s`)."""
        pause = self.predicted_pause_s(run, pool) * (1.0 + self.margin_frac)
        until = now_s + min(pause, self.max_pause_s)
        self._end(run)
        hold = _Hold(instance_id, max(0, blocks), now_s, until, pool)
        self._holds[run] = hold
        self._held[instance_id] += hold.blocks
        heapq.heappush(self._ends, (until, next(self._seq), run, hold))
        return until

    def _end(self, run: Hashable) -> _Hold | None:
        hold = self._holds.pop(run, None)
        if hold is not None:
            self._held[hold.instance_id] -= hold.blocks
            if self._held[hold.instance_id] <= 0:
                del self._held[hold.instance_id]
        return hold

    def arrived(self, run: Hashable, now_s: float) -> bool:
        """The run's next step arrived: its hold ends and its pause is learned. True when it
        held blocks (a queued sequence may fit now)."""
        hold = self._end(run)
        if hold is None:
            return False
        pause = min(max(0.0, now_s - hold.ended_at_s), self.max_pause_s)
        last = self._run_pause_s.pop(run, None)
        self._run_pause_s[run] = pause if last is None else last + _ALPHA * (pause - last)
        while len(self._run_pause_s) > self.max_runs:
            self._run_pause_s.popitem(last=False)
        pooled = self._pool_pause_s.get(hold.pool)
        self._pool_pause_s[hold.pool] = (
            pause if pooled is None else pooled + _ALPHA * (pause - pooled)
        )
        return now_s < hold.until_s

    def forget(self, run: Hashable) -> None:
        """The run ended: no hold, no pause remembered."""
        self._end(run)
        self._run_pause_s.pop(run, None)

    def forget_instance(self, instance_id: str) -> None:
        """The instance left (its cache with it): its holds end."""
        for run in [r for r, h in self._holds.items() if h.instance_id == instance_id]:
            self._end(run)

    def held_blocks(self, instance_id: str, capacity_blocks: int, now_s: float) -> int:
        """Blocks held on the instance now for paused runs, at most `max_frac` of
        `capacity_blocks`. Drops the holds that have passed (anywhere)."""
        ends = self._ends
        while ends and ends[0][0] <= now_s:
            _, _, run, hold = heapq.heappop(ends)
            if self._holds.get(run) is hold:  # not ended or replaced since
                self._end(run)
        if len(ends) > 2 * len(self._holds) + 64:  # ended holds' entries: drop them
            self._ends = [e for e in ends if self._holds.get(e[2]) is e[3]]
            heapq.heapify(self._ends)
        return min(self._held[instance_id], int(self.max_frac * capacity_blocks))

    def holds(self) -> int:
        """How many runs hold blocks (expired ones included until the next `held_blocks`)."""
        return len(self._holds)
