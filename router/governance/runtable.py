"""A tenant's runs: which remembered runs it forgets (pure, bounded, always terminating), and
how a session's runs are numbered (`SessionRuns`).

The governor remembers up to `max_runs` runs per tenant (stopped runs stay refused while they
are remembered; active runs keep their guard counters). Past the bound it forgets, oldest
first (the table is in least-recently-used order):

1. runs that ended (client end, idle timeout, a guard) and have no step in flight;
2. then active runs with no step in flight (they end with reason `evicted`: their next step
   starts a fresh run);

never a run with a step in flight (its step settles into it when it finishes). So the table may
exceed `max_runs` by the runs with a step in flight, which is at most the tenant's requests in
flight. Each call looks at every run at most twice: O(len(runs)), whatever the states.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from itertools import islice

__all__ = ["MAX_ANCHORS", "SessionRuns", "runs_to_forget", "session_run_id"]

MAX_ANCHORS = 32  # a session's task anchors remembered (its latest tasks and side requests)


def session_run_id(session_id: str, number: int) -> str:
    """A session's n-th run: `<session>:<n>` (a colon, not a slash: the id goes in
    `/v1/runs/{run_id}` paths as one segment)."""
    return f"{session_id}:{number}"


@dataclass(slots=True)
class SessionRuns:
    """How one session's steps map to its runs (see `boundary`): each task anchor (the user
    message a step belongs to) gets the next number the first time it is seen and keeps it,
    so a retried step or a task's later tool steps land in the same run. A step with no anchor
    (a completions prompt, a Responses follow-up of tool outputs only) joins the current run.
    Numbers only grow: an ended run's anchor is forgotten, so its task continues as a new run.
    With a shared store (store.url) the store maps each step (router/governance/shared.py:
    `session_step`) and this is the replica's cache of its answers, which predicts the run
    of a step the replica knows."""

    last: int = 0  # the highest number given
    current: int = 0  # the run of the session's latest step (0: none yet)
    anchors: OrderedDict[str, int] = field(default_factory=OrderedDict)  # oldest first
    # with a shared store: the highest number given here while it could not be asked (the
    # store numbers the session's new runs past it once it answers again)
    floor: int = 0
    # with a shared store: when this replica last asked it to map each task (its anchor;
    # None: the steps without one), on the governor's clock; oldest first
    mapped_s: OrderedDict[str | None, float] = field(default_factory=OrderedDict)

    def run_for(self, anchor_key: str | None) -> int:
        """The run number of a step with this anchor (None: no anchor)."""
        if anchor_key is None:
            number = self.current or self._next()
        else:
            found = self.anchors.get(anchor_key)
            number = self._next() if found is None else found
        self.adopt(anchor_key, number)
        return number

    def peek(self, anchor_key: str | None) -> int:
        """The run `run_for` would give a step with this anchor, recording nothing (a shared
        store maps it, and `adopt` records its answer)."""
        found = self.current if anchor_key is None else self.anchors.get(anchor_key, 0)
        return found or self.last + 1

    def adopt(self, anchor_key: str | None, number: int) -> None:
        """A step with this anchor belongs to run `number` (given here or by the store)."""
        if anchor_key is not None:
            self.anchors[anchor_key] = number
            self.anchors.move_to_end(anchor_key)
            while len(self.anchors) > MAX_ANCHORS:
                self.anchors.popitem(last=False)
        self.current = number
        self.last = max(self.last, number)

    def mapped(self, anchor_key: str | None, now_s: float) -> None:
        """This replica asked the shared store to map a step with this anchor at `now_s`."""
        self.mapped_s[anchor_key] = now_s
        self.mapped_s.move_to_end(anchor_key)
        while len(self.mapped_s) > MAX_ANCHORS:
            self.mapped_s.popitem(last=False)

    def ended(self, number: int) -> None:
        """Run `number` ended: its task's next step starts a new run."""
        for key in [k for k, n in self.anchors.items() if n == number]:
            del self.anchors[key]
        if self.current == number:
            self.current = 0

    def _next(self) -> int:
        self.last += 1
        return self.last


def runs_to_forget(inflight: Mapping[str, int], active: Container[str], max_runs: int) -> list[str]:
    """The run ids to forget so that at most `max_runs` remain (fewer when too many have a step
    in flight). `inflight`: run id -> its steps in flight, oldest first."""
    excess = len(inflight) - max_runs
    if excess <= 0:
        return []
    idle = [run_id for run_id, n in inflight.items() if n == 0]
    chosen = list(islice((r for r in idle if r not in active), excess))
    if len(chosen) < excess:
        chosen += islice((r for r in idle if r in active), excess - len(chosen))
    return chosen
