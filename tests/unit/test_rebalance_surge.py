"""The rebalancer's pure decision on the day-night shape: a night agent surge moves the agent
share within two intervals, and the ratio goes home when the surge is over (the property tests
with a home ratio are in test_rebalance.py).

Time is injected (`now_s`): each test places the decisions where the shell's timer would.
Settings and bounds are the day-night benchmark's (`benchmarks/rebalance/day_night.py`: 10 s
interval, 20 s cooldown and window, hysteresis 0.3, one engine per step; agent 0.2-0.67 of 3
engines, home 0.34). The plant: before the surge the pressures the committed run measured in
its evening phase (agent 0.2, normal 0.25); from the surge on, the night offers 1.4x one
engine's agent capacity, so the agent backlog grows at 0.4 of the engine's rate and the oldest
waiter's wait by 0.4 s each second (wait = backlog / service rate), against the agent pool's
3 s target.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from pools.rebalance import (
    Bounds,
    Decision,
    LoopState,
    PoolSignals,
    RebalanceSettings,
    decide,
    recall_hold_s,
)

BENCH = RebalanceSettings(
    interval_s=10, hysteresis_frac=0.3, cooldown_s=20, smoothing_window_s=20, max_step_frac=0.34
)
BOUNDS = {"agent": Bounds(0.2, 0.67), "normal": Bounds(0.33, 0.8)}
ONE_ENGINE = 1 / 3
TWO_ENGINES = 2 / 3
HOME = {"agent": ONE_ENGINE, "normal": TWO_ENGINES}  # initial 0.34 placed on three engines
SURGE_S = 120.0
AGENT_WAIT_TARGET_S = 3.0
OVERLOAD = 0.4  # 1.4x one engine's capacity offered


def sig(pressure: float) -> PoolSignals:
    return PoolSignals(queue_wait_s=pressure, queue_wait_target_s=1.0, requests=20)


def agent_wait_s(now_s: float) -> float:
    """The oldest agent waiter's age on one agent engine offered 1.4x its capacity."""
    return max(0.0, OVERLOAD * (now_s - SURGE_S))


@pytest.mark.parametrize("phase_s", [0.5, 3.0, 6.0, 9.9])
def test_night_surge_moves_the_agent_share_within_two_intervals(phase_s: float) -> None:
    """Whatever the timer's phase against the surge, by the second decision after the surge
    began the agent share is above one and a half engines' worth (0.5), and at two engines'
    (its ceiling) within the minute."""
    state = LoopState(shares={"agent": ONE_ENGINE, "normal": TWO_ENGINES})
    risen_at_s = None
    t = phase_s
    while t < SURGE_S + 60:
        if t < SURGE_S:
            signals = {"agent": sig(0.2), "normal": sig(0.25)}
        else:
            wait_s = agent_wait_s(t)
            signals = {
                "agent": PoolSignals(
                    queue_wait_s=wait_s, queue_wait_target_s=AGENT_WAIT_TARGET_S, requests=50
                ),
                "normal": sig(0.1),  # night chat: 0.5 req/s on two engines
            }
        d = decide(state, signals, BOUNDS, BENCH, t, instance_frac=ONE_ENGINE, home=HOME)
        state = d.state
        if t < SURGE_S:
            assert d.move is None, d  # nothing moves in the quiet evening
        elif risen_at_s is None and d.shares["agent"] > 0.5:
            risen_at_s = t
            assert d.reason == "moved"
        t += BENCH.interval_s
    assert risen_at_s is not None
    assert risen_at_s - SURGE_S <= 2 * BENCH.interval_s
    assert state.shares["agent"] == pytest.approx(TWO_ENGINES)  # the ceiling binds by then


def test_after_the_surge_the_ratio_goes_home_and_stays() -> None:
    """Morning: agents are back to a trickle on two engines (pressure 0.1) and chat (3 req/s)
    is at 0.3 on the one engine left: at home neither would be above 0.5 (agent 0.1 x 2 = 0.2,
    normal 0.3 / 2 = 0.15), so the engine goes back at once and the ratio stays home."""
    state = LoopState(shares={"agent": TWO_ENGINES, "normal": ONE_ENGINE}, last_move_at_s=100.0)
    demand = {"agent": 0.1 * TWO_ENGINES, "normal": 0.3 * ONE_ENGINE}  # pressure: / share
    shares = []
    for k in range(12):
        now = 200.0 + 10 * k
        signals = {p: sig(demand[p] / state.shares[p]) for p in demand}
        d = decide(state, signals, BOUNDS, BENCH, now, instance_frac=ONE_ENGINE, home=HOME)
        state = d.state
        shares.append(d.shares["agent"])
        if k == 0:
            assert d.reason == "home" and d.move is not None
            assert (d.move.from_pool, d.move.to_pool) == ("agent", "normal")
    assert shares[0] == pytest.approx(ONE_ENGINE)
    assert shares[-1] == pytest.approx(ONE_ENGINE)


