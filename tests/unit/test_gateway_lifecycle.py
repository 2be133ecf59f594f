"""The Gateway's lifecycle: components start in order, each one's close pushed on an exit stack
once its start succeeds, so a start that fails closes exactly what had started, in reverse
order, and `aclose` is the reverse of `start`. The components are stand-ins that record their
calls; the session is the Gateway's own (no engine is contacted: scrape off)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pools.config import Config
from pools.discovery import DiscoveryLoop
from pools.launchers.base import InstanceSpec
from pools.testing.config import config_for_test
from router.gateway.app import Gateway, create_app

# the components Gateway.start starts, in its order (the session comes after "placement")
ORDER = ["rebalancer", "ledger", "gpu_sampler", "governor", "placement", "discovery", "history"]


class Recorder:
    """A component that records start and aclose in a shared log; `fail` makes start raise."""

    devices = ()  # as the GPU sampler: no GPU, so no roofline prior to seed

    def __init__(self, name: str, log: list[str], *, fail: bool = False) -> None:
        self.name = name
        self.log = log
        self.fail = fail

    async def start(self) -> None:
        self.log.append(f"start {self.name}")
        if self.fail:
            raise RuntimeError(f"{self.name} cannot start")

    async def aclose(self) -> None:
        self.log.append(f"close {self.name}")


class NoEngines:
    """An engine source that answers with nothing (discovery is started by the Gateway)."""

    poll_interval_s = 3600.0
    drain_timeout_s = 1.0

    async def poll(self) -> list[InstanceSpec]:
        return []


SPECS = [InstanceSpec("engine-0", "http://127.0.0.1:9", 1)]


def _config(tmp_path: Path) -> Config:
    return config_for_test(tmp_path)


def _gateway(tmp_path: Path, log: list[str], failing: str | None = None) -> Gateway:
    gateway = create_app(_config(tmp_path), list(SPECS), scrape=False, source=NoEngines())
    assert isinstance(gateway.discovery, DiscoveryLoop)
    for name in ORDER:
        setattr(gateway, name, Recorder(name, log, fail=name == failing))
    return gateway


async def test_aclose_is_the_reverse_of_start(tmp_path: Path) -> None:
    log: list[str] = []
    gateway = _gateway(tmp_path, log)
    await gateway.start()
    assert log == [f"start {n}" for n in ORDER] and gateway.started
    assert gateway.session is not None and not gateway.session.closed
    await gateway.start()  # no-op when started
    assert len(log) == len(ORDER)
    log.clear()
    await gateway.aclose()
    assert log == [f"close {n}" for n in reversed(ORDER)] and not gateway.started
    assert gateway.session.closed
    log.clear()
    await gateway.aclose()  # idempotent
    assert log == []


@pytest.mark.parametrize("failing", ORDER)
async def test_a_failed_start_closes_what_started_in_reverse_order(
    tmp_path: Path, failing: str
) -> None:
    log: list[str] = []
    gateway = _gateway(tmp_path, log, failing)
    with pytest.raises(RuntimeError, match=f"{failing} cannot start"):
        await gateway.start()
    before = ORDER[: ORDER.index(failing)]
    assert log == [
        *(f"start {n}" for n in before),
        f"start {failing}",
        *(f"close {n}" for n in reversed(before)),
    ]
    assert not gateway.started
    session_opened = "placement" in before
    assert (gateway.session is not None) == session_opened
    if gateway.session is not None:
        assert gateway.session.closed
    log.clear()
    await gateway.aclose()  # nothing left to close
    assert log == []


async def test_the_real_components_start_and_close(tmp_path: Path) -> None:
    """The same lifecycle with the Gateway's own components: every task they started is gone
    after aclose."""
    gateway = create_app(_config(tmp_path), list(SPECS), scrape=False, source=NoEngines())
    before = asyncio.all_tasks()
    await gateway.start()
    assert gateway.started and asyncio.all_tasks() - before
    await gateway.aclose()
    assert not gateway.started
    assert asyncio.all_tasks() - before == set()
