"""Micro-benchmark: bytes one instance's prefix-cache index (router/prefix/index.py) costs per
million cached blocks, and how long a prompt's longest-prefix lookup takes.

Fills a `BlockIndex` with N blocks through its own event path (BlockStored batches of 16
hashes, as the engine sends them: 64-bit ints), measures the process's traced allocations
(tracemalloc) before and after, then times `longest_prefix_blocks` on a 64-block chain that
is fully cached (the worst case: every key looked up).

    .venv/bin/python -m benchmarks.prefix_index_memory [--blocks 1000000] [--runs 3]
"""

from __future__ import annotations

import argparse
import gc
import random
import time
import tracemalloc

from router.prefix.index import BlockIndex
from router.prefix.wire import Batch, BlockStored


def _fill(blocks: int, rng: random.Random) -> tuple[BlockIndex, int, list[int]]:
    index = BlockIndex(max_blocks=blocks + 1)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    keys: list[int] = []
    for seq, start in enumerate(range(0, blocks, 16)):
        hashes = tuple(rng.getrandbits(64) for _ in range(min(16, blocks - start)))
        if len(keys) < 64:
            keys.extend(hashes)
        event = BlockStored(hashes, None, (), 128, "GPU", 0, True)
        index.accept_live(seq, Batch(0.0, (event,)), 0.0)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return index, after - before, keys[:64]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(27)
    for run in range(args.runs):
        index, used, chain = _fill(args.blocks, rng)
        assert len(index.keys) == args.blocks
        reps = 20_000
        t0 = time.perf_counter()
        for _ in range(reps):
            assert index.longest_prefix_blocks(chain) == 64
        lookup_us = (time.perf_counter() - t0) / reps * 1e6
        print(
            f"run {run}: {args.blocks} blocks: {used / 2**20:.1f} MiB,"
            f" {used / args.blocks:.1f} B/block ({used * 1e6 / args.blocks / 2**20:.1f} MiB per"
            f" million blocks); 64-block lookup {lookup_us:.2f} us"
        )
        del index


if __name__ == "__main__":
    main()
