"""Placement by cached prefix (issue 27's done-when), side by side on the same real CPU engines:
gpupool placing by its KV-event index vs gpupool with the index off vs vllm-router's
`round_robin` and `cache_aware` policies.

Three CPU vLLM engines (the tiny dev model, a small KV cache: `--kv-cache-mib` each, so the
tenants' system prompts fit in the three caches together but not in one; KV events on, as the
local launcher starts them; `--enable-prompt-tokens-details`, so each response says how many
prompt tokens the engine found cached). Several tenants, each with a distinct system prompt of
1.5-3k tokens; sessions arrive (Poisson) for `--duration-s`, half of them chats (no run id),
half agent runs (`x-gpupool-run-id`), each 1-3 turns that carry the conversation so far (the
assistant's reply, then a new user turn). The same drawn plan goes to every target in turn,
each engine's prefix cache emptied before each (`POST /reset_prefix_cache`, dev mode).

Reported per target: client TTFT p50/p90/p99 (streaming, first chunk with a token); the
engines' prefix-cache hit rate over the target's run (vLLM's `vllm:prefix_cache_hits_total` /
`vllm:prefix_cache_queries_total`, prompt tokens, summed over engines); the oracle's hit rate
for the same requests (each request on an instance holding its longest previously-sent prefix:
the leading full blocks any earlier request's hash chain holds, capped at vLLM's
`num_tokens - 1`; no eviction, so an upper bound); for the gpupool targets, admission's
predicted prefill (the lease's prompt tokens, recorded in-process) against the engine's
(prompt tokens less `prompt_tokens_details.cached_tokens`).

The rate: `--rate-per-s` sessions/s, or by default sized from a calibration on this machine
(the TTFT of a cold and of a cached ~2k-token prompt on an idle engine) so that the engines
would be ~`--load-frac` busy if every prompt were prefilled from scratch. `--load-fracs
0.4,0.8` runs every target at each of several levels in one invocation (one engine start, one
calibration, the same tenants; each level its own drawn sessions). Each target's row also
says how busy the engines really were: their processes' CPU seconds over the run's wall time
and the CPUs they could use (`engine_cpu_frac`, min(CPUs, engines)), since the nominal level
leaves out decode, cache hits and engines sharing cores.

    flock /tmp/gpupool-engines.lock .venv/bin/python -m benchmarks.prefix_placement \\
        --out benchmarks/results/prefix-placement-YYYY-MM-DD
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import random
import secrets
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.admission.kv_pressure import reset_prefix_cache
from benchmarks.agent_flood_admission import tree_cpu_s
from benchmarks.outputs import bulk_path
from benchmarks.placement import hit_rate, prefix_counters
from pools.config import Config, parse_config
from pools.launchers import InstanceSpec, LocalLauncher
from pools.testing.serve import serve_asgi
from router.gateway.app import create_app
from router.prefix import ChatPrompt
from router.prefix.hashing import DEFAULT_SEED, chain_keys

MODEL_DIR = Path(".gpupool/models/tiny")
VLLM_ROUTER = Path(".venv-peers/vllmrouter/bin/vllm-router")
BLOCK_TOKENS = 128  # the CPU engines' block size
MAX_TOKENS = 16
KEY_ENV = "GPUPOOL_PREFIX_PLACEMENT_ENGINE_KEY"
WORDS = [
    *("alpha", "beta", "gamma", "delta", "config", "parser", "module", "request", "engine"),
    *("cache", "token", "block", "schema", "tool", "result", "error", "retry", "budget"),
    *("tenant", "policy", "limit", "queue", "latency", "throughput", "report", "file"),
    *("line", "function", "argument", "return", "value", "index", "prefix", "stream"),
]


def _say(message: str) -> None:
    print(f"[prefix-placement] {message}", file=sys.stderr, flush=True)


def _free_ports(n: int) -> int:
    """A base port with `n` consecutive free ports after it."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n >= 65535:
            continue
        try:
            socks = []
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


