"""`queue.order: run_las`: least attained service per run within priority bands and tenant
turns, aging so long runs are never starved, idle decay of a run's counter; and the
accountant's per-run attained service it reads. All in simulated time."""

from __future__ import annotations

import heapq
import math
import random
import statistics
from dataclasses import dataclass, field

import pytest

from router.accounting.accountant import Accountant
from router.admission.queueing import AttainedService, PoolQueue, QueueEntry, QueueFull, RunUsage
from router.runtable import RunTable


def _entry(
    attained: float,
    t: float = 0.0,
    tenant: str = "a",
    priority: int = 0,
    weight: float = 1.0,
    payload: object = None,
    run: str | None = None,
) -> QueueEntry:
    return QueueEntry(
        tenant=tenant,
        priority=priority,
        cost_tokens=100.0,
        weight=weight,
        enqueued_at_s=t,
        payload=payload,
        attained_gpu_s=attained,
        run_key=run,
    )


def _drain(q: PoolQueue, now_s: float = 0.0) -> list[QueueEntry]:
    out = []
    while (e := q.peek(now_s)) is not None:
        q.pop(e, now_s)
        out.append(e)
    return out


# ------------------------------------------------------------------ order


def test_least_attained_first_then_arrival() -> None:
    q = PoolQueue("agent", max_depth=10, order="run_las", aging_s=100.0)
    long_step = _entry(12.0)  # step 20 of a long run, queued first
    mid = _entry(3.0)
    short_a, short_b = _entry(0.5), _entry(0.5)  # step 2 of two short runs, same service
    fresh = _entry(0.0)  # a run's first step
    for e in (long_step, mid, short_a, short_b, fresh):
        q.push(e)
    assert _drain(q) == [fresh, short_a, short_b, mid, long_step]


def test_past_the_cap_long_runs_keep_their_arrival_order() -> None:
    q = PoolQueue("agent", max_depth=10, order="run_las", aging_s=100.0, max_attained_gpu_s=10.0)
    old_long, newer_long = _entry(50.0), _entry(20.0)  # both past the cap: arrival order
    young_long, short = _entry(2.0), _entry(0.5)  # under the cap: least attained first
    for e in (old_long, newer_long, young_long, short):
        q.push(e)
    assert _drain(q) == [short, young_long, old_long, newer_long]
    with pytest.raises(ValueError, match="max_attained_gpu_s"):
        PoolQueue("p", max_depth=1, order="run_las", max_attained_gpu_s=0.0)


def test_priority_bands_come_before_attained_service() -> None:
    q = PoolQueue("agent", max_depth=10, order="run_las", aging_s=100.0)
    low_fresh = _entry(0.0, priority=-1)
    high_long = _entry(50.0, priority=3)
    normal = _entry(1.0)
    for e in (low_fresh, high_long, normal):
        q.push(e)
    assert _drain(q) == [high_long, normal, low_fresh]


def test_a_step_waiting_past_the_aging_bound_goes_first_oldest_first() -> None:
    q = PoolQueue("agent", max_depth=10, order="run_las", aging_s=5.0)
    old_long = _entry(40.0, t=0.0)
    older_long = _entry(80.0, t=-0.5)
    q.push(older_long)
    q.push(old_long)
    fresh = _entry(0.0, t=4.0)
    q.push(fresh)
    assert q.peek(4.0) is fresh  # the long steps have waited 4 s and 4.5 s
    assert q.peek(4.5) is older_long  # waited 5 s: aged
    assert _drain(q, 5.0) == [older_long, old_long, fresh]
    assert q.peek() is None


def test_without_now_nothing_counts_as_aged() -> None:
    q = PoolQueue("agent", max_depth=10, order="run_las", aging_s=1.0)
    q.push(old := _entry(9.0, t=-100.0))
    q.push(fresh := _entry(0.0, t=0.0))
    assert q.peek() is fresh and q.peek(0.0) is old


