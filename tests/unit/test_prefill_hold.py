"""The prefill hold (`admission.prefill_hold_*`): the pure rules in
`router.admission.prefill_hold`, and the admitter's synchronous core on a fake clock: the
derived threshold, the bounded wait, `gpupool_prefill_hold_seconds` and one long prefill at a
time (`prefill_hold_serial`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pools.config import ConfigError
from pools.fleet import Lease
from pools.testing.config import config_for_test
from router.admission.decision import Need
from router.admission.prefill_hold import (
    PrefillHold,
    hold_applies,
    hold_min_tokens,
    holding_target_s,
    serial_bound_s,
    serial_hold_ends,
)
from router.core import Core
from router.request import RequestContext
from tests.unit.test_forecast_admission import CHAT, SPEC, Clock, _core, _ctx, _Waiter

AUTO = PrefillHold(None, 0.025, 0.5)


def test_only_a_stricter_pool_in_its_prefill_holds() -> None:
    # (admitted at, TTFT target): chat 0.8 s admitted at 1.0, another agent (3 s) at 0.5
    leases = [(1.0, 0.8), (0.5, 3.0)]
    assert holding_target_s(leases, 3.0, 1.2) == (0.8, 1.8)
    assert holding_target_s(leases, 0.8, 1.2) is None  # chat is not held by chat
    assert holding_target_s(leases, 3.0, 1.8) is None  # chat's target passed: no hold
    assert holding_target_s([], 3.0, 1.2) is None


def test_serial_one_long_prefill_of_a_pool_no_stricter_holds() -> None:
    # (tokens to prefill, TTFT target, admitted at, predicted prefill end, streams), none
    # streamed: each holds until its predicted end; own target 3 s, 512 tokens
    agent_long = (1500, 3.0, 1.0, 1.4, False)
    agent_short = (300, 3.0, 1.0, 1.6, False)
    chat_long = (900, 0.8, 1.0, 1.7, False)
    assert serial_hold_ends([agent_long, agent_short], 3.0, 512, 1.0) == 1.4
    assert serial_hold_ends([agent_long, (600, 5.0, 1.0, 1.5, False)], 3.0, 512, 1.0) == 1.5
    assert serial_hold_ends([agent_short], 3.0, 512, 1.0) is None  # short: no hold
    assert serial_hold_ends([chat_long], 3.0, 512, 1.0) is None  # stricter: the other hold's
    assert serial_hold_ends([agent_long], 3.0, 512, 1.4) is None  # past its prefill end
    assert serial_hold_ends([], 3.0, 512, 1.0) is None


def test_a_streamed_long_prefill_holds_past_its_predicted_end_until_its_target() -> None:
    # admitted at 1.0, predicted to end at 1.4, its pool's target 3 s: streamed, it holds
    # until its first token (which takes it out of the leases in prefill) or 4.0
    streamed = (1500, 3.0, 1.0, 1.4, True)
    assert serial_hold_ends([streamed], 3.0, 512, 1.4) == 4.0
    assert serial_hold_ends([streamed], 3.0, 512, 3.99) == 4.0
    assert serial_hold_ends([streamed], 3.0, 512, 4.0) is None  # its target passed
    # with the other, not streamed, the later end counts
    assert serial_hold_ends([streamed, (900, 3.0, 1.0, 1.2, False)], 3.0, 512, 1.1) == 4.0
    assert serial_bound_s(1.0, 1.4, 3.0, streams=False) == 1.4
    assert serial_bound_s(1.0, 1.4, 3.0, streams=True) == 4.0
    # a prediction beyond the target (a slow engine) is not cut short
    assert serial_bound_s(1.0, 5.0, 3.0, streams=True) == 5.0


def test_the_threshold_is_fixed_or_the_budget_at_the_measured_rate() -> None:
    assert hold_min_tokens(PrefillHold(512, 0.025, 0.5), 0.8, None) == 512
    # 2.5 % of 800 ms = 20 ms at 40,000 tokens/s: 800 tokens
    assert hold_min_tokens(AUTO, 0.8, 40_000.0) == 800
    assert hold_min_tokens(AUTO, 0.8, None) is None  # unmeasured: no hold
    assert hold_min_tokens(AUTO, 0.8, 0.0) is None


def test_a_request_is_held_at_most_max_wait() -> None:
    assert hold_applies(AUTO, None, 5.0)
    assert hold_applies(AUTO, 5.0, 5.49)
    assert not hold_applies(AUTO, 5.0, 5.5)


def test_bad_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        PrefillHold(0, 0.025, 0.5)
    with pytest.raises(ValueError):
        PrefillHold(None, 0.0, 0.5)
    with pytest.raises(ValueError):
        PrefillHold(None, 0.025, 0.0)
    for bad, match in (
        ({"prefill_hold_min_tokens": 0}, "prefill_hold_min_tokens"),
        ({"prefill_hold_min_tokens": True}, "prefill_hold_min_tokens"),
        ({"prefill_hold_min_tokens": "always"}, "prefill_hold_min_tokens"),
        ({"prefill_hold_budget_frac": 0.1}, "without prefill_hold_min_tokens: auto"),
        (
            {"prefill_hold_min_tokens": 512, "prefill_hold_budget_frac": 0.1},
            "without prefill_hold_min_tokens: auto",
        ),
        ({"prefill_hold_max_wait_s": 1.0}, "without prefill_hold_min_tokens"),
        ({"prefill_hold_serial": True}, "prefill_hold_serial set without"),
        ({"prefill_hold_min_tokens": "auto", "prefill_hold_max_wait_s": 0}, "max_wait_s"),
    ):
        with pytest.raises(ConfigError, match=match):
            config_for_test(tmp_path, admission=bad)
    config = config_for_test(
        tmp_path, admission={"prefill_hold_min_tokens": "auto", "prefill_hold_budget_frac": 0.1}
    )
    assert config.admission.prefill_hold_min_tokens == "auto"


def _held_seconds(core: Core) -> tuple[float, float]:
    """(count, sum) of gpupool_prefill_hold_seconds for the agent pool."""
    metric = core.metrics.prefill_held.labels("agent")
    samples = {s.name: s.value for m in metric.collect() for s in m.samples}
    return samples["gpupool_prefill_hold_seconds_count"], samples[
        "gpupool_prefill_hold_seconds_sum"
    ]


def _held_until_first_token(
    core: Core, clock: Clock, need: Need, holder: Lease, first_token_s: float
) -> Lease:
    """A queued agent request, held from the first pass at 0 until `holder`'s first token at
    `first_token_s`, then admitted (its lease returned); the one hold observed for as long."""
    a = core.admitter
    waiter = _Waiter(_ctx("agent", 0.0), need)
    a.enqueue(waiter, 0.0)
    a.dispatch_once(0.0)
    clock.now = first_token_s - 0.01
    a.dispatch_once(clock.now)
    assert waiter.lease is None
    holder.first_token(first_token_s)
    clock.now = first_token_s
    a.dispatch_once(first_token_s)
    assert waiter.lease is not None
    count, total = _held_seconds(core)
    assert count == 1 and total == pytest.approx(first_token_s)
    return waiter.lease


def test_auto_holds_long_prefills_by_the_measured_rate_and_for_a_bounded_wait(
    tmp_path: Path,
) -> None:
    clock = Clock()
    core = _core(tmp_path, clock, prefill_hold_min_tokens="auto")
    a = core.admitter
    state = core.fleet.get(SPEC.instance_id)
    assert state is not None
    long_agent = Need(prompt_tokens=1500, total_tokens=1600, deadline_s=1e9)
    mid_agent = Need(prompt_tokens=900, total_tokens=1000, deadline_s=1e9)
    short_agent = Need(prompt_tokens=700, total_tokens=800, deadline_s=1e9)
    # the prefill rate unmeasured: nothing is held, chat in its prefill or not
    chat = a.admit_now(_ctx("normal", 0.0), CHAT, 0.0)
    assert chat is not None
    lease = a.admit_now(_ctx("agent", 0.0), long_agent, 0.0)
    assert lease is not None
    lease.release()
    # measured at 40,000 tokens/s: 20 ms of chat's 800 ms is 800 tokens; 900 and 1,500 wait,
    # 700 goes
    state.prefill_tokens_per_s = 40_000.0
    assert a.admit_now(_ctx("agent", 0.0), mid_agent, 0.0) is None
    assert a.admit_now(_ctx("agent", 0.0), short_agent, 0.0) is not None
    # queued, a long one is held from the first pass until chat's first token
    _held_until_first_token(core, clock, long_agent, chat, 0.04)
    # chats one after another, each in its prefill: a held request goes after 0.5 s anyway
    t = 1.0
    clock.now = t
    chat = a.admit_now(_ctx("normal", t), CHAT, t)
    assert chat is not None
    waiter = _Waiter(_ctx("agent", t), long_agent)
    a.enqueue(waiter, t)
    while waiter.lease is None:
        a.dispatch_once(clock.now)
        if waiter.lease is None:
            clock.now += 0.1
            chat.first_token(clock.now)
            chat = a.admit_now(_ctx("normal", clock.now), CHAT, clock.now)
            assert chat is not None
    assert clock.now == pytest.approx(1.5)
    count, total = _held_seconds(core)
    assert count == 2 and total == pytest.approx(0.04 + 0.5)


def test_serial_lets_one_long_agent_prefill_run_at_a_time(tmp_path: Path) -> None:
    long_agent = Need(prompt_tokens=1500, total_tokens=1600, deadline_s=1e9)
    short_agent = Need(prompt_tokens=300, total_tokens=400, deadline_s=1e9)
    # without serial, a second long agent prefill starts beside the first
    clock = Clock()
    core = _core(tmp_path, clock, prefill_hold_min_tokens=512)
    state = core.fleet.get(SPEC.instance_id)
    assert state is not None
    state.prefill_tokens_per_s = 10_000.0
    a = core.admitter
    assert a.admit_now(_ctx("agent", 0.0), long_agent, 0.0) is not None
    assert a.admit_now(_ctx("agent", 0.0), long_agent, 0.0) is not None
    # with it: the second waits until the first's first token
    clock = Clock()
    core = _core(tmp_path, clock, prefill_hold_min_tokens=512, prefill_hold_serial=True)
    state = core.fleet.get(SPEC.instance_id)
    assert state is not None
    state.prefill_tokens_per_s = 10_000.0  # 1,500 tokens: 0.15 s predicted
    a = core.admitter
    first = a.admit_now(_ctx("agent", 0.0), long_agent, 0.0)
    assert first is not None
    assert a.admit_now(_ctx("agent", 0.0), long_agent, 0.0) is None
    assert a.admit_now(_ctx("agent", 0.0), short_agent, 0.0) is not None  # short: goes
    chat = a.admit_now(_ctx("normal", 0.0), CHAT, 0.0)  # the stricter pool is not held
    assert chat is not None
    chat.first_token(0.0)
    second = _held_until_first_token(core, clock, long_agent, first, 0.06)
    # a streamed one (admitted at 0.06) holds past its predicted prefill end (0.21) until its
    # first token, however late
    clock.now = 1.0
    assert a.admit_now(_ctx("agent", 1.0), long_agent, 1.0) is None
    second.first_token(1.0)
    first.release()  # the two first ones are done: room in the agent pool's half
    second.release()
    assert a.admit_now(_unstreamed("agent"), long_agent, 1.0) is not None
    # one that shows no first token (not streamed) holds until its predicted prefill end
    # (admitted at 1.0, 0.15 s); its release ends the hold at once
    clock.now = 1.1
    assert a.admit_now(_ctx("agent", 1.1), long_agent, 1.1) is None
    clock.now = 1.16
    assert a.admit_now(_unstreamed("agent"), long_agent, 1.16) is not None
    clock.now = 1.4  # that one's prefill ended at 1.31
    quiet = a.admit_now(_unstreamed("agent"), long_agent, 1.4)
    assert quiet is not None
    assert a.admit_now(_ctx("agent", 1.4), long_agent, 1.4) is None
    quiet.release()
    assert a.admit_now(_ctx("agent", 1.4), long_agent, 1.4) is not None


def _unstreamed(pool: str) -> RequestContext:
    return dataclasses.replace(_ctx(pool, 0.0), stream=False)
