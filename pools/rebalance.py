"""The rebalancer's decision, pure: given each pool's signals, where should the ratio go?

No clock, no I/O, no randomness: `decide(state, signals, bounds, settings, now_s)` returns a
`Decision` (the new target shares, the move if any, the reason, and the pressures behind it)
and the next `LoopState`. The shell (`router.rebalancer.rebalancer`) gathers the signals, calls
it once per `interval_s`, places the result (`pools.allocation.plan_moves`) and logs the decision.

Pressure (>= 1 means the pool misses a target) is the max of normalised signals:

    queue_wait  queue wait (p95 over the interval, or the oldest still waiting) / target
    kv          KV-cache use on the pool's instances / 0.8
    ttft        TTFT p95 / the pool's `slo.ttft_p95_ms`, counted from half the target
    tpot        TPOT p95 / the pool's `slo.tpot_p95_ms`, counted from half the target
    rejections  fraction of the pool's requests refused (429) / 0.01

"Counted from half the target": a latency r times its target is pressure `max(0, 2r - 1)` below
the target and `r` at or above it (continuous at 1). Far below its target a latency is the
engine's own (its prefill, its share of the processor), not a sign of load: without the dead
band a lightly used chat pool at 40 % of its TTFT target looked as pressured as a busy agent
pool at 50 % of its KV budget, and the night surge waited for the agent queue to build.

smoothed as the mean over `smoothing_window_s` (the window restarts after a move: pressures
measured at the old ratio say nothing about the new one). When the gap between the most and
the least pressured pool exceeds `hysteresis_frac`, share moves from the least to the most
pressured pool: the step that would equalise their pressures if each pool's pressure were
proportional to load / share (the receiver's load `p_r * s_r`, the giver's `p_g * s_g`:
`x = (L_r s_g - L_g s_r) / (L_r + L_g)`), capped by `max_step_frac` and both pools' bounds.
Then nothing moves for `cooldown_s`. An idle pool (no traffic for `traffic_memory_s`) gives
its share to the most pressured pool with traffic, down to its floor, whatever the gap: far
below their targets the busy pool's signals read 0 too, and the hysteresis alone would leave
the idle share unused. Traffic in the idle pool lifts it back to one instance's worth at the
next decision (the bounds).

Home: given `home` (the SREs' initial shares), the ratio goes back there once the pressure
that pulled it away is gone: when every pool's pressure *at the home shares* would be at most
`HOME_PRESSURE` (predicted with the same load / share model: `p * s / s_home`) and their gap
there within the hysteresis (so the pressure rule would not move away from home), the loop
steps toward home (`max_step_frac` per step, cooldown after each) and, once there, holds it;
otherwise the pressure rule acts. Under that model the
prediction does not depend on where the ratio is, so the two rules never undo each other under
constant demand. Home applies while every pool has traffic (see below); an idle pool gives its
share down to its floor first.

Recall: the pressure rule acts on smoothed pressure, which lags a surge by up to a window. In
the day-night run the morning's chat missed its TTFT target one decision before the smoothed
gap passed the hysteresis, with the night's share still lent to the agent pool. So a pool that
lent share (it is below its home share) and misses a target in the latest interval (pressure
>= 1) by more than the hysteresis over a pool holding share beyond its home (that pool's higher
of latest and smoothed pressure) gets the pressure rule's step at once: the step that
equalises the two, at most `max_step_frac`, never past home; the cooldown still applies. Only
toward home: leaving home still needs the smoothed gap, so one bad interval cannot pull the
ratio away; and as the step only equalises, under the load / share model recall and the
pressure rule do not undo each other under constant demand. The shell also checks this rule
alone between decisions (`recall_only`, every second over the trailing `interval_s`), so a lent
share comes back as soon as the lender's requests show the miss, not at the next decision (in
run R2 of docs/rebalancer.md the morning's chat missed for 10 s before the decision at 190 s
recalled the engine); still at most one move per `interval_s` and none within `cooldown_s`.

A recall holds: for `recall_hold_s` (twice a cooldown plus a smoothing window) the pressure rule
lends none of the recalling pool's share below what the recall gave back ("recall_hold"). A
recall shows the load / share model misjudged the lender at the lent share (in day-night run C1
the chat engine was slowed by the two agent engines beside it on shared cores, not by its own
load); without the hold the smoothed rule, seeing the lender calm at home, lent the share again
one cooldown later at the same demand, and the lender missed again. The hold is bounded so the
ratio still follows a real change of demand, one hold later.

Bounds: a pool never leaves [floor_frac, ceiling_frac] (the schedule's bounds at that time of
day, see `bounds_at`), and a pool that had traffic in the last `traffic_memory_s` never goes
below one instance's worth of capacity (where the bounds leave room for that).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Annotated

from pydantic import Field

__all__ = [
    "SIGNALS",
    "Bounds",
    "Decision",
    "LoopState",
    "Move",
    "PoolSignals",
    "RebalanceSettings",
    "ScheduleWindow",
    "bounds_at",
    "clamp_shares",
    "decide",
    "effective_bounds",
    "pressure_by_signal",
    "recall_hold_s",
]

SIGNALS = ("queue_wait", "kv", "ttft", "tpot", "rejections")
KV_TARGET_FRAC = 0.8
REJECTION_TARGET_FRAC = 0.01
_EPS = 1e-9
_MIN_STEP_FRAC = 0.005  # smaller steps are not worth a move
# every pool predicted at most this pressure at the home shares: the ratio goes home
HOME_PRESSURE = 0.5


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """What one pool looked like over the last interval. Times in seconds."""

    queue_wait_s: float = 0.0  # p95 of waits in the interval, or the oldest waiter's age
    queue_wait_target_s: float = 1.0
    kv_usage_frac: float = 0.0  # KV use on the pool's instances, [0, 1]
    ttft_p95_s: float | None = None  # None: nothing measured in the interval
    ttft_target_s: float = 1.0
    tpot_p95_s: float | None = None
    tpot_target_s: float = 0.1
    rejected_frac: float = 0.0  # requests refused / offered, [0, 1]
    requests: int = 0  # requests offered in the interval (finished, rejected or waiting)

    @property
    def has_traffic(self) -> bool:
        return self.requests > 0


def _latency_pressure(value_s: float | None, target_s: float) -> float:
    """A latency over its target, counted from half the target (see the module docstring)."""
    if value_s is None:
        return 0.0
    ratio = value_s / max(target_s, _EPS)
    return ratio if ratio >= 1.0 else max(0.0, 2.0 * ratio - 1.0)


def pressure_by_signal(s: PoolSignals) -> dict[str, float]:
    """Each signal over its target: 1.0 is exactly at target, 0 is idle."""
    return {
        "queue_wait": s.queue_wait_s / max(s.queue_wait_target_s, _EPS),
        "kv": s.kv_usage_frac / KV_TARGET_FRAC,
        "ttft": _latency_pressure(s.ttft_p95_s, s.ttft_target_s),
        "tpot": _latency_pressure(s.tpot_p95_s, s.tpot_target_s),
        "rejections": s.rejected_frac / REJECTION_TARGET_FRAC,
    }


@dataclass(frozen=True, slots=True)
class Bounds:
    floor_frac: float
    ceiling_frac: float


@dataclass(frozen=True, slots=True)
class ScheduleWindow:
    """Bounds that apply from `start_min` (minutes after midnight, UTC) up to `end_min`; a
    window with end < start wraps past midnight (e.g. 20:00 to 08:00)."""

    start_min: int
    end_min: int
    bounds: Bounds

    def covers(self, minute_of_day: float) -> bool:
        if self.start_min <= self.end_min:
            return self.start_min <= minute_of_day < self.end_min
        return minute_of_day >= self.start_min or minute_of_day < self.end_min


def bounds_at(default: Bounds, schedule: Sequence[ScheduleWindow], minute_of_day: float) -> Bounds:
    """The first schedule window covering the time of day, else the default bounds."""
    for window in schedule:
        if window.covers(minute_of_day % 1440):
            return window.bounds
    return default


@dataclass(frozen=True, slots=True)
class RebalanceSettings:
    """The decision's settings, declared here once: the config's `rebalancer` section
    (`pools.config.RebalancerConfig`) extends this class, so the YAML keys, their bounds
    (`Field`, checked when the config is loaded) and their defaults are these."""

    interval_s: Annotated[float, Field(gt=0)] = 30.0  # one decision (at most one step) each
    hysteresis_frac: Annotated[float, Field(ge=0)] = 0.2  # pressure gap below which none moves
    cooldown_s: Annotated[float, Field(ge=0)] = 60.0  # after a move, no other for this long
    smoothing_window_s: Annotated[float, Field(gt=0)] = 90.0  # pressure averaged over it
    max_step_frac: Annotated[float, Field(gt=0, le=1.0)] = 0.1  # largest share moved per step
    # a pool "has traffic" (and keeps one instance's worth) until this long after its last
    # request, so sparse traffic does not flap it between its floor and one instance
    traffic_memory_s: Annotated[float, Field(ge=0)] = 600.0


@dataclass(frozen=True, slots=True)
class LoopState:
    """What the loop remembers between decisions."""

    shares: Mapping[str, float]
    history: tuple[tuple[float, Mapping[str, float], Mapping[str, bool]], ...] = ()
    last_decision_at_s: float | None = None
    last_move_at_s: float | None = None
    last_traffic_at_s: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    # pool -> (until when, share): a pool that recalled lent share lends none below that share
    # until then (see "Recall" in the module docstring)
    held: Mapping[str, tuple[float, float]] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, slots=True)
class Move:
    from_pool: str
    to_pool: str
    share_frac: float


@dataclass(frozen=True, slots=True)
class Decision:
    at_s: float
    shares: Mapping[str, float]  # target shares after this decision
    move: Move | None
    reason: str  # moved | home | recalled | at_home | pinned | bounds | frozen | cooldown
    # | recall_hold
    # | within_hysteresis | at_bound | not_due | step_too_small
    pressure: Mapping[str, Mapping[str, float]]  # pool -> signal -> normalised value (raw)
    smoothed: Mapping[str, float]  # pool -> smoothed pressure
    bounds: Mapping[str, tuple[float, float]]  # pool -> effective (low, high)
    state: LoopState = field(repr=False)

    @property
    def changed(self) -> bool:
        return self.reason in ("moved", "home", "recalled", "pinned", "bounds")


def effective_bounds(
    bounds: Mapping[str, Bounds], has_traffic: Mapping[str, bool], instance_frac: float
) -> dict[str, tuple[float, float]]:
    """(low, high) per pool: the bounds, with the low raised to one instance's worth
    (`instance_frac`) for a pool that has traffic, as far as the others' lows leave room."""
    low = {p: b.floor_frac for p, b in bounds.items()}
    high = {p: b.ceiling_frac for p, b in bounds.items()}
    for pool in sorted(bounds):
        if not has_traffic.get(pool, False):
            continue
        wanted = min(max(low[pool], instance_frac), high[pool])
        room = 1.0 - sum(v for q, v in low.items() if q != pool)
        low[pool] = max(low[pool], min(wanted, room))
    return {p: (low[p], high[p]) for p in bounds}


