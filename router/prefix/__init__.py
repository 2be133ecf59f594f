"""Where each engine's prefix cache is: an index per instance, kept from vLLM's KV events.

An engine started with `--kv-events-config` publishes every block it caches or evicts over
ZMQ (`wire.py` decodes the format); `hashing.py` computes the same block hash chain for a
prompt's token ids (`--prefix-caching-hash-algo sha256_cbor`, a seed every process agrees
on).

What was checked against the installed vLLM (0.32.0) is written down, with file and line
references, in docs/prefix_cache.md.
"""

from router.prefix.hashing import DEFAULT_SEED, block_key, chain_hashes, chain_keys, none_hash

__all__ = ["DEFAULT_SEED", "block_key", "chain_hashes", "chain_keys", "none_hash"]
