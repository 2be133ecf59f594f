"""The per-pool queue: priority bands, weighted fair queuing across tenants, FIFO, bounds,
shedding and the measured drain rate."""

from __future__ import annotations

import pytest

from router.admission.queueing import PoolQueue, QueueEntry, QueueFull


def _entry(
    tenant: str = "a", priority: int = 0, cost: float = 100.0, weight: float = 1.0
) -> QueueEntry:
    return QueueEntry(
        tenant=tenant, priority=priority, cost_tokens=cost, weight=weight, enqueued_at_s=0.0
    )


def _pop_first(queue: PoolQueue, now_s: float) -> None:
    first = queue.peek()
    assert first is not None
    queue.pop(first, now_s)


def _drain(queue: PoolQueue, n: int | None = None) -> list[QueueEntry]:
    out: list[QueueEntry] = []
    t = 0.0
    while (e := queue.peek()) is not None and (n is None or len(out) < n):
        t += 0.1
        queue.pop(e, t)
        out.append(e)
    return out


def test_fifo_within_a_band_and_bands_first() -> None:
    q = PoolQueue("p", max_depth=10, order="fifo")
    a, b, c, hi = _entry("x"), _entry("y"), _entry("x"), _entry("z", priority=5)
    for e in (a, b, c, hi):
        q.push(e)
    assert _drain(q) == [hi, a, b, c]


def test_wfq_serves_tokens_in_proportion_to_weights() -> None:
    q = PoolQueue("p", max_depth=10_000, order="wfq")
    # both tenants keep the queue full; paid has weight 5, free 1; equal-size requests
    for _ in range(600):
        q.push(_entry("paid", weight=5.0))
        q.push(_entry("free", weight=1.0))
    served = _drain(q, 300)
    paid = sum(e.cost_tokens for e in served if e.tenant == "paid")
    free = sum(e.cost_tokens for e in served if e.tenant == "free")
    assert paid / free == pytest.approx(5.0, rel=0.05)


def test_wfq_by_cost_not_by_count() -> None:
    q = PoolQueue("p", max_depth=10_000, order="wfq")
    for _ in range(400):
        q.push(_entry("big", cost=400.0))
        q.push(_entry("small", cost=100.0))
        q.push(_entry("small", cost=100.0))
        q.push(_entry("small", cost=100.0))
        q.push(_entry("small", cost=100.0))
    served = _drain(q, 500)
    big = sum(e.cost_tokens for e in served if e.tenant == "big")
    small = sum(e.cost_tokens for e in served if e.tenant == "small")
    assert big / small == pytest.approx(1.0, rel=0.05)


def test_a_newly_active_tenant_does_not_get_credit_for_idle_time() -> None:
    q = PoolQueue("p", max_depth=10_000, order="wfq")
    for _ in range(100):
        q.push(_entry("busy"))
    _drain(q, 90)
    late = [_entry("late") for _ in range(20)]
    for e in late:
        q.push(e)
    served = _drain(q, 20)
    # alternates with the busy tenant instead of taking all 20 slots first
    assert sum(1 for e in served if e.tenant == "late") <= 11


def test_full_queue_refuses_unless_it_can_shed_a_lower_negative_priority() -> None:
    q = PoolQueue("p", max_depth=2, order="wfq")
    q.push(_entry(priority=0))
    low = _entry(priority=-1)
    q.push(low)
    with pytest.raises(QueueFull):
        q.push(_entry(priority=-1))  # not higher than the sheddable one
    shed = q.push(_entry(priority=0))
    assert shed is low and low.removed and len(q) == 2
    with pytest.raises(QueueFull):
        q.push(_entry(priority=9))  # nothing sheddable left


def test_zero_depth_queue_refuses_everything() -> None:
    with pytest.raises(QueueFull):
        PoolQueue("p", max_depth=0).push(_entry())


def test_remove_and_position() -> None:
    q = PoolQueue("p", max_depth=10, order="fifo")
    es = [_entry() for _ in range(4)]
    for e in es:
        q.push(e)
    q.remove(es[1])
    assert len(q) == 3 and q.position(es[3]) == 2
    assert _drain(q) == [es[0], es[2], es[3]]


def test_drain_rate_and_expected_wait() -> None:
    q = PoolQueue("p", max_depth=100, order="fifo")
    assert q.expected_wait_s(5, 0.0, default_s=7.0) == 7.0
    for _ in range(60):
        q.push(_entry())
    t = 0.0
    for _ in range(60):
        t += 0.5  # two dispatches per second
        _pop_first(q, t)
    assert q.drain_rate_per_s(t) == pytest.approx(2.0, rel=0.1)
    assert q.expected_wait_s(10, t, default_s=0) == pytest.approx(5.0, rel=0.1)
    # nothing dispatched for a while: the rate falls instead of promising 2/s
    assert q.drain_rate_per_s(t + 30) < 1.1
    assert q.drain_rate_per_s(t + 61) == 0.0
    assert q.expected_wait_s(3, t + 61, default_s=9.0) == 9.0
    # a burst of dispatches at one instant says little: the rate stays bounded by the window
    burst = PoolQueue("p", max_depth=100)
    for _ in range(5):
        burst.push(_entry())
    for _ in range(5):
        _pop_first(burst, 100.0)
    assert burst.drain_rate_per_s(101.0) == pytest.approx(5.0)
