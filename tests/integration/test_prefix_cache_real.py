"""The prefix-cache index against a real CPU vLLM engine (one of the session's engines, which
gpupool's `LocalLauncher` starts with KV events on, as `engines.kv_events` does by default).

After a chat request, the router's index of that engine holds every full block of the
prompt, keyed by hashes the router computed itself from the chat template and tokenizer
(so the hash chains and the token ids agree with vLLM's); a second request sharing the
system prompt looks up exactly the blocks the two prompts share.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from pools.launchers import InstanceSpec
from router.prefix import PrefixCache
from router.prefix.prompt import ChatPrompt
from tests.integration.conftest import MODEL_DIR

pytestmark = pytest.mark.integration


def _body(user: str) -> dict[str, Any]:
    system = " ".join(f"Rule {i}: keep the tool output short and cite the file." for i in range(60))
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
