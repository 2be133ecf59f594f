"""The pure admission decision: KV headroom (pool share and instance), the operating point,
the TTFT prediction, stale telemetry, the one-alone rule and deadlines."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.admission import decision
from router.admission.decision import Grant, InstanceView, Need, Reject, Wait, decide, fit_reason

BASE = InstanceView(
    instance_id="engine-0",
    frac=1.0,
    healthy=True,
    fresh=True,
    capacity_blocks=100,
    block_size=16,
    used_blocks=0.0,
    pool_reserved_blocks=0,
    pool_running=0,
    running=0,
    pool_limit=8,
    instance_limit=8,
    pending_prefill_tokens=0,
    prefill_tokens_per_s=None,
    ttft_target_s=1.0,
    margin_frac=0.05,
)
NEED = Need(prompt_tokens=100, total_tokens=160, deadline_s=100.0)  # 10 blocks of 16


def test_fits_on_an_empty_instance() -> None:
    assert fit_reason(BASE, NEED) is None
    assert decide([BASE], NEED, 0.0) == Grant(("engine-0",))


def test_kv_instance_budget_counts_margin() -> None:
    # 95 usable blocks: 85 used + 10 fits exactly, 86 + 10 does not
    assert fit_reason(replace(BASE, used_blocks=85.0, pool_running=1, running=1), NEED) is None
    assert fit_reason(replace(BASE, used_blocks=86.0, pool_running=1, running=1), NEED) == "kv"
    # the instance check applies even to a pool with nothing running there
    assert fit_reason(replace(BASE, used_blocks=90.0), NEED) == "kv"


def test_kv_pool_share_on_a_split_instance() -> None:
    split = replace(BASE, frac=0.25, pool_running=1, running=1)
    # the pool's part: 0.25 x 95 = 23.75 blocks
    assert fit_reason(replace(split, pool_reserved_blocks=13, used_blocks=13), NEED) is None
    assert fit_reason(replace(split, pool_reserved_blocks=14, used_blocks=14), NEED) == "kv"


def test_a_pool_alone_may_exceed_its_share_but_not_the_instance() -> None:
    big = Need(prompt_tokens=500, total_tokens=800, deadline_s=100.0)  # 50 blocks
    split = replace(BASE, frac=0.25)
    assert fit_reason(split, big) is None  # nothing of the pool runs there: served alone
    assert fit_reason(replace(split, pool_running=1, running=1, pool_reserved_blocks=1), big) == (
        "kv"
    )
    assert fit_reason(replace(split, used_blocks=60.0, running=2), big) == "kv"


def test_operating_point_for_the_pool_and_the_instance() -> None:
    at_limit = replace(BASE, pool_running=8, running=8)
    assert fit_reason(at_limit, NEED) == "operating_point"
    assert fit_reason(replace(at_limit, pool_running=7, running=7), NEED) is None
    # split: each pool keeps its share of the strictest limit
    split = replace(BASE, frac=0.5, pool_limit=20, instance_limit=8)
    assert fit_reason(replace(split, pool_running=4, running=4), NEED) == "operating_point"
    assert fit_reason(replace(split, pool_running=3, running=7), NEED) is None
    # the other pool filled the instance: even a pool with nothing running waits
    assert fit_reason(replace(split, pool_running=0, running=8), NEED) == "operating_point"


def test_ttft_prediction_from_the_prefill_rate() -> None:
    busy = replace(BASE, pool_running=1, running=1, prefill_tokens_per_s=1000.0)
    assert fit_reason(replace(busy, pending_prefill_tokens=900), NEED) is None  # 1.0 s
    assert fit_reason(replace(busy, pending_prefill_tokens=901), NEED) == "ttft"
    # with nothing of the pool running there is no one to wait behind
    assert fit_reason(replace(busy, pool_running=0, pending_prefill_tokens=5000), NEED) is None


def test_stale_or_unknown_capacity_counts_as_full() -> None:
    assert fit_reason(replace(BASE, fresh=False), NEED) == "stale"
    assert fit_reason(replace(BASE, capacity_blocks=0), NEED) == "stale"
    assert decide([replace(BASE, fresh=False)], NEED, 0.0) == Wait("stale")


def test_grant_lists_only_instances_that_fit() -> None:
    full = replace(BASE, instance_id="engine-1", used_blocks=95.0, running=3, pool_running=3)
    assert decide([BASE, full], NEED, 0.0) == Grant(("engine-0",))
    assert decide([full], NEED, 0.0) == Wait("kv")


def test_unhealthy_everywhere_rejects_no_instance() -> None:
    result = decide([replace(BASE, healthy=False)], NEED, 0.0)
    assert isinstance(result, Reject) and result.code == "no_instance"


def test_deadline_unmeetable_up_front() -> None:
    slow = replace(BASE, prefill_tokens_per_s=10.0, pending_prefill_tokens=0)  # 10 s prefill
    result = decide([slow], replace(NEED, deadline_s=5.0), 0.0)
    assert isinstance(result, Reject) and result.code == "deadline_unmeetable"
    full = replace(BASE, used_blocks=95.0, running=1, pool_running=1)
    waiting = decide([full], replace(NEED, deadline_s=5.0), 0.0, queue_wait_s=6.0)
    assert isinstance(waiting, Reject) and waiting.code == "deadline_unmeetable"
    assert decide([full], replace(NEED, deadline_s=5.0), 0.0, queue_wait_s=4.0) == Wait("kv")


@given(
    used=st.floats(0, 200),
    reserved=st.integers(0, 200),
    running=st.integers(0, 20),
    frac=st.floats(0.05, 1.0),
    total=st.integers(1, 3000),
)
def test_a_grant_never_overfills_the_instance(
    used: float, reserved: int, running: int, frac: float, total: int
) -> None:
    view = replace(
        BASE,
        used_blocks=used,
        pool_reserved_blocks=min(reserved, int(used)),
        pool_running=running,
        running=running,
        frac=frac,
    )
    need = Need(prompt_tokens=total, total_tokens=total, deadline_s=1e9)
    blocks = -(-total // 16)
    if fit_reason(view, need) is None:
        assert used + blocks <= 95.0 + 1e-9
        assert running < 8
        if running > 0:
            assert view.pool_reserved_blocks + blocks <= frac * 95.0 + 1e-9


def test_a_cached_prefix_saves_prefill_time_not_blocks() -> None:
    busy = replace(BASE, pool_running=1, running=1, prefill_tokens_per_s=100.0)
    step = Need(
        prompt_tokens=150,
        total_tokens=160,
        deadline_s=100.0,
        cached_on="engine-0",
        cached_tokens=100,
    )
    assert step.prefill_tokens("engine-0") == 50 and step.prefill_tokens("engine-1") == 150
    # 150 tokens at 100/s is 1.5 s, over the 1 s target; the 50 uncached ones fit
    assert fit_reason(busy, replace(step, cached_on=None)) == "ttft"
    assert fit_reason(busy, step) is None
    elsewhere = replace(busy, instance_id="engine-1")
    assert fit_reason(elsewhere, step) == "ttft"
    # the blocks are the whole sequence's either way (vLLM counts a cache hit's blocks as used)
    full = replace(busy, used_blocks=86.0)
    assert fit_reason(full, step) == "kv"


def test_a_deadline_shorter_than_one_engine_step_is_unmeetable() -> None:
    # prefill of 100 tokens at 100k tok/s is 1 ms, but the first token also needs one engine
    # step (20 ms here): a 5 ms deadline cannot be met, a 50 ms one can
    fast = replace(BASE, prefill_tokens_per_s=100_000.0, step_s=0.020)
    short = decide([fast], replace(NEED, deadline_s=0.005), 0.0)
    assert isinstance(short, Reject) and short.code == "deadline_unmeetable"
    assert decide([fast], replace(NEED, deadline_s=0.050), 0.0) == Grant(("engine-0",))
    # unmeasured step: only the prefill counts (1 ms fits 5 ms)
    unmeasured = replace(fast, step_s=0.0)
    assert decide([unmeasured], replace(NEED, deadline_s=0.005), 0.0) == Grant(("engine-0",))


def test_fill_is_the_fullest_of_kv_batch_and_the_pools_part() -> None:
    """The cached-prefix score's cooling input (router/prefix/score.py)."""
    assert decision.fill_frac(BASE) == 0.0
    assert decision.fill_frac(replace(BASE, used_blocks=30.0, running=4, pool_running=4)) == 0.5
    assert decision.fill_frac(replace(BASE, used_blocks=90.0, running=1, pool_running=1)) == 0.9
    assert (
        decision.fill_frac(replace(BASE, frac=0.5, running=3, pool_running=3)) == 0.75
    )  # of 4 slots
    assert decision.fill_frac(replace(BASE, used_blocks=90.0, kv_known=False)) == 0.0
    assert decision.fill_frac(replace(BASE, fresh=False)) == 1.0  # stale telemetry counts as full
    assert decision.fill_frac(replace(BASE, healthy=False)) == 1.0
    assert decision.fill_frac(replace(BASE, running=20, pool_running=20)) == 1.0


def test_prefill_is_the_indexs_uncached_tokens_where_the_index_is_exact() -> None:
    """Issue 27 item 4: where the instance's KV-event index is exact, predicted prefill is the
    prompt's exact tokens less those cached there; elsewhere the run's hit estimate or all."""
    prefix = decision.CachedPrefix(1000, {"a": 768, "b": 512, "c": 256}, frozenset({"a", "c"}))
    need = Need(990, 1100, 1e9, cached_on="b", cached_tokens=300, prefix=prefix)
    assert need.prefill_tokens("a") == 232  # exact: 1000 - 768
    assert need.prefill_tokens("b") == 690  # inexact index: the run's home estimate, 990 - 300
    assert need.prefill_tokens("c") == 744
    assert need.prefill_tokens("d") == 990  # no index, not home: all of it
    assert replace(need, prefix=None).prefill_tokens("a") == 990
    view = replace(BASE, instance_id="a", prefill_tokens_per_s=100.0)
    assert decision.predicted_ttft_s(view, need) == pytest.approx(2.32)
    assert decision.predicted_ttft_s(replace(view, instance_id="d"), need) == pytest.approx(9.9)
