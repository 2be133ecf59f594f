"""Prefix caches in the simulator: what each modelled engine holds, as block keys.

A prompt is a chain of full blocks (`block_size_tokens` each; a partial last block is not
cached, as in vLLM). A request whose class has a `shared_prefix` starts with its tenant's
prefix blocks, keyed by (class, tenant, position), so every request of that tenant names the
same keys; the rest of the chain is the request's own, keyed by (request, position), or for an
agent run by (run, position), so each step's prompt extends the last step's (prompt, output
and tool result appended, as a real run's context grows).

`EnginePrefixCache` is one engine's cache: an LRU of block keys bounded by the engine's KV
blocks. A sequence's prompt blocks are touched (or stored) when it starts, its prompt and
output blocks when it ends (vLLM caches full blocks of generated tokens too). Approximation:
vLLM evicts only blocks no running sequence uses, oldest freed first; here the least recently
touched key goes once the cache holds more keys than the engine has blocks (a running
sequence's blocks were touched when it started, so they are rarely the oldest).

The router's side is real: the simulator gives the admitter a `CachedPrefix` per request with
every engine's held blocks (an exact index, as the KV-event index is when no batch was lost),
and placement scores it with `router.prefix.score` through the picker's own
`score_cached_prefix`; admission predicts prefill as the uncached tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["EnginePrefixCache", "PromptChain"]


@dataclass(frozen=True, slots=True)
class PromptChain:
    """The block keys of one request's prompt (and, grown, of its context)."""

    shared: Hashable | None  # the tenant's prefix (class, tenant); None: nothing shared
    shared_blocks: int  # leading blocks that are the tenant's prefix
    own: Hashable  # the request's or run's own key
    block_size_tokens: int

    def keys(self, tokens: int) -> list[Hashable]:
        """The keys of the first `tokens` tokens' full blocks."""
        n = tokens // self.block_size_tokens
        shared = min(n, self.shared_blocks) if self.shared is not None else 0
        keys: list[Hashable] = [(self.shared, i) for i in range(shared)]
        keys += [(self.own, i) for i in range(shared, n)]
        return keys


class EnginePrefixCache:
    """One engine's cached blocks, least recently touched first."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def held(self, keys: Sequence[Hashable]) -> int:
        """Leading blocks of the chain held (vLLM reuses a prefix up to its first miss)."""
        n = 0
        for key in keys:
            if key not in self._lru:
                break
            n += 1
        return n

    def store(self, keys: Sequence[Hashable]) -> None:
        """Touch or store every block of the chain; evict the oldest past capacity."""
        lru = self._lru
        for key in keys:
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
        while len(lru) > self.capacity_blocks:
            lru.popitem(last=False)
