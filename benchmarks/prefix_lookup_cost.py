"""Micro-benchmark: what looking a chat prompt up in the prefix-cache indexes costs on the
request path (router/prefix/lookup.py): its token ids as vLLM makes them (`ChatPrompt`, the dev
model's template and tokenizer) and its block key chain (`chain_keys`, 128-token blocks, the
CPU engine's size), per prompt length, for a prompt never seen (a system prompt of a new
tenant each run: the whole cost) and for one whose system prompt was seen before with a new
user turn after it (the memos warm: what a tenant's next conversation costs); and the whole
lookup when no index is usable (the cost every request pays once KV events are followed but none
is connected).

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
from router.prefix.chain_memo import ChainMemo
from router.prefix.hashing import DEFAULT_SEED
from router.prefix.lookup import PrefixLookup

_RULE = "Rule 7: keep the tool output short and cite the file. "


def _body(chars: int, turn: int = 0, tenant: int = 0) -> dict[str, Any]:
    system = (f"You work for tenant {tenant}. " + _RULE * (chars // len(_RULE) + 1))[:chars]
    return {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Where is the config parsed? (question {turn})"},
        ],
    }


def _time(prompt: ChatPrompt, memo: ChainMemo, body: dict[str, Any]) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    ids = prompt.token_ids(body)
    t1 = time.perf_counter()
    assert ids is not None
    memo.keys(ids, 128, DEFAULT_SEED)
    return t1 - t0, time.perf_counter() - t1, len(ids)


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
        cold: list[tuple[float, float, int]] = []
        seen: list[tuple[float, float, int]] = []
        memo = ChainMemo()
        _time(prompt, memo, _body(chars, turn=-1))  # tenant 0's system prompt seen once
        for run in range(args.runs):
            cold.append(_time(prompt, memo, _body(chars, turn=run, tenant=1 + run)))
            seen.append(_time(prompt, memo, _body(chars, turn=run)))
        for name, rows in (("never seen", cold), ("seen prefix + new user turn", seen)):
            print(
                f"{chars} chars, {rows[0][2]} tokens, {name}: token ids"
                f" {statistics.median(r[0] for r in rows) * 1e3:.2f} ms, 128-token chain"
                f" {statistics.median(r[1] for r in rows) * 1e3:.2f} ms (medians of {args.runs})"
            )
    print(f"no usable index: {asyncio.run(_unusable_us(prompt, 100_000)):.2f} us per lookup")


if __name__ == "__main__":
    main()
