"""The prefix-cache index against a real CPU vLLM engine (one of the session's engines, which
gpupool's `LocalLauncher` starts with KV events on, as `engines.kv_events` does by default).

After a chat request, the router's index of that engine holds every full block of the
prompt, keyed by hashes the router computed itself from the chat template and tokenizer
(so the hash chains and the token ids agree with vLLM's); a second request sharing the
system prompt looks up exactly the blocks the two prompts share.

Through the router (an in-process gateway over the session's engines): a second
conversation sharing a new system prompt is placed on the engine that cached it, and its
response says how many prompt tokens were expected cached there (the shared full blocks).

A dropped event: between the engine and the router's subscriber, a forwarder drops one batch
(the blocks of one request); the next batch shows the gap, the subscriber asks the engine's
own replay socket, and the index holds the dropped request's blocks, still exact.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from pools.config import load_config
from pools.launchers import InstanceSpec
from pools.launchers.base import KvEventsSpec
from router.gateway.app import create_app
from router.prefix import PrefixCache
from router.prefix.prompt import ChatPrompt
from router.prefix.subscriber import SubscriberSettings
from tests.integration.conftest import MODEL_DIR, write_router_config
from tests.unit import vllm_goldens

pytestmark = pytest.mark.integration


def _body(user: str, tag: str = "") -> dict[str, Any]:
    rules = (f"Rule {i}: keep the tool output short and cite the file." for i in range(60))
    system = tag + " ".join(rules)
    return {
        "model": "tiny",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 1,
        "temperature": 0,
    }


async def _chat(client: httpx.AsyncClient, spec: InstanceSpec, body: dict[str, Any]) -> int:
    headers = {"Authorization": f"Bearer {spec.api_key}"}
    response = await client.post(f"{spec.url}/v1/chat/completions", json=body, headers=headers)
    response.raise_for_status()
    return int(response.json()["usage"]["prompt_tokens"])


async def _check(spec: InstanceSpec) -> None:
    prompt = ChatPrompt.from_model_dir(MODEL_DIR)
    assert prompt is not None and spec.kv_events is not None
    first, second = _body("Where is the config parsed?"), _body("Which test covers gaps?")
    first_ids, second_ids = prompt.token_ids(first), prompt.token_ids(second)
    assert first_ids is not None and second_ids is not None
    cache = PrefixCache([spec])
    await cache.start()
    events = cache.engines[spec.instance_id]
    try:
        async with asyncio.timeout(60), httpx.AsyncClient(timeout=60) as client:
            await events.wait_for(lambda e: e.connected)
            # the engine counts the prompt as the router tokenized it
            assert await _chat(client, spec, first) == len(first_ids)
            block = 128  # vLLM's CPU block size; the index learns it from the events
            await events.wait_for(
                lambda e: (
                    e.index.block_size_tokens is not None
                    and cache.cached_blocks(first_ids)[spec.instance_id] == len(first_ids) // block
                )
            )
            assert events.usable and not events.hash_mismatch  # checked against the engine's
            assert events.index.block_size_tokens == block
            shared = next(
                i for i, (a, b) in enumerate(zip(first_ids, second_ids, strict=False)) if a != b
            )
            assert shared // block >= 3  # the system prompt spans several blocks
            assert cache.cached_blocks(second_ids) == {spec.instance_id: shared // block}
            assert await _chat(client, spec, second) == len(second_ids)
            await events.wait_for(
                lambda e: (
                    cache.cached_blocks(second_ids)[spec.instance_id] == len(second_ids) // block
                )
            )
    finally:
        await cache.aclose()


def test_index_holds_the_prompts_blocks_as_the_router_hashes_them(
    real_engines: list[InstanceSpec],
) -> None:
    asyncio.run(_check(real_engines[0]))


async def _placed(tmp_path: Path, specs: list[InstanceSpec]) -> None:
    # the default pools: chat requests go to the normal pool's two engines
    config = load_config(write_router_config(tmp_path / "gpupool.yaml", [s.url for s in specs]))
    tag = f"Project {os.urandom(4).hex()}. "  # a system prompt no engine holds yet
    first, second = _body("Where is the config parsed?", tag), _body("Which test covers it?", tag)
    prompt = ChatPrompt.from_model_dir(MODEL_DIR)
    assert prompt is not None
    first_ids, second_ids = prompt.token_ids(first), prompt.token_ids(second)
    assert first_ids is not None and second_ids is not None
    shared = next(i for i, (a, b) in enumerate(zip(first_ids, second_ids, strict=False)) if a != b)
    gateway = create_app(config, specs)
    cache = gateway.prefix_cache
    assert cache is not None
    try:
        await gateway.start()
        transport = httpx.ASGITransport(app=gateway)
        async with (
            asyncio.timeout(60),
            httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=60) as client,
        ):
            for events in cache.engines.values():
                await events.wait_for(lambda e: e.usable)
            for _ in range(1200):  # a first scrape of every engine (stale counts as full)
                if all(gateway.fleet.is_fresh(s) for s in gateway.fleet):
                    break
                await asyncio.sleep(0.05)
            reply = await client.post("/v1/chat/completions", json=first)
            assert reply.status_code == 200, reply.text
            home = reply.headers["x-gpupool-instance"]
            assert reply.headers["x-gpupool-cached-tokens"] == "0"
            block = 128
            await cache.engines[home].wait_for(
                lambda e: cache.cached_blocks(first_ids)[home] == len(first_ids) // block
            )
            reply = await client.post("/v1/chat/completions", json=second)
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-gpupool-instance"] == home
            assert reply.headers["x-gpupool-cached-tokens"] == str(shared // block * block)
    finally:
        await gateway.aclose()


def test_a_shared_system_prompt_is_placed_where_it_is_cached(
    tmp_path: Path, real_engines: list[InstanceSpec]
) -> None:
    asyncio.run(_placed(tmp_path, real_engines))


class _Forwarder:
    """The engine's KV event batches, passed on from a PUB socket of its own, but for the
    first one after `drop_next()`: the router's subscriber follows this one."""

    def __init__(self, ctx: zmq.asyncio.Context, source: str, endpoint: str) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(source)
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(endpoint)
        self.dropped: list[int] = []
        self.payloads: list[bytes] = []  # every batch's payload, as the engine sent it
        self._drop = False
        self._task = asyncio.create_task(self._run())

    def drop_next(self) -> None:
        self._drop = True

    async def _run(self) -> None:
        while True:
            frames = await self.sub.recv_multipart()
            self.payloads.append(frames[-1])
            if self._drop:
                self._drop = False
                self.dropped.append(int.from_bytes(frames[1], "big"))
                continue
            await self.pub.send_multipart(frames)

    async def aclose(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.sub.close(linger=0)
        self.pub.close(linger=0)


async def _dropped(tmp_path: Path, spec: InstanceSpec) -> None:
    prompt = ChatPrompt.from_model_dir(MODEL_DIR)
    assert prompt is not None and spec.kv_events is not None
    bodies = [_body("Where?", f"Project {os.urandom(4).hex()}. ") for _ in range(3)]
    ids = [prompt.token_ids(b) for b in bodies]
    ctx = zmq.asyncio.Context()
    forwarder = _Forwarder(ctx, spec.kv_events.endpoint, f"ipc://{tmp_path}/fwd-pub")
    followed = dataclasses.replace(
        spec,
        kv_events=KvEventsSpec(f"ipc://{tmp_path}/fwd-pub", spec.kv_events.replay_endpoint),
    )
    # no catch-up replay after a quiet spell (5 s by default) before the third batch: the
    # gap it shows is what this checks
    cache = PrefixCache([followed], settings=SubscriberSettings(catch_up_s=300))
    await cache.start()
    events = cache.engines[spec.instance_id]
    block = 128

    def holds(i: int) -> bool:
        full = ids[i]
        assert full is not None
        return cache.cached_blocks(full).get(spec.instance_id) == len(full) // block

    try:
        async with asyncio.timeout(60), httpx.AsyncClient(timeout=60) as client:
            await events.wait_for(lambda e: e.connected)
            await _chat(client, spec, bodies[0])
            await events.wait_for(lambda e: holds(0))
            replays = events.replays
            forwarder.drop_next()  # the batch storing the second prompt's blocks
            await _chat(client, spec, bodies[1])
            await _chat(client, spec, bodies[2])  # its batch shows the gap
            await events.wait_for(lambda e: holds(2))
            assert len(forwarder.dropped) == 1
            assert holds(1), "the dropped batch's blocks were not replayed"
            assert events.replays == replays + 1 and events.resyncs == 0
            assert events.index.exact and events.usable
            _check_goldens(forwarder.payloads)
    finally:
        await cache.aclose()
        await forwarder.aclose()
        ctx.term()


def _check_goldens(payloads: list[bytes]) -> None:
    """The unit tests' goldens of vLLM (tests/unit/vllm_goldens.py) still hold: recorded from
    the vLLM installed here, and a real engine's batches laid out as the recorded ones (the
    array, then each BlockStored's fields in the recorded order). Their hashes agree with the
    router's chain, which the unit tests check against the goldens, by the subscriber's own
    check on these events (`usable`, no hash mismatch)."""
    golden = vllm_goldens.load()
    assert golden["vllm_version"] == vllm_goldens.installed_vllm_version(), (
        "vLLM changed: regenerate tests/unit/data/vllm_prefix_goldens.json"
        " (python -m tests.unit.vllm_goldens --write)"
    )
    recorded = msgspec.msgpack.decode(bytes.fromhex(golden["batches"]["stored_prompt_other"]))
    fields = [k for k in recorded[1][0] if k != "group_idx"]  # group_idx: omitted when None
    stored = 0
    for payload in payloads:
        batch = msgspec.msgpack.decode(payload)
        assert len(batch) == len(recorded) and isinstance(batch[0], float)
        for event in batch[1]:
            if event["type"] == "BlockStored":
                assert [k for k in event if k in fields] == fields
                assert isinstance(event["block_hashes"][0], int) == golden["int_block_hashes"]
                stored += 1
    assert stored >= 1


def test_a_dropped_event_is_replayed_from_the_engine(
    tmp_path: Path, real_engines: list[InstanceSpec]
) -> None:
    asyncio.run(_dropped(tmp_path, real_engines[0]))
