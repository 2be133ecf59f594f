"""Tracing's added latency at concurrency 1, request by request: `gpupool serve` with traces
off and with traces at each `sample_ratio`, all running at once in front of one fake engine,
visited in turn by one sequential client (each cycle sends one request to every router, in a
fresh random order), so a moment of the machine's load falls on all of them alike and each
traced request has an untraced one beside it.

    python -m benchmarks.tracing_paired [--cycles 4000] [--ratios off,0,0.01,1] [--out DIR]

Reports, per router: p50/p90 latency, CPU per request (its process tree, schedstat), and the
added p50 against traces off: the p50 of the per-cycle differences, and that of each fifth of
the cycles (the spread). `off` among the ratios runs a second untraced router, an A/A pair
that shows how far two identical routers differ on this machine. Placement as in
`benchmarks.router_overhead`: the client, the fake engine and the OTLP sink (a process of its
own) on CPU 0, the routers on CPU 1; free ports.
That benchmark measures each target alone (the others paused) in rounds of 200 requests; this
one alternates request by request, for the small differences those rounds cannot resolve.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.router_overhead.load import LoadClient, chat_body
from benchmarks.router_overhead.machine import load_average
from benchmarks.router_overhead.otlp_sink import otlp_sink
from benchmarks.router_overhead.procs import pin_self, start_proc
from benchmarks.router_overhead.runner import Live, Placement, close_all, ready, start_engine
from benchmarks.router_overhead.targets import PeerPaths, gpupool_target

__all__ = ["main"]

log = logging.getLogger("benchmarks.tracing_paired")

BLOCKS = 5  # the cycles are cut in this many parts for the spread


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _q(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    paths = PeerPaths.default(args.repo.resolve())
    workdir = Path(tempfile.mkdtemp(prefix="tracing-paired-", dir="/tmp"))
    placement = Placement(frozenset({0}), frozenset({1}))
    ratios = [None if r == "off" else float(r) for r in args.ratios.split(",")]
    engine_port = _free_port()
    engine = await start_engine(paths, workdir, placement, 1.0, port=engine_port)
    engine_url = f"http://127.0.0.1:{engine_port}"
    sink_port = _free_port()
    lives: list[Live] = []
    try:
        async with otlp_sink(sink_port, cpus=placement.loadgen, nice=placement.served_nice) as sunk:
            try:
                lives = await _start(paths, workdir, placement, engine_url, sink_port, ratios)
                pin_self(placement.loadgen, placement.loadgen_nice)
                result = await _cycles(lives, args.cycles, args.warmup, random.Random(args.seed))
            finally:
                await close_all(lives, None)  # before the sink: their last spans reach it
        result["otlp_sink"] = sunk.__dict__
    finally:
        engine.stop()
    result["workdir"] = str(workdir)
    return result


async def _start(
    paths: PeerPaths,
    workdir: Path,
    placement: Placement,
    engine_url: str,
    sink_port: int,
    ratios: list[float | None],
) -> list[Live]:
    """Traces off and one router per ratio, on free ports; raises when one does not start."""
    specs = [gpupool_target("off", _free_port(), engine_url, paths, workdir)]
    for ratio in ratios:
        if ratio is None:  # an untraced twin: how far two identical routers differ here
            specs.append(gpupool_target("off-twin", _free_port(), engine_url, paths, workdir))
            continue
        observability: dict[str, object] = {
            "otlp_endpoint": f"http://127.0.0.1:{sink_port}",
            "sample_ratio": ratio,
        }
        specs.append(
            gpupool_target(
                f"ratio-{ratio:g}",
                _free_port(),
                engine_url,
                paths,
                workdir,
                observability=observability,
            )
        )
    lives = [Live(spec) for spec in specs]
    for live in lives:
        assert live.spec.argv is not None
        live.proc = start_proc(
            live.spec.name,
            live.spec.argv,
            log_dir=workdir,
            cpus=placement.proxy,
            nice=placement.served_nice,
            env=live.spec.env,
            cwd=live.spec.cwd,
        )
    await asyncio.gather(*(ready(live) for live in lives))
    if failed := [f"{lv.spec.name}: {lv.reason}" for lv in lives if lv.status != "ok"]:
        await close_all(lives, None)
        raise RuntimeError("; ".join(failed))
    return lives


async def _cycles(
    lives: list[Live], cycles: int, warmup: int, rng: random.Random
) -> dict[str, Any]:
    body = chat_body(1, stream=False)
    clients = {lv.spec.name: LoadClient(lv.base_url) for lv in lives}
    try:
        for client in clients.values():
            for _ in range(warmup):
                await client.one(body)
        names = list(clients)
        latency: dict[str, list[float]] = {n: [] for n in names}
        cpu0 = {lv.spec.name: lv.cpu_s() for lv in lives}
        started = time.monotonic()
        for _ in range(cycles):
            order = names[:]
            rng.shuffle(order)
            for name in order:
                latency[name].append(await clients[name].one(body))
        elapsed_s = time.monotonic() - started
        cpu_us = {lv.spec.name: (lv.cpu_s() - cpu0[lv.spec.name]) / cycles * 1e6 for lv in lives}
    finally:
        for client in clients.values():
            await client.aclose()
    off = latency["off"]
    block = cycles // BLOCKS
    report: dict[str, Any] = {"cycles": cycles, "elapsed_s": round(elapsed_s, 1), "targets": {}}
    for name in names:
        lat = latency[name]
        row: dict[str, Any] = {
            "p50_ms": round(statistics.median(lat) * 1e3, 4),
            "p90_ms": round(_q(lat, 0.9) * 1e3, 4),
            "cpu_us_per_request": round(cpu_us[name], 1),
        }
        if name != "off":
            diffs = [a - b for a, b in zip(lat, off, strict=True)]
            row["added_p50_ms"] = round((statistics.median(lat) - statistics.median(off)) * 1e3, 4)
            row["paired_median_diff_ms"] = round(statistics.median(diffs) * 1e3, 4)
            row["added_p50_ms_blocks"] = [
                round(
                    (
                        statistics.median(lat[i * block : (i + 1) * block])
                        - statistics.median(off[i * block : (i + 1) * block])
                    )
                    * 1e3,
                    4,
                )
                for i in range(BLOCKS)
            ]
            row["added_cpu_us_per_request"] = round(cpu_us[name] - cpu_us["off"], 1)
        report["targets"][name] = row
    return report


def _render(result: dict[str, Any]) -> str:
    lines = [
        f"{result['command']}  ({result['cycles']} cycles, {result['elapsed_s']} s; load average"
        f" {result['load_before']} before, {result['load_after']} after)",
        "",
        "| router | p50 ms | p90 ms | added p50 ms (fifths of the run) | paired median diff ms"
        " | CPU µs/request (added) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in result["targets"].items():
        blocks = row.get("added_p50_ms_blocks")
        added = (
            f"{row['added_p50_ms']:+.3f} ({min(blocks):+.3f} to {max(blocks):+.3f})"
            if blocks
            else "—"
        )
        paired = f"{row['paired_median_diff_ms']:+.3f}" if "paired_median_diff_ms" in row else "—"
        extra = f" ({row['added_cpu_us_per_request']:+.0f})" if name != "off" else ""
        lines.append(
            f"| {name} | {row['p50_ms']:.3f} | {row['p90_ms']:.3f} | {added} | {paired}"
            f" | {row['cpu_us_per_request']:.0f}{extra} |"
        )
    lines.append(f"\nOTLP sink: {result['otlp_sink']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tracing_paired", description=__doc__)
    p.add_argument("--cycles", type=int, default=4000)
    p.add_argument("--warmup", type=int, default=200, help="requests to each router first")
    p.add_argument(
        "--ratios",
        default="off,0,0.01,1",
        help="sample ratios of the traced routers; `off`: an untraced twin of the baseline",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repo", type=Path, default=Path.cwd(), help="gpupool checkout")
    p.add_argument("--out", type=Path, help="folder for tracing_paired.md and .json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    load_before = load_average()
    try:
        import uvloop  # the load generator of benchmarks.router_overhead runs on it too

        result = uvloop.run(_run(args))
    except ImportError:
        result = asyncio.run(_run(args))
    result["command"] = "python -m benchmarks.tracing_paired " + " ".join(sys.argv[1:])
    result["load_before"], result["load_after"] = load_before, load_average()
    text = _render(result)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tracing_paired.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "tracing_paired.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
