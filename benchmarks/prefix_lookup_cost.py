"""Micro-benchmark: what looking a chat prompt up in the prefix-cache indexes costs on the
request path (router/prefix/lookup.py): its token ids as vLLM makes them (`ChatPrompt`, the dev
model's template and tokenizer) and its block key chain (`chain_keys`, 128-token blocks, the
CPU engine's size), per prompt length; and the whole lookup when no index is usable (the cost
every request pays once KV events are followed but none is connected).

    .venv/bin/python -m benchmarks.prefix_lookup_cost [--model .gpupool/models/tiny] [--runs 15]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from router.prefix import ChatPrompt, PrefixCache
from router.prefix.hashing import DEFAULT_SEED, chain_keys
from router.prefix.lookup import PrefixLookup

_RULE = "Rule 7: keep the tool output short and cite the file. "


def _body(chars: int) -> dict[str, Any]:
    system = (_RULE * (chars // len(_RULE) + 1))[:chars]
    return {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Where is the config parsed?"},
        ],
    }


async def _unusable_us(prompt: ChatPrompt, n: int) -> float:
    lookup = PrefixLookup(PrefixCache([]), prompt)  # followed, nothing usable
    body = _body(40_000)
    start = time.perf_counter()
    for _ in range(n):
        await lookup.lookup(body, 40_000)
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path(".gpupool/models/tiny"))
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    prompt = ChatPrompt.from_model_dir(args.model)
    if prompt is None:
        raise SystemExit(f"no chat template and tokenizer under {args.model}")
    for chars in (2_000, 8_000, 32_000):
        body = _body(chars)
        ids_s, chain_s = [], []
        n_tokens = 0
        for _ in range(args.runs):
            t0 = time.perf_counter()
            ids = prompt.token_ids(body)
            t1 = time.perf_counter()
            assert ids is not None
            chain_keys(ids, 128, DEFAULT_SEED)
            chain_s.append(time.perf_counter() - t1)
            ids_s.append(t1 - t0)
            n_tokens = len(ids)
        print(
            f"{chars} chars, {n_tokens} tokens: token ids {statistics.median(ids_s) * 1e3:.2f} ms,"
            f" 128-token chain {statistics.median(chain_s) * 1e3:.2f} ms (medians)"
        )
    print(f"no usable index: {asyncio.run(_unusable_us(prompt, 100_000)):.2f} us per lookup")


if __name__ == "__main__":
    main()