def test_tenant_turns_hold_whatever_the_runs_attained() -> None:
    """Tenant weights 3:1: the heavy tenant's runs have far more service, but fairness across
    tenants comes first: 3 of every 4 dispatches stay the heavy tenant's."""
    q = PoolQueue("agent", max_depth=10_000, order="run_las", aging_s=1e9)
    for i in range(400):
        q.push(_entry(1000.0 + i, tenant="heavy", weight=3.0))
        q.push(_entry(0.0, tenant="light", weight=1.0))
    served = []
    for _ in range(200):
        e = q.peek(0.0)
        assert e is not None
        q.pop(e, 0.0)
        served.append(e.tenant)
    assert served.count("heavy") / served.count("light") == pytest.approx(3.0, rel=0.05)
    # within the heavy tenant, least attained first
    heavy = [e.attained_gpu_s for e in _drain(q) if e.tenant == "heavy"]
    assert heavy == sorted(heavy)


def test_removed_entries_give_back_their_turns_and_leave_the_order() -> None:
    q = PoolQueue("agent", max_depth=10, order="run_las", aging_s=5.0)
    es = [_entry(float(i), t=float(i)) for i in range(5)]
    for e in es:
        q.push(e)
    q.remove(es[0])  # would be both least served and oldest
    q.remove(es[3])
    assert len(q) == 3
    assert q.peek(100.0) is es[1]  # aged now: oldest left
    assert _drain(q, 0.0) == [es[1], es[2], es[4]]
    q.push(again := _entry(7.0, tenant="b"))
    assert _drain(q) == [again]


def test_full_run_las_queue_sheds_the_most_served_sheddable_entry() -> None:
    q = PoolQueue("agent", max_depth=3, order="run_las", aging_s=5.0)
    keep = _entry(9.0, priority=-1)
    shed_me = _entry(20.0, priority=-1)
    q.push(_entry(0.0))
    q.push(keep)
    q.push(shed_me)
    assert q.push(_entry(1.0)) is shed_me
    with pytest.raises(QueueFull):
        q.push(_entry(0.0, priority=-1))
    assert [e.attained_gpu_s for e in _drain(q)] == [0.0, 1.0, 9.0]


def test_unknown_order_and_bad_aging_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown queue order"):
        PoolQueue("p", max_depth=1, order="las")
    with pytest.raises(ValueError, match="aging_s"):
        PoolQueue("p", max_depth=1, order="run_las", aging_s=0.0)


# ------------------------------------------------------------------ simulated agent pool


@dataclass
class _Run:
    name: str
    steps: int
    arrive_s: float
    done_steps: int = 0
    attained_s: float = 0.0
    finished_s: float | None = None
    waits_s: list[float] = field(default_factory=list)


def _simulate(
    order: str,
    *,
    aging_s: float = 1e9,
    seed: int = 7,
    cap_gpu_s: float = math.inf,
    max_slowdown: float = math.inf,
) -> list[_Run]:
    """One server that runs 3 steps at once, each step 1 s of service (1 GPU-second), a tool
    call of 0.5 s between steps; 60 runs of 2 or 20 steps arrive at random, 1:1 by count, about
    twice what the server can take. Steps queue in a `PoolQueue`."""
    rng = random.Random(seed)
    slots, step_s, tool_s = 3, 1.0, 0.5
    runs = []
    t = 0.0
    for i in range(60):
        t += rng.expovariate(1.0 / 1.3)  # ~0.77 runs/s x 11 steps/run mean > 4 steps/s
        runs.append(_Run(f"r{i}", 2 if rng.random() < 0.5 else 20, t))
    q = PoolQueue(
        "agent",
        max_depth=100_000,
        order=order,
        aging_s=aging_s,
        max_attained_gpu_s=cap_gpu_s,
        max_slowdown=max_slowdown,
    )
    events: list[tuple[float, int, str, _Run]] = []
    seq = 0

    def at(time_s: float, kind: str, run: _Run) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (time_s, seq, kind, run))

    for r in runs:
        at(r.arrive_s, "step", r)
    busy = 0
    while events:
        now, _, kind, run = heapq.heappop(events)
        if kind == "step":
            q.push(_entry(run.attained_s, t=now, payload=run, run=run.name))
        else:  # a step ended
            busy -= 1
            run.done_steps += 1
            run.attained_s += step_s
            if run.done_steps == run.steps:
                run.finished_s = now
            else:
                at(now + tool_s, "step", run)
        while busy < slots and (e := q.peek(now)) is not None:
            q.pop(e, now)
            e.payload.waits_s.append(now - e.enqueued_at_s)
            busy += 1
            at(now + step_s, "end", e.payload)
    return runs


