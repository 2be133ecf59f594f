"""Tool pauses (`admission.tool_pause_hold`): the pure holds in `router.admission.tool_pauses`
on explicit times, and the admitter's synchronous core on a fake clock: a paused run's context
blocks count as used for every other sequence on its home, never for its own next step."""

from __future__ import annotations

import dataclasses
import itertools
import random
from pathlib import Path

import pytest

from pools.config import ConfigError
from pools.testing.config import config_for_test
from router.admission.decision import Need
from router.admission.tool_pauses import PauseHolds
from router.core import Core
from router.request import RequestContext
from tests.unit.test_forecast_admission import SPEC, Clock, _core, _scrape
from tests.unit.test_rebalance_borrow import ctx

# 150 blocks of 16 tokens; the engine has 949 usable blocks (1000 less the 5 % margin), each
# pool's half 474.5
BIG = Need(prompt_tokens=2300, total_tokens=2400, deadline_s=1e9)
_ids = itertools.count()


def _ctx(pool: str, run_id: str | None) -> RequestContext:
    return dataclasses.replace(ctx(pool, next(_ids)), run_id=run_id)


def test_a_hold_lasts_the_learned_pause_with_its_margin_at_most_the_max() -> None:
    holds = PauseHolds(max_pause_s=10.0, margin_frac=0.5, max_frac=1.0)
    # nothing learned yet: the longest pause (the margin does not stretch it past the max)
    assert holds.ended("r1", "e0", 100, "agent", now_s=0.0) == 10.0
    assert holds.held_blocks("e0", 1000, 9.99) == 100
    assert holds.held_blocks("e1", 1000, 9.99) == 0
    assert holds.held_blocks("e0", 1000, 10.0) == 0  # passed
    # a pause of 2 s is learned: r1's next hold is 3 s, and a new run in the pool gets the
    # pool's mean
    holds.ended("r1", "e0", 100, "agent", now_s=20.0)
    assert holds.arrived("r1", 22.0)
    assert not holds.arrived("r1", 22.5)  # no hold left
    assert holds.ended("r1", "e0", 120, "agent", now_s=30.0) == 33.0
    assert holds.ended("r2", "e0", 50, "agent", now_s=30.0) == 33.0
    assert holds.ended("r3", "e0", 50, "chat", now_s=30.0) == 40.0  # another pool: nothing learned
    assert holds.held_blocks("e0", 1000, 32.0) == 220
    # the run's mean moves halfway to each new pause: (2 + 4) / 2 = 3 s, held 4.5 s
    assert holds.arrived("r1", 34.0) is False  # it came back after its hold had passed
    assert holds.predicted_pause_s("r1", "agent") == 3.0


def test_held_blocks_are_capped_and_end_with_the_run_or_its_instance() -> None:
    holds = PauseHolds(max_pause_s=10.0, margin_frac=0.0, max_frac=0.3)
    for run in ("a", "b", "c"):
        holds.ended(run, "e0", 200, "agent", now_s=0.0)
    holds.ended("d", "e1", 200, "agent", now_s=0.0)
    assert holds.held_blocks("e0", 1000, 1.0) == 300  # 600 held, capped at 0.3 x 1000
    holds.forget("a")
    holds.forget("b")
    assert holds.held_blocks("e0", 1000, 1.0) == 200
    holds.forget_instance("e1")
    assert holds.held_blocks("e1", 1000, 1.0) == 0
    assert holds.holds() == 1
    with pytest.raises(ValueError):
        PauseHolds(max_pause_s=10.0, margin_frac=0.0, max_frac=0.0)


def test_learned_pauses_are_bounded_per_run() -> None:
    holds = PauseHolds(max_pause_s=10.0, margin_frac=0.0, max_frac=1.0, max_runs=2)
    for i, run in enumerate(("a", "b", "c")):
        holds.ended(run, "e0", 1, "agent", now_s=float(i))
        holds.arrived(run, i + 1.0 + i)  # pauses 1, 2, 3 s
    assert holds.predicted_pause_s("a", "pool-never-seen") == 10.0  # forgotten
    assert holds.predicted_pause_s("c", "agent") == 3.0


def _paused_run_and_a_full_engine(tmp_path: Path, clock: Clock, **admission: str) -> Core:
    """Run "r"'s step (150 blocks) ends at 10 s; then 3 chat sequences of 150 blocks and 2 agent
    sequences of other runs run: 750 blocks in use, 150 held for "r"."""
    core = _core(tmp_path, clock, tool_pause_hold=True, tool_pause_max_s=4.0, **admission)
    a = core.admitter
    lease = a.admit_now(_ctx("agent", "r"), BIG, clock.now)
    assert lease is not None
    clock.now = 10.0
    lease.release()
    _scrape(core, clock)
    for pool, run in [("normal", None)] * 3 + [("agent", "x"), ("agent", "y")]:
        assert a.admit_now(_ctx(pool, run), BIG, clock.now) is not None
    return core


def test_a_paused_runs_context_is_held_against_others_not_its_own_next_step(
    tmp_path: Path,
) -> None:
    clock = Clock()
    core = _paused_run_and_a_full_engine(tmp_path, clock)
    a = core.admitter
    state = core.fleet.get(SPEC.instance_id)
    assert state is not None
    assert a.pause_held_blocks(state, clock.now) == 150
    # another run's step: 750 + 150 held + 150 > 949 (without the hold, 900 fits)
    assert a.admit_now(_ctx("agent", "z"), BIG, clock.now) is None
    # the paused run's own next step arrives: its hold ends and it fits
    clock.now = 11.0
    assert a.admit_now(_ctx("agent", "r"), BIG, clock.now) is not None
    assert a.pause_held_blocks(state, clock.now) == 0


