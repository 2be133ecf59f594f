"""router/prefix against what vLLM computes, without importing vLLM: the block hash chain and
the KV event batches' bytes against goldens recorded from vLLM (tests/unit/vllm_goldens.py,
which regenerates them; the real-engine test checks them against the installed vLLM), and
the index kept over real ZMQ sockets from a publisher of the tests' own that speaks vLLM's
`ZmqEventPublisher` protocol (gaps, replays, restarts, silence, a disagreeing hash)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

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
from router.prefix.wire import Batch, BlockRemoved, BlockStored, decode_batch
from tests.unit import vllm_goldens
from tests.unit.vllm_goldens import ANOTHER_SEED, BLOCK, OTHER, PROMPT, stored_fields

GOLDEN = vllm_goldens.load()


def test_default_seed_is_vllms() -> None:
    assert GOLDEN["default_seed"] == DEFAULT_SEED
    for seed, digest in GOLDEN["sha256_cbor_of_seed"].items():
        assert none_hash(seed).hex() == digest, seed


def test_chain_matches_vllm() -> None:
    cases = GOLDEN["chains"]
    assert [{k: c[k] for k in ("token_ids", "block_size", "seed")} for c in cases] == (
        vllm_goldens.chain_cases()
    )  # the goldens are of these inputs
    for case in cases:
        seed = case["seed"] or DEFAULT_SEED
        got = chain_hashes(case["token_ids"], case["block_size"], seed)
        assert [h.hex() for h in got] == case["hashes"], case


def test_partial_block_has_no_hash() -> None:
    assert chain_hashes(list(range(31)), 16) == chain_hashes(list(range(16)), 16)
    assert len(chain_keys(list(range(32)), 16)) == 2


def test_key_is_vllms_int_form() -> None:
    digest = chain_hashes(list(range(16)), 16)[0]
    as_int = int.from_bytes(digest, "big") & ((1 << 64) - 1)  # maybe_convert_block_hash
    assert block_key(digest) == as_int == block_key(as_int)


def test_engine_none_hash_follows_pythonhashseed() -> None:
    """vLLM reads PYTHONHASHSEED when the engine starts (`init_none_hash`): without it
    sha256_cbor's seed is the fixed default, the same in every process; with it, its value."""
    by_env = GOLDEN["engine_none_hash_by_pythonhashseed"]
    assert none_hash().hex() == by_env[""]
    assert none_hash("7").hex() == by_env["7"]


# ---------------------------------------------------------------------------------------------
# KV event batches as vLLM encodes them (checked byte for byte against its goldens), over real
# ZMQ sockets from a publisher speaking its protocol
# ---------------------------------------------------------------------------------------------


def _vllm_hashes(token_ids: list[int], seed: str = DEFAULT_SEED) -> list[int | bytes]:
    """What an engine puts in BlockStored.block_hashes for these full blocks (the router's
    chain, equal to vLLM's by `test_chain_matches_vllm`; ints or bytes as vLLM sends them)."""
    digests = chain_hashes(token_ids, BLOCK, seed)
    return [block_key(h) for h in digests] if GOLDEN["int_block_hashes"] else list(digests)


def _stored(token_ids: list[int], seed: str = DEFAULT_SEED, **fields: Any) -> dict[str, Any]:
    """vLLM's `BlockStored` as msgspec encodes it: tagged, in field order, defaults omitted."""
    event = {"type": "BlockStored", **stored_fields(_vllm_hashes(token_ids, seed), token_ids)}
    event.update(fields)
    if event["group_idx"] is None:  # a default: omitted
        del event["group_idx"]
    return event


def _removed(hashes: list[int | bytes]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}


CLEARED: dict[str, Any] = {"type": "AllBlocksCleared"}


def _batch(*events: dict[str, Any]) -> bytes:
    """A `KVEventBatch` (array-like: ts, events, data_parallel_rank) as the publisher sends it."""
    return msgspec.msgpack.encode([0.0, list(events), 0])


def test_batches_are_the_bytes_vllm_sends() -> None:
    cpu = _stored([], block_hashes=[1, 2], medium="CPU", group_idx=None)  # an offload tier
    ours = {
        "stored_prompt_other": _batch(_stored(PROMPT), _stored(OTHER)),
        "stored_prompt_another_seed": _batch(_stored(PROMPT, ANOTHER_SEED)),
        "removed_prompt_block_3": _batch(_removed(_vllm_hashes(PROMPT)[3:4])),
        "cleared": _batch(CLEARED),
        "stored_cpu": _batch(cpu),
        "empty": _batch(),
    }
    assert {k: v.hex() for k, v in ours.items()} == GOLDEN["batches"]
    decoded = decode_batch(bytes.fromhex(GOLDEN["batches"]["stored_prompt_other"]))
    first = decoded.events[0]
    assert isinstance(first, BlockStored) and first.plain and first.block_size_tokens == BLOCK
    assert [block_key(h) for h in first.block_hashes] == chain_keys(PROMPT, BLOCK)
    removed = decode_batch(bytes.fromhex(GOLDEN["batches"]["removed_prompt_block_3"])).events
    assert isinstance(removed[0], BlockRemoved) and removed[0].group_idx == 0
    assert decode_batch(bytes.fromhex(GOLDEN["batches"]["cleared"])).events == (None,)


