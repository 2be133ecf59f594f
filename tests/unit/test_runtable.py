"""The router's one run table (router/runtable.py): one cap, governance's eviction rule (issue
23: ended runs first, never a run with a step in flight, always terminating) over every part
kept per run, shared by the accountant, the ledger's step numbers, the spans and run affinity."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from router.accounting.accountant import Accountant
from router.admission.picking import RunAffinity
from router.runtable import RunTable


def test_past_the_cap_the_least_recently_used_run_goes() -> None:
    table = RunTable(max_runs=2)
    for key in ("a", "b", "a", "c"):
        table.touch(key)
    assert list(table) == ["a", "c"] and table.evicted == 1


def test_an_ended_run_goes_before_an_older_active_one() -> None:
    table = RunTable(max_runs=2)
    table.touch("a")
    table.touch("b")
    table.set_ended("b")
    table.touch("c")
    assert list(table) == ["a", "c"]


def test_a_run_with_a_step_in_flight_is_never_forgotten() -> None:
    acct = Accountant(runs=RunTable(max_runs=1))
    acct.add_instance("i0", 1.0, {"p": 1.0}, 0.0)
    busy = acct.begin("i0", 0.0, ("t", "busy"))
    acct.end(acct.begin("i0", 1.0, ("t", "other")), 2.0)
    assert ("t", "busy") in acct.runs  # kept over the bound, its step still running
    acct.end(busy, 3.0)
    usage = acct.run_usage(("t", "busy"), 3.0)
    assert usage is not None and usage.in_flight == 0


def test_one_record_holds_every_part_of_a_run() -> None:
    table = RunTable()
    acct = Accountant(runs=table)
    affinity = RunAffinity(runs=table)
    acct.add_instance("i0", 1.0, {"p": 1.0}, 0.0)
    acct.end(acct.begin("i0", 0.0, ("t", "r")), 2.0)
    affinity.record(("t", "r"), "i0", 120)
    assert len(table) == 1
    record = table.get(("t", "r"))
    assert record is not None
    assert (record.ended_gpu_s, record.home, record.context_tokens) == (2.0, "i0", 120)
    # a run only affinity knows has no attained service yet
    affinity.record(("t", "s"), "i0")
    assert acct.run_usage(("t", "s"), 3.0) is None


_event = st.tuples(st.integers(0, 9), st.sampled_from(["touch", "begin", "end_step", "end_run"]))


@settings(max_examples=300, deadline=None)
@given(st.lists(_event, max_size=60), st.integers(1, 5))
def test_the_bound_holds_and_no_run_in_flight_is_lost(
    events: list[tuple[int, str]], max_runs: int
) -> None:
    """Over any sequence of touches, steps and ends: every call returns, the table holds at
        most `max_runs` after each touch but for runs with a step in flight (plus the one just
    touched), and a run
        with a step in flight is never forgotten."""
    table = RunTable(max_runs=max_runs)
    in_flight: dict[str, int] = {}
    for n, what in events:
        key = f"r{n}"
        if what == "touch":
            table.touch(key)
        elif what == "begin":
            table.touch(key).in_flight.append(object())
            in_flight[key] = in_flight.get(key, 0) + 1
        elif what == "end_step" and in_flight.get(key):
            record = table.get(key)
            assert record is not None  # a run with a step in flight is kept
            record.in_flight.pop()
            in_flight[key] -= 1
        elif what == "end_run":
            table.set_ended(key)
        busy = {k for k, v in in_flight.items() if v}
        assert busy <= set(table)
        if what in ("touch", "begin"):  # the table is trimmed as a run is touched
            assert len(table) <= max(max_runs, len(busy) + 1)
