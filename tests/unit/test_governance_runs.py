"""The governor's run table on a fake clock: bounded eviction that always terminates (issue 23:
it used to spin forever once every remembered run was active or in flight and one had ended
with a step in flight), and which run states it may forget."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from pools.config import DEFAULT_CPU_CONFIG, Config, parse_config
from router.estimate import Estimate
from router.governance import GovernanceMetrics, Governor, StepSignals
from router.governance.runtable import runs_to_forget
from router.request import RequestContext, RequestOutcome


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def config(**extra: Any) -> Config:
    data = {**DEFAULT_CPU_CONFIG, "tenants": [{"name": "t", "api_key_sha256": "0" * 64}], **extra}
    return parse_config(data)


def governor(clock: Clock, cfg: Config | None = None, **kw: Any) -> Governor:
    gov = Governor(cfg or config(), GovernanceMetrics(CollectorRegistry()), clock=clock, **kw)
    return gov


_seq = iter(range(10**9))


def ctx(gov: Governor, run_id: str | None, clock: Clock) -> RequestContext:
    return RequestContext(
        request_id=f"r{next(_seq)}",
        tenant="t",
        class_name="agent",
        pool="agent",
        priority=0,
        deadline_s=clock() + 60,
        run_id=run_id,
        model="tiny",
        stream=False,
        client_wants_usage=False,
        received_at_s=clock(),
    )


ESTIMATE = Estimate(prompt_tokens=10, output_tokens=5, source="heuristic")


def signals(gov: Governor, *, run_end: bool = False) -> StepSignals:
    return StepSignals(tenant=gov.config.tenants[0], run_end=run_end)


async def start_step(gov: Governor, run_id: str, clock: Clock) -> RequestOutcome:
    c = ctx(gov, run_id, clock)
    await gov.enter(c, ESTIMATE, signals(gov))
    return RequestOutcome(ctx=c, estimate=ESTIMATE)


def dispatch(gov: Governor, outcome: RequestOutcome, clock: Clock) -> None:
    outcome.dispatched_at_s = clock()
    gov.dispatched(outcome)


def finish(gov: Governor, outcome: RequestOutcome, clock: Clock, status: int = 200) -> None:
    outcome.status = status
    outcome.ended_at_s = clock()
    gov.finished(outcome)


# ------------------------------------------------------------------------------ the hang


@pytest.mark.timeout(10)
async def test_eviction_terminates_when_every_run_is_active_or_in_flight() -> None:
    """Issue 23's hang: a tenant over `max_runs_per_tenant` whose runs are all active or have
    a step in flight, one of them ended while its step was in flight. Before the fix,
    `_forget_old_runs` rotated the table forever and the event loop stopped."""
    clock = Clock()
    gov = governor(clock, max_runs_per_tenant=2)
    c = await start_step(gov, "c", clock)  # a step in flight ...
    assert gov.end_run("t", "c") is not None  # ... when its run is ended
    await start_step(gov, "a", clock)
    await start_step(gov, "b", clock)  # three runs remembered, bound two: must return
    st = gov._tenants["t"]
    assert "c" in st.runs  # its step is still in flight: kept
    finish(gov, c, clock)
    await start_step(gov, "d", clock)
    assert "c" not in st.runs  # ended, nothing in flight: forgotten first
    assert len(st.runs) <= 3


# ------------------------------------------------------------------------------ the property

_state = st.sampled_from(["active", "in_flight", "ended_in_flight", "idle"])


@settings(max_examples=300, deadline=None)
@given(st.lists(_state, max_size=40), st.integers(0, 30))
def test_forgetting_keeps_the_bound_and_never_drops_a_run_in_flight(
    states: list[str], max_runs: int
) -> None:
    """Over any mix of run states: returns (a single bounded pass), forgets only runs with no
    step in flight, ended ones before active ones and oldest first, and leaves at most
    `max_runs`, or exactly the runs with a step in flight when they alone exceed it."""
    inflight = {f"r{i}": (1 if "in_flight" in s else 0) for i, s in enumerate(states)}
    active = {f"r{i}" for i, s in enumerate(states) if s in ("active", "in_flight")}
    gone = runs_to_forget(inflight, active, max_runs)
    assert len(set(gone)) == len(gone)
    assert all(inflight[r] == 0 for r in gone)
    left = len(inflight) - len(gone)
    busy = sum(1 for n in inflight.values() if n > 0)
    assert left == max(max_runs, busy) if len(inflight) > max_runs else left == len(inflight)
    ended = [r for r in inflight if inflight[r] == 0 and r not in active]
    idle_active = [r for r in inflight if inflight[r] == 0 and r in active]
    n_ended = sum(1 for r in gone if r not in active)
    assert [r for r in gone if r not in active] == ended[:n_ended]  # oldest ended first
    assert [r for r in gone if r in active] == idle_active[: len(gone) - n_ended]
    if any(r in active for r in gone):
        assert n_ended == len(ended)  # an active run only once no ended one is left


@pytest.mark.timeout(20)
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), _state), max_size=30), st.integers(1, 4))
async def test_the_governor_survives_any_sequence_of_run_states(
    events: list[tuple[int, str]], max_runs: int
) -> None:
    """Drive the governor itself through steps, ends and finishes of eight runs: every call
    returns, the table keeps its bound but for runs with a step in flight, and a run with a
    step in flight is never forgotten."""
    clock = Clock()
    gov = governor(clock, max_runs_per_tenant=max_runs)
    open_steps: dict[str, list[RequestOutcome]] = {}
    for run_no, what in events:
        run_id = f"run{run_no}"
        clock.now_s += 1.0
        if what == "idle":
            for o in open_steps.pop(run_id, []):
                finish(gov, o, clock)
        elif what == "ended_in_flight":
            open_steps.setdefault(run_id, []).append(await start_step(gov, run_id, clock))
            gov.end_run("t", run_id)
        else:
            outcome = await start_step(gov, run_id, clock)
            if what == "in_flight":
                open_steps.setdefault(run_id, []).append(outcome)
            else:
                finish(gov, outcome, clock)
        st_ = gov._tenants["t"]
        busy = {id(gov._tickets[o.ctx.request_id].run) for v in open_steps.values() for o in v}
        for steps in open_steps.values():
            for o in steps:
                run = gov._tickets[o.ctx.request_id].run
                assert run is not None
                # kept, unless the client ended it and its id started a fresh run since
                assert st_.runs.get(run.run_id) is run or run.ended == "client_end"
        if what != "idle":  # the table is trimmed as a step enters
            assert len(st_.runs) <= max(max_runs, len(busy)) + 1  # + the step just let in