def clamp_shares(
    shares: Mapping[str, float], limits: Mapping[str, tuple[float, float]]
) -> dict[str, float]:
    """The shares projected into their (low, high) limits, still summing to 1: each is clipped,
    then the surplus or deficit is spread over the pools with room, in proportion to it."""
    out = {p: min(max(shares.get(p, 0.0), lo), hi) for p, (lo, hi) in limits.items()}
    diff = 1.0 - sum(out.values())
    if abs(diff) > _EPS:
        if diff > 0:
            room = {p: limits[p][1] - v for p, v in out.items()}
        else:
            room = {p: v - limits[p][0] for p, v in out.items()}
        total = sum(room.values())
        if total > _EPS:
            frac = min(1.0, abs(diff) / total)
            for p, r in room.items():
                out[p] += (1 if diff > 0 else -1) * r * frac
    return out


def _smooth(
    history: Sequence[tuple[float, Mapping[str, float], Mapping[str, bool]]], pools: Sequence[str]
) -> tuple[dict[str, float], dict[str, bool]]:
    smoothed = {p: sum(h[1].get(p, 0.0) for h in history) / len(history) for p in pools}
    traffic = {p: any(h[2].get(p, False) for h in history) for p in pools}
    return smoothed, traffic


def _frozen(values: Mapping[str, float]) -> Mapping[str, float]:
    return MappingProxyType(dict(values))


