"""The block keys one engine holds in its prefix cache, kept from its KV events (pure core).

`BlockIndex.accept_live(seq, batch, now_s)` takes the PUB stream's batches and says what the
shell must do: nothing (`APPLIED`, `DUPLICATE`: a replay already applied it), replay from
`expected_seq` (`GAP`), or nothing because the live sequence went back, i.e. a new publisher
(the engine restarted), so the index was dropped first (`RESTARTED`). `accept_replayed` takes
the replay socket's batches. `resync(...)` is the way out of a gap the engine's replay buffer
cannot fill: the index is cleared and the batch applied, so from then on it holds only blocks
stored after the gap and *under*-reports (`exact` False) until the engine clears its cache
(restart, AllBlocksCleared).

Which events count: the engine's own KV cache (`medium` None or "GPU"; "CPU"/"STORAGE" are
offload tiers), KV cache group 0 (a model with one attention type has only that), and for
`BlockStored` every hash whatever its extra keys (LoRA, images, cache_salt): such blocks are
held, the router's own chain for a plain text prompt just never names them.

Memory: one Python int per block in a set: 69 bytes a block, 66 MiB per million blocks
(`python -m benchmarks.prefix_index_memory`, 2026-12-02); a 64-block lookup takes 10-20 us.
`max_blocks` bounds it: an index that would pass it is cleared and marked inexact (a leak of
lost removals cannot grow it without limit). A GPU engine holds far fewer blocks (an 80 GB KV
cache of a Llama-3-8B at 16 tokens a block is ~40 000).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from router.prefix.hashing import block_key
from router.prefix.wire import Batch, BlockRemoved, BlockStored

__all__ = ["DEFAULT_MAX_BLOCKS", "Accepted", "BlockIndex"]

DEFAULT_MAX_BLOCKS = 2_000_000  # per engine: ~132 MiB at the measured 69 B a block
_OWN_MEDIA = (None, "GPU")


class Accepted(enum.Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"  # already applied (from a replay): skipped
    GAP = "gap"  # batches are missing: replay from `expected_seq`, or `resync`
    RESTARTED = "restarted"  # seq went back: a new publisher; the index was dropped


@dataclass(slots=True)
class BlockIndex:
    """One engine's cached block keys (`hashing.block_key`) and how far its events got."""

    max_blocks: int = DEFAULT_MAX_BLOCKS
    keys: set[int] = field(default_factory=set)
    block_size_tokens: int | None = None  # from the engine's BlockStored events
    expected_seq: int = 0  # the next batch's sequence number
    exact: bool = True  # False: blocks stored before a lost batch are missing (under-reports)
    updated_at_s: float | None = None  # `now_s` of the last batch applied; None: none yet
    batches: int = 0  # applied since the last drop
    last_live_seq: int | None = None  # the PUB stream's last number seen

    def accept_live(self, seq: int, batch: Batch, now_s: float) -> Accepted:
        """A batch from the PUB stream, whose numbers only grow while the publisher lives."""
        restarted = self.last_live_seq is not None and seq <= self.last_live_seq
        if restarted:
            self.drop()
        self.last_live_seq = seq
        if seq < self.expected_seq:
            return Accepted.DUPLICATE
        if seq > self.expected_seq:
            return Accepted.GAP
        self._apply(seq, batch, now_s)
        return Accepted.RESTARTED if restarted else Accepted.APPLIED

    def accept_replayed(self, seq: int, batch: Batch, now_s: float) -> Accepted:
        """A batch from the replay socket (sent in order from `expected_seq` on, if kept)."""
        if seq < self.expected_seq:
            return Accepted.DUPLICATE
        if seq > self.expected_seq:
            return Accepted.GAP
        self._apply(seq, batch, now_s)
        return Accepted.APPLIED

    def resync(self, seq: int, batch: Batch, now_s: float) -> None:
        """Batches before `seq` are lost for good: start over from this one, inexact."""
        self.keys.clear()
        self.exact = False
        self._apply(seq, batch, now_s)

    def drop(self) -> None:
        """Forget everything (the engine restarted or may have): an empty cache, exactly."""
        self.keys.clear()
        self.block_size_tokens = None
        self.expected_seq = 0
        self.exact = True
        self.updated_at_s = None
        self.batches = 0
        self.last_live_seq = None

    def longest_prefix_blocks(self, chain: Sequence[int]) -> int:
        """How many leading blocks of a prompt's key chain this engine holds. vLLM reuses a
        prefix only up to its first missing block, so the count stops there."""
        n = 0
        for key in chain:
            if key not in self.keys:
                break
            n += 1
        return n

    def _apply(self, seq: int, batch: Batch, now_s: float) -> None:
        self.expected_seq = seq + 1
        self.updated_at_s = now_s
        self.batches += 1
        for event in batch.events:
            if event is None:  # AllBlocksCleared: the engine's cache is empty, exactly
                self.keys.clear()
                self.exact = True
            elif event.medium not in _OWN_MEDIA or event.group_idx not in (None, 0):
                continue
            elif isinstance(event, BlockStored):
                if event.block_size_tokens is not None and self.block_size_tokens is None:
                    self.block_size_tokens = event.block_size_tokens
                self._add(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.keys.difference_update(block_key(h) for h in event.block_hashes)

    def _add(self, hashes: Iterable[bytes | int]) -> None:
        self.keys.update(block_key(h) for h in hashes)
        if len(self.keys) > self.max_blocks:
            self.keys.clear()
            self.exact = False
