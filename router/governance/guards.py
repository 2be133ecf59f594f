"""Run guards: when an agent run must stop (pure decision, time as an argument).

A run is the requests that share a run id. `RunState` counts what the run has done (steps let
through, tokens and GPU-seconds settled, when it started); `check_step` decides, as a step
arrives, whether the run may take it: the first limit it has reached stops it, with the code
the client sees (`run_steps`, `run_duration`, `run_loop`, `run_tokens`, `run_gpu_seconds`) and
a message an agent framework can show. A stopped run stays stopped: `RunState.stopped` holds
the reason and every later step gets it again.

Limits are checked on what is already settled: a run at 49 of 50 steps may take its 50th; the
51st is refused. Tokens and GPU-seconds are counted when a step finishes, so a step that starts
under the limit may end over it; the next step is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from pools.config import RunGuardsConfig

__all__ = ["STOP_CODES", "RunLimits", "RunState", "Stop", "check_step"]

# One run's limits (None: no limit; loop_repeats below 2: no loop detection). The config's
# frozen dataclass is the type: `classes.<class>.run_guards`.
RunLimits = RunGuardsConfig

STOP_CODES = ("run_steps", "run_tokens", "run_gpu_seconds", "run_duration", "run_loop")


@dataclass(frozen=True, slots=True)
class Stop:
    code: str  # one of STOP_CODES
    message: str


@dataclass(slots=True)
class RunState:
    """What one run has done. Times on the router's monotonic clock."""

    run_id: str
    started_at_s: float
    last_seen_s: float
    limits: RunLimits
    steps: int = 0  # steps let through
    tokens: int = 0  # prompt + completion tokens settled
    gpu_seconds: float = 0.0  # settled
    inflight: int = 0
    stopped: Stop | None = None
    ended: str | None = None  # why it ended: a stop code, client_end, idle_timeout
    # of gpu_seconds, what was settled before the router's last restart (the accountant, which
    # run_las orders by, starts from zero then)
    restored_gpu_seconds: float = 0.0


def check_step(state: RunState, now_s: float, looping_call: str | None) -> Stop | None:
    """The stop for the step arriving at `now_s`, or None when the run may take it.
    `looping_call`: the tool call the request's history repeats (see `loops`), if any."""
    if state.stopped is not None:
        return state.stopped
    lim = state.limits
    run = state.run_id[:64]
    if lim.max_steps is not None and state.steps >= lim.max_steps:
        return Stop(
            "run_steps",
            f"run {run!r} stopped: it took its {lim.max_steps} steps (max_steps); end it and"
            " start a new run to continue",
        )
    elapsed_s = now_s - state.started_at_s
    if lim.max_duration_s is not None and elapsed_s >= lim.max_duration_s:
        return Stop(
            "run_duration",
            f"run {run!r} stopped: it has run {elapsed_s:.0f} s, its limit is"
            f" {lim.max_duration_s:g} s (max_duration_s)",
        )
    if looping_call is not None:
        return Stop(
            "run_loop",
            f"run {run!r} stopped: it called {looping_call[:80]} with the same arguments"
            f" {lim.loop_repeats} times in a row (loop detection); change the approach and"
            " start a new run",
        )
    if lim.max_tokens is not None and state.tokens >= lim.max_tokens:
        return Stop(
            "run_tokens",
            f"run {run!r} stopped: it used {state.tokens} tokens, its limit is"
            f" {lim.max_tokens} (max_tokens)",
        )
    if lim.max_gpu_seconds is not None and state.gpu_seconds >= lim.max_gpu_seconds:
        return Stop(
            "run_gpu_seconds",
            f"run {run!r} stopped: it used {state.gpu_seconds:.1f} GPU-seconds, its limit is"
            f" {lim.max_gpu_seconds:g} (max_gpu_seconds)",
        )
    return None
