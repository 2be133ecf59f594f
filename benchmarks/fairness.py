"""Fairness benchmark: two tenants with weights 5:1 both saturate one pool; how are tokens
shared?

One real CPU vLLM engine (the tiny dev model) runs with `--max-num-seqs` small enough that the
pool's queue, not the engine, decides who goes next. Two tenants (`paid`, weight 5; `free`,
weight 1) each keep the same number of closed-loop clients busy with identical chat requests.
gpupool runs in this process in front of the engine, once with `queue.order: wfq` and once
with `queue.order: fifo`, side by side on the same engine. Over the measurement window
(after a warm-up) it counts the completion tokens each tenant was served.

With WFQ the served-token ratio should be 5:1 (target: within ±10 %); with FIFO it follows
the clients' own arrival (about 1:1 with equal client counts).

    python -m benchmarks.fairness --out benchmarks/results/fairness-YYYY-MM-DD
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.engines import cpu_engines
from pools.config import parse_config
from pools.devmodel import is_dev_model, make_dev_model
from pools.launchers import InstanceSpec
from pools.testing.serve import serve_asgi
from router.gateway.app import create_app

MODEL_DIR = Path(".gpupool/models/tiny")
TENANTS = {"paid": 5.0, "free": 1.0}


@dataclass
class Tally:
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TENANTS, 0))
    requests: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TENANTS, 0))
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TENANTS, 0))
    errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TENANTS, 0))


def _router_config(engine_url: str, api_key_env: str, order: str, tmp: Path) -> Any:
    return parse_config(
        {
            "model": {"name": "tiny", "path": str(MODEL_DIR), "max_model_len_tokens": 4096},
            "engines": {
                "launcher": "static",
                "static": {"urls": [engine_url], "api_key_env": api_key_env},
            },
            "pools": {
                "agent": {"classes": ["agent"], "share": {"initial_frac": 0.0}},
                "normal": {
                    "classes": ["normal"],
                    "share": {"initial_frac": 1.0},
                    "queue": {"max_depth": 1024, "max_wait_s": 120, "order": order},
                },
            },
            "classes": {"normal": {"timeout_s": 300, "expected_output_tokens": 32}},
            "tenants": [
                {"name": name, "api_key": f"key-{name}", "weight": weight}
                for name, weight in TENANTS.items()
            ],
            "router": {
                "scrape_interval_s": 0.25,
                "ledger_path": str(tmp / f"ledger-{order}.sqlite"),
                "state_path": str(tmp / "state.json"),
                "admin_api_key_env": None,
            },
        }
    )


async def _client(
    session: aiohttp.ClientSession,
    url: str,
    tenant: str,
    body: dict[str, Any],
    tally: Tally,
    window: tuple[float, float],
    stop_at: float,
) -> None:
    headers = {"authorization": f"Bearer key-{tenant}"}
    while time.monotonic() < stop_at:
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            data = await r.read()
            done = time.monotonic()
            if r.status == 429:
                tally.rejected[tenant] += 1
                await asyncio.sleep(0.5)
                continue
            if r.status != 200:
                tally.errors[tenant] += 1
                await asyncio.sleep(0.5)
                continue
            if window[0] <= done <= window[1]:
                tally.tokens[tenant] += json.loads(data)["usage"]["completion_tokens"]
                tally.requests[tenant] += 1


async def _run_order(
    engine: InstanceSpec,
    key_env: str,
    order: str,
    *,
    clients: int,
    warmup_s: float,
    measure_s: float,
    tmp: Path,
) -> dict[str, Any]:
    gateway = create_app(_router_config(engine.url, key_env, order, tmp), [engine])
    await gateway.start()
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "tell me about queues " * 20}],
        "max_tokens": 32,
        "ignore_eos": True,
    }
    tally = Tally()
    try:
        async with serve_asgi(gateway) as url, aiohttp.ClientSession() as session:
            start = time.monotonic()
            window = (start + warmup_s, start + warmup_s + measure_s)
            stop_at = window[1]
            await asyncio.gather(
                *(
                    _client(session, url, tenant, body, tally, window, stop_at)
                    for tenant in TENANTS
                    for _ in range(clients)
                )
            )
            view = gateway.pools_view()
    finally:
        await gateway.aclose()
    paid, free = tally.tokens["paid"], tally.tokens["free"]
    ratio = paid / free if free else float("inf")
    total = paid + free
    return {
        "order": order,
        "tokens": tally.tokens,
        "requests": tally.requests,
        "rejected": tally.rejected,
        "errors": tally.errors,
        "paid_to_free_ratio": round(ratio, 3),
        "paid_share": round(paid / total, 4) if total else None,
        "expected_paid_share": round(5 / 6, 4),
        "tokens_per_s": round(total / measure_s, 1),
        "operating_point_limit": next(iter(view["instances"].values()))["operating_point"],
    }


async def _main(args: argparse.Namespace) -> int:
    if not is_dev_model(MODEL_DIR):
        make_dev_model(MODEL_DIR, "tiny")
    key_env = "GPUPOOL_FAIRNESS_ENGINE_KEY"
    import os

    os.environ.setdefault(key_env, "fairness-" + os.urandom(6).hex())
    tmp = Path(tempfile.mkdtemp(prefix="gpupool-fairness-"))
    launcher = cpu_engines(
        MODEL_DIR,
        count=1,
        port=args.engine_port,
        key_env=key_env,
        run_dir=tmp / "run",
        max_num_seqs=args.max_num_seqs,
        progress=lambda m: print(f"[engine] {m}", file=sys.stderr, flush=True),
    )
    (engine,) = await launcher.start()
    results = []
    try:
        for round_ in range(args.rounds):
            for order in ("wfq", "fifo"):
                print(f"round {round_ + 1}: order {order} ...", file=sys.stderr, flush=True)
                result = await _run_order(
                    engine,
                    key_env,
                    order,
                    clients=args.clients,
                    warmup_s=args.warmup_s,
                    measure_s=args.measure_s,
                    tmp=tmp,
                )
                result["round"] = round_ + 1
                print(f"  {result}", file=sys.stderr, flush=True)
                results.append(result)
    finally:
        await launcher.aclose()
    out = Path(args.out)
    await asyncio.to_thread(out.mkdir, parents=True, exist_ok=True)
    report = {
        "benchmark": "fairness",
        "command": "python -m benchmarks.fairness " + " ".join(sys.argv[1:]),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "setup": {
            "tenants": TENANTS,
            "clients_per_tenant": args.clients,
            "engine_max_num_seqs": args.max_num_seqs,
            "warmup_s": args.warmup_s,
            "measure_s": args.measure_s,
            "request": "chat, ~100 prompt tokens, max_tokens 32, ignore_eos",
        },
        "results": results,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(_markdown(report))
    print((out / "report.md").read_text())
    return 0


def _markdown(report: dict[str, Any]) -> str:
    setup = report["setup"]
    lines = [
        "# Fairness: two tenants, weights 5:1, both saturating one pool",
        "",
        f"Command: `{report['command']}`",
        "",
        f"One real CPU vLLM engine (tiny dev model, `--max-num-seqs "
        f"{setup['engine_max_num_seqs']}`), all of it allocated to the normal pool; "
        f"{setup['clients_per_tenant']} closed-loop clients per tenant sending identical "
        f"requests ({setup['request']}); tokens counted over {setup['measure_s']:g} s after "
        f"{setup['warmup_s']:g} s of warm-up.",
        "",
        "| round | order | paid tokens | free tokens | paid:free | paid share (5:1 = 0.833)"
        " | tok/s | 429s | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['round']} | {r['order']} | {r['tokens']['paid']} | {r['tokens']['free']} | "
            f"{r['paid_to_free_ratio']} | {r['paid_share']} | {r['tokens_per_s']} | "
            f"{sum(r['rejected'].values())} | {sum(r['errors'].values())} |"
        )
    wfq = [r["paid_to_free_ratio"] for r in report["results"] if r["order"] == "wfq"]
    within = all(4.5 <= x <= 5.5 for x in wfq)
    lines += [
        "",
        f"WFQ paid:free ratios {wfq}: {'within' if within else 'NOT within'} ±10 % of 5:1.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", type=int, default=12, help="closed-loop clients per tenant")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument("--measure-s", type=float, default=60.0)
    parser.add_argument("--engine-port", type=int, default=8460)
    return asyncio.run(_main(parser.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
