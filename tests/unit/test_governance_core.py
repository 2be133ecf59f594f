"""The pure cores of governance: the token bucket, the sliding window, run guards, loop
detection, the rate-limit headers and which limits apply. Simulated time throughout."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pools.testing.config import config_for_test
from router.governance.bucket import TokenBucket, WindowSum
from router.governance.guards import RunLimits, RunState, Stop, check_step
from router.governance.headers import format_duration, rate_limit_headers
from router.governance.limits import run_limits, tenant_limits
from router.governance.loops import repeated_tool_call, tool_calls_signature

# ------------------------------------------------------------------------------ token bucket


def test_bucket_reserves_waits_and_refills_at_its_rate() -> None:
    b = TokenBucket(600, 10, now_s=0.0)  # 600 a minute: 10 a second, one minute of burst
    assert b.try_reserve(500, 0.0)
    assert b.level(0.0) == pytest.approx(100)
    assert not b.try_reserve(300, 0.0)
    assert b.wait_s(300, 0.0) == pytest.approx(20.0)  # 200 short at 10 a second
    assert not b.try_reserve(300, 19.9)
    assert b.try_reserve(300, 20.0)
    assert b.reset_s(20.0) == pytest.approx(60.0)  # empty: a whole minute to fill


def test_bucket_settle_gives_back_the_unused_part_and_takes_an_overrun() -> None:
    b = TokenBucket(1000, 1, now_s=0.0)
    b.try_reserve(400, 0.0)
    b.settle(400, 150, 0.0)  # used 150 of the 400 reserved
    assert b.level(0.0) == pytest.approx(850)
    b.try_reserve(100, 0.0)
    b.settle(100, 300, 0.0)  # used more than it reserved
    assert b.level(0.0) == pytest.approx(550)
    b.settle(0, 0, 0.0)
    b.settle(10_000, 0, 0.0)  # never above capacity
    assert b.level(0.0) == pytest.approx(1000)


def test_an_oversized_reservation_waits_for_a_full_bucket_then_goes_into_debt() -> None:
    b = TokenBucket(100, 10, now_s=0.0)
    b.try_reserve(50, 0.0)
    assert b.wait_s(250, 0.0) == pytest.approx(5.0)  # until full, not until 250 (never)
    assert b.try_reserve(250, 5.0)
    assert b.level(5.0) == pytest.approx(-150)
    assert b.wait_s(10, 5.0) == pytest.approx(16.0)


def test_set_rate_keeps_the_level_within_the_new_capacity() -> None:
    b = TokenBucket(600, 10, now_s=0.0)
    b.set_rate(300, 5, 0.0)
    assert b.level(0.0) == 300 and b.rate_per_s == 5
    with pytest.raises(ValueError):
        TokenBucket(0, 1, now_s=0.0)


_request = st.tuples(
    st.floats(0.0, 5.0),  # gap before it, seconds
    st.integers(1, 400),  # estimate reserved
    st.floats(0.0, 1.5),  # used / reserved
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_request, min_size=1, max_size=80))
def test_bucket_never_lets_more_than_burst_plus_rate_through(reqs: list[Any]) -> None:
    """Over any horizon T the tokens settled are at most capacity + rate * T (plus one
    oversized reservation's overrun), reserved - settled is 0 once all settled, and a
    request refused now is admitted exactly after `wait_s`."""
    capacity, rate = 1000.0, 20.0
    b = TokenBucket(capacity, rate, now_s=0.0)
    now = 0.0
    used_total = 0.0
    reserved_total = settled_back = 0.0
    overrun = 0.0
    for gap, estimate, used_frac in reqs:
        now += gap
        wait = b.wait_s(estimate, now)
        if wait > 0:
            assert not b.try_reserve(estimate, now)
            now += wait
        assert b.try_reserve(estimate, now)
        used = round(estimate * used_frac)
        b.settle(estimate, used, now)
        reserved_total += estimate
        settled_back += estimate - used
        used_total += used
        overrun = max(overrun, used - min(estimate, capacity))
    assert reserved_total - (settled_back + used_total) == pytest.approx(0.0)
    assert used_total <= capacity + rate * now + overrun + 1e-6


# ------------------------------------------------------------------------------ window sum


def test_window_sum_forgets_what_left_the_window() -> None:
    w = WindowSum(3600.0, buckets=60)  # one-minute slices
    w.add(10.0, 0.0)
    w.add(5.0, 1800.0)
    assert w.total(3540.0) == pytest.approx(15.0)
    assert w.total(3600.0) == pytest.approx(5.0)  # the first minute left at 3600 s
    assert w.total(5400.0) == pytest.approx(0.0)
    w.add(8.0, 6000.0)
    w.add(8.0, 6030.0)  # same slice
    assert w.wait_below_s(10.0, 6030.0) == pytest.approx(3600 - 30.0)
    assert w.wait_below_s(100.0, 6030.0) == 0.0


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 900.0), st.floats(0.0, 50.0)), max_size=60))
def test_window_sum_equals_the_sum_of_its_live_slices(adds: list[tuple[float, float]]) -> None:
    w = WindowSum(3600.0, buckets=60)
    now = 0.0
    events = []
    for gap, amount in adds:
        now += gap
        w.add(amount, now)
        events.append((now, amount))
        first_live_slice = math.floor(now / 60.0) - 59
        expected = sum(a for t, a in events if math.floor(t / 60.0) >= first_live_slice)
        assert w.total(now) == pytest.approx(expected, abs=1e-6)


# ------------------------------------------------------------------------------ run guards


def _run(**kw: Any) -> RunState:
    limits = RunLimits(
        max_steps=kw.pop("max_steps", 50),
        max_tokens=kw.pop("max_tokens", None),
        max_gpu_seconds=kw.pop("max_gpu_seconds", None),
        max_duration_s=kw.pop("max_duration_s", 600.0),
        loop_repeats=3,
    )
    return RunState(run_id="r1", started_at_s=0.0, last_seen_s=0.0, limits=limits, **kw)


def test_the_51st_step_is_refused_and_the_50th_is_not() -> None:
    assert check_step(_run(steps=49), 1.0, None) is None
    stop = check_step(_run(steps=50), 1.0, None)
    assert stop is not None and stop.code == "run_steps" and "50 steps" in stop.message


@pytest.mark.parametrize(
    ("state", "now_s", "loop", "code"),
    [
        ({"max_duration_s": 600.0}, 600.0, None, "run_duration"),
        ({"max_duration_s": 600.0}, 599.9, None, None),
        ({}, 1.0, "read_file", "run_loop"),
        ({"max_tokens": 1000, "tokens": 1000}, 1.0, None, "run_tokens"),
        ({"max_tokens": 1000, "tokens": 999}, 1.0, None, None),
        ({"max_gpu_seconds": 2.0, "gpu_seconds": 2.5}, 1.0, None, "run_gpu_seconds"),
        ({"max_steps": None, "max_duration_s": None, "steps": 10**6}, 1e9, None, None),
    ],
)
def test_each_guard_stops_at_its_limit(
    state: dict[str, Any], now_s: float, loop: str | None, code: str | None
) -> None:
    stop = check_step(_run(**state), now_s, loop)
    assert (stop.code if stop else None) == code


def test_a_stopped_run_stays_stopped_with_its_first_reason() -> None:
    run = _run()
    run.stopped = Stop("run_loop", "looping")
    assert check_step(run, 1.0, None) == Stop("run_loop", "looping")


# ------------------------------------------------------------------------------ loops


def _call(name: str, args: str, role: str = "assistant") -> dict[str, Any]:
    return {
        "role": role,
        "content": None,
        "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": name, "arguments": args}}
        ],
    }


_RESULT = {"role": "tool", "tool_call_id": "x", "content": "ok"}
_USER = {"role": "user", "content": "go"}


def test_three_identical_tool_calls_in_a_row_are_a_loop() -> None:
    same = _call("read_file", '{"path": "a.py", "lines": [1, 2]}')
    reordered = _call("read_file", '{"lines":[1,2],"path":"a.py"}')  # same arguments
    history = [_USER, same, _RESULT, same, _RESULT, reordered, _RESULT]
    assert repeated_tool_call(history, 3) == "read_file"
    assert repeated_tool_call(history[:5], 3) is None  # only two so far
    assert repeated_tool_call(history, 4) is None


def test_different_arguments_or_a_plain_answer_break_the_streak() -> None:
    a = _call("read_file", '{"path": "a.py"}')
    b = _call("read_file", '{"path": "b.py"}')
    answer = {"role": "assistant", "content": "done"}
    assert repeated_tool_call([a, _RESULT, a, _RESULT, b, _RESULT], 3) is None
    assert repeated_tool_call([a, a, answer, a, a], 3) is None
    assert repeated_tool_call([a, a, a, _USER], 3) == "read_file"  # a user turn does not


def test_malformed_history_never_raises_and_never_loops() -> None:
    junk: list[Any] = [None, 3, {"role": "assistant", "tool_calls": "x"}, {"role": "assistant"}]
    assert repeated_tool_call(junk * 3, 3) is None
    assert tool_calls_signature({"role": "assistant", "tool_calls": [{"function": {}}]}) is None
    assert repeated_tool_call([_call("f", "{not json")] * 3, 3) == "f"  # same raw text
    assert repeated_tool_call([_call("f", "{}")] * 5, 0) is None  # 0: off


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from(["a", "b", "c"]), max_size=8),
    st.integers(0, 6),
    st.integers(2, 5),
)
def test_loop_detected_exactly_when_the_last_n_calls_are_the_same(
    prefix: list[str], tail: int, repeats: int
) -> None:
    """History: calls named by `prefix`, then `tail` calls of "z" (tool results between)."""
    names = [*prefix, *["z"] * tail]
    history: list[Any] = [_USER]
    for name in names:
        history += [_call(name, '{"k": 1}'), _RESULT]
    streak = 0
    for name in reversed(names):
        if name != names[-1]:
            break
        streak += 1
    expected = names[-1] if names and streak >= repeats else None
    assert repeated_tool_call(history, repeats) == expected


# ------------------------------------------------------------------------------ headers


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0, "0ms"), (0.25, "250ms"), (1.5, "1.5s"), (59.9991, "60s"), (360.0, "6m0s"),
     (3723.0, "1h2m3s"), (-3.0, "0ms")],
)  # fmt: skip
def test_reset_durations_read_like_openais(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_rate_limit_headers_say_limit_remaining_and_reset() -> None:
    tokens = TokenBucket(6000, 100, now_s=0.0)
    requests = TokenBucket(60, 1, now_s=0.0)
    tokens.try_reserve(1500, 0.0)
    requests.try_reserve(1, 0.0)
    headers = dict(rate_limit_headers(requests, tokens, 0.0))
    assert headers == {
        b"x-ratelimit-limit-requests": b"60",
        b"x-ratelimit-remaining-requests": b"59",
        b"x-ratelimit-reset-requests": b"1s",
        b"x-ratelimit-limit-tokens": b"6000",
        b"x-ratelimit-remaining-tokens": b"4500",
        b"x-ratelimit-reset-tokens": b"15s",
    }
    assert rate_limit_headers(None, None, 0.0) == []


# ------------------------------------------------------------------------------ limits


def test_tiers_set_concurrency_and_weight_and_the_tenant_overrides_runs() -> None:
    config = config_for_test(
        tenants=[
            {"name": "f", "tier": "free"},
            {"name": "p", "tier": "paid", "max_concurrent_runs": 5},
            {"name": "e", "tier": "enterprise"},
            {"name": "n"},
        ]
    )
    f, p, e, n = (tenant_limits(config, t) for t in config.tenants)
    assert (f.max_concurrent_runs, p.max_concurrent_runs, e.max_concurrent_runs) == (1, 5, 10)
    assert (f.queue_weight, p.queue_weight, e.queue_weight) == (1.0, 2.0, 4.0)
    assert n.max_concurrent_runs is None and n.max_concurrent_requests is None


def test_run_guards_layer_class_then_tenant_then_task_type() -> None:
    config = config_for_test(
        classes={
            "agent": {"timeout_s": 600, "run_guards": {"max_steps": 20, "max_tokens": 9000}},
            "normal": {"timeout_s": 120},
        },
        tenants=[
            {"name": "t", "run_guards": {"max_steps": 80}, "task_type": "short"},
            {"name": "u"},
        ],
    )
    t, u = config.tenants
    assert run_limits(config, "agent", u, None) == RunLimits(20, 9000, None, 3600.0, 3)
    assert run_limits(config, "agent", t, None) == RunLimits(80, 9000, None, 180.0, 3)
    assert run_limits(config, "agent", t, "long").max_duration_s == 1800.0
    assert (
        run_limits(config, "normal", u, None) == RunLimits()
    )  # the defaults: 500 steps, 1 h active


def test_unknown_tier_or_task_type_is_a_config_error() -> None:
    from pools.config import ConfigError

    with pytest.raises(ConfigError, match="tier 'gold'"):
        config_for_test(tenants=[{"name": "t", "tier": "gold"}])
    with pytest.raises(ConfigError, match="task_type 'huge'"):
        config_for_test(tenants=[{"name": "t", "task_type": "huge"}])
    config = config_for_test(
        governance={"tiers": {"gold": {"max_concurrent_runs": 7, "max_concurrent_requests": 9}}},
        tenants=[{"name": "t", "tier": "gold"}],
    )
    assert tenant_limits(config, config.tenants[0]).max_concurrent_runs == 7


# ------------------------------------------------------------------------------ borrowing


def test_only_an_idle_lender_lends_and_keeps_half_its_bucket() -> None:
    from router.governance.borrowing import LenderView, lendable, pick_lender

    idle = LenderView("idle", level=900, capacity=1000, idle=True)
    busy = LenderView("busy", level=1000, capacity=1000, idle=False)
    low = LenderView("low", level=550, capacity=1000, idle=True)
    assert lendable(idle) == 400 and lendable(busy) == 0 and lendable(low) == 50
    assert pick_lender(300, [busy, low, idle]) == "idle"
    assert pick_lender(401, [busy, low, idle]) is None  # nobody can lend that much
    assert pick_lender(40, [low]) == "low"
    assert pick_lender(40, []) is None
