"""A pytest plugin: what a loaded machine does to the governance replicas' slot tests, on
purpose. A slot's release reaches the database 50 ms late (a busy background connection or
thread) and each `Governor.enter` starts 15 ms late (a preempted event loop), so the slots
parked for the hand-over (10 ms timers) are released by their timers while the next slot is
asked for. Before 05ce146,
`test_a_slot_asked_for_at_prepare_is_given_back_when_the_request_ends_before_enter` failed 4
runs of 5 under it; after, 5 of 5 passed.

    REPEAT=5 PYTHONPATH=.:benchmarks/results/unit-suite-time-2026-12-04-s46 \
        .venv/bin/pytest -p repeatplug -p delayplug tests/unit/test_governance_replicas.py
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from router.governance import governor as governor_module
from router.governance import replica as replica_module


@pytest.fixture(autouse=True)
def _loaded_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    release = replica_module.ReplicaBudgets._release
    enter = governor_module.Governor.enter

    async def late_release(self: replica_module.ReplicaBudgets, key: str, holder: str) -> None:
        await asyncio.sleep(0.05)
        await release(self, key, holder)

    async def late_enter(self: governor_module.Governor, *args: Any, **kwargs: Any) -> float:
        await asyncio.sleep(0.015)
        return await enter(self, *args, **kwargs)

    monkeypatch.setattr(replica_module.ReplicaBudgets, "_release", late_release)
    monkeypatch.setattr(governor_module.Governor, "enter", late_enter)
