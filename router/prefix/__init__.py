"""Where each engine's prefix cache is: an index per instance, kept from vLLM's KV events.

An engine started with `--kv-events-config` publishes every block it caches or evicts over
ZMQ (`wire.py` decodes the format); `EngineEvents` (`subscriber.py`) keeps one engine's
`BlockIndex` (`index.py`, the pure core) from that stream through gaps, reconnects and
restarts; `hashing.py` computes the same block hash chain for a prompt's token ids
(`--prefix-caching-hash-algo sha256_cbor`, a seed every process agrees on), and `ChatPrompt`
(`prompt.py`) the token ids vLLM makes of a chat request. `PrefixCache`
(`cache.py`) follows every instance that publishes and answers "how many leading blocks of
this prompt does each instance hold".

What was checked against the installed vLLM (0.32.0) is written down, with file and line
references, in docs/prefix_cache.md.
"""

from router.prefix.cache import IndexView, PrefixCache
from router.prefix.hashing import DEFAULT_SEED, block_key, chain_hashes, chain_keys, none_hash
from router.prefix.prompt import ChatPrompt

__all__ = [
    "DEFAULT_SEED",
    "ChatPrompt",
    "IndexView",
    "PrefixCache",
    "block_key",
    "chain_hashes",
    "chain_keys",
    "none_hash",
]
