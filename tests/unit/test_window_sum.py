"""`WindowSum` against a naive window written here (issue 28, s48): an add into the current
slice skips the expiry step, and the sums, slices and waits must stay what a window that keeps
every amount and filters by slice index on each read says, across slice boundaries, gaps
longer than the window and adds out of time order (a merged or restored window).

Amounts are multiples of 1/64 below 2**20, so every sum is exact in any order and the
comparisons are `==`, not approximate.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from router.governance.bucket import WindowSum
from router.governance.governor import _window

WINDOW_S = 3600.0
BUCKETS = 60
SLICE_S = WINDOW_S / BUCKETS


class NaiveWindow:
    """Every (time, amount) kept; a read sums the amounts whose slice index is among the
    window's last `BUCKETS` slices at the reading time (an amount leaves when its slice does)."""

    def __init__(self) -> None:
        self.events: list[tuple[float, float]] = []

    def add(self, amount: float, now_s: float) -> None:
        if amount > 0:
            self.events.append((now_s, amount))

    def _live(self, now_s: float) -> dict[int, float]:
        oldest = math.floor(now_s / SLICE_S) - BUCKETS + 1
        by_index: dict[int, float] = {}
        for t, a in self.events:
            index = math.floor(t / SLICE_S)
            if index >= oldest:
                by_index[index] = by_index.get(index, 0.0) + a
        return by_index

    def total(self, now_s: float) -> float:
        return sum(self._live(now_s).values())

    def slices(self, now_s: float) -> list[tuple[float, float]]:
        return [(i * SLICE_S, a) for i, a in sorted(self._live(now_s).items())]

    def wait_below_s(self, limit: float, now_s: float) -> float:
        live = sorted(self._live(now_s).items())
        total = sum(a for _, a in live)
        if total < limit:
            return 0.0
        for index, amount in live:
            total -= amount
            if total < limit:
                return max(0.0, (index + BUCKETS) * SLICE_S - now_s)
        return WINDOW_S


# a step of the fake clock: within a slice (most adds, the skipped expiry), to the next
# slice's first instant exactly, one slice on, or past the whole window
gaps = st.one_of(
    st.sampled_from([0.0, 0.25, 1.0, 59.0]),
    st.just(-1.0),  # "to the next boundary exactly", resolved in the test
    st.sampled_from([SLICE_S, 3 * SLICE_S, WINDOW_S - SLICE_S, WINDOW_S, 2 * WINDOW_S]),
    st.floats(0.0, 2 * WINDOW_S).map(lambda x: float(round(x * 4)) / 4),
)
amounts = st.integers(0, 64 * 1024).map(lambda n: n / 64)  # 0 is ignored by both


def _step(now: float, gap: float) -> float:
    if gap < 0:
        return (math.floor(now / SLICE_S) + 1) * SLICE_S
    return now + gap


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(gaps, amounts, st.booleans()), min_size=1, max_size=120))
def test_sums_match_the_naive_window_across_slice_boundaries(
    steps: list[tuple[float, float, bool]],
) -> None:
    w, naive = WindowSum(WINDOW_S, BUCKETS), NaiveWindow()
    now = 0.0
    for gap, amount, read in steps:
        now = _step(now, gap)
        w.add(amount, now)
        naive.add(amount, now)
        if read:  # reads in between expire too; the adds after them must not care
            assert w.total(now) == naive.total(now)
    assert w.total(now) == naive.total(now)
    assert w.slices(now) == naive.slices(now)
    for limit in (0.5, naive.total(now) / 2, naive.total(now)):
        assert w.wait_below_s(limit, now) == naive.wait_below_s(limit, now)
    later = now + SLICE_S * 30
    assert w.total(later) == naive.total(later)


def test_many_adds_in_one_slice_then_each_boundary() -> None:
    """The skipped path at its edges: the last instant of a slice, the first of the next, a
    slice that opens exactly when the oldest one leaves."""
    w, naive = WindowSum(WINDOW_S, BUCKETS), NaiveWindow()
    times = [0.0, 1.0, SLICE_S - 2**-20, SLICE_S, SLICE_S + 1.0]
    times += [WINDOW_S - 1.0, WINDOW_S, WINDOW_S + 0.5, WINDOW_S + SLICE_S, 3 * WINDOW_S]
    for k, t in enumerate(times):
        for _ in range(3):
            w.add(1.0 + k / 64, t)
            naive.add(1.0 + k / 64, t)
            assert w.total(t) == naive.total(t)
            assert w.slices(t) == naive.slices(t)


def test_an_add_leaves_no_expired_slice_behind() -> None:
    """What makes skipping the step sound: after any add (in order), the oldest slice kept is
    live at that add's time, so an expiry step at the same slice would remove nothing."""
    w = WindowSum(WINDOW_S, BUCKETS)
    now = 0.0
    for i in range(2000):
        now += (0.5, 7.0, SLICE_S, 1000.0)[i % 4] * (1 + i % 3)
        w.add(1.0, now)
        oldest_live = math.floor(now / SLICE_S) - BUCKETS + 1
        assert w._slices[0][0] >= oldest_live
        assert len(w._slices) <= BUCKETS


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, BUCKETS - 1), amounts), max_size=20),
    st.lists(st.tuples(st.integers(0, BUCKETS - 1), amounts), max_size=20),
    st.floats(0.0, SLICE_S - 1.0),
)
def test_a_merged_window_added_out_of_order_matches(
    own: list[tuple[int, float]], others: list[tuple[int, float]], into_slice_s: float
) -> None:
    """The governor's merge (`_window`) and restore add one source's live slices, then
    another's from an earlier time: the last slice is then not the current one, and the sum
    read at the time of the merge is every amount added."""
    now = 10 * WINDOW_S + (BUCKETS - 1) * SLICE_S + into_slice_s
    first = math.floor(now / SLICE_S) - BUCKETS + 1
    w, naive = WindowSum(WINDOW_S, BUCKETS), NaiveWindow()
    for source in (own, others):
        for offset, amount in sorted(source):
            start = (first + offset) * SLICE_S
            w.add(amount, start)
            naive.add(amount, start)
    assert w.total(now) == naive.total(now) == sum(a for _, a in own + others)
    by_start: dict[float, float] = {}  # one source's slice may repeat another's start
    for start, amount in w.slices(now):
        by_start[start] = by_start.get(start, 0.0) + amount
    assert sorted(by_start.items()) == naive.slices(now)


def test_the_governors_merged_window_waits_for_the_oldest_slice_first() -> None:
    """A cost cap's Retry-After across replicas (`governor._window`): the own window's recent
    slice and another replica's old one, merged; the sum drops below the cap when the old
    one leaves (in 120 s), as the naive window says, not when the recent one does (~1 h)."""
    now = 10 * WINDOW_S
    own, others, naive = WindowSum(WINDOW_S, BUCKETS), WindowSum(WINDOW_S, BUCKETS), NaiveWindow()
    for window, at_s, amount in ((own, now - 60.0, 2.0), (others, now - WINDOW_S + 120.0, 8.0)):
        window.add(amount, at_s)
        naive.add(amount, at_s)
    merged = _window(own, others, now)
    assert merged.total(now) == naive.total(now) == 10.0
    assert merged.slices(now) == naive.slices(now)
    for cap in (5.0, 9.0):  # 9: the recent slice alone would bring it below, but leaves last
        assert merged.wait_below_s(cap, now) == naive.wait_below_s(cap, now) == 120.0
