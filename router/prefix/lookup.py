"""A chat request's cached prefix on each instance, on the request path: the prompt's token ids
as vLLM makes them (`ChatPrompt`), looked up in every usable index (`PrefixCache`).

`PrefixLookup.lookup(body, body_chars)` returns None, at the cost of one check, when no
instance's index is usable (no engine publishes KV events, none connected yet): placement and
admission then run exactly as without the index. Rendering and tokenizing (~0.7 us a character
with the dev tokenizer) and the block hash chain (~0.1 ms a 128-token block: a 15k-token
prompt is 23 ms of ids and 11 ms of hashes) are CPU work: above `ASYNC_CHARS` of body they run
in a worker thread (`asyncio.to_thread`), off the event loop; the set probes (microseconds)
stay on the loop, the indexes' only writer. The estimator's token counts cannot be reused: it
counts memoised text chunks, never the whole prompt's ids.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from router.admission.decision import CachedPrefix
from router.prefix.cache import PrefixCache
from router.prefix.chain_memo import ChainMemo
from router.prefix.prompt import ChatPrompt

__all__ = ["ASYNC_CHARS", "PrefixLookup"]

log = logging.getLogger(__name__)

ASYNC_CHARS = 1024  # a body longer than this is rendered and hashed in a worker thread


class PrefixLookup:
    def __init__(self, cache: PrefixCache, prompt: ChatPrompt) -> None:
        self.cache = cache
        self.prompt = prompt
        self._chains_memo = ChainMemo()

    async def lookup(self, body: Mapping[str, Any], body_chars: int) -> CachedPrefix | None:
        """The chat request's cached prefix per usable instance; None without a usable index
        or when its token ids cannot be known exactly (`ChatPrompt.token_ids`)."""
        if not self.cache.usable:
            return None
        params = self.cache.chain_params()
        try:
            if body_chars > ASYNC_CHARS:
                found = await asyncio.to_thread(self._chains, body, params)
            else:
                found = self._chains(body, params)
        except Exception as err:  # a body the template or tokenizer trips on: serve it unhashed
            log.debug("prefix lookup skipped: %s", type(err).__name__)
            return None
        if found is None:
            return None
        ids, chains = found
        tokens = self.cache.cached_tokens(ids, chains)
        return CachedPrefix(len(ids), tokens, self.cache.exact_ids())

    def _chains(
        self, body: Mapping[str, Any], params: set[tuple[int, str]]
    ) -> tuple[list[int], dict[tuple[int, str], list[int]]] | None:
        """The prompt's token ids and its block key chain per (block size, seed): pure CPU
        work, safe in a worker thread."""
        ids = self.prompt.token_ids(body)
        if ids is None:
            return None
        return ids, {(size, seed): self._chains_memo.keys(ids, size, seed) for size, seed in params}
