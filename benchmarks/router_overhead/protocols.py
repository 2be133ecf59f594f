"""`python -m benchmarks.router_overhead.protocols --out DIR`: what gpupool adds per request on
each protocol it serves, `/v1/chat/completions`, `/v1/responses` and `/v1/messages`, at
concurrency 1, in one run: the fake engine alone (the limit) and `gpupool serve` in front of it.

Rounds interleave everything (the order of protocols and of direct / gpupool rotates each
round), so a noisy neighbour hits all of them alike. Per protocol: added latency = gpupool's
percentile minus the engine's own for the same requests (so the protocols' different bodies
and event counts cancel out), non-streaming (1 token) and streaming (`stream_tokens` tokens,
timed to the last byte), and gpupool's CPU per request. The target: each protocol within
0.2 ms of chat completions at p50 (issue 22). Writes DIR/protocol_overhead.md and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from benchmarks.router_overhead.load import LoadClient
from benchmarks.router_overhead.machine import describe, load_average
from benchmarks.router_overhead.plan import PORTS
from benchmarks.router_overhead.procs import Proc, pin_self, start_proc, wait_ready
from benchmarks.router_overhead.runner import Placement, start_engine
from benchmarks.router_overhead.stats import added_latency_ms, per_round_added_ms, summarize
from benchmarks.router_overhead.targets import PeerPaths, gpupool_target

__all__ = ["PROTOCOLS", "ProtocolPlan", "body", "main", "render"]

log = logging.getLogger("benchmarks.router_overhead.protocols")

PROTOCOLS = {
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}
TARGET_MS = 0.2  # each protocol's added p50 within this of chat's
_TEXT = "Say hello to the benchmark in a few words."


def body(protocol: str, max_tokens: int, *, stream: bool) -> bytes:
    """The same short request in each protocol's own shape."""
    if protocol == "chat":
        req: dict[str, Any] = {
            "messages": [{"role": "user", "content": _TEXT}],
            "max_tokens": max_tokens,
        }
    elif protocol == "responses":
        req = {"input": _TEXT, "max_output_tokens": max_tokens}
    elif protocol == "messages":
        req = {"messages": [{"role": "user", "content": _TEXT}], "max_tokens": max_tokens}
    else:
        raise ValueError(f"unknown protocol {protocol!r}")
    return orjson.dumps({"model": "tiny", **req, "temperature": 0.0, "stream": stream})


@dataclass(frozen=True)
class ProtocolPlan:
    engine_itl_ms: float = 1.0  # the fake engine's gap between streamed tokens
    warmup_requests: int = 100  # per protocol and target, before any round
    rounds: int = 6
    requests: int = 200  # non-streaming, per protocol, target and round
    streams: int = 30  # streaming, per protocol, target and round
    stream_tokens: int = 16
    settle_s: float = 0.2

    @classmethod
    def quick(cls) -> ProtocolPlan:
        return cls(warmup_requests=30, rounds=2, requests=50, streams=10)


@dataclass
class Samples:
    """Latencies (s) of one protocol on one target, per round, and gpupool's CPU over them."""

    plain: list[list[float]] = field(default_factory=list)
    stream: list[list[float]] = field(default_factory=list)
    cpu_s: float = 0.0  # over `cpu_requests` non-streaming requests, this protocol alone
    cpu_requests: int = 0
    errors: int = 0
    first_error: str = ""


async def _one(client: LoadClient, payload: bytes, samples: Samples) -> float | None:
    try:
        return await client.one(payload)
    except Exception as err:  # a benchmark reports failures, it does not stop on them
        samples.errors += 1
        samples.first_error = samples.first_error or repr(err)[:300]
        return None


async def _interleaved(
    clients: dict[tuple[str, str], LoadClient],
    samples: dict[tuple[str, str], Samples],
    kind: str,
    n: int,
    plan: ProtocolPlan,
) -> None:
    """One round of `kind` (plain | stream): `n` passes, each sending one request to every
    (target, protocol) in an order that rotates every pass, so drift and other jobs' load
    reach all of them alike."""
    keys = list(clients)
    tokens = 1 if kind == "plain" else plan.stream_tokens
    rnd: dict[tuple[str, str], list[float]] = {key: [] for key in keys}
    for i in range(n):
        for key in keys[i % len(keys) :] + keys[: i % len(keys)]:
            payload = body(key[1], tokens, stream=kind == "stream")
            lat = await _one(clients[key], payload, samples[key])
            if lat is not None:
                rnd[key].append(lat)
    for key in keys:
        getattr(samples[key], kind).append(rnd[key])


