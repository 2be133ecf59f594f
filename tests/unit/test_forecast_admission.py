"""Admission on one engine split between the pools with `admission.reserve: forecast` and
`admission.prefill_hold_min_tokens`: the synchronous core (`admit_now`, `enqueue`,
`dispatch_once`) on a fake clock, as the simulator drives it. The engine has 999 usable
blocks of 16 tokens less the 5 % margin: 949.05; each pool's half is 474.5."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest

from pools.config import Config, ConfigError, contract_problems
from pools.fleet import Lease
from pools.launchers.base import InstanceSpec
from pools.telemetry import InstanceReading
from pools.testing.config import config_for_test, even_pools
from router.admission.admitter import Admitter
from router.admission.decision import Need
from router.core import Core, build_core
from router.errors import CapacityExceeded
from router.request import RequestContext
from tests.unit.test_rebalance_borrow import ctx

SPEC = InstanceSpec("engine-0", "http://127.0.0.1:9", 1)
POOLS = even_pools(
    agent={"slo": {"ttft_p95_ms": 3000, "tpot_p95_ms": 150}},
    normal={"slo": {"ttft_p95_ms": 800, "tpot_p95_ms": 80}},
)
AGENT = Need(prompt_tokens=1500, total_tokens=1600, deadline_s=1e9)  # 100 blocks
CHAT = Need(prompt_tokens=24, total_tokens=32, deadline_s=1e9)  # 2 blocks


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _core(tmp_path: Path, clock: Clock, **admission: Any) -> Core:
    config = config_for_test(
        tmp_path,
        urls=[SPEC.url],
        pools=POOLS,
        admission=admission,
        rebalancer={"decision_log_path": str(tmp_path / "d.sqlite")},
    )
    core = build_core(config, [SPEC], clock, random.Random(0), wall_clock=clock)
    _scrape(core, clock)
    return core


def _scrape(core: Core, clock: Clock) -> None:
    core.fleet.record_reading(
        SPEC.instance_id,
        InstanceReading(clock.now, 0.0, 0, 0, 1000, 16, 0, 0, 0, 0, 0, 0, 0),
    )


class _Waiter:
    def __init__(self, ctx: RequestContext, need: Need) -> None:
        self.ctx, self.need, self.exclude = ctx, need, frozenset[str]()
        self.lease: Lease | None = None

    def gone(self) -> bool:
        return self.lease is not None

    def admitted(self, lease: Lease) -> None:
        self.lease = lease

    def refused(self, err: CapacityExceeded) -> None:
        raise AssertionError(err)


_ids = itertools.count()


def _ctx(pool: str, _now_s: float) -> RequestContext:
    return ctx(pool, next(_ids))


def _fill(a: Admitter, pool: str, need: Need, now_s: float) -> list[Lease]:
    """Leases for `pool` at once until one does not fit."""
    held = []
    while (lease := a.admit_now(_ctx(pool, now_s), need, now_s)) is not None:
        held.append(lease)
    return held


def _chat_minute(core: Core, clock: Clock) -> None:
    """A minute of chat at 2 req/s, each holding 2 blocks for 0.5 s."""
    a = core.admitter
    while clock.now < 60.0:
        clock.now += 0.5
        _scrape(core, clock)
        lease = a.admit_now(_ctx("normal", clock.now), CHAT, clock.now)
        assert lease is not None
        clock.now += 0.5 - 1e-6
        lease.release()
        clock.now -= 0.5 - 1e-6
    _scrape(core, clock)


def test_share_keeps_each_pool_in_its_half(tmp_path: Path) -> None:
    clock = Clock()
    core = _core(tmp_path, clock)
    assert len(_fill(core.admitter, "agent", AGENT, 0.0)) == 4  # 400 <= 474.5 < 500


def test_forecast_lends_the_idle_half_less_the_owners_forecast(tmp_path: Path) -> None:
    clock = Clock()
    core = _core(tmp_path, clock, reserve="forecast")
    a = core.admitter
    # the router's first minute, chat unmeasured: its whole unused half is kept
    assert len(_fill(a, "agent", AGENT, 0.0)) == 4
    state = core.fleet.get(SPEC.instance_id)
    assert state is not None
    for lease in list(state.leases):
        lease.release()
    _chat_minute(core, clock)
    # chat measured: 2/s x 0.5 s = 1 in flight on average, the model's p99 4 sequences of 2
    # blocks; it was never seen holding more than one: the peak (2) + one sequence (2) - the
    # none it holds now = 4 blocks and 1 + 1 - 0 = 2 slots are kept
    reserves = a.reserves(state, clock.now)
    assert (reserves["normal"].forecast.blocks, reserves["normal"].forecast.slots) == (8, 4)
    assert (reserves["normal"].blocks, reserves["normal"].slots) == (4.0, 2)
    # the agent pool may use 949.05 - 4 = 945 blocks: 9 sequences of 100
    agents = _fill(a, "agent", AGENT, clock.now)
    assert len(agents) == 9
    # chat still fits at once beside them (900 + 2 <= 949.05)
    chat = a.admit_now(_ctx("normal", clock.now), CHAT, clock.now)
    assert chat is not None and chat.pool == "normal"


def _lent(tmp_path: Path) -> tuple[Clock, Core, list[Lease]]:
    """A minute of chat measured, then the agent pool filling what it may: 9 sequences."""
    clock = Clock()
    core = _core(tmp_path, clock, reserve="forecast")
    _chat_minute(core, clock)
    return clock, core, _fill(core.admitter, "agent", AGENT, clock.now)


def test_a_waiting_owner_stops_the_borrowers_new_admissions(tmp_path: Path) -> None:
    clock, core, agents = _lent(tmp_path)
    a = core.admitter
    assert len(agents) == 9  # 900 blocks, 449.5 of them borrowed
    now = clock.now
    big_chat = Need(prompt_tokens=900, total_tokens=960, deadline_s=1e9)  # 60 blocks
    assert a.admit_now(_ctx("normal", now), big_chat, now) is None  # 960 > 949.05: it queues
    chat = _Waiter(_ctx("normal", now), big_chat)
    a.enqueue(chat, now)
    agent = _Waiter(_ctx("agent", now), AGENT)
    a.enqueue(agent, now)
    agents.pop().release()  # 800 held: the agent's 100 would fit (900 <= 941), then not chat's
    a.dispatch_once(now)  # the agent queue's head is tried first
    # all of chat's unused half was kept while chat waited: the borrower waited, chat went
    assert chat.lease is not None and chat.lease.pool == "normal"
    assert agent.lease is None
    assert len(agents) == 8 and all(not lease.released for lease in agents)


def test_the_owners_rising_forecast_stops_the_borrower_first(tmp_path: Path) -> None:
    clock, core, agents = _lent(tmp_path)
    a = core.admitter
    for lease in agents[5:]:
        lease.release()
    # 500 blocks held by 5 agent sequences. Chat surges: 100 requests in 5 s (20/s), each
    # still running at t = 65
    held = []
    for _ in range(100):
        clock.now += 0.05
        _scrape(core, clock)
        granted = a.admit_now(_ctx("normal", clock.now), CHAT, clock.now)
        assert granted is not None  # the owner is served in its own half
        held.append(granted)
    state = core.fleet.get(SPEC.instance_id)
    assert state is not None
    reserve = a.reserves(state, clock.now)["normal"]
    # rate: the last 10 s hold 10 of the minute's (55.5 .. 60.0) + 100: 11/s (one more or
    # less at the window's edge: the clock is summed in floats); E[S]: ~109 ended in the
    # window (0.5 s each) and the 100 running aged 0 .. 4.95 s (247.5 s): ~302 / 109 = 2.77 s;
    # m ~30. The 100 it runs are in the used blocks already; beyond them its p99 need over
    # the horizon is a few sequences (0.6 s on: new ones Poisson(6.2), p99 13, less the 10
    # of its 100 surely ended by then), not m's p99 of 44
    assert reserve.forecast.rate_per_s == pytest.approx(11.0, abs=0.15)
    assert reserve.forecast.running == 100
    assert 2 <= reserve.blocks <= 8
    # 700 held: two more agents fit (900 <= 949.05 - 8), a third would not (1000)
    more = _fill(a, "agent", AGENT, clock.now)
    assert len(more) == 2
    assert all(not lease.released for lease in [*agents[:5], *held])  # nothing preempted


def test_prefill_hold_waits_for_the_chat_requests_first_token(tmp_path: Path) -> None:
    clock = Clock()
    core = _core(tmp_path, clock, prefill_hold_min_tokens=512)
    a = core.admitter
    chat = a.admit_now(_ctx("normal", 0.0), CHAT, 0.0)
    assert chat is not None
    short_agent = Need(prompt_tokens=300, total_tokens=400, deadline_s=1e9)
    # a long agent prefill waits while the chat request is in its prefill; a short one goes
    assert a.admit_now(_ctx("agent", 0.0), AGENT, 0.0) is None
    assert a.admit_now(_ctx("agent", 0.0), short_agent, 0.0) is not None
    clock.now = 0.05
    chat.first_token(0.05)
    assert a.admit_now(_ctx("agent", 0.05), AGENT, 0.05) is not None
    # a chat request that shows no first token (not streamed) holds for its TTFT target only
    clock.now = 1.0
    quiet = a.admit_now(_ctx("normal", 1.0), CHAT, 1.0)
    assert quiet is not None
    clock.now = 1.5
    assert a.admit_now(_ctx("agent", 1.5), AGENT, 1.5) is None
    clock.now = 1.8
    assert a.admit_now(_ctx("agent", 1.8), AGENT, 1.8) is not None  # 1.0 + 0.8 s


def test_forecast_fields_need_reserve_forecast(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="reserve: forecast"):
        config_for_test(tmp_path, admission={"headroom_horizon_s": 5})
    config: Config = config_for_test(
        tmp_path, router={"admission": "off"}, admission={"reserve": "forecast"}
    )
    assert any(p.startswith("admission:") for p in contract_problems(config))


def test_admin_pools_shows_owned_borrowed_and_the_reserve(tmp_path: Path) -> None:
    clock, core, _agents = _lent(tmp_path)
    state = core.fleet.get(SPEC.instance_id)
    assert state is not None
    by_pool = core.admitter.capacity_by_pool(state, clock.now)
    agent, normal = by_pool["agent"], by_pool["normal"]
    # 900 blocks held by the agents: their half (474.5) owned, the rest borrowed
    assert (agent["share_blocks"], agent["owned_blocks"]) == (474.5, 474.5)
    assert agent["borrowed_blocks"] == 425.5
    assert agent["owned_slots"] + agent["borrowed_slots"] == 9
    # chat holds nothing now; what is kept for it is its forecast (the model's 4 sequences
    # of 2 blocks) capped by its measured peak: one sequence, plus one
    assert (normal["owned_blocks"], normal["borrowed_blocks"]) == (0.0, 0.0)
    assert normal["reserve"]["blocks"] == 4.0 and normal["reserve"]["slots"] == 2
    assert normal["reserve"]["forecast"]["measured_blocks"] == 4
    assert normal["reserve"]["why"] == "forecast"
    assert normal["reserve"]["forecast"]["rate_per_s"] == pytest.approx(2.0, abs=0.05)
