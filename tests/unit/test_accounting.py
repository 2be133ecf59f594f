"""GPU-seconds by processor sharing (router/accounting/accountant.py): worked examples with every
number worked out by hand, then properties checked by hypothesis against a brute-force reference
that splits every interval between events explicitly.

The accountant's own `conservation().rel_error` compares its counters with each other, so it
holds for many wrong answers (a cost given to the wrong sequence, time charged to the wrong
pool); no test here relies on it. Each checks the accountant against numbers computed apart
from it."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from router.accounting.accountant import (
    UNALLOCATED_POOL,
    Accountant,
    AccountingError,
    SequenceToken,
    UnknownInstanceError,
)

REL = 1e-9


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL, abs_tol=1e-9)


# --- examples ---------------------------------------------------------------------------------


def test_lone_sequence_pays_gpus_times_its_wall_time() -> None:
    acc = Accountant()
    acc.add_instance("i0", 2.0, {"agent": 1.0}, now_s=0.0)
    tok = acc.begin("i0", 10.0)
    assert acc.end(tok, 13.5) == pytest.approx(7.0)
    report = acc.conservation(20.0)
    assert report.capacity_gpu_seconds == pytest.approx(40.0)  # 2 GPUs x 20 s
    assert report.ended_gpu_seconds == pytest.approx(7.0)  # 2 GPUs x 3.5 s
    assert report.in_flight_gpu_seconds == 0.0
    assert report.idle_by_pool_gpu_seconds == {"agent": pytest.approx(33.0)}  # 2 x (10 + 6.5)


def test_two_sequences_overlapping_share_equally() -> None:
    acc = Accountant()
    acc.add_instance("i0", 1.0, {"normal": 1.0}, now_s=0.0)
    a = acc.begin("i0", 1.0)
    b = acc.begin("i0", 1.0)
    assert acc.end(a, 5.0) == acc.end(b, 5.0) == pytest.approx(2.0)


def test_staggered_sequences_split_the_overlap() -> None:
    # a alone 0-2 (2), both 2-4 (1 each), b alone 4-6 (2): a=3, b=3.
    acc = Accountant()
    acc.add_instance("i0", 1.0, {"normal": 1.0}, now_s=0.0)
    a = acc.begin("i0", 0.0)
    b = acc.begin("i0", 2.0)
    assert acc.end(a, 4.0) == pytest.approx(3.0)
    assert acc.end(b, 6.0) == pytest.approx(3.0)
    assert acc.conservation(6.0).idle_gpu_seconds == 0.0


def test_idle_splits_by_shares_and_follows_share_changes() -> None:
    acc = Accountant()
    acc.add_instance("i0", 1.0, {"agent": 1.0, "normal": 3.0}, now_s=0.0)  # normalised
    acc.set_shares("i0", {"agent": 1.0}, now_s=4.0)
    idle = acc.idle_gpu_seconds(10.0)
    assert idle == {"agent": pytest.approx(1.0 + 6.0), "normal": pytest.approx(3.0)}


def test_unallocated_instance_idles_to_the_unallocated_pool() -> None:
    acc = Accountant()
    acc.add_instance("i0", 1.0, {}, now_s=0.0)
    acc.add_instance("i1", 1.0, {"agent": 0.0}, now_s=0.0)
    assert acc.idle_gpu_seconds(2.0) == {UNALLOCATED_POOL: pytest.approx(4.0)}


def test_adding_an_idle_instance_only_adds_idle() -> None:
    acc = Accountant()
    acc.add_instance("i0", 1.0, {"agent": 1.0}, now_s=0.0)
    tok = acc.begin("i0", 0.0)
    acc.add_instance("i1", 4.0, {"normal": 1.0}, now_s=1.0)
    assert acc.end(tok, 3.0) == pytest.approx(3.0)
    report = acc.conservation(3.0)
    assert report.idle_by_pool_gpu_seconds == {"normal": pytest.approx(8.0)}
    assert report.capacity_gpu_seconds == pytest.approx(11.0)


def test_removed_instance_charges_in_flight_sequences_up_to_removal() -> None:
    acc = Accountant()
    acc.add_instance("i0", 1.0, {"agent": 1.0}, now_s=0.0)
    tok = acc.begin("i0", 1.0)
    acc.remove_instance("i0", 3.0)
    assert acc.conservation(4.0).in_flight_gpu_seconds == pytest.approx(2.0)
    assert acc.end(tok, 9.0) == pytest.approx(2.0)
    report = acc.conservation(10.0)
    assert report.capacity_gpu_seconds == pytest.approx(3.0)  # 1 GPU from 0 to the removal at 3
    assert report.in_flight_sequences == 0
    assert report.ended_gpu_seconds == pytest.approx(2.0)
    assert report.idle_by_pool_gpu_seconds == {"agent": pytest.approx(1.0)}  # 0 to 1
    acc.add_instance("i0", 1.0, {"agent": 1.0}, now_s=10.0)  # the id may come back
    assert acc.in_flight("i0") == 0


def test_end_twice_returns_the_first_cost() -> None:
    acc = Accountant()
    acc.add_instance("i0", 1.0, {"agent": 1.0}, now_s=0.0)
    tok = acc.begin("i0", 0.0)
    first = acc.end(tok, 2.0)
    assert acc.end(tok, 5.0) == first
    assert acc.conservation(5.0).ended_gpu_seconds == pytest.approx(2.0)


def test_time_going_backwards_counts_as_no_time() -> None:
    acc = Accountant()
    acc.add_instance("i0", 1.0, {"agent": 1.0}, now_s=5.0)
    tok = acc.begin("i0", 6.0)
    assert acc.end(tok, 4.0) == 0.0
    report = acc.conservation(7.0)
    assert report.capacity_gpu_seconds == pytest.approx(2.0)  # 1 GPU, 5 to 7
    assert report.ended_gpu_seconds == 0.0
    # the sequence ended "before" it began: it held no time, so 5 to 7 was all idle
    assert report.idle_by_pool_gpu_seconds == {"agent": pytest.approx(2.0)}


def test_bad_calls_are_refused() -> None:
    acc = Accountant()
    acc.add_instance("i0", 1.0, {"agent": 1.0}, now_s=0.0)
    with pytest.raises(AccountingError):
        acc.add_instance("i0", 1.0, {}, now_s=0.0)
    with pytest.raises(AccountingError):
        acc.add_instance("i1", 0.0, {}, now_s=0.0)
    with pytest.raises(AccountingError):
        acc.set_shares("i0", {"agent": -1.0}, now_s=0.0)
    with pytest.raises(UnknownInstanceError):
        acc.begin("nope", 0.0)
    with pytest.raises(KeyError):
        acc.remove_instance("nope", 0.0)


def test_long_busy_instance_keeps_precision() -> None:
    # A month of back-to-back overlapping requests without the instance ever emptying.
    acc = Accountant()
    acc.add_instance("i0", 8.0, {"agent": 1.0}, now_s=0.0)
    held = acc.begin("i0", 0.0)
    t = 0.0
    costs = 0.0
    for _ in range(20_000):
        tok = acc.begin("i0", t)
        t += 130.0
        costs += acc.end(tok, t)
    assert costs == pytest.approx(8.0 * t / 2, rel=REL)
    report = acc.conservation(t)
    assert report.capacity_gpu_seconds == pytest.approx(8.0 * t, rel=REL)
    assert report.idle_gpu_seconds == 0.0  # never empty
    assert report.in_flight_gpu_seconds == pytest.approx(8.0 * t / 2, rel=REL)
    assert acc.end(held, t) == pytest.approx(8.0 * t / 2, rel=REL)


# --- properties -------------------------------------------------------------------------------


@given(
    gpus=st.floats(min_value=0.1, max_value=16.0),
    start_s=st.floats(min_value=0.0, max_value=1e6),
    wall_s=st.floats(min_value=0.0, max_value=1e5),
)
def test_lone_sequence_costs_gpus_times_wall(gpus: float, start_s: float, wall_s: float) -> None:
    acc = Accountant()
    acc.add_instance("i0", gpus, {"agent": 1.0}, now_s=0.0)
    tok = acc.begin("i0", start_s)
    assert math.isclose(acc.end(tok, start_s + wall_s), gpus * wall_s, rel_tol=REL, abs_tol=1e-9)


# (offset from the pair's start, duration) of other sequences on the same instance
others_strategy = st.lists(
    st.tuples(st.floats(min_value=-50.0, max_value=50.0), st.floats(min_value=0.0, max_value=80.0)),
    max_size=8,
)


def brute_force(
    events: list[tuple[float, int, int]], gpus: float, start_s: float, end_s: float
) -> tuple[dict[int, float], float]:
    """(cost per sequence, idle GPU-seconds) on one instance from `start_s` to `end_s`: walk the
    sorted (time, 0 begin / 1 end, sequence) events and give each elementary interval's
    `gpus x dt` to the sequences open in it in equal parts, or to idle."""
    costs: dict[int, float] = {}
    idle = 0.0
    open_: set[int] = set()
    last = start_s
    for t, kind, k in [*sorted(events), (end_s, 2, 0)]:
        if t > last:
            if open_:
                for seq in open_:
                    costs[seq] = costs.get(seq, 0.0) + gpus * (t - last) / len(open_)
            else:
                idle += gpus * (t - last)
            last = t
        if kind == 0:
            open_.add(k)
            costs.setdefault(k, 0.0)
        elif kind == 1:
            open_.discard(k)
    return costs, idle


@given(
    others=others_strategy,
    wall_s=st.floats(min_value=0.0, max_value=60.0),
    gpus=st.sampled_from([0.5, 1.0, 8.0]),
)
def test_costs_match_a_brute_force_split_of_every_interval(
    others: list[tuple[float, float]], wall_s: float, gpus: float
) -> None:
    acc = Accountant()
    acc.add_instance("i0", gpus, {"normal": 1.0}, now_s=-100.0)
    events: list[tuple[float, int, int]] = []  # (time, 0 begin / 1 end, sequence)
    for k, (offset, duration) in enumerate(others):
        events += [(offset, 0, k), (offset + duration, 1, k)]
    events += [(0.0, 0, -1), (0.0, 0, -2), (wall_s, 1, -1), (wall_s, 1, -2)]
    open_tokens: dict[int, SequenceToken] = {}
    costs: dict[int, float] = {}
    for t, kind, k in sorted(events):
        if kind == 0:
            open_tokens[k] = acc.begin("i0", t)
        else:
            costs[k] = acc.end(open_tokens.pop(k), t)
    expected, expected_idle = brute_force(events, gpus, -100.0, 200.0)
    assert costs.keys() == expected.keys()
    for k, cost in costs.items():
        assert math.isclose(cost, expected[k], rel_tol=1e-9, abs_tol=1e-9), (k, cost, expected[k])
    assert costs[-1] == costs[-2]  # overlapping throughout: the same share at every instant
    report = acc.conservation(200.0)
    assert math.isclose(report.idle_by_pool_gpu_seconds.get("normal", 0.0), expected_idle)
    assert math.isclose(report.capacity_gpu_seconds, gpus * 300.0)


@given(others=others_strategy, added_s=st.floats(min_value=-50.0, max_value=100.0))
def test_an_idle_instance_only_adds_idle(others: list[tuple[float, float]], added_s: float) -> None:
    def run(with_idle_instance: bool) -> tuple[list[float], dict[str, float]]:
        acc = Accountant()
        acc.add_instance("busy", 2.0, {"agent": 1.0}, now_s=-100.0)
        events = sorted(
            [(o, 0, k) for k, (o, _) in enumerate(others)]
            + [(o + d, 1, k) for k, (o, d) in enumerate(others)]
            + ([(added_s, 2, -1)] if with_idle_instance else [])
        )
        tokens: dict[int, SequenceToken] = {}
        costs = []
        for t, kind, k in events:
            if kind == 2:
                acc.add_instance("idle", 4.0, {"normal": 1.0}, now_s=t)
            elif kind == 0:
                tokens[k] = acc.begin("busy", t)
            else:
                costs.append(acc.end(tokens.pop(k), t))
        return costs, acc.idle_gpu_seconds(200.0)

    costs_without, idle_without = run(False)
    costs_with, idle_with = run(True)
    assert costs_with == costs_without
    assert idle_with["agent"] == idle_without["agent"]
    assert math.isclose(idle_with["normal"], 4.0 * (200.0 - added_s), rel_tol=REL)


class Reference:
    """Brute force: every time step splits g·dt among the instance's open sequences."""

    def __init__(self) -> None:
        self.instances: dict[str, tuple[float, dict[str, float]]] = {}
        self.open: dict[int, tuple[str, float]] = {}  # seq -> (instance, cost so far)
        self.idle: dict[str, float] = {}
        self.capacity = 0.0
        self.ended = 0.0  # costs of the sequences that ended

    def step(self, dt: float) -> None:
        for iid, (gpus, shares) in self.instances.items():
            self.capacity += gpus * dt
            on = [s for s, (i, _) in self.open.items() if i == iid]
            if on:
                for s in on:
                    self.open[s] = (iid, self.open[s][1] + gpus * dt / len(on))
            else:
                total = sum(shares.values())
                split = {p: f / total for p, f in shares.items()} if total > 0 else {}
                for pool, frac in (split or {UNALLOCATED_POOL: 1.0}).items():
                    if frac > 0:
                        self.idle[pool] = self.idle.get(pool, 0.0) + gpus * dt * frac