def _completion(runs: list[_Run], steps: int) -> list[float]:
    return [r.finished_s - r.arrive_s for r in runs if r.steps == steps and r.finished_s]


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_short_runs_overtake_long_ones_in_a_saturated_pool(seed: int) -> None:
    fifo = _simulate("fifo", seed=seed)
    las = _simulate("run_las", aging_s=30.0, seed=seed)
    assert all(r.finished_s is not None for r in fifo + las)
    # saturated: FIFO steps wait several step times
    assert statistics.median(w for r in fifo for w in r.waits_s) > 3.0
    short_fifo = statistics.median(_completion(fifo, 2))
    short_las = statistics.median(_completion(las, 2))
    # a short run needs 2 s of service and one 0.5 s tool call; under run_las it waits ~1 s
    assert short_las <= 2.5 + 2.0
    assert short_fifo >= 1.8 * short_las
    # the long runs pay for it, a little: their median completion moves by at most 1/4
    long_fifo = statistics.median(_completion(fifo, 20))
    assert statistics.median(_completion(las, 20)) <= 1.25 * long_fifo
    # the same work ends at about the same time (work-conserving either way)
    end_fifo = max(r.finished_s or 0.0 for r in fifo)
    assert max(r.finished_s or 0.0 for r in las) == pytest.approx(end_fifo, rel=0.02)


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_the_cap_keeps_old_long_runs_from_waiting_behind_new_ones(seed: int) -> None:
    """Pure LAS serves a new long run's steps before an old one's until it catches up; with
    service counted up to 3 steps' worth, long runs past it keep arrival order, and the worst
    run's completion against FIFO drops, while short runs keep their gain."""

    def by_run(runs: list[_Run]) -> dict[str, float]:
        return {r.name: (r.finished_s or math.inf) - r.arrive_s for r in runs}

    fifo = by_run(_simulate("fifo", seed=seed))
    pure = by_run(_simulate("run_las", aging_s=30.0, seed=seed))
    capped_runs = _simulate("run_las", aging_s=30.0, seed=seed, cap_gpu_s=3.0)
    capped = by_run(capped_runs)
    worst_pure = max(pure[k] / fifo[k] for k in fifo)
    worst_capped = max(capped[k] / fifo[k] for k in fifo)
    assert worst_capped < worst_pure - 0.1
    short_fifo = statistics.median(v for k, v in fifo.items() if _steps(k, capped_runs) == 2)
    assert statistics.median(_completion(capped_runs, 2)) * 1.8 <= short_fifo


def _steps(name: str, runs: list[_Run]) -> int:
    return next(r.steps for r in runs if r.name == name)


def test_aging_bounds_every_steps_wait() -> None:
    aging_s = 15.0
    las = _simulate("run_las", aging_s=aging_s)
    starved = _simulate("run_las", aging_s=1e9)
    worst = max(w for r in las for w in r.waits_s)
    # an aged step waits at most for the aged steps ahead of it and a slot to free (1 s steps
    # on 3 slots): a couple of seconds past the bound
    assert aging_s <= worst <= aging_s + 2.0
    # without aging, a long run's step waits behind every less-served step: far longer
    assert max(w for r in starved for w in r.waits_s) > 3 * aging_s


# ------------------------------------------------------------------ idle decay


class _Usage:
    """A fake accountant: per run, its counter, steps in flight and last activity."""

    def __init__(self) -> None:
        self.runs: dict[object, RunUsage] = {}

    def __call__(self, key: object, now_s: float) -> RunUsage | None:
        return self.runs.get(key)