class Engine:
    """A KV event publisher on socket files speaking vLLM's `ZmqEventPublisher` protocol
    (router/prefix/wire.py): PUB `(topic, seq, payload)`, a ROUTER replay socket answering
    `(b"", start seq)` with every buffered batch from it then the end marker, served by a
    thread as vLLM's is. `lose` takes a sequence number without sending the batch, keeping it
    for replay or not."""

    def __init__(self, tmp_path: Path, *, tcp: bool = False) -> None:
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = self._ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        if tcp:  # as a Ray engine: bound on every interface, reached at an address
            ports = [s.bind_to_random_port("tcp://*") for s in (self._pub, self._replay)]
            pub, replay = (f"tcp://127.0.0.1:{p}" for p in ports)
        else:
            pub, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
            self._pub.bind(pub)
            self._replay.bind(replay)
        self.spec = KvEventsSpec(endpoint=pub, replay_endpoint=replay)
        self._seq = itertools.count()
        self._buffer: list[tuple[int, bytes]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, name="test-kv-replay")
        self._thread.start()

    def publish(self, payload: bytes) -> None:
        seq = next(self._seq)
        with self._lock:
            self._buffer.append((seq, payload))
        self._pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))

    def lose(self, payload: bytes, *, keep_for_replay: bool = True) -> None:
        seq = next(self._seq)
        if keep_for_replay:
            with self._lock:
                self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        end = (-1).to_bytes(8, "big", signed=True)
        while not self._stop.is_set():
            if not self._replay.poll(20):
                continue
            client, _, start = self._replay.recv_multipart()
            first = int.from_bytes(start, "big")
            with self._lock:
                kept = [(seq, buf) for seq, buf in self._buffer if seq >= first]
            for seq, buf in kept:
                self._replay.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), buf))
            self._replay.send_multipart((client, b"", b"", end, b""))

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self._pub.close()
        self._replay.close()
        self._ctx.term()


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
    try:
        async with asyncio.timeout(30):  # a deadline for a hung test, not a speed bound
            await events.wait_for(cond)
    except TimeoutError:
        i = events.index
        state = (
            *(events.connected, i.expected_seq, i.last_live_seq, len(i.keys), i.exact),
            *(events.batches_received, events.replays, events.restarts),
        )
        names = "connected, expected seq, last live seq, keys, exact, batches, replays, restarts"
        raise AssertionError(f"timed out at ({names}) = {state}") from None


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
    engine.publish(_batch(CLEARED))
    await _until(events, lambda e: e.index.expected_seq == 3)
    assert cache.cached_blocks(OTHER) == {"engine-0": 0}
    (view,) = cache.snapshot()
    assert view.usable and view.exact and view.cached_blocks == 0 and view.block_size_tokens == 4
    assert view.index_age_s is not None and view.index_age_s >= 0
    shown = cache.view("engine-0")
    assert shown is not None and shown["cached_blocks"] == 0 and shown["usable"]
    assert shown["batches_received"] >= 3 and shown["restarts"] == 0  # replays: twice
    assert cache.view("engine-1") is None


async def test_index_fills_over_tcp_and_follows_instances_that_move(
    cache: PrefixCache, tmp_path: Path
) -> None:
    """A Ray engine on another node publishes on TCP; the discovery loop's answers add it,
    move it (restarted elsewhere: index dropped, new endpoint followed) and drop it."""
    first, second = Engine(tmp_path / "a", tcp=True), Engine(tmp_path / "b", tcp=True)
    try:
        spec = InstanceSpec("ray-engine-0", "http://10.0.0.1:1", 1, kv_events=first.spec)
        cache.follow([spec, InstanceSpec("ray-engine-1", "http://10.0.0.2:1", 1)])
        assert list(cache.engines) == ["ray-engine-0"]  # engine-1 publishes nothing
        events = cache.engines["ray-engine-0"]
        await _until(events, lambda e: e.connected)
        first.publish(_batch(_stored(PROMPT)))
        await _until(events, lambda e: e.index.expected_seq == 1)
        assert cache.cached_blocks([*PROMPT, 1]) == {"ray-engine-0": 6}
        cache.follow([spec])  # the same answer again: the same subscriber, index kept
        assert cache.engines["ray-engine-0"] is events
        moved = dataclasses.replace(spec, kv_events=second.spec)
        cache.follow([moved])
        after = cache.engines["ray-engine-0"]
        assert after is not events and after.spec == second.spec
        await _until(after, lambda e: e.connected)
        assert cache.cached_blocks([*PROMPT, 1]) == {"ray-engine-0": 0}
        cache.follow([])  # gone
        assert cache.engines == {}
    finally:
        first.close()
        second.close()


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
    engine.publish(_batch(CLEARED))  # the engine's cache is empty: exact
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
    return decode_batch(_batch(*events))


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
    cpu = _stored([], block_hashes=[1, 2], medium="CPU", group_idx=None)
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
