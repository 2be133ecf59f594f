"""vLLM's prefix-cache block hash chain, recomputed by the router (pure; no vLLM import).

vLLM (v1/core/kv_cache_utils.py `hash_block_tokens`, utils/hashing.py `sha256_cbor`) hashes
each *full* block of `block_size` prompt tokens as

    hash_i = sha256(cbor_canonical((hash_{i-1}, tuple(tokens_i), extra_keys)))

with hash_{-1} = NONE_HASH = sha256(cbor_canonical(seed)), seed = $PYTHONHASHSEED if the engine
has it set, else the fixed "vllm-none-hash" (`DEFAULT_NONE_HASH_SEED`; only xxhash algos draw a
random per-process seed). `extra_keys` is None for a plain text request (no LoRA, no multimodal
input, no `cache_salt`, no prompt embeddings): the only kind the router hashes.

KV events carry the 32-byte digest (or, with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, its low
64 bits as an int). The index keys every hash by its low 64 bits (`block_key`), so both forms
meet, and a key costs one int.

`ChainMemo` remembers block digests by (parent digest, block token ids), so a prompt whose
leading blocks were hashed before (a shared system prompt, the turns so far) hashes only its
new blocks; the result is the same chain.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence

__all__ = [
    "DEFAULT_SEED",
    "ChainMemo",
    "block_key",
    "chain_hashes",
    "chain_keys",
    "hash_block",
    "none_hash",
]

DEFAULT_SEED = "vllm-none-hash"  # vLLM's DEFAULT_NONE_HASH_SEED (kv_cache_utils.py)
_MASK_64 = (1 << 64) - 1


def _head(major: int, n: int) -> bytes:
    """A CBOR item head: major type and argument, shortest form (canonical CBOR)."""
    if n < 24:
        return bytes([major << 5 | n])
    if n < 0x100:
        return bytes([major << 5 | 24, n])
    if n < 0x10000:
        return bytes([major << 5 | 25]) + struct.pack(">H", n)
    if n < 0x100000000:
        return bytes([major << 5 | 26]) + struct.pack(">I", n)
    if n <= _MASK_64:
        return bytes([major << 5 | 27]) + struct.pack(">Q", n)
    raise ValueError("integer out of CBOR's 64-bit range")


# a token id's CBOR bytes, memoised: building them is most of a block's hash (4,096 tokens:
# 2.75 -> 0.47 ms); bounded (at most 2^16 ids, a few MiB), as vocabularies reach 256k
@functools.lru_cache(maxsize=1 << 16)
def _int(value: int) -> bytes:
    return _head(0, value) if value >= 0 else _head(1, -1 - value)


@functools.lru_cache(maxsize=64)
def none_hash(seed: str = DEFAULT_SEED) -> bytes:
    """NONE_HASH: sha256 of the seed string as canonical CBOR (a text string)."""
    raw = seed.encode()
    return hashlib.sha256(_head(3, len(raw)) + raw).digest()


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """`sha256_cbor((parent, tuple(token_ids), None))`: one block whose extra keys are None."""
    body = b"".join([_head(4, 3), _head(2, len(parent)), parent, _head(4, len(token_ids))])
    return hashlib.sha256(body + b"".join(map(_int, token_ids)) + b"\xf6").digest()


def chain_hashes(
    token_ids: Sequence[int], block_size: int, seed: str = DEFAULT_SEED
) -> list[bytes]:
    """The digests of every full block of `token_ids` (a trailing partial block has none)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    parent = none_hash(seed)
    out: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        out.append(parent)
    return out


def block_key(block_hash: bytes | int) -> int:
    """A block hash as the index keys it: the low 64 bits, as vLLM's int form has them."""
    if isinstance(block_hash, int):
        return block_hash & _MASK_64
    return int.from_bytes(block_hash[-8:], "big")


def chain_keys(token_ids: Sequence[int], block_size: int, seed: str = DEFAULT_SEED) -> list[int]:
    """`chain_hashes` as index keys."""
    return [block_key(h) for h in chain_hashes(token_ids, block_size, seed)]


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