# --------------------------------------------------------------------------------- the plan


@dataclasses.dataclass
class Session:
    sid: int
    start_s: float
    tenant: int
    is_run: bool
    turns: list[str]  # the user turns
    think_s: list[float]


def system_prompts(prompt: ChatPrompt, n: int, rng: random.Random) -> list[str]:
    """`n` distinct system prompts of 1.5-3k tokens each (measured with the model's ids)."""
    out = []
    for t in range(n):
        target = rng.randint(1500, 3000)
        words = [f"You are the assistant of tenant {t} ({rng.random():.6f})."]
        while True:
            words += [rng.choice(WORDS) for _ in range(20)]
            text = " ".join(words)
            ids = prompt.token_ids({"messages": [{"role": "system", "content": text}]})
            assert ids is not None
            if len(ids) >= target:
                break
        out.append(text)
    return out


def plan(
    n_tenants: int, rate_per_s: float, duration_s: float, seed: int
) -> tuple[list[str], list[Session]]:
    rng = random.Random(seed)
    prompt = ChatPrompt.from_model_dir(MODEL_DIR)
    assert prompt is not None
    systems = system_prompts(prompt, n_tenants, rng)
    sessions: list[Session] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= duration_s:
            break
        n_turns = rng.choice([1, 2, 3])
        sessions.append(
            Session(
                sid=len(sessions),
                start_s=t,
                tenant=rng.randrange(n_tenants),
                is_run=rng.random() < 0.5,
                turns=[
                    " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))
                    for _ in range(n_turns)
                ],
                think_s=[rng.uniform(0.2, 1.0) for _ in range(n_turns)],
            )
        )
    return systems, sessions


# ------------------------------------------------------------------------------ the client


@dataclasses.dataclass
class Result:
    sid: int
    turn: int
    sent_s: float
    messages: list[dict[str, Any]]
    status: int = 0
    ttft_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    router_cached_tokens: int | None = None
    request_id: str | None = None
    error: str | None = None


async def _one_request(
    session: aiohttp.ClientSession,
    url: str,
    messages: list[dict[str, Any]],
    headers: dict[str, str],
    result: Result,
) -> str:
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    text = []
    try:
        async with (
            asyncio.timeout(300),
            session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp,
        ):
            result.status = resp.status
            result.request_id = resp.headers.get("x-gpupool-request-id")
            cached = resp.headers.get("x-gpupool-cached-tokens")
            result.router_cached_tokens = int(cached) if cached is not None else None
            if resp.status != 200:
                result.error = (await resp.text())[:200]
                return ""
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                for choice in chunk.get("choices") or []:
                    delta = (choice.get("delta") or {}).get("content")
                    if delta:
                        if result.ttft_s is None:
                            result.ttft_s = time.perf_counter() - t0
                        text.append(delta)
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
    except (TimeoutError, aiohttp.ClientError) as err:
        result.error = type(err).__name__
    return "".join(text)


async def drive(
    url: str, systems: list[str], sessions: list[Session], headers: dict[str, str]
) -> list[Result]:
    results: list[Result] = []
    t_start = time.perf_counter()
    connector = aiohttp.TCPConnector(limit=0)

    async def one_session(http: aiohttp.ClientSession, s: Session) -> None:
        await asyncio.sleep(max(0.0, s.start_s - (time.perf_counter() - t_start)))
        messages: list[dict[str, Any]] = [{"role": "system", "content": systems[s.tenant]}]
        extra = dict(headers)
        if s.is_run:
            extra["x-gpupool-run-id"] = f"run-{s.sid}"
        for k, turn in enumerate(s.turns):
            messages = [*messages, {"role": "user", "content": turn}]
            r = Result(s.sid, k, time.perf_counter() - t_start, messages)
            results.append(r)
            reply = await _one_request(http, url, messages, extra, r)
            if r.error is not None:
                return
            messages = [*messages, {"role": "assistant", "content": reply}]
            await asyncio.sleep(s.think_s[k])

    async with aiohttp.ClientSession(connector=connector) as http:
        await asyncio.gather(*(one_session(http, s) for s in sessions))
    return results