POOLS = ("agent", "normal", "batch")
shares_strategy = st.dictionaries(
    st.sampled_from(POOLS), st.floats(min_value=0.0, max_value=1.0), max_size=3
)


class AccountingMachine(RuleBasedStateMachine):
    tokens = Bundle("tokens")

    def __init__(self) -> None:
        super().__init__()
        self.acc = Accountant()
        self.ref = Reference()
        self.now_s = 0.0
        self.next_id = 0
        self.next_seq = 0
        self.seq_of: dict[int, int] = {}  # id(token) -> reference seq

    @initialize(gpus=st.floats(min_value=0.1, max_value=8.0), shares=shares_strategy)
    def first_instance(self, gpus: float, shares: dict[str, float]) -> None:
        self.add(gpus, shares)

    @rule(gpus=st.sampled_from([0.5, 1.0, 2.0, 8.0]), shares=shares_strategy)
    def add(self, gpus: float, shares: dict[str, float]) -> None:
        iid = f"i{self.next_id}"
        self.next_id += 1
        self.acc.add_instance(iid, gpus, shares, self.now_s)
        self.ref.instances[iid] = (gpus, dict(shares))

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        if len(self.ref.instances) <= 1:
            return
        iid = data.draw(st.sampled_from(sorted(self.ref.instances)))
        self.acc.remove_instance(iid, self.now_s)
        del self.ref.instances[iid]

    @rule(data=st.data(), shares=shares_strategy)
    def reshare(self, data: st.DataObject, shares: dict[str, float]) -> None:
        iid = data.draw(st.sampled_from(sorted(self.ref.instances)))
        self.acc.set_shares(iid, shares, self.now_s)
        self.ref.instances[iid] = (self.ref.instances[iid][0], dict(shares))

    @rule(dt=st.one_of(st.just(0.0), st.floats(min_value=1e-6, max_value=1000.0)))
    def wait(self, dt: float) -> None:
        self.ref.step(dt)
        self.now_s += dt

    @rule(target=tokens, data=st.data())
    def begin(self, data: st.DataObject) -> SequenceToken:
        iid = data.draw(st.sampled_from(sorted(self.ref.instances)))
        token = self.acc.begin(iid, self.now_s)
        self.seq_of[id(token)] = self.next_seq
        self.ref.open[self.next_seq] = (iid, 0.0)
        self.next_seq += 1
        return token

    @rule(token=consumes(tokens))
    def end(self, token: SequenceToken) -> None:
        cost = self.acc.end(token, self.now_s)
        _, expected = self.ref.open.pop(self.seq_of.pop(id(token)))
        self.ref.ended += expected
        assert cost >= 0.0
        assert close(cost, expected), (cost, expected)

    @invariant()
    def matches_the_reference(self) -> None:
        report = self.acc.conservation(self.now_s)
        assert close(report.capacity_gpu_seconds, self.ref.capacity)
        assert close(report.ended_gpu_seconds, self.ref.ended)
        assert report.in_flight_gpu_seconds >= -1e-9
        expected_in_flight = sum(c for i, c in self.ref.open.values())
        assert close(report.in_flight_gpu_seconds, expected_in_flight)
        for pool in set(report.idle_by_pool_gpu_seconds) | set(self.ref.idle):
            got = report.idle_by_pool_gpu_seconds.get(pool, 0.0)
            assert close(got, self.ref.idle.get(pool, 0.0)), (pool, got)


AccountingMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAccountingProperties = AccountingMachine.TestCase
