"""A chat request's cached prefix on each instance, on the request path: the prompt's token ids
as vLLM makes them (`ChatPrompt`), looked up in every usable index (`PrefixCache`).

`PrefixLookup.lookup(body, body_chars)` returns None, at the cost of one check, when no
instance's index is usable (no engine publishes KV events, none connected yet): placement and
admission then run exactly as without the index. Rendering and tokenizing (~1 us a character)
is CPU work: above `ASYNC_CHARS` of body it runs in a worker thread (`asyncio.to_thread`), off
the event loop; the lookup itself (hash chain and set probes, 10-20 us for 64 blocks) stays on
the loop, which is the only writer of the indexes. The estimator's token counts cannot be reused: it
counts memoised text chunks, never the whole prompt's ids.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from router.admission.decision import CachedPrefix
from router.prefix.cache import PrefixCache
from router.prefix.prompt import ChatPrompt

__all__ = ["ASYNC_CHARS", "PrefixLookup"]

log = logging.getLogger(__name__)

ASYNC_CHARS = 1024  # a body longer than this is rendered and hashed in a worker thread


class PrefixLookup:
    def __init__(self, cache: PrefixCache, prompt: ChatPrompt) -> None:
        self.cache = cache
        self.prompt = prompt

    async def lookup(self, body: Mapping[str, Any], body_chars: int) -> CachedPrefix | None:
        """The chat request's cached prefix per usable instance; None without a usable index
        or when its token ids cannot be known exactly (`ChatPrompt.token_ids`)."""
        if not self.cache.usable:
            return None
        try:
            if body_chars > ASYNC_CHARS:
                ids = await asyncio.to_thread(self.prompt.token_ids, body)
            else:
                ids = self.prompt.token_ids(body)
        except Exception as err:  # a body the template or tokenizer trips on: serve it unhashed
            log.debug("prefix lookup skipped: %s", type(err).__name__)
            return None
        if ids is None:
            return None
        return CachedPrefix(len(ids), self.cache.cached_tokens(ids), self.cache.exact_ids())
