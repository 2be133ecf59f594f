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

`router.prefix.chain_memo.ChainMemo` remembers these digests, so a prompt whose leading blocks
were hashed before hashes only its new blocks.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence

__all__ = [
    "DEFAULT_SEED",
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