def test_home_does_not_hold_a_move_the_pressure_rule_would_make_there() -> None:
    """At home, agent 0.45 and chat 0.05: both under 0.5, but 0.4 apart, past the 0.3
    hysteresis, so the pressure rule moves share to agent rather than home holding it (the
    second day-night run waited a decision for this)."""
    state = LoopState(shares=HOME)
    d = decide(state, {"agent": sig(0.45), "normal": sig(0.05)}, BOUNDS, BENCH, 0.0, home=HOME)
    assert d.reason == "moved" and d.shares["agent"] > ONE_ENGINE


def test_no_return_home_while_the_surge_lasts() -> None:
    """Night, after the move: two agent engines carry 1.4x one engine's load at pressure 0.4;
    at home (one engine) that would be 0.8 > 0.5, so the engine stays."""
    state = LoopState(shares={"agent": TWO_ENGINES, "normal": ONE_ENGINE}, last_move_at_s=100.0)
    for k in range(10):
        signals = {"agent": sig(0.4), "normal": sig(0.1)}
        d = decide(state, signals, BOUNDS, BENCH, 130.0 + 10 * k, home=HOME)
        state = d.state
        assert d.shares["agent"] == pytest.approx(TWO_ENGINES), d.reason


def test_an_idle_pool_gives_its_share_down_to_its_floor_whatever_the_gap() -> None:
    """No agent traffic (none yet): home does not apply, and the idle agent pool gives its
    share down to its floor (0.2) to chat, whether chat is pressured (0.4, past the 0.3
    hysteresis) or calm (0.2: the idle check of the day-night benchmark, where a 0.33 agent
    share sat unused under light chat). Agent traffic lifts it back to one engine's worth."""
    state = LoopState(shares=HOME)
    for chat in (0.4, 0.2, 0.0):
        d = decide(state, {"normal": sig(chat)}, BOUNDS, BENCH, 0.0, home=HOME)
        assert d.reason == "idle_pool", chat
        assert d.shares["agent"] == pytest.approx(0.2) and d.shares["normal"] == pytest.approx(0.8)
    signals = {"agent": sig(0.1), "normal": sig(0.2)}
    back = decide(d.state, signals, BOUNDS, BENCH, 60.0, home=HOME, instance_frac=ONE_ENGINE)
    assert back.reason == "bounds" and back.shares["agent"] == pytest.approx(ONE_ENGINE)


CHAT_TTFT_TARGET_S = 0.8  # the day-night scenario's chat SLO


def morning_signals(agent_pressure: float, chat_ttft_s: float) -> dict[str, PoolSignals]:
    return {
        "agent": sig(agent_pressure),
        "normal": PoolSignals(
            ttft_p95_s=chat_ttft_s, ttft_target_s=CHAT_TTFT_TARGET_S, requests=30
        ),
    }


def night_state() -> LoopState:
    """After the night: two engines lent to the agent pool at t = 140 s, and three decisions
    of a backlogged agent pool (pressure 1.1) beside a calm chat pool since."""
    state = LoopState(shares={"agent": TWO_ENGINES, "normal": ONE_ENGINE}, last_move_at_s=140.0)
    for t in (170.0, 180.0, 190.0):
        state = decide(
            state, morning_signals(1.1, 0.2), BOUNDS, BENCH, t, instance_frac=ONE_ENGINE, home=HOME
        ).state
    return state