def test_attained_service_decays_only_after_a_long_idle_and_stays_forgiven() -> None:
    usage = _Usage()
    svc = AttainedService(usage, idle_decay_s=60.0)
    assert svc.attained_gpu_s("r", 0.0) == 0.0  # never seen
    usage.runs["r"] = RunUsage(gpu_seconds=10.0, in_flight=0, last_active_s=100.0)
    assert svc.attained_gpu_s("r", 130.0) == 10.0  # a tool call of 30 s: no decay
    assert svc.attained_gpu_s("r", 160.0) == 10.0  # exactly the bound
    assert svc.attained_gpu_s("r", 220.0) == pytest.approx(5.0)  # 60 s past it: halved
    assert svc.attained_gpu_s("r", 280.0) == pytest.approx(2.5)  # asked twice: no double decay
    # the run comes back: a step in flight has added 1 GPU-second; the forgiven 7.5 stay
    usage.runs["r"] = RunUsage(gpu_seconds=11.0, in_flight=1, last_active_s=280.0)
    assert svc.attained_gpu_s("r", 285.0) == pytest.approx(3.5)
    # idle again from 290 s: decay starts from 3.5, not from 11
    usage.runs["r"] = RunUsage(gpu_seconds=11.0, in_flight=0, last_active_s=290.0)
    assert svc.attained_gpu_s("r", 350.0) == pytest.approx(3.5)
    assert svc.attained_gpu_s("r", 410.0) == pytest.approx(1.75)
    # the accountant forgot the run: so does LAS
    del usage.runs["r"]
    assert svc.attained_gpu_s("r", 420.0) == 0.0
    usage.runs["r"] = RunUsage(gpu_seconds=4.0, in_flight=0, last_active_s=419.0)
    assert svc.attained_gpu_s("r", 420.0) == 4.0


def test_credit_and_forgiveness_live_in_the_runs_record_and_go_with_it() -> None:
    """run_las keeps no table of its own: a run's banked dispatches and forgiven service are
    in its record of the router's `RunTable`, per pool, and go when the table forgets it."""
    runs = RunTable(max_runs=2)
    queue = PoolQueue("agent", max_depth=8, order="run_las", max_slowdown=2.0, runs=runs)
    first = _entry(0.0, run="r1")
    queue.push(first)
    # alone in the queue: due by the 2 x (0 + 1) - 1 = 1st dispatch, it went at the 0th
    assert first.due_dispatches == 1.0
    queue.pop(first, 0.0)
    record = runs.get("r1")
    assert record is not None and record.credit == {"agent": 1.0}
    # its next step carries the credit: due one dispatch later than a newcomer would be
    second = _entry(1.0, run="r1")
    queue.push(second)
    assert second.due_dispatches == 1 + 1.0 + 1.0
    queue.remove(second)

    usage = _Usage()
    svc = AttainedService(usage, idle_decay_s=60.0, pool="agent", runs=runs)
    usage.runs["r1"] = RunUsage(gpu_seconds=8.0, in_flight=0, last_active_s=0.0)
    assert svc.attained_gpu_s("r1", 120.0) == pytest.approx(4.0)
    assert record.forgiven is not None and record.forgiven["agent"].gpu_s == pytest.approx(4.0)
    # two newer runs push it out of a table of two: its credit and forgiveness go with it
    runs.touch("r2")
    runs.touch("r3")
    assert "r1" not in runs
    third = _entry(2.0, run="r1")
    queue.push(third)
    assert third.due_dispatches == 1 + 1.0  # no credit: a newcomer's bound


def test_attained_service_refuses_a_zero_decay() -> None:
    with pytest.raises(ValueError, match="idle_decay_s"):
        AttainedService(_Usage(), idle_decay_s=0.0)


# ------------------------------------------------------------------ the accountant's side


