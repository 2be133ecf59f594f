"""The admitter's view of an instance (`Admitter._views`, built positionally on the request
path, issue 28) holds each reading where `InstanceView` names it, and follows the allocation
the pool map holds now (the admitter keeps what it reads of one allocation until the map
replaces it).

One engine split half and half between `agent` and `normal`: 1000 blocks of 16 tokens (999
usable), an operating point of at most 6 sequences, a measured prefill of 4000 tokens/s at a
50 % prefix-cache hit rate (2000 uncached tokens/s), 10 blocks in use at the scrape."""

from __future__ import annotations

import random
from pathlib import Path

from pools.allocation import Allocation
from pools.launchers.base import InstanceSpec
from pools.operating_point import OperatingPoint
from pools.telemetry import InstanceReading
from pools.testing.config import config_for_test, even_pools
from router.admission.decision import InstanceView
from router.core import Core, build_core

SPEC = InstanceSpec("engine-0", "http://127.0.0.1:9", 1)


def _core(tmp_path: Path) -> Core:
    config = config_for_test(
        tmp_path,
        urls=[SPEC.url],
        pools=even_pools(
            agent={"slo": {"ttft_p95_ms": 3000, "tpot_p95_ms": 150}},
            normal={"slo": {"ttft_p95_ms": 800, "tpot_p95_ms": 80}},
        ),
        router={"kv_margin_frac": 0.05},
        rebalancer={"decision_log_path": str(tmp_path / "d.sqlite")},
    )
    core = build_core(config, [SPEC], lambda: 1.0, random.Random(0), wall_clock=lambda: 1.0)
    state = core.fleet.get(SPEC.instance_id)
    assert state is not None
    state.op = OperatingPoint(max_num_seqs=6)
    # taken at 0.5 s (fresh at 1.0), 1 % of 999 blocks in use
    reading = InstanceReading(0.5, 10 / 999, 0, 0, 1000, 16, 0, 0, 0, 0, 0, 0, 0)
    core.fleet.record_reading(SPEC.instance_id, reading)
    state.prefill_tokens_per_s, state.prefix_hit_frac = 4000.0, 0.5
    return core


def test_the_view_holds_each_reading_in_its_field(tmp_path: Path) -> None:
    core = _core(tmp_path)
    # both predicted in their prefill until 3.0
    core.fleet.acquire(SPEC.instance_id, "agent", blocks=7, prompt_tokens=100, prefill_s=2.0)
    core.fleet.acquire(SPEC.instance_id, "normal", blocks=3, prompt_tokens=40, prefill_s=2.0)
    (view,) = core.admitter._views("normal", 1.0)
    assert view == InstanceView(
        instance_id="engine-0",
        frac=0.5,
        healthy=True,
        fresh=True,
        capacity_blocks=999,
        block_size=16,
        used_blocks=20.0,  # measured 10 + 10 reserved since
        pool_reserved_blocks=3,
        pool_running=1,
        running=2,
        pool_limit=6,
        instance_limit=6,
        pending_prefill_tokens=140,
        prefill_tokens_per_s=2000.0,
        ttft_target_s=0.8,
        margin_frac=0.05,
        step_s=0.0,  # no TPOT measured, no prior
        kv_known=True,
        reserve_forecast=False,
        others_reserve_blocks=0.0,
        others_reserve_slots=0,
        hold_prefill_min_tokens=None,
    )


def test_the_views_follow_the_allocation_the_pool_map_holds_now(tmp_path: Path) -> None:
    core = _core(tmp_path)
    (before,) = core.admitter._views("normal", 1.0)
    assert before.frac == 0.5
    core.pool_map.replace(Allocation({SPEC.instance_id: {"normal": 1.0}}))
    (after,) = core.admitter._views("normal", 1.0)
    assert after.frac == 1.0
    assert core.admitter._views("agent", 1.0) == []
    core.pool_map.replace(Allocation({SPEC.instance_id: {"agent": 1.0}}))
    assert core.admitter._views("normal", 1.0) == []
    (agent,) = core.admitter._views("agent", 1.0)
    assert (agent.frac, agent.ttft_target_s) == (1.0, 3.0)
