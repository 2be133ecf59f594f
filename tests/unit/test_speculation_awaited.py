"""`Speculation.awaited` (router/governance/speculation.py): True only when the response
waited for the store's answer (its `wait` came first), the count behind
`gpupool_governance_step_speculated_awaited_total`."""

from __future__ import annotations

import asyncio

from router.governance.speculation import Speculation


async def test_awaited_only_when_the_response_came_before_the_answer() -> None:
    loop = asyncio.get_running_loop()
    answered: list[bool] = []  # each answer read: was its response waiting for it

    def on_answer(spec: Speculation) -> None:
        answered.append(spec.awaited)

    # the store's answer first, then the response's `wait`: not awaited
    early: asyncio.Future[int] = loop.create_future()
    first = Speculation(asyncio.ensure_future(early), 4, on_answer)
    early.set_result(0)
    await asyncio.sleep(0)  # the task ends, its callback reads the answer
    await asyncio.sleep(0)
    assert first.resolved
    await first.wait()
    assert (first.awaited, answered) == (False, [False])

    # the response's `wait` first (the engine answered first): awaited
    late: asyncio.Future[int] = loop.create_future()
    second = Speculation(asyncio.ensure_future(late), 5, on_answer)
    waiting = asyncio.ensure_future(second.wait())
    await asyncio.sleep(0)
    assert not second.resolved
    late.set_result(0)
    await waiting
    assert (second.awaited, answered) == (True, [False, True])