# ------------------------------------------------------------------------------ the targets


def router_config(urls: list[str], tmp: Path, name: str) -> Config:
    return parse_config(
        {
            "model": {"name": "tiny", "path": str(MODEL_DIR), "max_model_len_tokens": 4096},
            "engines": {"launcher": "static", "static": {"urls": urls}},
            "pools": {
                "chat": {
                    "classes": ["agent", "normal"],
                    "share": {"initial_frac": 1.0},
                    "slo": {"ttft_p95_ms": 60000, "tpot_p95_ms": 5000},
                    "queue": {"max_depth": 4096, "max_wait_s": 240},
                },
            },
            "classes": {
                "agent": {"timeout_s": 300, "expected_output_tokens": MAX_TOKENS},
                "normal": {"timeout_s": 300, "expected_output_tokens": MAX_TOKENS},
            },
            "router": {
                "scrape_interval_s": 0.25,
                "ledger_path": str(tmp / f"ledger-{name}.sqlite"),
                "state_path": str(tmp / f"state-{name}.json"),
            },
        }
    )


Driver = Callable[[str, dict[str, str]], Awaitable[list[Result]]]


async def gpupool_target(
    name: str, specs: list[InstanceSpec], tmp: Path, run: Driver
) -> tuple[list[Result], dict[str, tuple[str, int]]]:
    """Drive an in-process gateway; returns the results and, per request id, admission's
    (instance, predicted prefill tokens) as the lease had them."""
    gw = create_app(router_config([s.url for s in specs], tmp, name), specs)
    predicted: dict[str, tuple[str, int]] = {}
    admit = gw.admitter.admit

    async def recording(ctx: Any, estimate: Any, **kwargs: Any) -> Any:
        lease = await admit(ctx, estimate, **kwargs)
        predicted[ctx.request_id] = (lease.instance_id, lease.prompt_tokens)
        return lease

    gw.admitter.admit = recording  # type: ignore[method-assign]
    await gw.start()
    try:
        for _ in range(600):
            healthy = all(st.healthy and st.capacity_blocks for st in gw.fleet)
            indexed = gw.prefix_cache is None or all(
                v is not None and v["usable"]
                for v in (gw.prefix_cache.view(s.instance_id) for s in specs)
            )
            if healthy and indexed:
                break
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError(f"{name}: the router never saw the engines healthy and indexed")
        async with serve_asgi(gw) as url:
            results = await run(url, {})
    finally:
        await gw.aclose()
    return results, predicted


async def vllm_router_target(
    policy: str, urls: list[str], key: str | None, tmp: Path, run: Driver
) -> list[Result]:
    """vllm-router over the engines: the engines' key given to it (`--api-key`) and sent by
    the client too (it forwards the client's authorization header)."""
    port = _free_ports(2)
    argv = [
        str(VLLM_ROUTER),
        "--worker-urls",
        *urls,
        "--policy",
        policy,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-port",
        str(port + 1),
        "--log-level",
        "warning",
        *(["--api-key", key] if key else []),
    ]
    with (tmp / f"vllm-router-{policy}.log").open("w") as log:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=log, stderr=asyncio.subprocess.STDOUT
        )
    try:
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http:
            for _ in range(600):
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"{url}/health") as resp:
                        if resp.status == 200:
                            break
                if proc.returncode is not None:
                    raise RuntimeError(f"vllm-router exited {proc.returncode}")
                await asyncio.sleep(0.1)
            else:
                raise RuntimeError("vllm-router never became healthy")
        return await run(url, {"authorization": f"Bearer {key}"} if key else {})
    finally:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()


# ---------------------------------------------------------------------------- the numbers


