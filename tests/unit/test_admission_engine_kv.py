"""Engine-tracked KV use (router/admission/engine_kv.py) over a real `Fleet` and hand-made
readings: a lease whose first token preceded the scrape's request counts by the engine's
measure plus its output still to grow, the others by their whole reservation, a released one
by the measure until the next scrape, and never more than the reservations' bound."""

from __future__ import annotations

from pools.fleet import Fleet
from pools.launchers.base import InstanceSpec
from pools.telemetry import InstanceReading
from router.admission.engine_kv import EngineKV

SPEC = InstanceSpec("engine-0", "http://127.0.0.1:9", 1)
BLOCK = 16


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _reading(now_s: float, used_blocks: int, *, asked_s: float | None) -> InstanceReading:
    # 1001 blocks: 1000 usable (vLLM's null block), usage = used / 1000
    return InstanceReading(
        now_s, used_blocks / 1000, 0, 0, 1001, BLOCK, 0, 0, 0, 0, 0, 0, 0, requested_at_s=asked_s
    )


def _fleet() -> tuple[Clock, Fleet, EngineKV]:
    clock = Clock()
    fleet = Fleet([SPEC], clock=clock)
    kv = EngineKV()
    fleet.on_lease_event(lambda lease, event: kv.released(lease) if event == "released" else None)
    return clock, fleet, kv


def test_a_sequence_past_its_prefill_counts_by_the_engine_and_its_growth() -> None:
    clock, fleet, kv = _fleet()
    # two sequences of one 1600-token prompt + 64 expected output: 104 blocks reserved each,
    # growth 4 + 1 = 5 each; the engine holds the prompt's 100 blocks once
    a = fleet.acquire(SPEC.instance_id, "agent", blocks=104, prompt_tokens=1600)
    b = fleet.acquire(SPEC.instance_id, "agent", blocks=104, prompt_tokens=0)
    kv.acquired(a, 64, BLOCK)
    kv.acquired(b, 64, BLOCK)
    state = fleet.get(SPEC.instance_id)
    assert state is not None
    clock.now = 0.5
    a.first_token(0.5)
    b.first_token(0.5)
    # a scrape asked at 0.4 (before the first tokens): the engine's 60 may miss the prompt
    fleet.record_reading(SPEC.instance_id, _reading(0.45, 60, asked_s=0.4))
    assert kv.used_blocks(state) == 208  # the reservations' bound: 208 < 60 + 208
    # asked at 0.6, after them: the shared prompt and a first output block each, 102
    fleet.record_reading(SPEC.instance_id, _reading(0.65, 102, asked_s=0.6))
    assert kv.used_blocks(state) == 102 + 5 + 5
    # a third sequence before its first token counts whole
    c = fleet.acquire(SPEC.instance_id, "normal", blocks=20, prompt_tokens=300)
    kv.acquired(c, 20, BLOCK)
    assert kv.used_blocks(state) == 112 + 20
    # released since the scrape: its measured blocks (perhaps shared) count until the next
    # one, its growth no longer (102 + 5 + 20); the reservations' bound, 104 + 20, is lower
    a.release()
    assert kv.used_blocks(state) == 124
    b.release()
    assert kv.used_blocks(state) == 20  # only c's reservation is left
    fleet.record_reading(SPEC.instance_id, _reading(0.9, 3, asked_s=0.85))
    c.first_token(0.95)  # after the scrape was asked: c still counts whole
    assert kv.used_blocks(state) == 20


def test_the_reservations_bound_wins_when_smaller() -> None:
    _clock, fleet, kv = _fleet()
    lease = fleet.acquire(SPEC.instance_id, "agent", blocks=10, prompt_tokens=100)
    kv.acquired(lease, 48, BLOCK)
    state = fleet.get(SPEC.instance_id)
    assert state is not None
    lease.first_token(0.1)
    # another router's (or an unknown) 500 blocks on the engine: the engine's count is larger
    fleet.record_reading(SPEC.instance_id, _reading(0.3, 500, asked_s=0.2))
    assert kv.used_blocks(state) == state.used_blocks() == 500 + 0  # measured, nothing since
    # without the request time (a reading built elsewhere) the fleet's bound alone
    fleet.record_reading(SPEC.instance_id, _reading(0.5, 3, asked_s=None))
    assert kv.used_blocks(state) == state.used_blocks() == 10
