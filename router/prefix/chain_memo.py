"""`ChainMemo`: vLLM's block hash chain (router.prefix.hashing) with each block's digest
remembered by (parent digest, block token ids), so a prompt whose leading blocks were hashed
before (a shared system prompt, the turns so far) hashes only its new blocks; the result is the
same chain. Thread safe: the request path hashes a long prompt in a worker thread."""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from router.prefix.hashing import DEFAULT_SEED, block_key, chain_keys, hash_block, none_hash

__all__ = ["MEMO_TOKENS", "ChainMemo"]


MEMO_TOKENS = 1 << 20  # ChainMemo's bound in the tokens of the blocks it keeps (~15-60 MB)


class ChainMemo:
    """`chain_keys` with each block's digest remembered by (parent digest, the block's token
    ids): a prefix hashed before costs a dict probe a block (~1 us at 128 tokens) instead of
    its CBOR and SHA-256 (~20 us). LRU, at most `max_tokens` tokens' blocks; thread safe."""

    def __init__(self, max_tokens: int = MEMO_TOKENS) -> None:
        self._memo: OrderedDict[tuple[bytes, bytes], bytes] = OrderedDict()
        self._tokens = 0
        self._max_tokens = max_tokens
        self._lock = threading.Lock()

    @property
    def memo_tokens(self) -> int:
        return self._tokens

    def keys(
        self, token_ids: Sequence[int], block_size: int, seed: str = DEFAULT_SEED
    ) -> list[int]:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        n_blocks = len(token_ids) // block_size
        try:
            raw = array("I", token_ids[: n_blocks * block_size]).tobytes()
        except OverflowError:  # an id past 32 bits (no vocabulary has one): not memoised
            return chain_keys(token_ids, block_size, seed)
        width = 4 * block_size
        parent = none_hash(seed)
        out: list[int] = []
        with self._lock:
            for i in range(n_blocks):
                digest = self._memo.get(key := (parent, raw[i * width : (i + 1) * width]))
                if digest is None:
                    break
                self._memo.move_to_end(key)
                out.append(block_key(digest))
                parent = digest
        new: list[tuple[tuple[bytes, bytes], bytes]] = []
        for i in range(len(out), n_blocks):
            start = i * block_size
            digest = hash_block(parent, token_ids[start : start + block_size])
            new.append(((parent, raw[i * width : (i + 1) * width]), digest))
            out.append(block_key(digest))
            parent = digest
        if new and block_size <= self._max_tokens:
            with self._lock:
                for key, digest in new:
                    if key not in self._memo:
                        self._memo[key] = digest
                        self._tokens += block_size
                while self._tokens > self._max_tokens:
                    self._memo.popitem(last=False)
                    self._tokens -= block_size
        return out
