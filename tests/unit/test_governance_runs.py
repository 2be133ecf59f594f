"""The governor's run table on a fake clock: bounded eviction that always terminates (issue 23:
it used to spin forever once every remembered run was active or in flight and one had ended
with a step in flight), and which run states it may forget."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from pools.config import Config
from pools.testing.config import config_for_test
from router.admission.estimate import Estimate
from router.errors import RunStopped
from router.governance import GovernanceMetrics, Governor, StepSignals
from router.governance.runtable import runs_to_forget
from router.governance.store import GovernanceStore
from router.request import RequestContext, RequestOutcome


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def config(**extra: Any) -> Config:
    tenants = [{"name": "t", "api_key_sha256": "0" * 64}]
    return config_for_test(**{"tenants": tenants, **extra})


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


# ------------------------------------------------------------------------------ guard semantics


def guarded(clock: Clock, **guards: Any) -> Governor:
    cfg = config_for_test(
        tenants=[{"name": "t", "api_key_sha256": "0" * 64, "run_guards": guards}],
        governance={"run_idle_timeout_s": 30},
    )
    return governor(clock, cfg)


async def served_step(gov: Governor, run_id: str, clock: Clock, took_s: float = 1.0) -> None:
    outcome = await start_step(gov, run_id, clock)
    dispatch(gov, outcome, clock)
    clock.now_s += took_s
    finish(gov, outcome, clock)


async def test_only_steps_an_engine_served_count_toward_max_steps() -> None:
    clock = Clock()
    gov = guarded(clock, max_steps=2)
    refused = await start_step(gov, "r", clock)  # the queue refused it (429): no engine
    refused.outcome, refused.reason = "rejected", "queue_full"
    finish(gov, refused, clock, status=429)
    left = await start_step(gov, "r", clock)  # the client left while it waited (499)
    left.outcome = "aborted"
    finish(gov, left, clock, status=499)
    failed = await start_step(gov, "r", clock)  # dispatched, retried, then the engine failed
    dispatch(gov, failed, clock)
    dispatch(gov, failed, clock)
    failed.outcome = "engine_error"
    finish(gov, failed, clock, status=502)
    unreachable = await start_step(gov, "r", clock)  # no engine answered the connection
    dispatch(gov, unreachable, clock)
    unreachable.outcome = "engine_error"
    finish(gov, unreachable, clock, status=502)
    assert gov._tenants["t"].runs["r"].steps == 0
    retried = await start_step(gov, "r", clock)  # two attempts, one step
    dispatch(gov, retried, clock)
    dispatch(gov, retried, clock)
    finish(gov, retried, clock)
    await served_step(gov, "r", clock)
    assert gov._tenants["t"].runs["r"].steps == 2
    with pytest.raises(RunStopped) as stopped:
        await start_step(gov, "r", clock)
    assert stopped.value.code == "run_steps"


async def test_an_aborted_step_after_dispatch_counts() -> None:
    """The engine worked on it until the client left: it is a step."""
    clock = Clock()
    gov = guarded(clock, max_steps=1)
    outcome = await start_step(gov, "r", clock)
    dispatch(gov, outcome, clock)
    outcome.outcome = "aborted"
    finish(gov, outcome, clock, status=499)
    with pytest.raises(RunStopped):
        await start_step(gov, "r", clock)


async def test_the_403_names_the_setting_to_raise() -> None:
    clock = Clock()
    gov = guarded(clock, max_steps=1)  # the tenant's override
    await served_step(gov, "r", clock)
    with pytest.raises(RunStopped) as stopped:
        await start_step(gov, "r", clock)
    assert stopped.value.param == "tenants[t].run_guards.max_steps"
    assert "raise tenants[t].run_guards.max_steps" in stopped.value.message
    plain = governor(clock, config(classes={"agent": {"run_guards": {"max_steps": 1}}}))
    await served_step(plain, "r", clock)
    with pytest.raises(RunStopped) as stopped:
        await start_step(plain, "r", clock)
    assert stopped.value.param == "classes.agent.run_guards.max_steps"
    payload = stopped.value.payload()
    assert payload["param"] == "classes.agent.run_guards.max_steps"


async def test_ending_a_stopped_run_lets_its_id_start_afresh() -> None:
    clock = Clock()
    gov = guarded(clock, max_steps=1)
    await served_step(gov, "r", clock)
    for _ in range(2):  # stopped, and stays so
        with pytest.raises(RunStopped):
            await start_step(gov, "r", clock)
    ended = gov.end_run("t", "r")
    assert ended is not None and ended.ended == "client_end" and ended.steps == 1
    await served_step(gov, "r", clock)  # a fresh run under the same id
    assert gov._tenants["t"].runs["r"].steps == 1
    # x-gpupool-run-end on a refused step ends it too: refused, then released
    c = ctx(gov, "r", clock)
    with pytest.raises(RunStopped):
        await gov.enter(c, ESTIMATE, signals(gov, run_end=True))
    await served_step(gov, "r", clock)


async def test_run_duration_counts_active_time_only() -> None:
    """max_duration_s 100 s with a 30 s idle timeout: busy stretches count, a pause longer
    than 30 s with nothing in flight does not, a step in flight for 50 s does."""
    clock = Clock()
    gov = guarded(clock, max_duration_s=100.0)
    await served_step(gov, "r", clock, took_s=50.0)  # 50 s in flight: counts
    clock.now_s += 20.0  # a short pause: counts (70 s)
    await served_step(gov, "r", clock, took_s=10.0)  # 80 s
    clock.now_s += 3600.0  # the user went to lunch: does not count
    await served_step(gov, "r", clock, took_s=15.0)  # 95 s
    run = gov._tenants["t"].runs["r"]
    assert run.active_s == pytest.approx(95.0)
    clock.now_s += 10.0  # 105 s active
    with pytest.raises(RunStopped) as stopped:
        await start_step(gov, "r", clock)
    assert stopped.value.code == "run_duration"
    assert stopped.value.param == "tenants[t].run_guards.max_duration_s"


async def test_a_150_step_task_is_served_on_the_default_guards() -> None:
    """Issue 22: a coding agent's 150 tool steps, 4 s each with 2 s of tool time between,
    under the default guards."""
    clock = Clock()
    gov = governor(clock)
    for _ in range(150):
        await served_step(gov, "session", clock, took_s=4.0)
        clock.now_s += 2.0
    run = gov._tenants["t"].runs["session"]
    assert run.steps == 150 and run.stopped is None


async def test_active_time_and_guard_settings_survive_a_restart(tmp_path: Path) -> None:
    clock = Clock()
    store = GovernanceStore(tmp_path / "g.sqlite")
    gov = governor(clock, guarded(clock, max_steps=1).config, store=store)
    await gov.start()
    await served_step(gov, "r", clock, took_s=12.0)
    with pytest.raises(RunStopped):
        await start_step(gov, "r", clock)
    await gov.aclose()
    again = governor(clock, gov.config, store=GovernanceStore(tmp_path / "g.sqlite"))
    await again.start()
    try:
        run = again._tenants["t"].runs["r"]
        assert run.active_s == pytest.approx(12.0) and run.steps == 1
        assert run.settings["max_steps"] == "tenants[t].run_guards.max_steps"
        with pytest.raises(RunStopped) as stopped:
            await start_step(again, "r", clock)
        assert stopped.value.param == "tenants[t].run_guards.max_steps"
    finally:
        await again.aclose()
