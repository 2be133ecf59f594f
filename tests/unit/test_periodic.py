"""`Periodic`, stepped by hand: a fake sleep the test releases one wake at a time and a fake
clock, so no test waits on the wall clock or depends on scheduling luck."""

from __future__ import annotations

import asyncio
import logging

import pytest

from pools.periodic import Periodic


class FakeTime:
    """`sleep` parks until the test calls `wake()`, which advances the clock by the sleep."""

    def __init__(self) -> None:
        self.now_s = 100.0
        self.sleeps: list[float] = []
        self._parked: asyncio.Queue[tuple[float, asyncio.Event]] = asyncio.Queue()

    def clock(self) -> float:
        return self.now_s

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        woken = asyncio.Event()
        await self._parked.put((seconds, woken))
        await woken.wait()

    async def wake(self) -> None:
        """Let the parked sleep end (waiting for the loop to reach it), clock advanced."""
        seconds, woken = await asyncio.wait_for(self._parked.get(), 5)
        self.now_s += seconds
        woken.set()

    async def parked(self) -> None:
        """Wait until the loop sleeps again (so whatever came before the sleep is done)."""
        item = await asyncio.wait_for(self._parked.get(), 5)
        await self._parked.put(item)


async def test_ticks_every_interval_after_a_first_sleep() -> None:
    time = FakeTime()
    ticked: list[float] = []
    loop = Periodic("t", lambda: ticked.append(time.now_s), 5.0, sleep=time.sleep)
    loop.start()
    await time.parked()
    assert ticked == [] and time.sleeps == [5.0]  # no tick before the first interval
    for _ in range(3):
        await time.wake()
        await time.parked()
    assert ticked == [105.0, 110.0, 115.0] and time.sleeps == [5.0] * 4
    assert loop.ticks == 3 and loop.failures == 0 and loop.running
    await loop.aclose()
    assert not loop.running


async def test_an_async_tick_is_awaited() -> None:
    time = FakeTime()
    done: list[int] = []

    async def tick() -> None:
        await asyncio.sleep(0)
        done.append(1)

    loop = Periodic("t", tick, 1.0, sleep=time.sleep)
    loop.start()
    await time.wake()
    await time.parked()
    assert done == [1]
    await loop.aclose()


async def test_a_raising_tick_is_logged_counted_and_the_loop_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    time = FakeTime()
    results = iter([RuntimeError("disk gone"), None, ValueError("bad row"), None])
    ticked = 0

    def tick() -> None:
        nonlocal ticked
        ticked += 1
        if (err := next(results)) is not None:
            raise err

    loop = Periodic("gpupool-test-loop", tick, 2.0, sleep=time.sleep)
    loop.start()
    with caplog.at_level(logging.ERROR, logger="pools.periodic"):
        for _ in range(4):
            await time.wake()
            await time.parked()
    assert ticked == 4 and loop.ticks == 4 and loop.failures == 2 and loop.running
    assert "gpupool-test-loop: tick failed" in caplog.text and "disk gone" in caplog.text
    await loop.aclose()


async def test_first_delay_zero_ticks_at_once_and_the_clock_keeps_start_to_start() -> None:
    time = FakeTime()
    starts: list[float] = []

    def tick() -> None:
        starts.append(time.now_s)
        time.now_s += 0.3  # the tick takes 0.3 s of the interval

    loop = Periodic("t", tick, 1.0, first_delay_s=0.0, clock=time.clock, sleep=time.sleep)
    loop.start()
    await time.parked()
    assert starts == [100.0] and time.sleeps == [pytest.approx(0.7)]
    await time.wake()
    await time.parked()
    assert starts == [100.0, pytest.approx(101.0)]
    await loop.aclose()


async def test_a_tick_longer_than_the_interval_sleeps_zero() -> None:
    time = FakeTime()

    def slow() -> None:
        time.now_s += 3.0

    loop = Periodic("t", slow, 1.0, first_delay_s=0.0, clock=time.clock, sleep=time.sleep)
    loop.start()
    await time.parked()
    assert time.sleeps == [0.0]
    await loop.aclose()


async def test_the_loop_ends_by_itself_once_inactive() -> None:
    time = FakeTime()
    ticked: list[int] = []
    loop = Periodic(
        "t",
        lambda: ticked.append(1),
        1.0,
        first_delay_s=0.0,
        sleep=time.sleep,
        active=lambda: len(ticked) < 2,
    )
    loop.start()
    await time.wake()  # the second tick
    await time.wake()  # after its sleep, `active()` is false: no third tick
    task = next(t for t in asyncio.all_tasks() if t.get_name() == "t")
    await asyncio.wait_for(task, 5)
    assert ticked == [1, 1] and not loop.running
    loop.start()  # started again once ended: asks `active()` first
    await asyncio.wait_for(next(t for t in asyncio.all_tasks() if t.get_name() == "t"), 5)
    assert ticked == [1, 1]
    await loop.aclose()


async def test_aclose_cancels_the_sleep_and_leaves_no_task() -> None:
    time = FakeTime()
    loop = Periodic("gpupool-test-loop", lambda: None, 60.0, sleep=time.sleep)
    loop.start()
    loop.start()  # no-op while running
    await time.parked()
    await loop.aclose()
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "gpupool-test-loop"]
    await loop.aclose()  # idempotent
    assert loop.ticks == 0


async def test_aclose_cancels_a_tick_in_progress_by_default() -> None:
    entered, cancelled = asyncio.Event(), asyncio.Event()

    async def tick() -> None:
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    loop = Periodic("t", tick, 1.0, first_delay_s=0.0)
    loop.start()
    await asyncio.wait_for(entered.wait(), 5)
    await asyncio.wait_for(loop.aclose(), 5)
    assert cancelled.is_set() and not loop.running


async def test_aclose_lets_a_tick_finish_when_asked_not_to_interrupt() -> None:
    time = FakeTime()
    entered, release = asyncio.Event(), asyncio.Event()
    finished: list[int] = []

    async def flush() -> None:
        entered.set()
        await release.wait()
        finished.append(1)

    loop = Periodic("t", flush, 1.0, first_delay_s=0.0, sleep=time.sleep, interrupt_tick=False)
    loop.start()
    await asyncio.wait_for(entered.wait(), 5)
    closing = asyncio.create_task(loop.aclose())
    await asyncio.sleep(0)
    assert not closing.done()  # waits for the flush
    release.set()
    await asyncio.wait_for(closing, 5)
    assert finished == [1] and time.sleeps == []  # ended after the tick, no further sleep


async def test_aclose_during_the_sleep_does_not_wait_when_not_interrupting() -> None:
    time = FakeTime()
    loop = Periodic("t", lambda: None, 1.0, sleep=time.sleep, interrupt_tick=False)
    loop.start()
    await time.parked()
    await asyncio.wait_for(loop.aclose(), 5)
    assert loop.ticks == 0 and not loop.running


def test_a_negative_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        Periodic("t", lambda: None, -1.0)
