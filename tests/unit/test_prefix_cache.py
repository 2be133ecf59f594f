"""The router's block hash chain (router/prefix/hashing.py) against vLLM's own functions."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.prefix.hashing import DEFAULT_SEED, block_key, chain_hashes, chain_keys, none_hash

kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
hashing = pytest.importorskip("vllm.utils.hashing")


def _vllm_chain(token_ids: list[int], block_size: int, seed: str) -> list[bytes]:
    none = hashing.sha256_cbor(seed)
    parent = none
    out = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = kv_cache_utils.hash_block_tokens(
            hashing.sha256_cbor, parent, token_ids[start : start + block_size]
        )
        out.append(parent)
    return out


def test_default_seed_is_vllms() -> None:
    assert DEFAULT_SEED == kv_cache_utils.DEFAULT_NONE_HASH_SEED
    assert none_hash() == hashing.sha256_cbor(DEFAULT_SEED)


@settings(max_examples=60, deadline=None)
@given(
    token_ids=st.lists(st.integers(min_value=0, max_value=2**32), max_size=70),
    block_size=st.sampled_from([1, 4, 16, 23]),
    seed=st.sampled_from([DEFAULT_SEED, "0", "12345", "é"]),
)
def test_chain_matches_vllm(token_ids: list[int], block_size: int, seed: str) -> None:
    assert chain_hashes(token_ids, block_size, seed) == _vllm_chain(token_ids, block_size, seed)


def test_partial_block_has_no_hash() -> None:
    assert chain_hashes(list(range(31)), 16) == chain_hashes(list(range(16)), 16)
    assert len(chain_keys(list(range(32)), 16)) == 2


def test_key_is_vllms_int_form() -> None:
    digest = chain_hashes(list(range(16)), 16)[0]
    os.environ.setdefault("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    as_int = int.from_bytes(digest, "big") & ((1 << 64) - 1)  # maybe_convert_block_hash
    assert block_key(digest) == as_int == block_key(as_int)


def test_engine_none_hash_follows_pythonhashseed(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM reads PYTHONHASHSEED when the engine starts (`init_none_hash`): without it
    sha256_cbor's seed is the fixed default, the same in every process; with it, its value."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    kv_cache_utils.init_none_hash(hashing.sha256_cbor)
    assert none_hash() == kv_cache_utils.NONE_HASH
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    kv_cache_utils.init_none_hash(hashing.sha256_cbor)
    assert none_hash("7") == kv_cache_utils.NONE_HASH
    monkeypatch.delenv("PYTHONHASHSEED")
    kv_cache_utils.init_none_hash(hashing.sha256_cbor)
