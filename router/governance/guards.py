"""Run guards: when an agent run must stop (pure decision, time as an argument).

A run is the requests that share a run id (an explicit `x-gpupool-run-id`, or one task of a
session: see `boundary`). `RunState` counts what the run has done (steps dispatched to an
engine, tokens and GPU-seconds settled, its active time); `check_step` decides, as a step
arrives, whether the run may take it: the first limit it has reached stops it, with the code
the client sees (`run_steps`, `run_duration`, `run_loop`, `run_tokens`, `run_gpu_seconds`), a
message an agent framework can show, and the setting to raise (`Stop.setting`, e.g.
`classes.agent.run_guards.max_steps`). A stopped run stays stopped until it is ended (`POST
/v1/runs/{id}/end` or `x-gpupool-run-end: 1`): then its id starts a fresh run.

Limits are checked on what is already counted: a run at 49 of 50 steps may take its 50th; the
51st is refused. A step counts once it is dispatched to an engine and stops counting if the
engine failed it (refusals, engine errors and steps the client dropped before dispatch never
count), so parallel steps of one run that pass the check together may take it past
`max_steps` by the steps in flight. Tokens and GPU-seconds are counted when a step finishes,
so a step that starts under the limit may end over it; the next step is refused.

Duration is active time: the run's time between consecutive events (a step arriving or
finishing) counts, except a gap longer than `governance.run_idle_timeout_s` with no step in
flight (a user reading, a long pause): `touch` keeps the sum. With a shared store each
replica also tells the store how long the run has been active here without such a pause
(`active_span_s`), so the run's active time is counted across replicas there
(router/governance/shared.py: `RUN_ACTIVE`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pools.config import RunGuardsConfig

__all__ = [
    "STOP_CODES",
    "STOP_FIELDS",
    "RunLimits",
    "RunState",
    "Stop",
    "active_span_s",
    "active_time_s",
    "check_step",
    "touch",
]

# One run's limits (None: no limit; loop_repeats below 2: no loop detection). The config's
# frozen dataclass is the type: `classes.<class>.run_guards`.
RunLimits = RunGuardsConfig

STOP_FIELDS = {  # a stop code -> the guard field whose limit it is
    "run_steps": "max_steps",
    "run_tokens": "max_tokens",
    "run_gpu_seconds": "max_gpu_seconds",
    "run_duration": "max_duration_s",
    "run_loop": "loop_repeats",
}
STOP_CODES = tuple(STOP_FIELDS)


@dataclass(frozen=True, slots=True)
class Stop:
    code: str  # one of STOP_CODES
    message: str
    setting: str | None = None  # the config setting that set the limit (to raise it)


@dataclass(slots=True)
class RunState:
    """What one run has done. Times on the router's monotonic clock."""

    run_id: str
    started_at_s: float
    last_seen_s: float
    limits: RunLimits
    steps: int = 0  # steps dispatched to an engine (a failed one is taken back)
    tokens: int = 0  # prompt + completion tokens settled
    gpu_seconds: float = 0.0  # settled
    inflight: int = 0
    stopped: Stop | None = None
    ended: str | None = None  # why it ended: a stop code, client_end, idle_timeout
    # of gpu_seconds, what was settled before the router's last restart (the accountant, which
    # run_las orders by, starts from zero then)
    restored_gpu_seconds: float = 0.0
    active_s: float = 0.0  # active time up to last_seen_s (see `touch`)
    # guard field (max_steps, ...) -> the setting it came from; absent: run_guards.<field>
    settings: dict[str, str] = field(default_factory=dict)
    session_id: str | None = None  # the session it is a run of (None: an explicit run id)
    # with a shared store: the store's number of this run's latest step here (its next step
    # here may go on as this + 1 before the store answers: router/governance/speculation.py)
    store_step: int | None = None
    # the start of the run's current active stretch here: every gap since counted (none a
    # pause longer than the idle timeout with no step in flight); None: `started_at_s`
    active_since_s: float | None = None

    def setting(self, name: str) -> str:
        return self.settings.get(name, f"run_guards.{name}")