def test_accountant_run_usage_counts_ended_and_in_flight_steps() -> None:
    acct = Accountant()
    acct.add_instance("i0", 1.0, {"agent": 1.0}, 0.0)
    run = ("t", "run-1")
    assert acct.run_usage(run, 0.0) is None
    s1 = acct.begin("i0", 0.0, run)
    other = acct.begin("i0", 0.0)  # no run: not in any run's service
    # 0..2 s: two sequences share one GPU: 1 GPU-second each
    usage = acct.run_usage(run, 2.0)
    assert usage is not None
    assert usage.gpu_seconds == pytest.approx(1.0)
    assert (usage.in_flight, usage.last_active_s) == (1, 0.0)
    acct.end(other, 2.0)
    acct.end(s1, 3.0)  # alone 2..3 s: +1
    usage = acct.run_usage(run, 10.0)
    assert usage is not None
    assert usage.gpu_seconds == pytest.approx(2.0)
    assert (usage.in_flight, usage.last_active_s) == (0, 3.0)
    # two steps of the run at once with a third sequence: each step 1/3 GPU per second
    s2 = acct.begin("i0", 10.0, run)
    s3 = acct.begin("i0", 10.0, run)
    s4 = acct.begin("i0", 10.0, ("t", "run-2"))
    usage = acct.run_usage(run, 13.0)
    assert usage is not None
    assert usage.gpu_seconds == pytest.approx(2.0 + 2.0)
    assert usage.in_flight == 2
    for tok in (s2, s3, s4):
        acct.end(tok, 13.0)
    assert math.isclose(acct.conservation(13.0).rel_error, 0.0, abs_tol=1e-12)


def test_accountant_forgets_the_least_recent_run_past_max_runs() -> None:
    acct = Accountant(max_runs=2)
    acct.add_instance("i0", 1.0, {"agent": 1.0}, 0.0)
    for i, name in enumerate(("a", "b", "a", "c")):
        acct.end(acct.begin("i0", float(i), name), float(i) + 1)
    assert acct.run_usage("b", 10.0) is None  # a was used after b
    assert acct.run_usage("a", 10.0) is not None and acct.run_usage("c", 10.0) is not None


# ------------------------------------------------------------------ the bound relative to FIFO


def test_a_step_is_due_once_its_fifo_position_times_the_bound_have_gone() -> None:
    """Bound 1.5. Three long-run steps queue into an empty queue (0, 1, 2 ahead: FIFO would
    dispatch them 1st, 2nd, 3rd), due after 1.5 x 1 - 1 = 0.5, 1.5 x 2 - 1 = 2 and
    1.5 x 3 - 1 = 3.5 dispatches; four fresh steps behind them (3..6 ahead) are due after 5,
    6.5, 8, 9.5. Worked by hand: the first fresh step overtakes all three; then A is due
    (1 >= 0.5), then B (2 >= 2); C (3.5) is not yet at 3, so a fresh step goes; then C."""
    q = PoolQueue("agent", max_depth=10, order="run_las", aging_s=1e9, max_slowdown=1.5)
    a, b, c = (_entry(10.0, run=f"long-{i}") for i in range(3))
    fresh = [_entry(0.0, run=f"short-{i}") for i in range(4)]
    for e in (a, b, c, *fresh):
        q.push(e)
    assert [e.due_dispatches for e in (a, b, c, *fresh)] == [0.5, 2.0, 3.5, 5.0, 6.5, 8.0, 9.5]
    assert _drain(q) == [fresh[0], a, b, fresh[1], c, fresh[2], fresh[3]]
    # without the bound: least attained first throughout
    q = PoolQueue("agent", max_depth=10, order="run_las", aging_s=1e9)
    for e in (a, b, c, *fresh):
        e.removed = False
        q.push(e)
    assert _drain(q) == [*fresh, a, b, c]