def decide(
    state: LoopState,
    signals: Mapping[str, PoolSignals],
    bounds: Mapping[str, Bounds],
    settings: RebalanceSettings,
    now_s: float,
    *,
    instance_frac: float = 0.0,
    frozen: bool = False,
    pinned: Mapping[str, float] | None = None,
    home: Mapping[str, float] | None = None,
    recall_only: bool = False,
) -> Decision:
    """One step of the loop. `bounds` names every pool; `signals` may lack an idle pool.
    `instance_frac` is one instance's share of total capacity (the smallest instance).
    `frozen` holds the shares as they are; `pinned` (shares summing to 1) replaces the loop's
    judgement with the SRE's ratio, still within bounds. `home` (shares summing to 1, the
    configured initial ratio) is where the ratio returns when every pool has traffic and none
    would be pressured there (see the module docstring); None: no return. `recall_only`: the
    shell's check between decisions (see "Recall" above): a "recalled" decision when the recall
    rule applies, at least `interval_s` and `cooldown_s` after the last move, else "not_due"
    with the state left as it was."""
    pools = sorted(bounds)
    raw = {p: pressure_by_signal(signals.get(p, PoolSignals())) for p in pools}
    now_pressure = {p: max(raw[p].values()) for p in pools}
    now_traffic = {p: signals.get(p, PoolSignals()).has_traffic for p in pools}
    window_start = now_s - settings.smoothing_window_s
    history = (
        *(h for h in state.history if h[0] > window_start),
        (now_s, _frozen(now_pressure), MappingProxyType(now_traffic)),
    )
    smoothed, in_window = _smooth(history, pools)
    last_traffic = dict(state.last_traffic_at_s)
    last_traffic.update({p: now_s for p in pools if now_traffic[p]})
    traffic = {
        p: in_window[p] or now_s - last_traffic.get(p, -math.inf) <= settings.traffic_memory_s
        for p in pools
    }
    limits = effective_bounds(bounds, traffic, instance_frac)
    current = {p: state.shares.get(p, 0.0) for p in pools}
    held = {p: h for p, h in state.held.items() if now_s < h[0]}

    def result(
        reason: str, shares: Mapping[str, float], move: Move | None, moved: bool
    ) -> Decision:
        next_held = dict(held)
        if reason == "recalled" and move is not None:
            next_held[move.to_pool] = (now_s + recall_hold_s(settings), shares[move.to_pool])
        next_state = LoopState(
            shares=_frozen(shares),
            history=() if moved else history,
            last_decision_at_s=now_s,
            last_move_at_s=now_s if moved else state.last_move_at_s,
            last_traffic_at_s=MappingProxyType(last_traffic),
            held=MappingProxyType(next_held),
        )
        return Decision(
            at_s=now_s,
            shares=next_state.shares,
            move=move,
            reason=reason,
            pressure=MappingProxyType({p: _frozen(v) for p, v in raw.items()}),
            smoothed=_frozen(smoothed),
            bounds=MappingProxyType(limits),
            state=next_state,
        )

    if recall_only:
        unchanged = replace(result("not_due", current, None, False), state=state)
        last_move_s = state.last_move_at_s if state.last_move_at_s is not None else -math.inf
        if (
            frozen
            or pinned is not None
            or home is None
            or not all(traffic.values())
            or now_s - last_move_s < max(settings.interval_s, settings.cooldown_s) - _EPS
        ):
            return unchanged
        target = clamp_shares(home, limits)
        recalled = _recalled(current, target, now_pressure, smoothed, settings, result)
        return recalled if recalled is not None and recalled.reason == "recalled" else unchanged
    if frozen:
        return result("frozen", current, None, False)
    if pinned is not None:
        target = clamp_shares(pinned, limits)
        if _differs(target, current):
            return result("pinned", target, _largest_move(current, target), True)
        return result("pinned", current, None, False)
    clamped = clamp_shares(current, limits)
    if _differs(clamped, current):
        return result("bounds", clamped, _largest_move(current, clamped), True)
    if (
        state.last_decision_at_s is not None
        and now_s - state.last_decision_at_s < settings.interval_s - _EPS
    ):
        return replace(result("not_due", current, None, False), state=state)
    if state.last_move_at_s is not None and now_s - state.last_move_at_s < settings.cooldown_s:
        return result("cooldown", current, None, False)
    busy = [p for p in pools if traffic[p]]
    idle = [p for p in pools if not traffic[p] and current[p] - limits[p][0] >= _MIN_STEP_FRAC]
    if busy and idle:  # an idle pool's share goes to the pools with traffic, down to its floor
        giver = idle[0]
        receiver = max(busy, key=lambda p: (smoothed[p], p))
        room = min(current[giver] - limits[giver][0], limits[receiver][1] - current[receiver])
        step = min(settings.max_step_frac, room)
        if step >= _MIN_STEP_FRAC:
            return _step(result, "idle_pool", current, Move(giver, receiver, step))
    if home is not None and all(traffic.values()):
        target = clamp_shares(home, limits)
        recalled = _recalled(current, target, now_pressure, smoothed, settings, result)
        if recalled is not None:
            return recalled
        at_home = {
            p: 0.0
            if smoothed[p] <= _EPS
            else smoothed[p] * current[p] / target[p]
            if target[p] > _EPS
            else math.inf
            for p in pools
        }
        gap_at_home = max(at_home.values()) - min(at_home.values())
        if max(at_home.values()) <= HOME_PRESSURE and gap_at_home <= settings.hysteresis_frac:
            return _toward(current, target, settings.max_step_frac, result)
    receiver = max(pools, key=lambda p: (smoothed[p], p))
    giver = min(pools, key=lambda p: (smoothed[p], p))
    gap = smoothed[receiver] - smoothed[giver]
    if receiver == giver or gap <= settings.hysteresis_frac:
        return result("within_hysteresis", current, None, False)
    s_r, s_g = current[receiver], current[giver]
    equalise = _equalising_step(smoothed[receiver], s_r, smoothed[giver], s_g)
    room = min(s_g - limits[giver][0], limits[receiver][1] - s_r)
    if room < _MIN_STEP_FRAC:
        return result("at_bound", current, None, False)
    if giver in held:
        room = min(room, s_g - held[giver][1])
        if room < _MIN_STEP_FRAC:
            return result("recall_hold", current, None, False)
    step = min(equalise, settings.max_step_frac, room)
    if step < _MIN_STEP_FRAC:
        return result("step_too_small", current, None, False)
    return _step(result, "moved", current, Move(giver, receiver, step))


