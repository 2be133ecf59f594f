"""router/prefix against vLLM itself: the block hash chain against vLLM's functions, and the
index kept from batches made of vLLM's own event classes, sent by vLLM's own ZMQ publisher
(gaps, replays, restarts, silence, a disagreeing hash). One file: it imports vLLM once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pools.config import parse_config
from pools.devmodel import make_dev_model
from pools.launchers.base import InstanceSpec, KvEventsSpec
from pools.testing.config import config_data, one_pool
from pools.testing.fake_engine import FakeEngineState, make_fake_engine
from pools.testing.serve import serve_asgi
from router.gateway.app import create_app
from router.prefix.cache import PrefixCache
from router.prefix.hashing import DEFAULT_SEED, block_key, chain_hashes, chain_keys, none_hash
from router.prefix.index import Accepted, BlockIndex
from router.prefix.prompt import ChatPrompt
from router.prefix.subscriber import EngineEvents, SubscriberSettings
from router.prefix.wire import Batch, decode_batch

kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
hashing = pytest.importorskip("vllm.utils.hashing")


def _vllm_chain(token_ids: list[int], block_size: int, seed: str) -> list[bytes]:
    none = hashing.sha256_cbor(seed)
    parent = none
    out = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = kv_cache_utils.hash_block_tokens(
            hashing.sha256_cbor, parent, token_ids[start : start + block_size]
        )
        out.append(parent)
    return out


def test_default_seed_is_vllms() -> None:
    assert DEFAULT_SEED == kv_cache_utils.DEFAULT_NONE_HASH_SEED
    assert none_hash() == hashing.sha256_cbor(DEFAULT_SEED)


@settings(max_examples=60, deadline=None)
@given(
    token_ids=st.lists(st.integers(min_value=0, max_value=2**32), max_size=70),
    block_size=st.sampled_from([1, 4, 16, 23]),
    seed=st.sampled_from([DEFAULT_SEED, "0", "12345", "é"]),
)
def test_chain_matches_vllm(token_ids: list[int], block_size: int, seed: str) -> None:
    assert chain_hashes(token_ids, block_size, seed) == _vllm_chain(token_ids, block_size, seed)


def test_partial_block_has_no_hash() -> None:
    assert chain_hashes(list(range(31)), 16) == chain_hashes(list(range(16)), 16)
    assert len(chain_keys(list(range(32)), 16)) == 2


def test_key_is_vllms_int_form() -> None:
    digest = chain_hashes(list(range(16)), 16)[0]
    as_int = int.from_bytes(digest, "big") & ((1 << 64) - 1)  # maybe_convert_block_hash
    assert block_key(digest) == as_int == block_key(as_int)


def test_engine_none_hash_follows_pythonhashseed(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM reads PYTHONHASHSEED when the engine starts (`init_none_hash`): without it
    sha256_cbor's seed is the fixed default, the same in every process; with it, its value."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    kv_cache_utils.init_none_hash(hashing.sha256_cbor)
    assert none_hash() == kv_cache_utils.NONE_HASH
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    kv_cache_utils.init_none_hash(hashing.sha256_cbor)
    assert none_hash("7") == kv_cache_utils.NONE_HASH
    monkeypatch.delenv("PYTHONHASHSEED")
    kv_cache_utils.init_none_hash(hashing.sha256_cbor)


# ---------------------------------------------------------------------------------------------
# the index from vLLM's own event classes, over real ZMQ sockets (vLLM's own publisher)
# ---------------------------------------------------------------------------------------------

kv_events = pytest.importorskip("vllm.distributed.kv_events")

BLOCK = 4


def _vllm_hashes(token_ids: list[int], seed: str = DEFAULT_SEED) -> list[int | bytes]:
    """What an engine puts in BlockStored.block_hashes for these full blocks."""
    return [kv_cache_utils.maybe_convert_block_hash(h) for h in _vllm_chain(token_ids, BLOCK, seed)]


def _stored(token_ids: list[int], seed: str = DEFAULT_SEED) -> Any:
    hashes = _vllm_hashes(token_ids, seed)
    return kv_events.BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=token_ids[: len(hashes) * BLOCK],
        block_size=BLOCK,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
    )


def _removed(hashes: list[int | bytes]) -> Any:
    return kv_events.BlockRemoved(block_hashes=hashes, medium="GPU", group_idx=0)


def _batch(*events: Any) -> Any:
    return kv_events.KVEventBatch(ts=0.0, events=list(events))


PROMPT = list(range(100, 124))  # 6 blocks of 4
OTHER = list(range(500, 512))  # 3 blocks


class Engine:
    """vLLM's `ZmqEventPublisher` on socket files, as an engine started with
    --kv-events-config runs it; `lose` puts a batch in its replay buffer without sending it."""

    def __init__(self, tmp_path: Path) -> None:
        self.spec = KvEventsSpec(
            endpoint=f"ipc://{tmp_path}/pub", replay_endpoint=f"ipc://{tmp_path}/replay"
        )
        self.pub = kv_events.ZmqEventPublisher(
            0, endpoint=self.spec.endpoint, replay_endpoint=self.spec.replay_endpoint
        )

    def publish(self, batch: Any) -> None:
        self.pub.publish(batch)

    def lose(self, batch: Any, *, keep_for_replay: bool = True) -> None:
        seq = next(self.pub._seq_gen)
        if keep_for_replay:
            self.pub._buffer.append((seq, msgspec.msgpack.encode(batch)))

    def close(self) -> None:
        self.pub.shutdown()


@pytest.fixture
async def cache() -> AsyncIterator[PrefixCache]:
    settings = SubscriberSettings(connect_warn_s=0.0, replay_timeout_s=5.0, catch_up_s=0.5)
    cache = PrefixCache(settings=settings)
    await cache.start()
    try:
        yield cache
    finally:
        await cache.aclose()


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    engine = Engine(tmp_path)
    try:
        yield engine
    finally:
        engine.close()


async def _until(events: EngineEvents, cond: Callable[[EngineEvents], bool]) -> None:
    async with asyncio.timeout(30):  # a deadline for a hung test, not a speed bound
        await events.wait_for(cond)


async def _follow(cache: PrefixCache, engine: Engine) -> EngineEvents:
    cache.add("engine-0", engine.spec)
    events = cache.engines["engine-0"]
    await _until(events, lambda e: e.connected)
    return events


async def test_index_follows_stored_removed_cleared(cache: PrefixCache, engine: Engine) -> None:
    events = await _follow(cache, engine)
    engine.publish(_batch(_stored(PROMPT), _stored(OTHER)))
    await _until(events, lambda e: e.index.expected_seq == 1)
    assert cache.cached_blocks([*PROMPT, 1, 2]) == {"engine-0": 6}
    assert cache.cached_blocks([*PROMPT[:8], 9, 9, 9, 9, *PROMPT[12:]]) == {"engine-0": 2}
    assert cache.cached_blocks([7, *PROMPT]) == {"engine-0": 0}
    engine.publish(_batch(_removed(_vllm_hashes(PROMPT)[3:4])))  # block 3 evicted
    await _until(events, lambda e: e.index.expected_seq == 2)
    assert cache.cached_blocks(PROMPT) == {"engine-0": 3}  # vLLM reuses up to the hole
    engine.publish(_batch(kv_events.AllBlocksCleared()))
    await _until(events, lambda e: e.index.expected_seq == 3)
    assert cache.cached_blocks(OTHER) == {"engine-0": 0}
    (view,) = cache.snapshot()
    assert view.usable and view.exact and view.cached_blocks == 0 and view.block_size_tokens == 4
    assert view.index_age_s is not None and view.index_age_s >= 0
    shown = cache.view("engine-0")
    assert shown is not None and shown["cached_blocks"] == 0 and shown["usable"]
    assert shown["batches_received"] >= 3 and shown["restarts"] == 0  # replays: twice
    assert cache.view("engine-1") is None


async def test_lost_batch_is_replayed(cache: PrefixCache, engine: Engine) -> None:
    events = await _follow(cache, engine)
    engine.publish(_batch(_stored(OTHER)))
    await _until(events, lambda e: e.index.expected_seq == 1)
    engine.lose(_batch(_stored(PROMPT)))  # seq 1: in the buffer, never received
    engine.publish(_batch(_removed(_vllm_hashes(OTHER)[2:])))  # seq 2
    await _until(events, lambda e: e.index.expected_seq == 3)
    assert events.resyncs == 0 and events.index.exact  # by the gap or the catch-up
    assert cache.cached_blocks(PROMPT) == {"engine-0": 6}
    assert cache.cached_blocks(OTHER) == {"engine-0": 2}


async def test_gap_past_the_replay_buffer_starts_over_inexact(
    cache: PrefixCache, engine: Engine
) -> None:
    events = await _follow(cache, engine)
    engine.publish(_batch(_stored(OTHER)))
    await _until(events, lambda e: e.index.expected_seq == 1)
    engine.lose(_batch(_removed(_vllm_hashes(OTHER))), keep_for_replay=False)  # seq 1: gone
    engine.publish(_batch(_stored(PROMPT)))  # seq 2
    await _until(events, lambda e: e.index.expected_seq == 3)
    assert events.resyncs == 1 and not events.index.exact
    # what is known is still right; what was before the gap is forgotten (under-reports)
    assert cache.cached_blocks(PROMPT) == {"engine-0": 6}
    assert cache.cached_blocks(OTHER) == {"engine-0": 0}
    engine.publish(_batch(kv_events.AllBlocksCleared()))  # the engine's cache is empty: exact
    await _until(events, lambda e: e.index.expected_seq == 4)
    assert events.index.exact


async def test_engine_restart_drops_the_index(
    cache: PrefixCache, engine: Engine, tmp_path: Path
) -> None:
    events = await _follow(cache, engine)
    engine.publish(_batch(_stored(OTHER)))
    engine.publish(_batch(_stored(PROMPT[:8])))
    await _until(events, lambda e: e.index.expected_seq == 2)
    engine.close()  # the engine dies: its cache with it
    await _until(events, lambda e: not e.connected)
    assert cache.cached_blocks(OTHER) == {}  # not usable while it is away
    restarted = Engine(tmp_path)  # same sockets, a new process: seq from 0 again
    try:
        await _until(events, lambda e: e.connected)
        restarted.publish(_batch(_stored(PROMPT)))
        await _until(events, lambda e: e.index.expected_seq == 1)
        assert cache.cached_blocks(OTHER) == {"engine-0": 0}
        assert cache.cached_blocks(PROMPT) == {"engine-0": 6}
        assert events.restarts >= 1
    finally:
        restarted.close()


async def test_router_joining_late_replays_from_the_start(
    cache: PrefixCache, engine: Engine
) -> None:
    engine.lose(_batch(_stored(OTHER)))  # published before the router subscribed
    events = await _follow(cache, engine)
    engine.publish(_batch(_stored(PROMPT)))
    await _until(events, lambda e: e.index.expected_seq == 2)
    assert events.index.exact
    assert cache.cached_blocks(OTHER) == {"engine-0": 3}


async def test_engine_that_publishes_nothing_is_left_out(
    cache: PrefixCache, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="router.prefix.subscriber")
    cache.add("engine-9", KvEventsSpec(endpoint=f"ipc://{tmp_path}/nobody", replay_endpoint=None))
    await _until(cache.engines["engine-9"], lambda e: e.silent)
    assert "nothing at" in caplog.text
    assert cache.cached_blocks(PROMPT) == {}
    assert [v.usable for v in cache.snapshot()] == [False]


async def test_engine_hashing_differently_is_left_out(
    cache: PrefixCache, engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    events = await _follow(cache, engine)
    engine.publish(_batch(_stored(PROMPT, seed="another-seed")))
    await _until(events, lambda e: e.index.expected_seq == 1)
    assert events.hash_mismatch and cache.cached_blocks(PROMPT) == {}
    assert "hashes blocks differently" in caplog.text


# ---------------------------------------------------------------------------------------------
# the pure core
# ---------------------------------------------------------------------------------------------


def _wire(*events: Any) -> Batch:
    return decode_batch(msgspec.msgpack.encode(_batch(*events)))


def test_index_sequence_rules() -> None:
    index = BlockIndex()
    assert index.accept_live(0, _wire(_stored(OTHER)), 1.0) is Accepted.APPLIED
    assert index.accept_live(2, _wire(_stored(PROMPT)), 2.0) is Accepted.GAP
    assert index.accept_replayed(1, _wire(), 2.0) is Accepted.APPLIED
    assert index.accept_replayed(2, _wire(_stored(PROMPT)), 2.0) is Accepted.APPLIED
    assert index.accept_live(3, _wire(), 3.0) is Accepted.APPLIED
    assert len(index.keys) == 9 and index.updated_at_s == 3.0
    assert index.accept_replayed(3, _wire(), 3.0) is Accepted.DUPLICATE
    assert index.accept_live(0, _wire(_stored(PROMPT[:4])), 4.0) is Accepted.RESTARTED
    assert len(index.keys) == 1 and index.expected_seq == 1


def test_index_ignores_offload_tiers_and_is_bounded() -> None:
    index = BlockIndex(max_blocks=5)
    cpu = kv_events.BlockStored(
        block_hashes=[1, 2], parent_block_hash=None, token_ids=[], block_size=4,
        lora_id=None, medium="CPU", lora_name=None,
    )  # fmt: skip
    index.accept_live(0, _wire(cpu, _stored(OTHER)), 0.0)
    assert len(index.keys) == 3 and index.exact
    index.accept_live(1, _wire(_stored(PROMPT)), 0.0)  # 9 > 5: cleared, under-reports
    assert not index.keys and not index.exact


# ---------------------------------------------------------------------------------------------
# a chat request's prompt token ids, as vLLM renders them (transformers' apply_chat_template)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dev_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dev_model(tmp_path_factory.mktemp("model") / "tiny")


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "grep",
            "description": "search ünïcode",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a careful agent. " * 40},
    {
        "role": "user",
        "content": [{"type": "text", "text": "find x"}, {"type": "text", "text": "y"}],
    },
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "grep", "arguments": '{"q": 1}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "x at line 3"},
]


def test_prompt_ids_are_transformers_chat_template_ids(dev_model: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(dev_model))
    prompt = ChatPrompt.from_model_dir(dev_model)
    assert prompt is not None
    # what vLLM hands transformers for this template ("openai" content format: it loops over
    # a message's content): text parts, arguments parsed from JSON
    conversation = [
        {**m, "content": [{"type": "text", "text": m["content"]}]}
        if isinstance(m["content"], str)
        else m
        for m in MESSAGES
    ]
    call = conversation[2]["tool_calls"][0]
    conversation[2] = {
        **conversation[2],
        "tool_calls": [{**call, "function": {"name": "grep", "arguments": {"q": 1}}}],
    }
    text = tokenizer.apply_chat_template(
        conversation, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    expected = tokenizer.encode(text, add_special_tokens=False)
    assert prompt.token_ids({"messages": MESSAGES, "tools": TOOLS}) == expected


def test_prompts_the_router_cannot_hash_exactly(dev_model: Path) -> None:
    prompt = ChatPrompt.from_model_dir(dev_model)
    assert prompt is not None
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    assert prompt.token_ids({"messages": [{"role": "user", "content": [image]}]}) is None
    salted = {"messages": MESSAGES, "cache_salt": "tenant-a"}  # vLLM hashes the salt in
    assert prompt.token_ids(salted) is None
    assert prompt.token_ids({"prompt": "completions are not chats"}) is None
    assert ChatPrompt.from_model_dir(dev_model / "missing") is None


# ---------------------------------------------------------------------------------------------
# GET /admin/pools
# ---------------------------------------------------------------------------------------------


async def test_admin_pools_shows_each_instances_cached_blocks(
    tmp_path: Path, engine: Engine
) -> None:
    data = config_data(tmp_path, pools=one_pool())
    async with serve_asgi(make_fake_engine(FakeEngineState())) as url:
        specs = [InstanceSpec("e0", url, 1, kv_events=engine.spec), InstanceSpec("e1", url, 1)]
        gateway = create_app(parse_config(data), specs)
        await gateway.start()
        try:
            assert gateway.prefix_cache is not None
            events = gateway.prefix_cache.engines["e0"]
            await _until(events, lambda e: e.connected)
            engine.publish(_batch(_stored(PROMPT), _stored(OTHER)))
            await _until(events, lambda e: e.index.expected_seq == 1)
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=gateway), base_url="http://gw"
            ) as client:
                instances = (await client.get("/admin/pools")).json()["instances"]
            shown = instances["e0"]["prefix_cache"]
            assert shown["usable"] and shown["exact"] and shown["cached_blocks"] == 9
            assert shown["index_age_s"] >= 0 and shown["block_size_tokens"] == 4
            assert shown["connected"] and shown["batches_received"] >= 1
            assert shown["replays"] == shown["resyncs"] == shown["restarts"] == 0
            assert instances["e1"]["prefix_cache"] is None  # publishes nothing gpupool knows
        finally:
            await gateway.aclose()
