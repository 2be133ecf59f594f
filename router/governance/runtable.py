"""Which remembered runs a tenant forgets (pure, bounded, always terminating).

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

from collections.abc import Container, Mapping
from itertools import islice

__all__ = ["runs_to_forget"]


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