def test_morning_chat_missing_its_target_recalls_the_lent_engine_at_once() -> None:
    """The third day-night run's morning, as its decision log measured it (t = 199.6 s): chat
    TTFT p95 2.1 s on the one engine left (pressure 2.1 / 0.8 = 2.63), the agent pool still
    working off its backlog (pressure 1.0). Smoothed over the 20 s window (the decisions at
    190 and 200 s), chat is (0 + 2.625) / 2 = 1.31 and agent (1.1 + 1.0) / 2 = 1.05: 0.26
    apart, within the 0.3 hysteresis, so the pressure rule would wait (it moved one decision
    later in that run). Chat misses its target now by 2.625 - 1.05 = 1.6 more than the agent
    pool: share comes back in this decision, the step that equalises the two under the
    load / share model: loads 2.625 / 3 = 0.875 and 1.05 x 2 / 3 = 0.7, so
    (0.875 x 2/3 - 0.7 x 1/3) / (0.875 + 0.7) = 0.35 / 1.575 = 0.2222 (under the 0.34 step)."""
    state = night_state()
    d = decide(
        state, morning_signals(1.0, 2.1), BOUNDS, BENCH, 200.0, instance_frac=ONE_ENGINE, home=HOME
    )
    assert d.reason == "recalled"
    assert d.move is not None and (d.move.from_pool, d.move.to_pool) == ("agent", "normal")
    assert d.move.share_frac == pytest.approx(0.35 / 1.575)
    assert d.shares["normal"] == pytest.approx(1 / 3 + 0.35 / 1.575)


def test_no_recall_while_the_lender_meets_its_target_or_the_holder_is_as_pressured() -> None:
    """Chat at 0.7 s (pressure 0.75, under 1): no recall, whatever the gap to the agent pool
    (0.1); chat at 2.1 s (2.63) against an agent pool at 2.5: 0.13 apart, within the 0.3
    hysteresis, no recall either (and the smoothed gap is within it too)."""
    for agent, chat_s in ((0.1, 0.7), (2.5, 2.1)):
        state = LoopState(shares={"agent": TWO_ENGINES, "normal": ONE_ENGINE}, last_move_at_s=140.0)
        for t in (170.0, 180.0, 190.0):
            state = decide(
                state,
                morning_signals(agent, chat_s),
                BOUNDS,
                BENCH,
                t,
                instance_frac=ONE_ENGINE,
                home=HOME,
            ).state
        d = decide(
            state,
            morning_signals(agent, chat_s),
            BOUNDS,
            BENCH,
            200.0,
            instance_frac=ONE_ENGINE,
            home=HOME,
        )
        assert d.reason != "recalled", (agent, chat_s, d.reason)


def test_no_recall_in_the_cooldown_nor_past_home() -> None:
    """A recall is a move: not within `cooldown_s` of the last one. And it goes back to home,
    not beyond: chat at home (two engines) missing its target is the pressure rule's case."""
    state = LoopState(shares={"agent": TWO_ENGINES, "normal": ONE_ENGINE}, last_move_at_s=190.0)
    d = decide(
        state, morning_signals(1.0, 2.1), BOUNDS, BENCH, 200.0, instance_frac=ONE_ENGINE, home=HOME
    )
    assert d.reason == "cooldown"
    at_home = LoopState(shares=HOME)
    d = decide(
        at_home, morning_signals(0.2, 2.1), BOUNDS, BENCH, 0.0, instance_frac=ONE_ENGINE, home=HOME
    )
    # the pressure rule's case (2.63 vs 0.2), not a recall: and the agent pool, which has
    # traffic, keeps one engine's worth (its effective floor), so nothing moves
    assert d.reason == "at_bound"
    assert d.shares == HOME


def after_two_decisions() -> LoopState:
    """Two engines lent to the agent pool at t = 140 s; the decisions at 170 and 180 s saw a
    backlogged agent pool (pressure 1.1) beside a calm chat pool."""
    state = LoopState(shares={"agent": TWO_ENGINES, "normal": ONE_ENGINE}, last_move_at_s=140.0)
    for t in (170.0, 180.0):
        state = decide(
            state, morning_signals(1.1, 0.2), BOUNDS, BENCH, t, instance_frac=ONE_ENGINE, home=HOME
        ).state
    return state


def recall_check(
    state: LoopState, signals: dict[str, PoolSignals], now_s: float, **extra: Any
) -> Decision:
    """The shell's check between decisions, with the benchmark's settings."""
    return decide(
        state,
        signals,
        BOUNDS,
        BENCH,
        now_s,
        instance_frac=ONE_ENGINE,
        home=HOME,
        recall_only=True,
        **extra,
    )