def test_a_runs_early_steps_bank_credit_and_late_ones_a_debt() -> None:
    """Bound 2. Run r's first step queues behind two others (due after 2 x 3 - 1 = 5) and
    goes first (0 dispatched): it had 5 left, its run's credit. Its next step, queued with
    one ahead at 3 dispatched, is due at 3 + 2 x 2 - 1 + 5 = 11 instead of 6. Run s's step,
    due at 0 + 2 x 1 - 1 = 1, goes at 2 dispatched (held back by the caller, see `skip`):
    1 late, its next step is due 1 dispatch sooner than its own bound."""
    q = PoolQueue("agent", max_depth=10, order="run_las", aging_s=1e9, max_slowdown=2.0)
    s1 = _entry(50.0, run="s")
    q.push(s1)
    other = _entry(9.0, run="o")
    q.push(other)
    r1 = _entry(0.0, run="r")
    q.push(r1)
    assert (s1.due_dispatches, other.due_dispatches, r1.due_dispatches) == (1.0, 3.0, 5.0)
    assert q.peek(0.0) is r1
    q.pop(r1, 0.0)
    assert q.peek(0.0, skip={s1}) is other  # s1 is due (1 <= 1) but passed over this once
    q.pop(other, 0.0)
    assert q.peek(0.0) is s1
    q.pop(s1, 0.0)  # dispatched at 2, due at 1: a debt of 1
    blocker = _entry(0.0, run="b")
    q.push(blocker)  # 0 ahead at 3 dispatched: due 3 + 1 = 4
    r2 = _entry(1.0, run="r")
    q.push(r2)
    s2 = _entry(1.0, run="s")
    q.push(s2)
    assert blocker.due_dispatches == 4.0
    assert r2.due_dispatches == 3 + 2 * 2 - 1 + 5.0
    assert s2.due_dispatches == 3 + 2 * 3 - 1 - 1.0
    with pytest.raises(ValueError, match="max_slowdown"):
        PoolQueue("p", max_depth=1, order="run_las", max_slowdown=0.9)


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_the_bound_keeps_every_run_near_its_fifo_completion(seed: int) -> None:
    """In the simulated pool (twice its capacity offered), least attained service with the
    cap alone lets the worst run take 1.39 to 1.57x its FIFO time (seeds 7-9); a bound of 1.5
    on queue position keeps every run within 1.35x (its queue wait is bounded, its service and
    tool time are not slowed down), and short runs keep at least 1.8x of their gain."""
    fifo_runs = _simulate("fifo", seed=seed)
    fifo = {r.name: (r.finished_s or math.inf) - r.arrive_s for r in fifo_runs}
    capped = _simulate("run_las", aging_s=1e9, seed=seed, cap_gpu_s=3.0)
    worst_capped = max(
        (r.finished_s or math.inf) - r.arrive_s - 1.35 * fifo[r.name] for r in capped
    )
    assert worst_capped > 0  # some run past 1.35x without the bound
    bounded_runs = _simulate("run_las", aging_s=1e9, seed=seed, cap_gpu_s=3.0, max_slowdown=1.5)
    bounded = {r.name: (r.finished_s or math.inf) - r.arrive_s for r in bounded_runs}
    assert max(bounded[k] / fifo[k] for k in fifo) <= 1.35
    short_fifo = statistics.median(_completion(fifo_runs, 2))
    assert statistics.median(_completion(bounded_runs, 2)) * 1.8 <= short_fifo


# ------------------------------------------------------------------ passing over an entry


@pytest.mark.parametrize("order", ["fifo", "wfq", "run_las"])
def test_skipped_entries_keep_their_place(order: str) -> None:
    q = PoolQueue("agent", max_depth=10, order=order, aging_s=1e9)
    es = [_entry(float(i), t=float(i), run=f"r{i}") for i in range(4)]
    for e in es:
        q.push(e)
    assert q.peek(0.0) is es[0]
    assert q.peek(0.0, skip={es[0]}) is es[1]
    assert q.peek(0.0, skip={es[0], es[1]}) is es[2]
    q.pop(es[2], 0.0)
    assert q.peek(0.0, skip={es[0], es[1], es[3]}) is None
    assert _drain(q) == [es[0], es[1], es[3]]