def recall_hold_s(settings: RebalanceSettings) -> float:
    """How long a recall holds (see "Recall" in the module docstring): two rounds of a
    cooldown and a full smoothing window, the time the pressure rule needs to move twice."""
    return 2.0 * (settings.cooldown_s + settings.smoothing_window_s)


def _equalising_step(p_r: float, s_r: float, p_g: float, s_g: float) -> float:
    """The share that, moved from the giver (pressure `p_g` at share `s_g`) to the receiver
    (`p_r` at `s_r`), equalises their pressures if each is load / share."""
    load_r, load_g = p_r * s_r, p_g * s_g
    return (load_r * s_g - load_g * s_r) / max(load_r + load_g, _EPS)


def _recalled(
    current: Mapping[str, float],
    home: Mapping[str, float],
    now_pressure: Mapping[str, float],
    smoothed: Mapping[str, float],
    settings: RebalanceSettings,
    result: Callable[[str, Mapping[str, float], Move | None, bool], Decision],
) -> Decision | None:
    """The recall rule's decision (see `_recall`): the step that equalises the lender's
    latest pressure with the holder's higher of latest and smoothed, at most `max_step_frac`,
    never past home ("step_too_small" when that is not worth a move); None when it does not
    apply."""
    recall = _recall(current, home, now_pressure, smoothed, settings)
    if recall is None:
        return None
    giver, receiver = recall
    step = min(
        _equalising_step(
            now_pressure[receiver],
            current[receiver],
            max(now_pressure[giver], smoothed[giver]),
            current[giver],
        ),
        settings.max_step_frac,
        current[giver] - home[giver],
        home[receiver] - current[receiver],
    )
    if step < _MIN_STEP_FRAC:
        return result("step_too_small", current, None, False)
    return _step(result, "recalled", current, Move(giver, receiver, step))