def active_time_s(state: RunState, now_s: float, idle_timeout_s: float) -> float:
    """The run's active time at `now_s`: `active_s` plus the gap since it was last seen,
    unless that gap is longer than `idle_timeout_s` with no step in flight."""
    gap_s = max(0.0, now_s - state.last_seen_s)
    if state.inflight > 0 or gap_s <= idle_timeout_s:
        return state.active_s + gap_s
    return state.active_s


def active_span_s(state: RunState, now_s: float, idle_timeout_s: float) -> float:
    """How long the run has been active without a pause up to `now_s` (an event then): 0
    when the gap since it was last seen is a pause (`active_time_s` leaves it out)."""
    gap_s = now_s - state.last_seen_s
    if state.inflight <= 0 and gap_s > idle_timeout_s:
        return 0.0
    since_s = state.started_at_s if state.active_since_s is None else state.active_since_s
    return max(0.0, now_s - since_s)


def touch(state: RunState, now_s: float, idle_timeout_s: float) -> None:
    """Record an event of the run at `now_s` (a step arriving or finishing)."""
    if state.inflight <= 0 and now_s - state.last_seen_s > idle_timeout_s:
        state.active_since_s = now_s  # after a pause: a new stretch
    state.active_s = active_time_s(state, now_s, idle_timeout_s)
    state.last_seen_s = max(state.last_seen_s, now_s)


def check_step(
    state: RunState, now_s: float, looping_call: str | None, idle_timeout_s: float = math.inf
) -> Stop | None:
    """The stop for the step arriving at `now_s`, or None when the run may take it.
    `looping_call`: the tool call the request's history repeats (see `loops`), if any;
    `idle_timeout_s`: a longer pause does not count toward `max_duration_s`."""
    if state.stopped is not None:
        return state.stopped
    lim = state.limits
    run = state.run_id[:64]
    end = (
        "end the run (POST /v1/runs/{run_id}/end, or x-gpupool-run-end: 1) and its id starts"
        " a fresh run"
    )

    def stop(code: str, what: str, name: str | None) -> Stop:
        setting = None if name is None else state.setting(name)
        raise_it = f"; to allow more, raise {setting}" if setting else ""
        return Stop(code, f"run {run!r} stopped: {what}{raise_it}; {end}", setting)

    if lim.max_steps is not None and state.steps >= lim.max_steps:
        return stop("run_steps", f"it took its {lim.max_steps} steps (max_steps)", "max_steps")
    active_s = active_time_s(state, now_s, idle_timeout_s)
    if lim.max_duration_s is not None and active_s >= lim.max_duration_s:
        return stop(
            "run_duration",
            f"it has been active {active_s:.0f} s, its limit is {lim.max_duration_s:g} s"
            " (max_duration_s; pauses longer than governance.run_idle_timeout_s do not count)",
            "max_duration_s",
        )
    if looping_call is not None:
        return stop(
            "run_loop",
            f"it called {looping_call[:80]} with the same arguments {lim.loop_repeats} times"
            " in a row (loop detection); change the approach",
            "loop_repeats",
        )
    if lim.max_tokens is not None and state.tokens >= lim.max_tokens:
        return stop(
            "run_tokens",
            f"it used {state.tokens} tokens, its limit is {lim.max_tokens} (max_tokens)",
            "max_tokens",
        )
    if lim.max_gpu_seconds is not None and state.gpu_seconds >= lim.max_gpu_seconds:
        return stop(
            "run_gpu_seconds",
            f"it used {state.gpu_seconds:.1f} GPU-seconds, its limit is"
            f" {lim.max_gpu_seconds:g} (max_gpu_seconds)",
            "max_gpu_seconds",
        )
    return None
