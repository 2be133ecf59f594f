"""Everything the router keeps about one run, in one bounded table: `RunTable`, keyed by the
run's key ((tenant, run id) on the request path; a session's home is keyed (tenant, session)).

One `RunRecord` per run holds what used to live in separate LRUs, each with its own cap:

- its attained service (router.accounting.accountant): the GPU-seconds of its ended steps, when
  it was last active, and its steps in flight (their sequence tokens: the one count of them);
- its span (the class of its first step, first arrival, last byte out: run completion time);
- its next step number (router.accounting.ledger: the ledger numbers a run's steps 0, 1, 2, ...);
- its home (router.admission.picking.RunAffinity: where its last step went, and its context then);
- its place in the run-aware queue order (router.admission.queueing, per pool: the dispatches
  its steps banked against their FIFO bound, and the service its idle periods forgave);
- whether governance ended it;
- its first step's span, when tracing is on (router.ops.tracing: its later steps join it).

One cap, one eviction rule (governance's, issue 23; `router.governance.runtable.runs_to_forget`
is the same rule over a whole table): past `max_runs` the table forgets a run that ended with
no step in flight (the one that ended first, or was last used longest ago since), else the
least recently used one with no step in flight; never one with a step in flight nor the run
just touched (its caller is about to use it). So it may exceed `max_runs` by the runs with a
step in flight, plus one (trimmed again at the next touch). Each eviction skips at most the
runs with a step in flight: it always terminates, O(1) amortised while few steps are in flight.

Kept elsewhere, on purpose:

- governance's run states (router.governance.governor: guard counters, stopped runs, a
  session's run numbers) are bounded per tenant (`max_runs_per_tenant`), not by this table's
  one cap: under one cap a tenant that opened 100,000 runs would push another tenant's stopped
  run out, and that run would be served again. They are also persisted with the tenant's
  buckets, in the governance store. So governance counts a run's served steps (its `max_steps`
  guard) and the ledger numbers every step, failed ones too: two counts, two meanings;
- where each stored OpenAI response lives (router.gateway.response_placement): keyed by
  response id, many per run, and it records where an engine holds an object, which outlives
  the run's other state (a follow-up may come after the run is forgotten); persisted too.

Pure state, no I/O, no clock; not thread-safe (own it from one event loop).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RunRecord", "RunTable"]


@dataclass(slots=True, eq=False)
class RunRecord:
    """What the router keeps about one run. Each part is unset until its owner first writes it."""

    # attained service (router.accounting.accountant): set once a step of it was metered
    metered: bool = False
    ended_gpu_s: float = 0.0
    last_active_s: float = 0.0
    in_flight: list[Any] = field(default_factory=list)  # its steps' SequenceTokens
    # span (router.accounting.observer): class_name None until a step of it finished
    class_name: str | None = None
    first_arrival_s: float = math.inf
    last_end_s: float = -math.inf
    # step numbering (router.accounting.ledger): the next step's index, None until known
    next_step: int | None = None
    # home (router.admission.picking.RunAffinity): None until a step of it went somewhere
    home: str | None = None
    context_tokens: int = 0
    home_step: int | None = None  # the step number (shared store) that set it; None: unknown
    # run-aware queue order (router.admission.queueing), per pool: dispatches banked against
    # the FIFO bound, and the service idle periods forgave; None until a queue wrote one
    credit: dict[str, float] | None = None
    forgiven: dict[str, Any] | None = None
    # governance ended it (cleared when a step of it starts again): forgotten first
    ended: bool = False
    # its first step's span context (router.ops.tracing): later steps continue its trace
    trace_first_step: Any = None

    @property
    def steps_in_flight(self) -> int:
        return len(self.in_flight)


class RunTable:
    """(tenant, run id) -> `RunRecord`, at most `max_runs` (but for runs with a step in
    flight), least recently used forgotten first by the rule in the module's docstring."""

    def __init__(self, max_runs: int = 100_000) -> None:
        if max_runs < 1:
            raise ValueError(f"max_runs must be >= 1, got {max_runs}")
        self.max_runs = max_runs
        self._records: OrderedDict[Hashable, RunRecord] = OrderedDict()
        # the ended ones, in the order they ended (or were last used since)
        self._ended: OrderedDict[Hashable, None] = OrderedDict()
        self.evicted = 0  # records forgotten to keep the bound
        self.touches = 0  # `touch` calls so far (the runs touched since a moment: at most that)

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._records)

    def recent(self) -> Iterator[Hashable]:
        """The keys, most recently touched first (do not touch while iterating)."""
        return reversed(self._records)

    def get(self, key: Hashable) -> RunRecord | None:
        """The run's record without touching it (None: not kept)."""
        return self._records.get(key)

    def touch(self, key: Hashable) -> RunRecord:
        """The run's record, created when new, now the most recently used; may forget another
        run to keep the bound (never this one)."""
        self.touches += 1
        record = self._records.get(key)
        if record is None:
            record = self._records[key] = RunRecord()
            if len(self._records) > self.max_runs:
                self._evict(keep=key)
            return record
        self._records.move_to_end(key)
        if record.ended:
            self._ended.move_to_end(key)
        if len(self._records) > self.max_runs:  # over while runs had steps in flight
            self._evict(keep=key)
        return record

    def set_ended(self, key: Hashable, ended: bool = True) -> None:
        """Governance ended the run (or a step of it started again: `ended=False`)."""
        record = self._records.get(key)
        if record is None or record.ended == ended:
            return
        record.ended = ended
        if ended:
            self._ended[key] = None
        else:
            self._ended.pop(key, None)

    def forget(self, key: Hashable) -> None:
        """Drop the run's record (a test or an owner that knows it is done)."""
        if self._records.pop(key, None) is not None:
            self._ended.pop(key, None)

    def _evict(self, *, keep: Hashable) -> None:
        while len(self._records) > self.max_runs:
            victim = self._victim(keep)
            if victim is None:
                return  # everything else has a step in flight
            del self._records[victim]
            self._ended.pop(victim, None)
            self.evicted += 1

    def _victim(self, keep: Hashable) -> Hashable | None:
        for key in self._ended:
            if key != keep and not self._records[key].in_flight:
                return key
        for key, record in self._records.items():
            if key != keep and not record.in_flight:
                return key
        return None
