"""Prefix caches in the simulator (router/simulate/prefix.py): the modelled caches, the shared
prefixes a scenario draws, and placement by cached prefix through the router's own picker and
`router.prefix.score` (not a copy of it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pools.config import Config
from pools.testing.config import config_for_test, one_pool
from router.admission import picking
from router.prefix.score import cached_prefix_scores
from router.simulate.model import LatencyModel
from router.simulate.prefix import EnginePrefixCache, PromptChain
from router.simulate.prompts import PromptMaker
from router.simulate.scenario import ScenarioError, parse_scenario
from router.simulate.sim import SimResult, simulate, summarize
from router.simulate.workload import build_plan

# prefill is what a cached prefix saves: slow enough that a miss shows in TTFT
LATENCY = LatencyModel(tpot_intercept_s=0.01, tpot_slope_s=0.002, prefill_tokens_per_s=4000)
SHARED: dict[str, Any] = {
    "name": "tenants",
    "seed": 3,
    "duration_s": 60,
    "drain_timeout_s": 60,
    "classes": {
        "normal": {
            "kind": "chat",
            "arrivals": {"process": "poisson", "rate_per_s": 3.0},
            "prompt_tokens": {"dist": "fixed", "value": 100},
            "output_tokens": {"dist": "fixed", "value": 16},
            "shared_prefix": {
                "tenants": 12,
                "tokens": {"dist": "uniform", "low": 1500, "high": 3000},
            },
        },
        "agent": {
            "kind": "agent",
            "arrivals": {"process": "poisson", "rate_per_s": 0.2},
            "steps": {"dist": "fixed", "value": 3},
            "prompt_tokens": {"dist": "fixed", "value": 300},
            "output_tokens": {"dist": "fixed", "value": 32},
            "tool_result_tokens": {"dist": "fixed", "value": 100},
            "tool_wait_ms": {"dist": "fixed", "value": 200},
            "max_context_tokens": 8000,
        },
    },
}


def test_prompt_chain_shares_the_tenants_blocks_then_its_own() -> None:
    a = PromptChain(("normal", 1), 3, ("normal", 7), 16)
    b = PromptChain(("normal", 1), 3, ("normal", 8), 16)
    assert a.keys(15) == []  # a partial block is not cached
    assert a.keys(80)[:3] == b.keys(80)[:3] and a.keys(80)[3:] != b.keys(80)[3:]
    assert len(a.keys(80)) == 5 and a.keys(40) == a.keys(80)[:2]
    run = PromptChain(None, 0, ("agent", ("run", 4)), 16)
    assert run.keys(64) == run.keys(128)[:4]  # a run's next step extends its context


def test_engine_cache_reuses_up_to_the_first_miss_and_evicts_the_oldest() -> None:
    cache = EnginePrefixCache(4)
    cache.store(["a", "b", "c"])
    assert cache.held(["a", "b", "c", "d"]) == 3 and cache.held(["z", "a"]) == 0
    cache.store(["a"])  # touched: now the newest
    cache.store(["x", "y"])  # 5 keys: "b", the oldest, goes
    assert len(cache) == 4 and cache.held(["a", "b"]) == 1 and cache.held(["c"]) == 1
    with pytest.raises(ValueError, match="capacity_blocks"):
        EnginePrefixCache(0)


def test_shared_prefix_plan_leaves_other_classes_as_they_were() -> None:
    plain = {**SHARED, "classes": {**SHARED["classes"]}}
    plain["classes"]["normal"] = {
        k: v for k, v in SHARED["classes"]["normal"].items() if k != "shared_prefix"
    }
    with_prefix = build_plan(parse_scenario(SHARED), PromptMaker())
    without = build_plan(parse_scenario(plain), PromptMaker())
    assert with_prefix.runs == without.runs  # the agent class draws what it did
    assert [c.t_s for c in with_prefix.chat] == [c.t_s for c in without.chat]
    by_tenant: dict[int, set[str]] = {}
    for c, bare in zip(with_prefix.chat, without.chat, strict=True):
        assert c.tenant is not None and 1500 <= c.prefix_tokens <= 3000
        assert c.prompt_tokens == bare.prompt_tokens + c.prefix_tokens
        assert c.prompt_text.endswith(bare.prompt_text)
        by_tenant.setdefault(c.tenant, set()).add(c.prompt_text[: -len(bare.prompt_text)])
    assert len(by_tenant) == 12 and all(len(texts) == 1 for texts in by_tenant.values())


def test_shared_prefix_is_validated() -> None:
    bad = {**SHARED, "classes": {"normal": {**SHARED["classes"]["normal"]}}}
    bad["classes"]["normal"]["shared_prefix"] = {
        "tenants": 0,
        "tokens": {"dist": "fixed", "value": 9},
    }
    with pytest.raises(ScenarioError, match=r"shared_prefix\.tenants"):
        parse_scenario(bad)


def _config(tmp_path: Path, kv_events: bool) -> Config:
    """One pool over the three engines: every request has all three to choose from."""
    return config_for_test(tmp_path, pools=one_pool(), engines={"kv_events": kv_events})


def _run(config: Config) -> SimResult:
    plan = build_plan(parse_scenario(SHARED), PromptMaker(write_text=False))
    return simulate(
        config, plan, LATENCY, capacity_blocks=1000, block_size_tokens=16, prefix_cache=True
    )


def _ttft_p90(result: SimResult) -> float:
    return float(np.percentile([r["ttft_s"] for r in result.requests if r["ttft_s"]], 90))


def test_placement_by_cached_prefix_runs_the_routers_score(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same workload with the router following KV events and without: with, the picker's
    `score_cached_prefix` scores every homeless request through `router.prefix.score`, the
    engines find far more of their prompts cached, and TTFT p90 drops."""
    scored: list[int] = []
    real = cached_prefix_scores  # the function `picking` calls by that name

    def counting(*args: Any, **kwargs: Any) -> list[float]:
        scored.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(picking, "cached_prefix_scores", counting)
    config = _config(tmp_path, kv_events=True)
    on = _run(config)
    homeless = (
        len(on.requests) - sum(1 for r in on.requests if r["class"] == "agent") + len(on.runs)
    )
    # each pick among two or more instances left by the filters (one left: no scoring)
    assert homeless >= len(scored) > homeless / 2 > 50
    scored.clear()
    off = _run(_config(tmp_path, kv_events=False))
    assert scored == []  # no lookup: the scorer has no opinion, as in the router
    assert on.prefix is not None and off.prefix is not None
    assert on.prefix["lookups"] > 100 and off.prefix["lookups"] == 0
    hit_on = on.prefix["cached_tokens"] / on.prefix["prompt_tokens"]
    hit_off = off.prefix["cached_tokens"] / off.prefix["prompt_tokens"]
    assert hit_on > 0.8 and hit_on > hit_off + 0.1, (hit_on, hit_off)
    assert _ttft_p90(on) < 0.8 * _ttft_p90(off), (_ttft_p90(on), _ttft_p90(off))
    assert summarize(on, config)["prefix_cache"]["hit_frac"] == round(hit_on, 4)
    assert not any(r["rejected"] for r in on.requests)
