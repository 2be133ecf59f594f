"""The rebalancer's pure decision: bounds, hysteresis, cooldown, convergence, no oscillation.

The closed-loop tests drive `decide` with a plant model in which a pool's pressure is its
demand over its share (pressure 1 = at target), in simulated time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pools.rebalance import (
    Bounds,
    LoopState,
    PoolSignals,
    RebalanceSettings,
    ScheduleWindow,
    bounds_at,
    clamp_shares,
    decide,
    effective_bounds,
    pressure_by_signal,
)

SETTINGS = RebalanceSettings(
    interval_s=30, hysteresis_frac=0.2, cooldown_s=60, smoothing_window_s=60, max_step_frac=0.1
)
BOUNDS = {"agent": Bounds(0.15, 0.40), "normal": Bounds(0.60, 0.85)}


def signals_for(pressure: float, requests: int = 10) -> PoolSignals:
    """Signals whose pressure is `pressure` (through the queue wait, target 1 s)."""
    return PoolSignals(queue_wait_s=pressure, queue_wait_target_s=1.0, requests=requests)


def run_loop(
    demand: Mapping[str, float] | Sequence[Mapping[str, float]],
    shares: Mapping[str, float],
    bounds: Mapping[str, Bounds],
    steps: int,
    cfg: RebalanceSettings = SETTINGS,
    instance_frac: float = 0.0,
    home: Mapping[str, float] | None = None,
) -> tuple[list[dict[str, float]], list[tuple[str, str]]]:
    """Run `steps` intervals; pressure = demand / share. Returns shares after each step and
    the (giver, receiver) of every move."""
    state = LoopState(shares=dict(shares))
    trajectory: list[dict[str, float]] = []
    moves: list[tuple[str, str]] = []
    for k in range(steps):
        d = demand[k] if isinstance(demand, Sequence) else demand
        sig = {p: signals_for(d[p] / max(state.shares[p], 1e-9), 10 if d[p] else 0) for p in d}
        decision = decide(
            state, sig, bounds, cfg, k * cfg.interval_s, instance_frac=instance_frac, home=home
        )
        state = decision.state
        if decision.move is not None:
            moves.append((decision.move.from_pool, decision.move.to_pool))
        trajectory.append(dict(state.shares))
    return trajectory, moves


def test_pressure_is_each_signal_over_its_target() -> None:
    p = pressure_by_signal(
        PoolSignals(
            queue_wait_s=3.0,
            queue_wait_target_s=2.0,
            kv_usage_frac=0.4,
            ttft_p95_s=1.5,
            ttft_target_s=2.0,
            tpot_p95_s=None,
            rejected_frac=0.02,
        )
    )
    # TTFT at 75 % of its target: counted from half the target, 2 x 0.75 - 1 = 0.5
    assert p == pytest.approx(
        {"queue_wait": 1.5, "kv": 0.5, "ttft": 0.5, "tpot": 0.0, "rejections": 2.0}
    )


@pytest.mark.parametrize(
    ("ttft_s", "tpot_s", "expected"),
    [
        (0.8, 0.04, (0.0, 0.0)),  # 40 % of the targets: the engine's own latency
        (1.0, 0.05, (0.0, 0.0)),  # half the targets
        (1.5, 0.09, (0.5, 0.8)),
        (2.0, 0.10, (1.0, 1.0)),  # at target
        (3.0, 0.25, (1.5, 2.5)),  # above: plain ratio
    ],
)
def test_latency_counts_from_half_its_target(
    ttft_s: float, tpot_s: float, expected: tuple[float, float]
) -> None:
    p = pressure_by_signal(
        PoolSignals(ttft_p95_s=ttft_s, ttft_target_s=2.0, tpot_p95_s=tpot_s, tpot_target_s=0.1)
    )
    assert (p["ttft"], p["tpot"]) == pytest.approx(expected)


def test_moves_share_to_the_pressured_pool_one_capped_step() -> None:
    state = LoopState(shares={"agent": 0.25, "normal": 0.75})
    sig = {"agent": signals_for(3.0), "normal": signals_for(0.2)}
    d = decide(state, sig, BOUNDS, SETTINGS, 0.0)
    assert d.reason == "moved"
    assert d.move is not None and (d.move.from_pool, d.move.to_pool) == ("normal", "agent")
    # equalising step: L_a = 0.75, L_n = 0.15 -> (0.75*0.75 - 0.15*0.25) / 0.9 = 0.5833,
    # capped at max_step 0.1
    assert d.shares["agent"] == pytest.approx(0.35)
    assert d.shares["normal"] == pytest.approx(0.65)


def test_equalising_step_when_below_the_cap() -> None:
    cfg = RebalanceSettings(max_step_frac=0.5, hysteresis_frac=0.1)
    state = LoopState(shares={"a": 0.5, "b": 0.5})
    sig = {"a": signals_for(1.2), "b": signals_for(0.8)}
    d = decide(state, sig, {"a": Bounds(0, 1), "b": Bounds(0, 1)}, cfg, 0.0)
    # L_a = 0.6, L_b = 0.4: x = (0.6*0.5 - 0.4*0.5) / 1.0 = 0.1 -> a 0.6, b 0.4, both at 1.0
    assert d.shares == pytest.approx({"a": 0.6, "b": 0.4})


def test_within_hysteresis_nothing_moves() -> None:
    state = LoopState(shares={"agent": 0.25, "normal": 0.75})
    sig = {"agent": signals_for(0.9), "normal": signals_for(0.75)}
    d = decide(state, sig, BOUNDS, SETTINGS, 0.0)
    assert d.reason == "within_hysteresis" and d.move is None
    assert d.shares == {"agent": 0.25, "normal": 0.75}


def test_cooldown_and_one_step_per_interval() -> None:
    state = LoopState(shares={"agent": 0.2, "normal": 0.8})
    hot = {"agent": signals_for(5.0), "normal": signals_for(0.1)}
    first = decide(state, hot, BOUNDS, SETTINGS, 0.0)
    assert first.reason == "moved"
    early = decide(first.state, hot, BOUNDS, SETTINGS, 10.0)
    assert early.reason == "not_due" and early.shares == first.shares
    cooling = decide(first.state, hot, BOUNDS, SETTINGS, 30.0)
    assert cooling.reason == "cooldown"
    after = decide(cooling.state, hot, BOUNDS, SETTINGS, 60.0)
    assert after.reason == "moved"


def test_idle_pool_goes_to_its_floor_and_stays() -> None:
    traj, _ = run_loop({"agent": 0.0, "normal": 0.5}, {"agent": 0.4, "normal": 0.6}, BOUNDS, 40)
    assert traj[-1]["agent"] == pytest.approx(0.15)
    assert all(t["agent"] >= 0.15 - 1e-9 for t in traj)


def test_a_pool_with_traffic_keeps_one_instance() -> None:
    bounds = {"agent": Bounds(0.1, 0.9), "normal": Bounds(0.1, 0.9)}
    traj, _ = run_loop(
        {"agent": 0.01, "normal": 2.0},
        {"agent": 0.5, "normal": 0.5},
        bounds,
        60,
        instance_frac=1 / 3,
    )
    assert min(t["agent"] for t in traj) >= 1 / 3 - 1e-9
    assert traj[-1]["agent"] == pytest.approx(1 / 3)


def test_effective_bounds_leave_room_for_the_others() -> None:
    bounds = {"a": Bounds(0.0, 1.0), "b": Bounds(0.8, 1.0)}
    limits = effective_bounds(bounds, {"a": True, "b": True}, 0.5)
    assert limits["a"] == pytest.approx((0.2, 1.0))  # one instance (0.5) does not fit
    assert limits["b"] == pytest.approx((0.8, 1.0))


def test_bounds_change_applies_at_once_and_pin_and_freeze() -> None:
    state = LoopState(shares={"agent": 0.4, "normal": 0.6}, last_move_at_s=0.0)
    quiet = {"agent": signals_for(0.5), "normal": signals_for(0.5)}
    tighter = {"agent": Bounds(0.15, 0.3), "normal": Bounds(0.7, 0.85)}
    d = decide(state, quiet, tighter, SETTINGS, 5.0)  # inside the cooldown: bounds still win
    assert d.reason == "bounds" and d.shares == pytest.approx({"agent": 0.3, "normal": 0.7})
    pinned = decide(state, quiet, BOUNDS, SETTINGS, 5.0, pinned={"agent": 0.2, "normal": 0.8})
    assert pinned.reason == "pinned"
    assert pinned.shares == pytest.approx({"agent": 0.2, "normal": 0.8})
    out_of_bounds_pin = decide(state, quiet, BOUNDS, SETTINGS, 5.0, pinned={"agent": 0.9})
    assert out_of_bounds_pin.shares["agent"] == pytest.approx(0.4)  # the ceiling
    hot = {"agent": signals_for(9.0), "normal": signals_for(0.0)}
    frozen = decide(state, hot, tighter, SETTINGS, 500.0, frozen=True)
    assert frozen.reason == "frozen" and frozen.shares == {"agent": 0.4, "normal": 0.6}


def test_clamp_shares_spreads_the_remainder() -> None:
    out = clamp_shares({"a": 0.9, "b": 0.05, "c": 0.05}, {"a": (0, 0.5), "b": (0, 1), "c": (0, 1)})
    assert out == pytest.approx({"a": 0.5, "b": 0.25, "c": 0.25})


def test_schedule_windows_and_wrap_past_midnight() -> None:
    day = Bounds(0.6, 0.9)
    night = ScheduleWindow(20 * 60, 8 * 60, Bounds(0.3, 0.6))
    assert bounds_at(day, [night], 21 * 60) == Bounds(0.3, 0.6)
    assert bounds_at(day, [night], 7 * 60 + 59) == Bounds(0.3, 0.6)
    assert bounds_at(day, [night], 8 * 60) == day
    assert bounds_at(day, [night], 12 * 60) == day


def test_converges_after_a_demand_step_in_few_intervals() -> None:
    """Chat-heavy, then an agent surge: the agent share rises at the first decision after the
    surge and settles where pressures are equal (within the hysteresis) or at the ceiling."""
    bounds = {"agent": Bounds(0.1, 0.4), "normal": Bounds(0.6, 0.9)}
    cfg = RebalanceSettings(
        interval_s=10, hysteresis_frac=0.2, cooldown_s=10, smoothing_window_s=10, max_step_frac=0.1
    )
    demand = [{"agent": 0.05, "normal": 0.6}] * 10 + [{"agent": 0.5, "normal": 0.4}] * 10
    traj, _ = run_loop(demand, {"agent": 0.25, "normal": 0.75}, bounds, 20, cfg)
    assert traj[9]["agent"] == pytest.approx(0.1)  # quiet agents: at the floor
    assert traj[10]["agent"] > traj[9]["agent"]  # the first decision after the surge moves
    assert traj[-1]["agent"] == pytest.approx(0.4)  # 0.5/0.4 vs 0.4/0.6: ceiling binds


@st.composite
def bounded_pools(draw: st.DrawFn) -> tuple[dict[str, Bounds], dict[str, float]]:
    n = draw(st.integers(min_value=2, max_value=4))
    floors = [draw(st.floats(0.0, 0.9 / n)) for _ in range(n)]
    ceilings = [draw(st.floats(max(f, 1.0 / n), 1.0)) for f in floors]
    names = [f"p{i}" for i in range(n)]
    bounds = {p: Bounds(f, c) for p, f, c in zip(names, floors, ceilings, strict=True)}
    start = clamp_shares(
        {p: 1.0 / n for p in names},
        {p: (f, c) for p, f, c in zip(names, floors, ceilings, strict=True)},
    )
    return bounds, start


@settings(max_examples=150, deadline=None)
@given(
    setup=bounded_pools(),
    pressures=st.lists(
        st.lists(st.floats(0.0, 20.0), min_size=4, max_size=4), min_size=1, max_size=30
    ),
    instance_frac=st.sampled_from([0.0, 0.125, 0.25, 1 / 3]),
)
def test_bounds_are_never_violated(
    setup: tuple[dict[str, Bounds], dict[str, float]],
    pressures: list[list[float]],
    instance_frac: float,
) -> None:
    bounds, shares = setup
    state = LoopState(shares=shares)
    for k, row in enumerate(pressures):
        sig = {p: signals_for(row[i], requests=int(row[i] > 1)) for i, p in enumerate(bounds)}
        d = decide(state, sig, bounds, SETTINGS, 30.0 * k, instance_frac=instance_frac)
        state = d.state
        assert sum(d.shares.values()) == pytest.approx(1.0)
        for p, b in bounds.items():
            assert b.floor_frac - 1e-9 <= d.shares[p] <= b.ceiling_frac + 1e-9
            lo, hi = d.bounds[p]
            assert lo - 1e-9 <= d.shares[p] <= hi + 1e-9


@settings(max_examples=150, deadline=None)
@given(
    demand_a=st.floats(0.0, 2.0),
    demand_b=st.floats(0.0, 2.0),
    start_a=st.floats(0.15, 0.85),
    hysteresis=st.floats(0.05, 0.5),
    step=st.floats(0.02, 0.5),
    home_a=st.one_of(st.none(), st.floats(0.1, 0.9)),
)
def test_no_oscillation_under_constant_demand(
    demand_a: float,
    demand_b: float,
    start_a: float,
    hysteresis: float,
    step: float,
    home_a: float | None,
) -> None:
    """Constant demand: moves all go one way, and they stop (with a home ratio or without)."""
    cfg = RebalanceSettings(
        interval_s=30,
        hysteresis_frac=hysteresis,
        cooldown_s=30,
        smoothing_window_s=60,
        max_step_frac=step,
    )
    bounds = {"a": Bounds(0.1, 0.9), "b": Bounds(0.1, 0.9)}
    home = None if home_a is None else {"a": home_a, "b": 1 - home_a}
    traj, moves = run_loop(
        {"a": demand_a, "b": demand_b}, {"a": start_a, "b": 1 - start_a}, bounds, 80, cfg, home=home
    )
    assert len(set(moves)) <= 1, f"moves went both ways: {moves}"
    assert traj[-1] == traj[-20], "still moving after 60 intervals of constant demand"


@settings(max_examples=100, deadline=None)
@given(
    before=st.tuples(st.floats(0.05, 2.0), st.floats(0.05, 2.0)),
    after=st.tuples(st.floats(0.05, 2.0), st.floats(0.05, 2.0)),
    home_a=st.one_of(st.none(), st.floats(0.1, 0.9)),
)
def test_converges_under_a_step_change(
    before: tuple[float, float], after: tuple[float, float], home_a: float | None
) -> None:
    """After demand steps to a new constant, within (distance / max step) moves plus their
    cooldowns the pools are within the hysteresis band of each other or at a bound; with a
    home ratio where no pool would be above 0.5 nor the gap past the hysteresis, at home."""
    cfg = RebalanceSettings(
        interval_s=10, hysteresis_frac=0.2, cooldown_s=10, smoothing_window_s=10, max_step_frac=0.1
    )
    bounds = {"a": Bounds(0.1, 0.9), "b": Bounds(0.1, 0.9)}
    demand = [{"a": before[0], "b": before[1]}] * 30 + [{"a": after[0], "b": after[1]}] * 30
    home = None if home_a is None else {"a": home_a, "b": 1 - home_a}
    traj, _ = run_loop(demand, {"a": 0.5, "b": 0.5}, bounds, 60, cfg, home=home)
    budget = 30 + 2 * 9 + 2  # 0.8 of travel at 0.1 per move, a cooldown after each
    final = traj[budget]
    assert traj[-1] == pytest.approx(final)
    at_home = None if home_a is None else (after[0] / home_a, after[1] / (1 - home_a))
    if at_home is not None and max(at_home) <= 0.5 and max(at_home) - min(at_home) <= 0.2:
        assert final["a"] == pytest.approx(home_a, abs=0.005 + 1e-6)
        return
    pa, pb = after[0] / final["a"], after[1] / final["b"]
    at_bound = min(final.values()) <= 0.1 + 0.005 + 1e-6  # steps under 0.005 are not taken
    assert abs(pa - pb) <= 0.2 + 1e-6 or at_bound, (final, pa, pb)
    assert traj[-1] == pytest.approx(final)


def test_sparse_traffic_keeps_one_instance_until_the_memory_expires() -> None:
    """Agent traffic once, then none: the agent pool keeps one instance's worth for
    traffic_memory_s (no flapping between its floor and one instance on sparse traffic),
    then goes to its floor."""
    cfg = RebalanceSettings(
        interval_s=10,
        hysteresis_frac=0.2,
        cooldown_s=10,
        smoothing_window_s=10,
        max_step_frac=0.2,
        traffic_memory_s=100,
    )
    bounds = {"agent": Bounds(0.1, 0.9), "normal": Bounds(0.1, 0.9)}
    demand = [{"agent": 0.1, "normal": 1.0}] + [{"agent": 0.0, "normal": 1.0}] * 30
    traj, _ = run_loop(demand, {"agent": 0.5, "normal": 0.5}, bounds, 31, cfg, instance_frac=1 / 3)
    assert min(t["agent"] for t in traj[:10]) == pytest.approx(1 / 3)  # t <= 90 s
    assert traj[-1]["agent"] == pytest.approx(0.1)  # long after the last agent request
