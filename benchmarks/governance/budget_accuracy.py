"""Tenant budgets on a real CPU engine (issue 11, "Show it"): budget accuracy and borrowing.

One real CPU vLLM engine (the tiny dev model) behind gpupool routers built in this process.

**Accuracy.** Three tenants send a mix (chat and agent steps, prompts of 20-60 words, 4-32
output tokens; `a` and `b` stream, `c` mixes) from closed-loop workers until `--requests`
have finished: `a` with `tokens_per_minute` A (3 workers, far over it), `b` with A/2 (2
workers, over it), `c` with no budget (1 worker pausing 1 s). Measured per tenant: tokens
settled by the router (`gpupool_tenant_tokens_settled_total`) against the `usage` the clients
received, tokens still reserved once everything finished (`gpupool_tenant_tokens_reserved`;
reserved - settled = 0 means 0 here), and the served rate: the usage tokens of the requests
admitted between the first and the last request that had to wait for the bucket, over that
window (the bucket is empty at both ends; before it is the bucket's one-minute burst). A
streamed response's head arrives when it is admitted, so its head time is its admission time.

**Borrowing.** An owner `h` (`tokens_per_minute` 2B) idle for `--borrow-phase-s`, then back
(1 worker, pausing 2 s: under its own rate) for another phase, and a saturating `l` (B, 3
workers) throughout; run twice: `l` without `borrow_max_frac`, then with 0.5. Reported: engine
utilisation (the GPU-seconds the accountant attributed to requests over its capacity) and
tokens served in the idle phase, and the owner's wait (response head after sending, governance
and queue included) when back.

    python -m benchmarks.governance --out benchmarks/governance/results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.engines import cpu_engines
from pools.config import parse_config
from pools.devmodel import is_dev_model, make_dev_model
from pools.launchers import InstanceSpec
from pools.testing.serve import serve_asgi
from router.gateway.app import Gateway, create_app

MODEL_DIR = Path(".gpupool/models/tiny")
KEY_ENV = "GPUPOOL_GOVERNANCE_BENCH_ENGINE_KEY"
ENGINE_PORT = 8310  # this benchmark's port range: 8300-8349
WORDS = ("alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "tensor", "cache", "token")


def _dev_model() -> Path:
    if not is_dev_model(MODEL_DIR):
        make_dev_model(MODEL_DIR, "tiny")
    return MODEL_DIR.resolve()


def _say(message: str) -> None:
    print(f"[governance] {message}", file=sys.stderr, flush=True)


@dataclass
class Done:
    tenant: str
    sent_at_s: float
    head_at_s: float  # the response head arrived (streaming: admission)
    status: int
    tokens: int  # usage total (0 when refused)

    @property
    def head_wait_s(self) -> float:
        return self.head_at_s - self.sent_at_s


@dataclass
class Load:
    client: httpx.AsyncClient
    keys: dict[str, str]
    rng: random.Random
    t0: float = field(default_factory=time.monotonic)
    done: list[Done] = field(default_factory=list)
    stop: bool = False
    target: int = 0  # stop once this many have finished (0: when told)

    def ok(self, tenant: str | None = None) -> int:
        return sum(1 for d in self.done if d.status == 200 and tenant in (None, d.tenant))

    def body(self, stream: bool) -> dict[str, Any]:
        words = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(20, 60)))
        return {
            "model": "tiny",
            "messages": [{"role": "user", "content": words}],
            "max_tokens": self.rng.randint(4, 32),
            "ignore_eos": True,
            "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {}),
        }

    async def one(self, tenant: str, run_id: str | None, stream: bool) -> float:
        """One request; returns the seconds to wait before the next (a 429's Retry-After)."""
        headers = {"authorization": f"Bearer {self.keys[tenant]}"}
        if run_id is not None:
            headers["x-gpupool-run-id"] = run_id
        sent = time.monotonic() - self.t0
        async with self.client.stream(
            "POST", "/v1/chat/completions", json=self.body(stream), headers=headers
        ) as resp:
            head = time.monotonic() - self.t0
            raw = await resp.aread()
        tokens = 0
        if resp.status_code == 200:
            found = re.findall(rb'"total_tokens":(\d+)', raw)
            tokens = int(found[-1]) if found else 0
        self.done.append(Done(tenant, sent, head, resp.status_code, tokens))
        if self.target and self.ok() >= self.target:
            self.stop = True
        if resp.status_code == 429:
            return float(resp.headers.get("retry-after-ms", "1000")) / 1000
        return 0.0

    async def worker(self, tenant: str, w: int, *, pause_s: float, stream: bool | None) -> None:
        step = 0
        while not self.stop:
            run_id = f"{tenant}-{w}-{step // 5}" if self.rng.random() < 0.5 else None
            step += 1
            chosen = self.rng.random() < 0.5 if stream is None else stream
            wait_s = await self.one(tenant, run_id, chosen)
            await asyncio.sleep(wait_s + pause_s)


@asynccontextmanager
async def router(
    engine_url: str, engine_key: str | None, tenants: list[dict[str, Any]], tmp: Path
) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient]]:
    config = parse_config(
        {
            "model": {"name": "tiny", "path": str(_dev_model()), "max_model_len_tokens": 4096},
            "engines": {
                "launcher": "static",
                "static": {"urls": [engine_url], "api_key_env": KEY_ENV},
            },
            "pools": {"normal": {"classes": ["normal", "agent"], "share": {"initial_frac": 1}}},
            "classes": {"normal": {"expected_output_tokens": 32}},
            "tenants": tenants,
            "router": {
                "ledger_path": str(tmp / f"ledger-{os.urandom(4).hex()}.sqlite"),
                "state_path": str(tmp / "state.json"),
                "scrape_interval_s": 0.5,
            },
        }
    )
    gateway = create_app(config, [InstanceSpec("engine-0", engine_url, 1, api_key=engine_key)])
    await gateway.start()
    try:
        async with (
            serve_asgi(gateway) as url,
            httpx.AsyncClient(base_url=url, timeout=300) as client,
        ):
            yield gateway, client
    finally:
        await gateway.aclose()


