"""Placement by cached prefix (issue 27): the picker's `score_cached_prefix` over synthetic
lookups (`decision.fill_frac`: test_admission.py), `PrefixLookup` over a fake index, and
`x-gpupool-cached-tokens` on the response through the request path to fake engines. No vLLM
import."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from pools.allocation import plan_allocation
from pools.fleet import Fleet
from pools.launchers.base import InstanceSpec
from pools.telemetry import InstanceReading, parse_vllm_metrics
from pools.testing.config import config_for_test, one_pool
from pools.testing.fake_engine import FakeEngineState
from pools.testing.gateway import gateway_over_fakes
from router.admission.decision import CachedPrefix
from router.admission.picking import Candidate, Picker, PickRequest, RunAffinity, default_picker
from router.prefix.hashing import DEFAULT_SEED, chain_keys
from router.prefix.lookup import ASYNC_CHARS, PrefixLookup

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


def _reading(kv: float) -> InstanceReading:
    return InstanceReading(0.0, kv, 0, 0, 100, 16, 0, 0, 0, 0, 0, 0, 0)


def _picker(placement: str = "always_affinity") -> tuple[Picker, list[Candidate], RunAffinity]:
    """Three instances e0 (KV 0 %), e1 (10 %), e2 (20 %): without a lookup e0 wins."""
    specs = [InstanceSpec(f"e{i}", f"http://e{i}", 1) for i in range(3)]
    fleet = Fleet(specs, stale_after_s=5.0, clock=lambda: 0.0)
    for i in range(3):
        fleet.record_reading(f"e{i}", _reading(0.1 * i))
    affinity = RunAffinity()
    picker = default_picker(fleet, affinity, random.Random(0), placement=placement)
    cands = picker.candidates(plan_allocation(fleet.capacity_gpus(), {"normal": 1.0}), "normal")
    return picker, cands, affinity


def _pick(picker: Picker, cands: list[Candidate], run: str | None = None, **fields: Any) -> str:
    chosen = picker.pick(PickRequest("normal", run, **fields), cands)
    assert chosen is not None
    return str(chosen.instance_id)


FILL = {"e0": 0.0, "e1": 0.1, "e2": 0.2}


def test_a_request_without_a_home_goes_where_its_prefix_is_cached() -> None:
    picker, cands, _ = _picker()
    assert _pick(picker, cands) == "e0"
    prefix = CachedPrefix(1000, {"e0": 0, "e1": 0, "e2": 896})
    assert _pick(picker, cands, prefix=prefix, fill_frac=FILL) == "e2"
    # nothing cached anywhere, or no usable index: as without the lookup
    assert _pick(picker, cands, prefix=CachedPrefix(1000, {}), fill_frac=FILL) == "e0"
    nothing = CachedPrefix(1000, {"e0": 0, "e1": 0, "e2": 0})
    assert _pick(picker, cands, prefix=nothing, fill_frac=FILL) == "e0"


def test_a_hot_instance_loses_its_pull_and_a_full_one_gets_none() -> None:
    """The cooling: past 80 % fill the cache's pull fades; at full it is gone, so the request
    prefills on the idle instance instead of piling onto the hot one."""
    picker, cands, _ = _picker()
    prefix = CachedPrefix(1000, {"e0": 0, "e1": 0, "e2": 1000})
    assert _pick(picker, cands, prefix=prefix, fill_frac={**FILL, "e2": 0.8}) == "e2"
    assert _pick(picker, cands, prefix=prefix, fill_frac={**FILL, "e2": 1.0}) == "e0"
    assert _pick(picker, cands, prefix=prefix, fill_frac={**FILL, "e2": 0.99}) == "e0"
    assert _pick(picker, cands, prefix=prefix, fill_frac={"e0": 0.0, "e1": 0.1}) == "e0"


def test_a_runs_later_steps_keep_their_home_and_least_loaded_ignores_the_cache() -> None:
    picker, cands, affinity = _picker(placement="affinity_or_move")
    affinity.record("run", "e1")
    prefix = CachedPrefix(1000, {"e0": 0, "e1": 0, "e2": 1000})
    assert _pick(picker, cands, "run", prefix=prefix, fill_frac=FILL) == "e1"
    assert _pick(picker, cands, "new run", prefix=prefix, fill_frac=FILL) == "e2"
    picker, cands, _ = _picker(placement="least_loaded")
    assert _pick(picker, cands, prefix=prefix, fill_frac=FILL) == "e0"


class FakeIndex:
    """`PrefixCache`'s lookup surface over fixed answers."""

    def __init__(self, tokens: Mapping[str, int], usable: bool = True) -> None:
        self.tokens = dict(tokens)
        self.usable = usable
        self.looked_up: list[int] = []

    def chain_params(self) -> set[tuple[int, str]]:
        return {(4, DEFAULT_SEED)}

    def cached_tokens(
        self, token_ids: Sequence[int], chains: Mapping[tuple[int, str], Sequence[int]]
    ) -> dict[str, int]:
        # the chain came computed with the ids (in the worker thread for a long prompt)
        assert chains == {(4, DEFAULT_SEED): chain_keys(token_ids, 4, DEFAULT_SEED)}
        self.looked_up.append(len(token_ids))
        return dict(self.tokens)

    def exact_ids(self) -> frozenset[str]:
        return frozenset(self.tokens)


