"""What admission reads per request without a pass over every lease (issue 28: at c=64 those
passes were O(in flight) per request): `InstanceState.pending_prefill_tokens` (pools/fleet.py),
kept as leases come and go, must equal the brute-force sum over the leases at every time
asked, later or earlier than the last; `EngineKV.used_blocks` (router/admission/engine_kv.py),
which skips its pass while no live lease has sent its first token, must equal the pass."""

from __future__ import annotations

import random

from pools.fleet import Fleet, InstanceState, Lease
from pools.launchers.base import InstanceSpec
from pools.telemetry import InstanceReading
from router.admission.engine_kv import EngineKV

SPEC = InstanceSpec("engine-0", "http://127.0.0.1:9", 1)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _fleet() -> tuple[Clock, Fleet, InstanceState]:
    clock = Clock()
    fleet = Fleet([SPEC], clock=clock)
    state = fleet.get("engine-0")
    assert state is not None
    return clock, fleet, state


def _brute(state: InstanceState, now_s: float) -> int:
    return sum(lease.prompt_tokens for lease in state.leases if lease.in_prefill(now_s))


def test_it_counts_until_the_first_token_the_predicted_end_or_the_release() -> None:
    _, fleet, state = _fleet()
    a = fleet.acquire("engine-0", "p", prompt_tokens=100, prefill_s=1.0)
    b = fleet.acquire("engine-0", "p", prompt_tokens=30, prefill_s=2.0)
    c = fleet.acquire("engine-0", "p", prompt_tokens=7, prefill_s=3.0)
    assert state.pending_prefill_tokens(0.5) == 137
    a.first_token(0.6)
    assert state.pending_prefill_tokens(0.7) == 37
    assert state.pending_prefill_tokens(2.0) == 7  # b's predicted prefill is over
    assert state.pending_prefill_tokens(1.5) == 37  # an earlier time: summed, b counts again
    c.release()
    assert state.pending_prefill_tokens(2.5) == 0
    b.release()
    assert state.prefill_tokens == 0


def test_it_equals_the_sum_over_the_leases_through_random_operations() -> None:
    rng = random.Random(28)
    clock, fleet, state = _fleet()
    live: list[Lease] = []
    for _ in range(3000):
        clock.now += rng.random() * 0.05
        op = rng.random()
        if op < 0.4 or not live:
            prefill_s = rng.choice([0.0, rng.random() * 0.5, rng.random() * 5.0])
            live.append(
                fleet.acquire(
                    "engine-0", "p", prompt_tokens=rng.randint(0, 500), prefill_s=prefill_s
                )
            )
        elif op < 0.6:
            lease = rng.choice(live)
            if lease.first_token_at_s is None:
                lease.first_token(clock.now)
        elif op < 0.8:
            live.pop(rng.randrange(len(live))).release()
        asked = clock.now + rng.choice([0.0, 0.0, -rng.random(), rng.random()])
        assert state.pending_prefill_tokens(asked) == _brute(state, asked)
    for lease in live:
        lease.release()
    assert state.prefill_tokens == 0
    # the heap keeps no more than its bound of entries for released leases
    assert len(state.prefill_heap) <= 2 * len(state.leases) + 64 + 1


def _used_blocks_by_the_pass(kv: EngineKV, state: InstanceState) -> float:
    """`EngineKV.used_blocks` with its pass over every live lease forced."""
    real = state.first_token_leases
    state.first_token_leases = 1
    try:
        return kv.used_blocks(state)
    finally:
        state.first_token_leases = real


def test_engine_kv_without_first_tokens_equals_the_pass_over_the_leases() -> None:
    rng = random.Random(25)
    clock, fleet, state = _fleet()
    kv = EngineKV()
    live: list[Lease] = []
    checked = skipped = 0
    for step in range(2000):
        clock.now += 0.01
        op = rng.random()
        if op < 0.45 or not live:
            lease = fleet.acquire("engine-0", "p", blocks=rng.randint(1, 40))
            kv.acquired(lease, rng.randint(0, 300), 16)
            live.append(lease)
        elif op < 0.5 and step > 1000:  # first tokens only in the second half
            lease = rng.choice(live)
            if lease.first_token_at_s is None:
                lease.first_token(clock.now)
        elif op < 0.8:
            lease = live.pop(rng.randrange(len(live)))
            lease.release()
            kv.released(lease)
        if op > 0.95:  # a scrape: the engine's count, requested a little earlier
            used = min(state.reserved_blocks, rng.randint(0, 1000)) / 1000
            state.reading = InstanceReading(
                clock.now, used, 0, 0, 1001, 16, 0, 0, 0, 0, 0, 0, 0,
                requested_at_s=clock.now - 0.005,
            )  # fmt: skip
            state.added_since_reading = state.released_since_reading = 0
        if state.reading is not None:
            assert kv.used_blocks(state) == _used_blocks_by_the_pass(kv, state)
            checked += 1
            skipped += state.first_token_leases == 0
    assert checked > 1000 and 0 < skipped < checked  # both ways taken
    for lease in live:
        lease.release()
    assert state.first_token_leases == 0