async def _drive(
    clients: dict[tuple[str, str], LoadClient], gpupool: Proc, plan: ProtocolPlan
) -> dict[tuple[str, str], Samples]:
    samples = {key: Samples() for key in clients}
    for key, client in clients.items():
        warm = Samples()
        for _ in range(plan.warmup_requests):
            await _one(client, body(key[1], 1, stream=False), warm)
        if warm.errors == plan.warmup_requests:
            raise RuntimeError(f"{key}: every warm-up request failed: {warm.first_error}")
    protocols = list(PROTOCOLS)
    for r in range(plan.rounds):
        await _interleaved(clients, samples, "plain", plan.requests, plan)
        await _interleaved(clients, samples, "stream", plan.streams, plan)
        # gpupool's CPU per request, one protocol at a time (the order rotates each round)
        for protocol in protocols[r % 3 :] + protocols[: r % 3]:
            s = samples[("gpupool", protocol)]
            await asyncio.sleep(plan.settle_s)
            cpu0 = gpupool.cpu_s()
            payload = body(protocol, 1, stream=False)
            for _ in range(plan.requests):
                if await _one(clients[("gpupool", protocol)], payload, s) is not None:
                    s.cpu_requests += 1
            s.cpu_s += gpupool.cpu_s() - cpu0
        log.info("round %d/%d done", r + 1, plan.rounds)
    return samples


def _results(samples: dict[tuple[str, str], Samples], plan: ProtocolPlan) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for protocol in PROTOCOLS:
        direct, gp = samples[("direct", protocol)], samples[("gpupool", protocol)]
        row: dict[str, Any] = {"errors": direct.errors + gp.errors}
        if gp.first_error or direct.first_error:
            row["first_error"] = gp.first_error or direct.first_error
        for kind in ("plain", "stream"):
            d_rounds, g_rounds = getattr(direct, kind), getattr(gp, kind)
            d_all = [x for rnd in d_rounds for x in rnd]
            g_all = [x for rnd in g_rounds for x in rnd]
            row[kind] = {
                "direct": summarize(d_all).as_dict(),
                "gpupool": summarize(g_all).as_dict(),
                "added_p50_ms": added_latency_ms(g_all, d_all, 50),
                "added_p99_ms": added_latency_ms(g_all, d_all, 99),
                "added_p50_ms_per_round": per_round_added_ms(g_rounds, d_rounds, 50),
            }
        row["gpupool_cpu_us_per_request"] = (
            gp.cpu_s * 1e6 / gp.cpu_requests if gp.cpu_requests else None
        )
        out[protocol] = row
    chat = out["chat"]
    for row in out.values():
        for kind in ("plain", "stream"):
            row[kind]["vs_chat_p50_ms"] = row[kind]["added_p50_ms"] - chat[kind]["added_p50_ms"]
    return out


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    plan = ProtocolPlan.quick() if args.quick else ProtocolPlan()
    if args.rounds:
        plan = ProtocolPlan(**{**asdict(plan), "rounds": args.rounds})
    paths = PeerPaths.default(args.repo.resolve())
    workdir = Path(tempfile.mkdtemp(prefix="protocol-overhead-", dir="/tmp"))
    pinned = not args.no_pin and (os.cpu_count() or 1) >= 2
    placement = Placement(frozenset({0}), frozenset({1})) if pinned else Placement(None, None)
    result: dict[str, Any] = {
        "command": "python -m benchmarks.router_overhead.protocols " + shlex.join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": describe(),
        "plan": asdict(plan),
        "placement": "load generator and fake engine on CPU 0, gpupool on CPU 1"
        if pinned
        else "not pinned",
        "workdir": str(workdir),
    }
    for name in ("protocols-engine", "protocols-gpupool"):
        _require_free(PORTS[name])  # else another run's process would answer in its place
    engine = await start_engine(
        paths, workdir, placement, plan.engine_itl_ms, port=PORTS["protocols-engine"]
    )
    engine_url = f"http://127.0.0.1:{PORTS['protocols-engine']}"
    spec = gpupool_target("gpupool", PORTS["protocols-gpupool"], engine_url, paths, workdir)
    assert spec.argv is not None
    gp = start_proc(
        "gpupool",
        spec.argv,
        log_dir=workdir,
        cpus=placement.proxy,
        nice=placement.served_nice,
        cwd=spec.cwd,
    )
    clients: dict[tuple[str, str], LoadClient] = {}
    try:
        await wait_ready(gp, f"http://127.0.0.1:{spec.port}/ready", timeout_s=60)
        result["placement"] += "; this process: " + pin_self(
            placement.loadgen, placement.loadgen_nice
        )
        for target, url in (("direct", engine_url), ("gpupool", f"http://127.0.0.1:{spec.port}")):
            for protocol, path in PROTOCOLS.items():
                clients[(target, protocol)] = LoadClient(url, path=path)
        samples = await _drive(clients, gp, plan)
    finally:
        for client in clients.values():
            await client.aclose()
        gp.stop()
        engine.stop()
    result["protocols"] = _results(samples, plan)
    result["git"] = _git_head(paths.repo)
    result["load_average_at_end"] = load_average()
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    return result