def test_held_against_new_runs_only_a_run_in_progress_goes_and_a_new_one_waits(
    tmp_path: Path,
) -> None:
    clock = Clock()
    core = _paused_run_and_a_full_engine(tmp_path, clock, tool_pause_hold_against="new_runs")
    a = core.admitter
    state = core.fleet.get(SPEC.instance_id)
    assert state is not None
    assert a.pause_held_blocks(state, clock.now) == 150
    # a new run's first step: 750 + 150 held + 150 > 949, it waits
    assert a.admit_now(_ctx("agent", "z"), BIG, clock.now) is None
    # run "x" has its home here (its first step was answered there, as settlement records):
    # its next step counts no one's hold, 750 + 150 <= 949
    x = _ctx("agent", "x")
    a.affinity.record(x.home_key, SPEC.instance_id, context_tokens=2400)
    assert a.admit_now(x, BIG, clock.now) is not None
    # a request outside any run is gated like a new run: 2 blocks fit beside the 900 in use
    # (949), not beside the 150 held too
    small = Need(16, 32, 1e9)
    assert a.admit_now(_ctx("agent", None), small, clock.now) is None
    clock.now = 14.0  # "r"'s hold passes (tool_pause_max_s 4 s from 10 s)
    assert a.admit_now(_ctx("agent", None), small, clock.now) is not None


def test_held_against_all_a_run_in_progress_waits_too(tmp_path: Path) -> None:
    clock = Clock()
    core = _paused_run_and_a_full_engine(tmp_path, clock)  # the default: all
    x = _ctx("agent", "x")
    core.admitter.affinity.record(x.home_key, SPEC.instance_id, context_tokens=2400)
    assert core.admitter.admit_now(x, BIG, clock.now) is None


def test_the_hold_ends_when_the_predicted_pause_passes(tmp_path: Path) -> None:
    clock = Clock()
    core = _paused_run_and_a_full_engine(tmp_path, clock)
    a = core.admitter
    clock.now = 13.99  # held 4 s (tool_pause_max_s: nothing learned yet) from 10 s
    assert a.admit_now(_ctx("agent", "z"), BIG, clock.now) is None
    clock.now = 14.0
    assert a.admit_now(_ctx("agent", "z"), BIG, clock.now) is not None


def test_off_nothing_is_held(tmp_path: Path) -> None:
    assert config_for_test(tmp_path).admission.tool_pause_hold is False  # the default
    clock = Clock()
    core = _core(tmp_path, clock, tool_pause_hold=False)
    assert core.admitter.pauses is None
    lease = core.admitter.admit_now(_ctx("agent", "r"), BIG, 0.0)
    assert lease is not None
    lease.release()
    state = core.fleet.get(SPEC.instance_id)
    assert state is not None
    assert core.admitter.pause_held_blocks(state, 0.0) == 0


def test_the_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tool_pause_max_s set with tool_pause_hold: false"):
        config_for_test(tmp_path, admission={"tool_pause_hold": False, "tool_pause_max_s": 5.0})
    with pytest.raises(ConfigError, match="tool_pause_max_frac"):
        config_for_test(tmp_path, admission={"tool_pause_hold": True, "tool_pause_max_frac": 0})
    with pytest.raises(ConfigError, match="tool_pause_hold_against set with tool_pause_hold"):
        config_for_test(tmp_path, admission={"tool_pause_hold_against": "new_runs"})
    with pytest.raises(ConfigError, match="tool_pause_hold_against"):
        config_for_test(
            tmp_path, admission={"tool_pause_hold": True, "tool_pause_hold_against": "old"}
        )
    adm = config_for_test(tmp_path, admission={"tool_pause_hold": True}).admission
    assert (
        adm.tool_pause_max_s,
        adm.tool_pause_margin_frac,
        adm.tool_pause_max_frac,
        adm.tool_pause_hold_against,
    ) == (10.0, 0.5, 0.3, "all")


def test_held_blocks_match_a_walk_over_the_holds_through_random_events() -> None:
    """The per-instance totals and the heap of ends agree with summing the live holds."""
    rng = random.Random(7)
    holds = PauseHolds(max_pause_s=5.0, margin_frac=0.5, max_frac=1.0)
    live: dict[str, tuple[str, int, float]] = {}  # run -> (instance, blocks, until)
    now = 0.0
    for _ in range(2000):
        now += rng.random() * 0.5
        run, instance = f"r{rng.randrange(30)}", f"e{rng.randrange(3)}"
        event = rng.random()
        if event < 0.5:
            blocks = rng.randrange(1, 50)
            live[run] = (instance, blocks, holds.ended(run, instance, blocks, "agent", now))
        elif event < 0.9:
            holds.arrived(run, now)
            live.pop(run, None)
        else:
            holds.forget(run)
            live.pop(run, None)
        for i in ("e0", "e1", "e2"):
            want = sum(b for inst, b, until in live.values() if inst == i and until > now)
            assert holds.held_blocks(i, 10_000, now) == want
