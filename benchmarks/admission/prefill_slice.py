"""How long a short chat prompt waits behind long uncached prefills on one engine, by vLLM's
`--long-prefill-token-threshold` (issue 26, item 2: bound the prefill a chat request shares a
step with).

    python -m benchmarks.admission.prefill_slice --out DIR [--thresholds 0,256,512]

For each threshold one CPU engine is started (gpupool's local launcher, `engine-fcfs.yaml`
with `--long-prefill-token-threshold N` added; 0: vLLM's default, no cap) and measured twice:
- alone: a chat probe (`--chat-tokens` uncached prompt tokens, one output token, so its
  latency is its time to first token) every `--probe-interval-s`, nothing else running;
- loaded: the same probes while `--agents` clients each send long uncached prompts
  (`--agent-tokens` tokens, `--agent-output` output tokens) back to back, as agent steps
  whose prefix was evicted do on `kv_pressure`.
Prompts are random token ids, so nothing is served from the prefix cache. Reported per
threshold: the probes' p50/p95/p99 alone and loaded, loaded p99 over alone p99, and the agent
clients' prefilled tokens per second (the price of slicing: more, smaller steps).

Writes `DIR/prefill_slice.json` and prints a table. Run it under
`flock /tmp/gpupool-engines.lock` (it starts engines) from the repository root.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from pools.config import load_config
from pools.launchers.local import LocalLauncher

__all__ = ["main"]

log = logging.getLogger("prefill_slice")
HERE = Path(__file__).resolve().parent


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


async def _complete(
    session: aiohttp.ClientSession, url: str, key: str | None, prompt: list[int], max_tokens: int
) -> float:
    """Seconds until the whole answer came back (for max_tokens 1: the time to first token)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    t0 = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        resp.raise_for_status()
        await resp.read()
    return time.perf_counter() - t0


async def _phase(
    session: aiohttp.ClientSession,
    url: str,
    key: str | None,
    args: argparse.Namespace,
    agents: int,
    seed: int,
) -> dict[str, Any]:
    rng = random.Random(seed)
    stop = asyncio.Event()
    prefilled = [0]

    async def agent(i: int) -> None:
        arng = random.Random(seed * 100 + i)
        while not stop.is_set():
            await _complete(
                session,
                url,
                key,
                _prompt(arng, args.agent_tokens, args.vocab),
                args.agent_output,
            )
            prefilled[0] += args.agent_tokens

    tasks = [asyncio.create_task(agent(i)) for i in range(agents)]
    await asyncio.sleep(1.0 if agents else 0.0)
    t0 = time.perf_counter()
    base = prefilled[0]
    probes: list[float] = []
    for _ in range(args.probes):
        # a random offset inside the interval: probes land anywhere in the agents' steps
        await asyncio.sleep(rng.uniform(0.5, 1.5) * args.probe_interval_s)
        probes.append(
            await _complete(session, url, key, _prompt(rng, args.chat_tokens, args.vocab), 1)
        )
    wall = time.perf_counter() - t0
    done = prefilled[0] - base
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    ms = np.array(probes) * 1000
    return {
        "probes": len(probes),
        "ttft_ms": {q: float(np.percentile(ms, int(q[1:]))) for q in ("p50", "p95", "p99")},
        "agent_prefill_tok_s": done / wall if agents else None,
    }


async def amain(args: argparse.Namespace) -> int:
    out = Path(args.out)
    results: dict[str, Any] = {"args": {k: v for k, v in vars(args).items()}, "runs": {}}
    for n in (int(x) for x in args.thresholds.split(",")):
        cfg = load_config(HERE / "engine-fcfs.yaml")
        local = cfg.engines.local
        extra = ("--long-prefill-token-threshold", str(n)) if n else ()
        local = dataclasses.replace(
            local,
            kv_cache_bytes=args.kv_cache_bytes,
            vllm_args=(*local.vllm_args, *extra, *args.engine_args.split()),
            base_port=args.port,
            run_dir=Path(args.work_dir) / f"run-{n}",
        )
        launcher = LocalLauncher(local, cfg.model, progress=lambda m: log.info("%s", m))
        try:
            spec = (await launcher.start())[0]
            timeout = aiohttp.ClientTimeout(total=120)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                await _complete(session, spec.url, spec.api_key, [11] * 64, 1)  # warm-up
                alone = await _phase(session, spec.url, spec.api_key, args, 0, 1)
                loaded = await _phase(session, spec.url, spec.api_key, args, args.agents, 2)
        finally:
            await launcher.aclose()
        ratio = loaded["ttft_ms"]["p99"] / alone["ttft_ms"]["p99"]
        results["runs"][str(n)] = {
            "alone": alone,
            "loaded": loaded,
            "p99_ratio": ratio,
            "load_avg": os.getloadavg()[0],
        }
        log.info("threshold %d: %s", n, json.dumps(results["runs"][str(n)]))
    (out / "prefill_slice.json").write_text(json.dumps(results, indent=2) + "\n")
    print(
        "| threshold | alone p50/p99 ms | loaded p50/p95/p99 ms | p99 ratio | agent prefill tok/s |"
    )
    print("|---|---|---|---|---|")
    for n, r in results["runs"].items():
        a, lo = r["alone"]["ttft_ms"], r["loaded"]["ttft_ms"]
        print(
            f"| {n} | {a['p50']:.0f} / {a['p99']:.0f} | {lo['p50']:.0f} / {lo['p95']:.0f} /"
            f" {lo['p99']:.0f} | {r['p99_ratio']:.2f} | {r['loaded']['agent_prefill_tok_s']:.0f} |"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.admission.prefill_slice", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", required=True)
    p.add_argument("--thresholds", default="0,256,512", help="0: no cap (vLLM's default)")
    p.add_argument("--engine-args", default="", help="more vLLM arguments for every engine")
    p.add_argument("--kv-cache-bytes", type=int, default=16777216)
    p.add_argument("--agents", type=int, default=3, help="clients sending long prompts")
    p.add_argument("--agent-tokens", type=int, default=3000)
    p.add_argument("--agent-output", type=int, default=16)
    p.add_argument("--chat-tokens", type=int, default=256)
    p.add_argument("--probes", type=int, default=40)
    p.add_argument("--probe-interval-s", type=float, default=0.4)
    p.add_argument("--vocab", type=int, default=4096, help="the dev model's vocabulary size")
    p.add_argument("--port", type=int, default=8795)
    p.add_argument("--work-dir", default=".gpupool/bench-prefill-slice")
    args = p.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