def _require_free(port: int) -> None:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as err:
            raise SystemExit(f"port {port} is taken ({err}): is another run going?") from None


def _git_head(repo: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() or "unknown"


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def render(result: dict[str, Any]) -> str:
    """The Markdown report."""
    plan, m = result["plan"], result["machine"]
    lines = [
        "# Router overhead per protocol: chat completions, responses, messages",
        "",
        f"Command: `{result['command']}`  ",
        f"Date: {result['date']}, {result['elapsed_s']} s, gpupool git {result['git']}  ",
        f"Machine: {m['cpu']}, {m['cpus']} CPUs, {m['memory_gib']} GiB; load average "
        f"{m['load_average_at_start']} at start, {result['load_average_at_end']} at end  ",
        f"Placement: {result['placement']}  ",
        f"Plan: {plan['rounds']} rounds; per protocol, target and round {plan['requests']} "
        f"non-streaming requests (1 token) and {plan['streams']} streams of "
        f"{plan['stream_tokens']} tokens (fake engine, {plan['engine_itl_ms']} ms between "
        "tokens), all at concurrency 1, timed to the last byte.",
        "",
        "| protocol | engine p50 (ms) | gpupool p50 (ms) | added p50 / p99 (ms) "
        "| added p50 vs chat (ms) | added p50 per round (ms) | streamed: added p50 (ms) "
        "| streamed: vs chat (ms) | gpupool CPU µs / request | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for protocol, row in result["protocols"].items():
        p, st = row["plain"], row["stream"]
        per_round = ", ".join(f"{x:.3f}" for x in p["added_p50_ms_per_round"])
        cpu = row["gpupool_cpu_us_per_request"]
        lines.append(
            f"| `{PROTOCOLS[protocol]}` | {_ms(p['direct']['p50_ms'])} | "
            f"{_ms(p['gpupool']['p50_ms'])} | {_ms(p['added_p50_ms'])} / "
            f"{_ms(p['added_p99_ms'])} | {p['vs_chat_p50_ms']:+.3f} | {per_round} | "
            f"{_ms(st['added_p50_ms'])} | {st['vs_chat_p50_ms']:+.3f} | "
            f"{'—' if cpu is None else f'{cpu:.0f}'} | {row['errors']} |"
        )
    worst = max(
        row["plain"]["vs_chat_p50_ms"]
        for name, row in result["protocols"].items()
        if name != "chat"
    )
    met = "met" if worst <= TARGET_MS else "NOT met"
    lines += [
        "",
        f"Target (issue 22): each protocol's added p50 within {TARGET_MS} ms of chat "
        f"completions' (non-streaming): {met}, the worst is {worst:+.3f} ms.",
        "",
        "Added = gpupool's percentile minus the engine's own, for the same requests on the same "
        'protocol; "vs chat" subtracts chat completions\' added figure. Requests to the six '
        "(target, protocol) pairs alternate one by one, in an order that rotates every pass. "
        "The CPU column: gpupool's process over windows of non-streaming requests of that "
        "protocol alone.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.router_overhead.protocols",
        description=(__doc__ or "").splitlines()[0],
    )
    p.add_argument("--out", required=True, type=Path, help="folder for the .md and .json")
    p.add_argument("--quick", action="store_true", help="a ~20-second smoke run")
    p.add_argument("--rounds", type=int, default=0, help="rounds (default: the plan's)")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    p.add_argument("--repo", type=Path, default=Path.cwd(), help="gpupool checkout")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    result = asyncio.run(_run(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "protocol_overhead.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "protocol_overhead.md").write_text(render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
