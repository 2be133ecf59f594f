"""A router whose engine is also loaded by someone else (another `gpupool serve` on the same
static engines, any other client) must not lock itself down once that load has gone.

Observed in s38 (benchmarks/results/agent-flood-index-cpu-2026-12-02/README.md, run 2): the
router that had watched the other router's run kept its agent engine at 5 running (KV 26 %)
while its agent steps queued 12 s. Hand-made readings through a real `Fleet` (the path
`TelemetryScraper` feeds) replay what can cause that: first the other router's load, on a
machine it slows, with a transient wait in the engine at a small batch as the load ebbs; then
this router alone, with more demand than any limit, always topping the engine up to its limit
for the target. Two things learned from the foreign load used to hold the limit at 5-6 for
good, each shown on its own below: the batch sizes the other load ran slow at were never
measured again (this router never ran that many), and the ceiling taken from the transient
wait (4 running while requests waited) was only forgotten when more than one above it ran,
which a limit of one above it never allows."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from pools.fleet import Fleet, InstanceState, Lease
from pools.launchers.base import InstanceSpec
from pools.telemetry import InstanceReading

SPEC = InstanceSpec("engine-0", "http://127.0.0.1:9", 1)
TARGET_S = 0.150  # the agent pool's TPOT target in the s38 run
# the engine alone: TPOT(n) = 20 ms + 5 ms per running sequence, so 26 meet the target
TRUE_LIMIT = 26
MAX_NUM_SEQS = 64


def tpot_alone_s(running: int) -> float:
    return 0.020 + 0.005 * running


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Engine:
    """The engine's cumulative counters, as `/metrics` reports them."""

    itl_sum_s: float = 0.0
    itl_count: float = 0.0

    def scrape(self, now_s: float, running: int, waiting: int, itl_s: float) -> InstanceReading:
        tokens = 20.0 * running  # one second of decode steps at ~20 steps/s
        self.itl_sum_s += itl_s * tokens
        self.itl_count += tokens
        # KV 26 % of 1000 blocks of 16 tokens; no preemptions, prefix cache or TTFT
        return InstanceReading(
            now_s, 0.26, running, waiting, 1001, 16, 0, 0, 0, 0, 0, self.itl_sum_s, self.itl_count
        )


def _foreign_phase(
    clock: Clock, fleet: Fleet, engine: Engine, *, slowed: bool, tail_wait: bool
) -> None:
    """The other router's load: its batch ramps 1 -> 21 -> 1 over ~80 s while this router
    sends nothing; `slowed`: the machine runs 3x slower meanwhile (its prefills, its CPU);
    `tail_wait`: as the load ebbs, one scrape finds 4 running and 2 waiting (new requests
    not yet scheduled behind a prefill: no ceiling)."""
    ramp = [n for n in range(1, 22) for _ in range(2)]  # two seconds at each batch size
    for n in ramp + ramp[::-1]:
        clock.now += 1.0
        itl_s = tpot_alone_s(n) * (3.0 if slowed else 1.0)
        fleet.record_reading("engine-0", engine.scrape(clock.now, n, 0, itl_s))
    if tail_wait:
        clock.now += 1.0
        fleet.record_reading("engine-0", engine.scrape(clock.now, 4, 2, tpot_alone_s(4)))
    clock.now += 1.0
    fleet.record_reading("engine-0", engine.scrape(clock.now, 0, 0, 0.0))


def _alone_phase(
    clock: Clock,
    fleet: Fleet,
    state: InstanceState,
    engine: Engine,
    seconds: int,
    rng: random.Random | None = None,
) -> list[int]:
    """This router alone with a queue that never empties: each second it tops the engine up
    to its limit (one sequence of its own ends each second); every 4th scrape one of its new
    requests still waits inside the engine; with `rng`, each second's TPOT is off by up to
    ±20 %. Returns the limit after each scrape."""
    leases: list[Lease] = []
    limits = []
    for second in range(seconds):
        if leases:
            leases.pop(0).release()  # one finishes
        while len(leases) < state.op.limit(TARGET_S):
            leases.append(fleet.acquire("engine-0", "agent"))
        own = state.inflight
        waiting = 1 if second % 4 == 3 else 0
        running = own - waiting
        clock.now += 1.0
        noise = rng.uniform(0.8, 1.2) if rng is not None else 1.0
        reading = engine.scrape(clock.now, running, waiting, tpot_alone_s(running) * noise)
        fleet.record_reading("engine-0", reading)
        limits.append(state.op.limit(TARGET_S))
    for lease in leases:
        lease.release()
    return limits


def _fleet() -> tuple[Clock, Fleet, InstanceState]:
    clock = Clock()
    fleet = Fleet([SPEC], clock=clock)
    state = fleet.get("engine-0")
    assert state is not None
    state.op.max_num_seqs = MAX_NUM_SEQS
    return clock, fleet, state


def test_alone_from_the_start_it_finds_the_engines_operating_point() -> None:
    # the control: the same engine and demand without the foreign phase
    clock, fleet, state = _fleet()
    engine = Engine()
    fleet.record_reading("engine-0", engine.scrape(clock.now, 0, 0, 0.0))
    limits = _alone_phase(clock, fleet, state, engine, 120)
    assert min(limits[60:]) >= TRUE_LIMIT - 2 and max(limits[60:]) <= TRUE_LIMIT + 1


@pytest.mark.parametrize(
    ("slowed", "tail_wait"),
    [(True, False), (False, True), (True, True)],
    ids=["slow-batches-it-never-runs", "transient-wait-as-ceiling", "both"],
)
def test_after_a_foreign_load_it_recovers_the_engines_operating_point(
    slowed: bool, tail_wait: bool
) -> None:
    clock, fleet, state = _fleet()
    engine = Engine()
    fleet.record_reading("engine-0", engine.scrape(clock.now, 0, 0, 0.0))
    _foreign_phase(clock, fleet, engine, slowed=slowed, tail_wait=tail_wait)
    assert state.inflight == 0  # none of that load was this router's
    limit_after_foreign = state.op.limit(TARGET_S)
    assert limit_after_foreign <= 6  # what it learned there holds it down at first
    # alone, the engine meets the target up to 26 running: within a minute the limit is back
    # there, and stays (it was 5 for the rest of the run in s38)
    limits = _alone_phase(clock, fleet, state, engine, 120)
    assert min(limits[60:]) >= TRUE_LIMIT - 2 and max(limits[60:]) <= TRUE_LIMIT + 1


@pytest.mark.parametrize("foreign", [False, True], ids=["alone", "after-foreign-load"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_limit_holds_steady_on_a_noisy_engine(foreign: bool, seed: int) -> None:
    # what lets a lock go must not make the limit swing with noise: a busy router measures
    # only the batch sizes next to its limit, and a line fitted to those alone extrapolates
    # wildly (forgetting the rest on every sample swung it between 1 and 64 here)
    clock, fleet, state = _fleet()
    engine = Engine()
    fleet.record_reading("engine-0", engine.scrape(clock.now, 0, 0, 0.0))
    if foreign:
        _foreign_phase(clock, fleet, engine, slowed=True, tail_wait=True)
    limits = _alone_phase(clock, fleet, state, engine, 400, random.Random(seed))
    assert min(limits[100:]) >= TRUE_LIMIT - 4 and max(limits[100:]) <= TRUE_LIMIT + 3
