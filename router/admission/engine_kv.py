"""KV blocks in use on an instance by what the engine allocates, not by the whole
reservations (docs/admission.md, "Engine-tracked KV use").

A lease reserves its sequence's whole size (prompt + expected output), which vLLM allocates
only as the sequence runs: the prompt's blocks at its prefill, one block per `block_size`
output tokens after. The fleet counts an instance's use as the larger of the live
reservations and the last scrape corrected for the reservations made and released since
(`InstanceState.used_blocks`): an upper bound, but one that holds every lease's whole
reservation. This is a second upper bound, from the engine's own count:

    used = measured at the scrape
         + Σ live leases whose first token came before the scrape was requested: the output
           blocks still to grow (ceil(expected output / block size) + 1, the prompt's last
           block being partly filled)
         + Σ the other live leases: their whole reservation

A lease whose first token came before the scrape was requested had all its prompt blocks
allocated when the engine answered (vLLM allocates a prompt's blocks chunk by chunk before its
first token; a cached prefix is taken out of the free queue, `BlockPool.touch`, and counts as
used, so its blocks are in the measured count too). A lease released since the scrape keeps
counting by its measured part until the next scrape (nothing is subtracted: its blocks may be
shared with a sequence still running, and vLLM frees only those no one else holds). A later
lease sharing a prefix with a running one is counted whole: more, never less.

Admission takes the smaller of the two bounds (`used_blocks`). What it does not bound: a
sequence that generates more than its expected output (the class's p95 when the request names
no smaller limit) grows past its reservation under either bound, until the next scrape shows
it; `router.kv_margin_frac` is kept free for that.
"""

from __future__ import annotations

from pools.fleet import InstanceState, Lease

__all__ = ["EngineKV"]


class EngineKV:
    """The output blocks each live lease may still grow by (`acquired`, `released`)."""

    def __init__(self) -> None:
        self._growth: dict[Lease, int] = {}

    def acquired(self, lease: Lease, output_tokens: int, block_size: int) -> None:
        growth = -(-max(0, output_tokens) // max(1, block_size)) + 1
        self._growth[lease] = min(lease.blocks, growth)

    def released(self, lease: Lease) -> None:
        self._growth.pop(lease, None)

    def used_blocks(self, state: InstanceState) -> float:
        """The smaller of the fleet's bound and the engine-tracked one (the module
        docstring); the fleet's alone while the reading lacks its request time."""
        fleet = state.used_blocks()
        reading, cap = state.reading, state.capacity_blocks
        if reading is None or cap is None or reading.requested_at_s is None:
            return fleet
        measured = reading.kv_usage_frac * cap
        # the sequences admitted since the reading arrived and still running count whole in
        # both bounds (added - released since is at most their blocks): when that reaches the
        # fleet's bound (its measured term decides it), the loop below cannot come out lower
        if measured + state.added_since_reading - state.released_since_reading >= fleet:
            return fleet
        if not state.first_token_leases:
            # no lease has sent its first token: every one counts whole below, and measured +
            # all reservations is never under the fleet's bound (added - released since the
            # reading is at most what is reserved now): no pass over the leases per request
            return fleet
        asked = reading.requested_at_s
        pending = 0
        for lease in state.leases:
            first = lease.first_token_at_s
            growth = self._growth.get(lease)
            if first is not None and first <= asked and growth is not None:
                pending += growth
            else:
                pending += lease.blocks
        return min(fleet, measured + pending)