def _metric(text: str, name: str, tenant: str) -> float | None:
    match = re.search(rf'^{name}{{tenant="{tenant}"}} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else None


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))], 3)


def served_rate(done: list[Done], wait_s: float = 0.3) -> dict[str, float] | None:
    """Tokens per minute admitted between the first and the last request that waited for the
    bucket (head after `wait_s`): both ends find the bucket empty."""
    ok = sorted((d for d in done if d.status == 200), key=lambda d: d.head_at_s)
    waited = [d for d in ok if d.head_wait_s > wait_s]
    if len(waited) < 2:
        return None
    start, end = waited[0].head_at_s, waited[-1].head_at_s
    tokens = sum(d.tokens for d in ok if start < d.head_at_s <= end)
    return {"window_s": round(end - start, 1), "tokens_per_minute": tokens / (end - start) * 60}


async def accuracy(args: argparse.Namespace, engine: InstanceSpec, tmp: Path) -> dict[str, Any]:
    keys = {t: f"gov-bench-{t}-" + os.urandom(4).hex() for t in ("a", "b", "c")}
    tpm: dict[str, int | None] = {"a": args.tpm, "b": args.tpm // 2, "c": None}
    tenants = [
        {"name": t, "api_key": keys[t], **({"tokens_per_minute": v} if v else {})}
        for t, v in tpm.items()
    ]
    tenants[2]["admin"] = True  # reads /metrics
    async with router(engine.url, engine.api_key, tenants, tmp) as (_gateway, client):
        load = Load(client, keys, random.Random(args.seed), target=args.requests)
        _say(f"accuracy: sending until {args.requests} requests have finished")
        await asyncio.gather(
            *(load.worker("a", i, pause_s=0.0, stream=True) for i in range(3)),
            *(load.worker("b", i, pause_s=0.0, stream=True) for i in range(2)),
            load.worker("c", 0, pause_s=1.0, stream=None),
        )
        wall_s = time.monotonic() - load.t0
        auth = {"authorization": f"Bearer {keys['c']}"}
        text = (await client.get("/metrics", headers=auth)).text
    out: dict[str, Any] = {"requests_finished": load.ok(), "wall_s": round(wall_s, 1)}
    for tenant, limit in tpm.items():
        mine = [d for d in load.done if d.tenant == tenant]
        ok = [d for d in mine if d.status == 200]
        entry: dict[str, Any] = {
            "tokens_per_minute": limit,
            "requests_ok": len(ok),
            "requests_429": sum(1 for d in mine if d.status == 429),
            "requests_other": sum(1 for d in mine if d.status not in (200, 429)),
            "usage_tokens": sum(d.tokens for d in ok),
            "settled_tokens": _metric(text, "gpupool_tenant_tokens_settled_total", tenant),
            "reserved_tokens_after": _metric(text, "gpupool_tenant_tokens_reserved", tenant),
            "head_wait_s_p50": _quantile([d.head_wait_s for d in ok], 0.5),
            "head_wait_s_p95": _quantile([d.head_wait_s for d in ok], 0.95),
        }
        rate = served_rate(mine) if limit is not None else None
        if rate is not None and limit is not None:
            entry["window_s"] = rate["window_s"]
            entry["served_tokens_per_minute"] = round(rate["tokens_per_minute"], 1)
            entry["served_vs_rate"] = round(rate["tokens_per_minute"] / limit - 1, 4)
        out[tenant] = entry
    return out


async def borrowing(
    args: argparse.Namespace, engine: InstanceSpec, tmp: Path, frac: float | None
) -> dict[str, Any]:
    keys = {t: f"gov-borrow-{t}-" + os.urandom(4).hex() for t in ("h", "l")}
    tenants = [
        {"name": "h", "api_key": keys["h"], "tokens_per_minute": 2 * args.borrow_tpm},
        {
            "name": "l",
            "api_key": keys["l"],
            "tokens_per_minute": args.borrow_tpm,
            **({"borrow_max_frac": frac} if frac else {}),
        },
    ]
    phase_s = args.borrow_phase_s
    async with router(engine.url, engine.api_key, tenants, tmp) as (gateway, _client):
        load = Load(_client, keys, random.Random(args.seed + 1))
        acct = gateway.accountant
        c0 = acct.conservation(gateway.clock())
        workers = [
            asyncio.ensure_future(load.worker("l", i, pause_s=0.0, stream=True)) for i in range(3)
        ]
        await asyncio.sleep(phase_s)  # the owner is idle
        c1 = acct.conservation(gateway.clock())
        back_at_s = time.monotonic() - load.t0
        # the owner back, under its own rate (~1 request of ~180 tokens every 2 s)
        owner = asyncio.ensure_future(load.worker("h", 0, pause_s=2.0, stream=True))
        await asyncio.sleep(phase_s)
        load.stop = True
        await asyncio.gather(*workers, owner)
    idle_phase = [d for d in load.done if d.tenant == "l" and d.head_at_s <= back_at_s]
    owner_ok = sorted(
        (d for d in load.done if d.tenant == "h" and d.status == 200), key=lambda d: d.sent_at_s
    )
    used_s = c1.attributed_gpu_seconds - c0.attributed_gpu_seconds
    cap_s = c1.capacity_gpu_seconds - c0.capacity_gpu_seconds
    return {
        "borrow_max_frac": frac,
        "idle_phase": {
            "seconds": phase_s,
            "l_tokens_per_minute": round(
                sum(d.tokens for d in idle_phase if d.status == 200) / phase_s * 60, 1
            ),
            "l_requests_429": sum(1 for d in idle_phase if d.status == 429),
            "engine_utilisation_frac": round(used_s / cap_s, 4) if cap_s else None,
        },
        "owner_back": {
            "requests_ok": len(owner_ok),
            "first_request_head_wait_s": round(owner_ok[0].head_wait_s, 3) if owner_ok else None,
            "requests_429": sum(1 for d in load.done if d.tenant == "h" and d.status == 429),
            "head_wait_s_p50": _quantile([d.head_wait_s for d in owner_ok], 0.5),
            "head_wait_s_p99": _quantile([d.head_wait_s for d in owner_ok], 0.99),
            "head_wait_s_max": _quantile([d.head_wait_s for d in owner_ok], 1.0),
        },
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = await asyncio.to_thread(_dev_model)
    os.environ.setdefault(KEY_ENV, "bench-" + os.urandom(8).hex())
    with tempfile.TemporaryDirectory(prefix="gpupool-gov-bench-") as tmp:
        launcher = cpu_engines(
            model_dir,
            count=1,
            port=args.engine_port,
            key_env=KEY_ENV,
            run_dir=Path(tmp) / "run",
            max_num_seqs=16,
            progress=_say,
        )
        (engine,) = await launcher.start()
        try:
            result: dict[str, Any] = {
                "command": " ".join(["python -m benchmarks.governance", *sys.argv[1:]]),
                "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            }
            if not args.skip_accuracy:
                result["accuracy"] = await accuracy(args, engine, Path(tmp))
            if not args.skip_borrowing:
                _say("borrowing: without, then with borrow_max_frac 0.5")
                result["borrowing"] = [
                    await borrowing(args, engine, Path(tmp), None),
                    await borrowing(args, engine, Path(tmp), 0.5),
                ]
        finally:
            await launcher.aclose()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.governance")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--tpm", type=int, default=6000, help="tenant a's tokens per minute")
    parser.add_argument("--borrow-tpm", type=int, default=3000, help="tenant l's base rate")
    parser.add_argument("--borrow-phase-s", type=float, default=60.0)
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--skip-borrowing", action="store_true")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--engine-port", type=int, default=ENGINE_PORT)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/governance/results"))
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0