def _recall(
    current: Mapping[str, float],
    home: Mapping[str, float],
    now_pressure: Mapping[str, float],
    smoothed: Mapping[str, float],
    settings: RebalanceSettings,
) -> tuple[str, str] | None:
    """(giver, receiver) when a pool that lent share (below its home share by a step worth
    taking) misses a target now (latest pressure >= 1) by more than the hysteresis over a pool
    holding share beyond its home, taken at that pool's higher of latest and smoothed pressure;
    else None. The loan is recalled on the latest interval alone: smoothing is there to keep the
    ratio from leaving home on a blip, and returning home is the safe direction."""
    lenders = [
        p for p in current if home[p] - current[p] >= _MIN_STEP_FRAC and now_pressure[p] >= 1.0
    ]
    holders = [p for p in current if current[p] - home[p] >= _MIN_STEP_FRAC]
    if not lenders or not holders:
        return None
    receiver = max(lenders, key=lambda p: (now_pressure[p], p))
    giver = min(holders, key=lambda p: (max(now_pressure[p], smoothed[p]), p))
    if (
        now_pressure[receiver] - max(now_pressure[giver], smoothed[giver])
        <= settings.hysteresis_frac
    ):
        return None
    return giver, receiver


def _toward(
    current: Mapping[str, float],
    target: Mapping[str, float],
    max_step_frac: float,
    result: Callable[[str, Mapping[str, float], Move | None, bool], Decision],
) -> Decision:
    """One step (at most `max_step_frac`) from the pool furthest above its home share to the
    one furthest below it; "at_home" when the rest is smaller than a step worth taking."""
    giver = max(current, key=lambda p: (current[p] - target[p], p))
    receiver = min(current, key=lambda p: (current[p] - target[p], p))
    step = min(max_step_frac, current[giver] - target[giver], target[receiver] - current[receiver])
    if step < _MIN_STEP_FRAC:
        return result("at_home", current, None, False)
    return _step(result, "home", current, Move(giver, receiver, step))


def _step(
    result: Callable[[str, Mapping[str, float], Move | None, bool], Decision],
    reason: str,
    current: Mapping[str, float],
    move: Move,
) -> Decision:
    """The decision that makes `move` from the `current` shares."""
    shares = dict(current)
    shares[move.from_pool] -= move.share_frac
    shares[move.to_pool] += move.share_frac
    return result(reason, shares, move, True)


def _differs(a: Mapping[str, float], b: Mapping[str, float]) -> bool:
    return any(abs(a[p] - b.get(p, 0.0)) > 1e-6 for p in a)


def _largest_move(before: Mapping[str, float], after: Mapping[str, float]) -> Move:
    gain = max(after, key=lambda p: (after[p] - before.get(p, 0.0), p))
    loss = min(after, key=lambda p: (after[p] - before.get(p, 0.0), p))
    return Move(loss, gain, after[gain] - before.get(gain, 0.0))