def test_the_recall_check_between_decisions_recalls_before_the_next_decision() -> None:
    """At 183 s, between the decisions at 180 and 190 s, chat's TTFT p95 is 2.1 s (pressure
    2.625) and the agent pool's 1.0: the check recalls there, with the step that equalises
    chat's latest pressure and the agent pool's smoothed one over the window (1.1, 1.1 and
    the check's 1.0: mean 3.2 / 3): loads 2.625 / 3 = 0.875 and (3.2 / 3) x 2 / 3 = 0.7111, so
    (0.875 x 2/3 - 0.7111 x 1/3) / (0.875 + 0.7111) = 0.21833. The decision at 190 s is then
    not due (one step per interval)."""
    state = after_two_decisions()
    d = recall_check(state, morning_signals(1.0, 2.1), 183.0)
    assert d.reason == "recalled"
    assert d.move is not None and (d.move.from_pool, d.move.to_pool) == ("agent", "normal")
    load_r, load_g = 2.625 / 3, (3.2 / 3) * 2 / 3
    assert d.move.share_frac == pytest.approx((load_r * 2 / 3 - load_g / 3) / (load_r + load_g))
    assert d.move.share_frac == pytest.approx(0.21833, abs=1e-4)
    following = decide(
        d.state,
        morning_signals(1.0, 2.1),
        BOUNDS,
        BENCH,
        190.0,
        instance_frac=ONE_ENGINE,
        home=HOME,
    )
    assert following.reason == "not_due" and following.move is None


def test_the_recall_check_changes_nothing_unless_it_recalls() -> None:
    """A calm chat pool, a frozen loop, a pinned ratio, or a move less than an interval (or a
    cooldown) ago: the check leaves the very state it was given, and no decision is logged
    (the reason is "not_due")."""
    state = after_two_decisions()
    cases: list[tuple[LoopState, dict[str, PoolSignals], dict[str, Any]]] = [
        (state, morning_signals(1.1, 0.2), {}),
        (state, morning_signals(1.0, 2.1), {"frozen": True}),
        (
            state,
            morning_signals(1.0, 2.1),
            {"pinned": {"agent": TWO_ENGINES, "normal": ONE_ENGINE}},
        ),
        (replace(state, last_move_at_s=170.0), morning_signals(1.0, 2.1), {}),  # cooldown 20 s
    ]
    for given, signals, extra in cases:
        d = recall_check(given, signals, 183.0, **extra)
        assert d.reason == "not_due" and d.move is None, extra
        assert d.state is given
    no_cooldown = replace(BENCH, cooldown_s=0.0)
    moved_at_175 = replace(state, last_move_at_s=175.0)
    kwargs: dict[str, Any] = {"instance_frac": ONE_ENGINE, "home": HOME, "recall_only": True}
    signals = morning_signals(1.0, 2.1)
    assert decide(moved_at_175, signals, BOUNDS, no_cooldown, 183.0, **kwargs).reason == "not_due"
    assert decide(moved_at_175, signals, BOUNDS, no_cooldown, 185.0, **kwargs).reason == "recalled"


def test_a_recall_holds_the_lender_share_then_lets_go() -> None:
    """Run C1's night: chat missed its target beside two busy agent engines and the check
    recalled the engine; at two engines chat read pressure 0, so one cooldown later the
    smoothed rule (agent 1.1 against chat 0) lent the engine again at the same demand, and chat
    missed again. After a recall the recalling pool lends nothing below the share it got back
    for `recall_hold_s` (2 x (20 s cooldown + 20 s window) = 80 s here); then the pressure rule
    acts as before."""
    assert recall_hold_s(BENCH) == 80.0
    recalled = recall_check(after_two_decisions(), morning_signals(1.0, 2.1), 183.0)
    assert recalled.reason == "recalled"
    got_back = recalled.shares["normal"]
    state = recalled.state
    assert state.held["normal"] == (263.0, got_back)
    reasons = {}
    for t in (190.0, 200.0, 210.0, 220.0, 230.0, 240.0, 250.0, 260.0, 270.0):
        d = decide(
            state, morning_signals(1.1, 0.0), BOUNDS, BENCH, t, instance_frac=ONE_ENGINE, home=HOME
        )
        state = d.state
        reasons[t] = d.reason
        if t < 263.0:
            assert d.shares["normal"] >= got_back - 1e-9, (t, d)
    assert reasons[210.0] == "recall_hold"  # past the cooldown, the pressure rule would lend
    assert reasons[270.0] == "moved"  # the hold is over