class FakePrompt:
    """`ChatPrompt.token_ids`: one id per character of the messages' text."""

    def __init__(self) -> None:
        self.rendered = 0

    def token_ids(self, body: Mapping[str, Any]) -> list[int] | None:
        self.rendered += 1
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        return [1] * sum(len(str(m.get("content", ""))) for m in messages)


async def test_lookup_costs_one_check_without_a_usable_index() -> None:
    index, prompt = FakeIndex({"e0": 128}, usable=False), FakePrompt()
    lookup = PrefixLookup(index, prompt)  # type: ignore[arg-type]
    assert await lookup.lookup(BODY, 100) is None
    assert prompt.rendered == 0 and index.looked_up == []
    index.usable = True
    assert await lookup.lookup(BODY, 100) == CachedPrefix(5, {"e0": 128}, frozenset({"e0"}))
    long = {"messages": [{"role": "user", "content": "x" * 2000}]}
    found = await lookup.lookup(long, 2 * ASYNC_CHARS)  # rendered in a worker thread
    assert found == CachedPrefix(2000, {"e0": 128}, frozenset({"e0"}))
    assert await lookup.lookup({"prompt": "no messages"}, 100) is None


@pytest.mark.parametrize("stream", [False, True])
async def test_the_response_says_how_many_prompt_tokens_were_expected_cached(
    tmp_path: Path, stream: bool
) -> None:
    """Two engines in one pool; the index says engine-1 holds 256 prompt tokens: the request
    goes there and says so; an engine the index does not follow gets no header."""
    index = FakeIndex({"engine-0": 0, "engine-1": 256})
    lookup = PrefixLookup(index, FakePrompt())  # type: ignore[arg-type]
    config = config_for_test(tmp_path, pools=one_pool())
    async with gateway_over_fakes(config, 2, prefix_lookup=lookup) as r:
        for state in r.gateway.fleet:
            r.gateway.fleet.record_reading(
                state.instance_id,
                parse_vllm_metrics(FakeEngineState().metrics_text(), r.gateway.clock()),
            )
        body = {**BODY, "stream": stream}
        resp = await r.client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200
        assert resp.headers["x-gpupool-instance"] == "engine-1"
        assert resp.headers["x-gpupool-cached-tokens"] == "256"
        index.tokens = {"engine-0": 0}  # engine-1 not followed (e.g. its index not usable)
        index.usable = True
        resp = await r.client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200
        expected = "0" if resp.headers["x-gpupool-instance"] == "engine-0" else None
        assert resp.headers.get("x-gpupool-cached-tokens") == expected
        index.usable = False  # no usable index: no header, no lookup
        looked = len(index.looked_up)
        resp = await r.client.post("/v1/chat/completions", json=body)
        assert "x-gpupool-cached-tokens" not in resp.headers
        assert len(index.looked_up) == looked


@pytest.mark.parametrize("placement", ["always_affinity", "affinity_or_move"])
def test_a_full_home_gives_way_only_to_an_instance_holding_much_more(placement: str) -> None:
    """Home e1 is full (not granted): the step goes at once to e2 when e2's index holds at
    least half the prompt more than e1's and e2 has spare room; else as before (always_affinity
    waits for home: no candidate; affinity_or_move, with no prefill rate measured, waits)."""
    picker, cands, affinity = _picker(placement=placement)
    affinity.record("run", "e1", context_tokens=1000)
    granted = frozenset({"e0", "e2"})
    richer = CachedPrefix(1000, {"e0": 0, "e1": 128, "e2": 896})

    def pick(prefix: CachedPrefix | None, **fields: Any) -> str | None:
        req = PickRequest("normal", "run", allowed=granted, prefix=prefix, **fields)
        chosen = picker.pick(req, cands)
        return None if chosen is None else str(chosen.instance_id)

    assert pick(None) is None  # waits for home, as without the index
    assert pick(richer) == "e2"
    assert pick(CachedPrefix(1000, {"e0": 0, "e1": 512, "e2": 896})) is None  # not much more
    assert pick(CachedPrefix(1000, {"e0": 0, "e2": 896})) is None  # home's index unknown
    assert pick(richer, free_slots={"e0": 4, "e2": 1}) is None  # no spare room there
    assert pick(richer, free_slots={"e2": 3}, awaited={"e2": 2}) is None  # others wait for e2
    # home with room: kept, however much another instance holds
    req = PickRequest("normal", "run", allowed=frozenset({"e0", "e1", "e2"}), prefix=richer)
    chosen = picker.pick(req, cands)
    assert chosen is not None and chosen.instance_id == "e1"