def _q(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def oracle_hits(results: list[Result]) -> tuple[int, int, int]:
    """(hit tokens, prompt tokens, requests whose ids differ from the engine's count): each
    request in the order sent finds the leading full blocks any earlier request's chain holds,
    at most vLLM's `num_tokens - 1` rounded down to a block."""
    prompt = ChatPrompt.from_model_dir(MODEL_DIR)
    assert prompt is not None
    seen: set[int] = set()
    hits = queries = mismatched = 0
    for r in sorted(results, key=lambda r: r.sent_s):
        if r.status != 200:
            continue
        ids = prompt.token_ids({"messages": r.messages})
        assert ids is not None
        if r.prompt_tokens is not None and r.prompt_tokens != len(ids):
            mismatched += 1
        chain = chain_keys(ids, BLOCK_TOKENS, DEFAULT_SEED)
        n = 0
        while n < len(chain) and chain[n] in seen:
            n += 1
        hits += min(n * BLOCK_TOKENS, (len(ids) - 1) // BLOCK_TOKENS * BLOCK_TOKENS)
        queries += len(ids)
        seen.update(chain)
    return hits, queries, mismatched


def summarize(
    name: str,
    results: list[Result],
    hit_frac: float | None,
    predicted: dict[str, tuple[str, int]] | None,
    oracle: tuple[int, int, int],
    warmup_s: float = 0.0,
) -> dict[str, Any]:
    ok = [r for r in results if r.status == 200 and r.ttft_s is not None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    # the steady part: requests sent after the warm-up, when every tenant's prompt has had
    # its first (cold, for every target and the oracle alike) prefill
    steady = [r for r in ok if r.sent_s >= warmup_s]
    steady_ttft = [r.ttft_s for r in steady if r.ttft_s is not None]
    end_s = max((r.sent_s for r in results), default=0.0)
    mid_s = warmup_s + (end_s - warmup_s) / 2
    out: dict[str, Any] = {
        "target": name,
        "requests": len(results),
        "ok": len(ok),
        "errors": sorted({f"{r.status} {r.error}" for r in results if r.error})[:5],
        "ttft_s": {
            "p50": _q(ttft, 0.5),
            "p90": _q(ttft, 0.9),
            "p99": _q(ttft, 0.99),
            "mean": statistics.fmean(ttft) if ttft else None,
        },
        "warmup_s": warmup_s,
        "steady_requests": len(steady),
        "ttft_steady_s": {
            "p50": _q(steady_ttft, 0.5),
            "p90": _q(steady_ttft, 0.9),
            "p99": _q(steady_ttft, 0.99),
        },
        # a steady run's p90 is the same in both halves of its steady part; one that grows is
        # queueing up (overloaded: not the moderate load the bar is about)
        "ttft_p90_by_half_s": [
            _q([r.ttft_s for r in half if r.ttft_s is not None], 0.9)
            for half in (
                [r for r in steady if r.sent_s < mid_s],
                [r for r in steady if r.sent_s >= mid_s],
            )
        ],
        "engine_hit_frac": hit_frac,
        "client_cached_frac": (
            sum(r.cached_tokens or 0 for r in ok) / max(1, sum(r.prompt_tokens or 0 for r in ok))
        ),
        "oracle_hit_frac": oracle[0] / oracle[1] if oracle[1] else None,
        "ids_mismatched": oracle[2],
    }
    if out["engine_hit_frac"] is not None and out["oracle_hit_frac"]:
        out["hit_vs_oracle"] = out["engine_hit_frac"] / out["oracle_hit_frac"]
    if predicted is not None:
        errors = []
        with_header = 0
        for r in ok:
            p = predicted.get(r.request_id or "")
            if p is None or r.prompt_tokens is None or r.cached_tokens is None:
                continue
            actual = r.prompt_tokens - r.cached_tokens
            errors.append(abs(p[1] - actual))
            with_header += r.router_cached_tokens is not None
        out["prefill_prediction_abs_error_tokens"] = {
            "n": len(errors),
            "p50": _q([float(e) for e in errors], 0.5),
            "p95": _q([float(e) for e in errors], 0.95),
            "mean": statistics.fmean(errors) if errors else None,
        }
        out["responses_with_cached_tokens_header"] = with_header
    return out


# ---------------------------------------------------------------------------------- running


def engine_cpu_s(run_dir: Path) -> float:
    """CPU seconds the local engines (their pid files in `run_dir`, and their children) have
    used so far."""
    total = 0.0
    for pid_file in run_dir.glob("engine-*.pid"):
        with contextlib.suppress(OSError, ValueError):
            total += tree_cpu_s(int(pid_file.read_text().split()[0]))
    return total


async def calibrate(url: str, key: str | None) -> dict[str, float]:
    """TTFT of a cold and of a cached ~2k-token prompt on one idle engine (3 each)."""
    rng = random.Random(7)
    cold: list[float] = []
    warm: list[float] = []
    async with aiohttp.ClientSession() as http:
        for i in range(3):
            system = f"calibration {i} {rng.random()} " + " ".join(
                rng.choice(WORDS) for _ in range(900)
            )
            for bucket in (cold, warm):
                r = Result(0, 0, 0.0, [])
                messages = [
                    {"role": "system", "content": system},
                    {"role": "user", "content": "hi"},
                ]
                auth = {"authorization": f"Bearer {key}"} if key else {}
                await _one_request(http, url, messages, auth, r)
                if r.ttft_s is None:
                    raise RuntimeError(f"calibration failed: {r.status} {r.error}")
                bucket.append(r.ttft_s)
    return {"cold_ttft_s": statistics.median(cold), "cached_ttft_s": statistics.median(warm)}


async def _run_target(
    name: str,
    args: argparse.Namespace,
    tmp: Path,
    specs: list[InstanceSpec],
    key: str | None,
    systems: list[str],
    sessions: list[Session],
) -> dict[str, Any]:
    """One target over the plan, the engines' prefix caches emptied first: its summary row,
    with its `results` and `engine_cpu_s` (for the caller to take out)."""
    urls = [s.url for s in specs]
    async with aiohttp.ClientSession() as http:
        for u in urls:
            if not await reset_prefix_cache(http, u, key):
                raise RuntimeError(f"could not reset {u}'s prefix cache")
        before = await prefix_counters(http, urls, key)

    async def run(url: str, headers: dict[str, str]) -> list[Result]:
        return await drive(url, systems, sessions, headers)

    load_before = os.getloadavg()[0]
    cpu_before = engine_cpu_s(tmp / "run")
    t_run = time.perf_counter()
    predicted: dict[str, tuple[str, int]] | None = None
    if name == "gpupool-prefix":
        results, predicted = await gpupool_target(name, specs, tmp, run)
    elif name == "gpupool-noindex":
        plain = [dataclasses.replace(s, kv_events=None) for s in specs]
        results, predicted = await gpupool_target(name, plain, tmp, run)
    elif name.startswith("vllm-router-"):
        policy = name.removeprefix("vllm-router-")
        results = await vllm_router_target(policy, urls, key, tmp, run)
    else:
        raise ValueError(f"unknown target {name}")
    wall_s = time.perf_counter() - t_run
    cpu_s = engine_cpu_s(tmp / "run") - cpu_before
    async with aiohttp.ClientSession() as http:
        after = await prefix_counters(http, urls, key)
    overall, per_engine = hit_rate(before, after)
    row = summarize(name, results, overall, predicted, oracle_hits(results), args.warmup_s)
    row["engine_hit_frac_per_engine"] = per_engine
    row["wall_s"] = wall_s
    row["load_avg_1m"] = [load_before, os.getloadavg()[0]]
    row["engine_cpu_s"] = cpu_s
    row["results"] = results
    return row


async def _main(args: argparse.Namespace, out: Path, tmp: Path) -> dict[str, Any]:
    base = _free_ports(args.engines)
    # one key for all engines (vllm-router sends one), made here, never printed
    os.environ.setdefault(KEY_ENV, secrets.token_urlsafe(24))
    config = parse_config(
        {
            "model": {"name": "tiny", "path": str(MODEL_DIR), "max_model_len_tokens": 4096},
            "engines": {
                "launcher": "local",
                "local": {
                    "count": args.engines,
                    "base_port": base,
                    "kv_cache_bytes": args.kv_cache_mib * 1024 * 1024,
                    "run_dir": str(tmp / "run"),
                    "api_key_env": KEY_ENV,
                    "vllm_args": [
                        "--max-num-seqs",
                        "16",
                        "--enable-prompt-tokens-details",
                    ],
                },
            },
            "pools": {"normal": {"classes": ["normal", "agent"], "share": {"initial_frac": 1}}},
        }
    )
    launcher = LocalLauncher(
        config.engines.local,
        config.model,
        progress=_say,
        gpu_count=0,
        environ={**os.environ, "VLLM_SERVER_DEV_MODE": "1"},
    )
    t0 = time.perf_counter()
    specs = await launcher.start()
    _say(f"{len(specs)} engines up in {time.perf_counter() - t0:.0f} s")
    urls = [s.url for s in specs]
    key = specs[0].api_key
    if any(s.api_key != key for s in specs):
        raise RuntimeError("the engines have different keys; vllm-router takes one")
    rows: list[dict[str, Any]] = []
    levels: list[dict[str, Any]] = []
    systems: list[str] = []
    targets: list[str] = []
    try:
        calibration = await calibrate(urls[0], key)
        cpus = min(os.cpu_count() or 1, args.engines)
        for load_frac in args.load_fracs:
            # sessions of 2 requests on average; at load_frac of the engines if all were cold
            rate = args.rate_per_s or (load_frac * args.engines / calibration["cold_ttft_s"] / 2.0)
            _say(f"calibration {calibration}; load {load_frac}: {rate:.2f} sessions/s")
            systems, sessions = plan(args.tenants, rate, args.duration_s, args.seed)
            level = {"load_frac": load_frac, "rate_sessions_per_s": rate, "sessions": len(sessions)}
            levels.append(level)
            suffix = f"-load{load_frac:g}" if len(args.load_fracs) > 1 else ""
            targets = args.targets.split(",")
            k = args.rotate % len(targets)
            targets = targets[k:] + targets[:k]
            for name in targets:
                row = await _run_target(name, args, tmp, specs, key, systems, sessions)
                results: list[Result] = row.pop("results")
                row |= level
                row["engine_cpu_frac"] = row.pop("engine_cpu_s") / row["wall_s"] / cpus
                _say(json.dumps(row))
                rows.append(row)
                bulk_path(out, f"{name}{suffix}.requests.json").write_text(
                    json.dumps(
                        [
                            {k: v for k, v in dataclasses.asdict(r).items() if k != "messages"}
                            | {"tenant": sessions[r.sid].tenant, "run": sessions[r.sid].is_run}
                            for r in results
                        ]
                    )
                )
                await asyncio.sleep(args.pause_s)
    finally:
        await launcher.aclose()
    return {
        "benchmark": "prefix_placement",
        "command": "python -m benchmarks.prefix_placement " + " ".join(sys.argv[1:]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "setup": {
            "engines": args.engines,
            "kv_cache_mib": args.kv_cache_mib,
            "tenants": args.tenants,
            "system_prompt_tokens": [
                len(
                    ChatPrompt.from_model_dir(MODEL_DIR).token_ids(  # type: ignore[union-attr]
                        {"messages": [{"role": "system", "content": s}]}
                    )
                    or []
                )
                for s in systems
            ],
            "levels": levels,  # load_frac, rate_sessions_per_s, sessions: one per level
            "duration_s": args.duration_s,
            "warmup_s": args.warmup_s,
            "calibration": calibration,
            "order": targets,
        },
        "targets": rows,
    }


def render_markdown(report: dict[str, Any]) -> str:
    def f(v: Any, fmt: str = ".2f") -> str:
        return "-" if v is None else format(v, fmt)

    lines = [
        "| load frac | target | ok/requests | TTFT p50 s | TTFT p90 s | TTFT p99 s "
        "| steady: requests, TTFT p50 / p90 / p99 s "
        "| steady p90 1st / 2nd half s | engine hit | oracle hit | hit / oracle "
        "| prefill error p50 / p95 (tokens) | engine CPU | load avg |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in report["targets"]:
        err = row.get("prefill_prediction_abs_error_tokens") or {}
        steady = row.get("ttft_steady_s") or {}
        lines.append(
            f"| {row['load_frac']:g} | {row['target']} | {row['ok']}/{row['requests']} "
            f"| {f(row['ttft_s']['p50'])} "
            f"| {f(row['ttft_s']['p90'])} | {f(row['ttft_s']['p99'])} "
            f"| {row.get('steady_requests', '-')}: {f(steady.get('p50'))} / "
            f"{f(steady.get('p90'))} / {f(steady.get('p99'))} "
            f"| {' / '.join(f(v) for v in row.get('ttft_p90_by_half_s', [None, None]))} "
            f"| {f(row['engine_hit_frac'], '.1%')} | {f(row['oracle_hit_frac'], '.1%')} "
            f"| {f(row.get('hit_vs_oracle'), '.1%')} "
            f"| {f(err.get('p50'), '.0f')} / {f(err.get('p95'), '.0f')} "
            f"| {f(row['engine_cpu_frac'], '.0%')} "
            f"| {row['load_avg_1m'][0]:.1f}-{row['load_avg_1m'][1]:.1f} |"
        )
    for key, what in (("ttft_s", "whole run"), ("ttft_steady_s", "after the warm-up")):
        lines += [
            "",
            f"TTFT p90 ({what}), the other target's over gpupool-prefix's, per load level:",
            "",
        ]
        for level in report["setup"]["levels"]:
            rows = [r for r in report["targets"] if r["load_frac"] == level["load_frac"]]
            p90 = {r["target"]: (r.get(key) or {}).get("p90") for r in rows}
            ours = p90.get("gpupool-prefix")
            ratios = [
                f"{name} {value / ours:.2f}x"
                for name, value in p90.items()
                if name != "gpupool-prefix" and ours and value is not None
            ]
            lines.append(f"- load {level['load_frac']:g}: " + (", ".join(ratios) or "-"))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--kv-cache-mib", type=int, default=16)
    parser.add_argument("--tenants", type=int, default=12)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--rate-per-s", type=float, default=None)
    parser.add_argument("--load-frac", type=float, default=0.6)
    parser.add_argument(
        "--load-fracs",
        type=lambda v: [float(x) for x in v.split(",")],
        default=None,
        help="several load levels in one run, e.g. 0.4,0.8 (overrides --load-frac)",
    )
    parser.add_argument(
        "--warmup-s",
        type=float,
        default=0.0,
        help="leave requests sent in the first S seconds out of the steady TTFT figures "
        "(each tenant's first prompt is a cold prefill for every target)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rotate", type=int, default=0)
    parser.add_argument("--pause-s", type=float, default=2.0)
    parser.add_argument(
        "--targets",
        default="gpupool-prefix,gpupool-noindex,vllm-router-round_robin,vllm-router-cache_aware",
    )
    args = parser.parse_args(argv)
    args.load_fracs = args.load_fracs or [args.load_frac]
    if args.rate_per_s is not None and len(args.load_fracs) > 1:
        parser.error("--rate-per-s fixes the rate: give one load level, not --load-fracs")
    if not 0 <= args.warmup_s < args.duration_s:
        parser.error("--warmup-s must be at least 0 and less than --duration-s")
    if not VLLM_ROUTER.exists():
        raise SystemExit(
            f"{VLLM_ROUTER} missing: python3 -m venv .venv-peers/vllmrouter && "
            ".venv-peers/vllmrouter/bin/pip install vllm-router"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpupool-prefix-placement-") as tmp:
        report = asyncio.run(_main(args, args.out, Path(tmp)))
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    (args.out / "report.md").write_text(render_markdown(report))
    print(render_markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
