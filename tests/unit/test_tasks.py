"""`cancel_and_wait`: every task ends, a failed task is logged not raised, and a cancellation
of the caller itself is not swallowed (the old `suppress(CancelledError)` pattern did)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from pools.tasks import cancel_and_wait


async def test_cancels_and_waits_for_every_task() -> None:
    a = asyncio.create_task(asyncio.sleep(60))
    b = asyncio.create_task(asyncio.sleep(60))
    await cancel_and_wait(a, None, b)
    assert a.cancelled() and b.cancelled()
    await cancel_and_wait()  # nothing to do


async def test_a_failed_task_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    async def boom() -> None:
        raise RuntimeError("disk gone")

    task = asyncio.create_task(boom(), name="sampler")
    await asyncio.sleep(0)
    with caplog.at_level(logging.ERROR, logger="pools.tasks"):
        await cancel_and_wait(task)
    assert "sampler" in caplog.text and "disk gone" in caplog.text


async def test_the_callers_own_cancellation_propagates() -> None:
    async def stubborn() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(0.2)  # takes a while to stop
            raise

    inner = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    closer = asyncio.create_task(cancel_and_wait(inner))
    await asyncio.sleep(0.05)
    closer.cancel()  # whoever called aclose is itself cancelled
    with pytest.raises(asyncio.CancelledError):
        await closer
    await asyncio.wait([inner])
    assert inner.cancelled()
