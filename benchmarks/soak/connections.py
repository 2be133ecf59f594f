"""2,000 concurrent streaming connections through the router against the fake engine: every
stream must complete (0 errors); the router's RSS before, at the peak and after, its memory per
connection, open fds, and the time to open them all.

    flock /tmp/gpupool-heavy.lock .venv/bin/python -m benchmarks.soak.connections \
        --out benchmarks/results/connections-YYYY-MM-DD

Set-up, so that all of them really stream at once: `gpupool serve` as a subprocess over one
fake engine (`pools.testing.fake_engine`) that streams `--tokens` tokens `--itl-ms` apart and
reports `--num-gpu-blocks` KV blocks of 16 tokens (far more than 2,000 short sequences need);
one pool serving both classes (no split of the instance); the operating point capped by
`--max-num-seqs` (read from `engines.local.vllm_args`, where the router looks for it) and
TTFT/TPOT targets loose enough that admission grants every stream at once (admission stays
on); queue depth above the connection count; `router.max_connections` 4096. This process and
its children get an open-file limit of 20,000.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from benchmarks.client import stream_chat
from benchmarks.outputs import bulk_path
from benchmarks.records import RequestRecord
from benchmarks.router_overhead.procs import Proc, start_proc, wait_ready
from benchmarks.router_overhead.stats import percentile
from benchmarks.soak.common import raise_nofile, read_gauge, sample_process, stop_gracefully

REPO = Path(__file__).resolve().parents[2]


def router_config(workdir: Path, port: int, engine_url: str, max_num_seqs: int) -> dict[str, Any]:
    loose = {"ttft_p95_ms": 60_000, "tpot_p95_ms": 5_000}  # streams ~1 token/s
    return {
        "model": {"name": "tiny", "path": "./.gpupool/models/tiny", "max_model_len_tokens": 4096},
        "engines": {
            "launcher": "static",
            "static": {"urls": [engine_url]},
            # the router reads the engines' --max-num-seqs (its operating-point cap) from here
            "local": {"vllm_args": ["--max-num-seqs", str(max_num_seqs)]},
        },
        "pools": {
            "normal": {
                "classes": ["normal", "agent"],
                "share": {"initial_frac": 1.0},
                "slo": loose,
                "queue": {"max_depth": 8192, "max_wait_s": 120},
            }
        },
        "classes": {
            c: {"timeout_s": 900, "expected_output_tokens": 64} for c in ("normal", "agent")
        },
        "router": {
            "port": port,
            "ledger_path": str(workdir / "ledger.sqlite"),
            "state_path": str(workdir / "state.json"),
            "max_connections": 4096,
        },
    }


@dataclass
class Point:
    t_s: float
    rss_mib: float
    fds: int
    engine_running: float | None


async def run(args: argparse.Namespace) -> int:
    out: Path = args.out
    workdir: Path = args.workdir
    t0 = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:7.1f}s] {msg}", flush=True)

    engine_url = f"http://127.0.0.1:{args.engine_port}"
    url = f"http://127.0.0.1:{args.port}"
    engine = start_proc(
        "fake-engine",
        [
            sys.executable,
            "-m",
            "pools.testing.fake_engine",
            "--port",
            str(args.engine_port),
            "--ttft-ms",
            str(args.ttft_ms),
            "--itl-ms",
            str(args.itl_ms),
            "--num-gpu-blocks",
            str(args.num_gpu_blocks),
            "--block-size",
            "16",
        ],
        log_dir=workdir,
        cpus=None,
        cwd=REPO,
    )
    cfg = workdir / "router.yaml"
    cfg.write_text(yaml.safe_dump(router_config(workdir, args.port, engine_url, args.max_num_seqs)))
    router: Proc | None = None
    try:
        await wait_ready(engine, engine_url + "/health", timeout_s=30)
        exe = Path(sys.executable).parent / "gpupool"
        router = start_proc(
            "gpupool-serve",
            [str(exe), "serve", "--config", str(cfg)],
            log_dir=workdir,
            cpus=None,
            cwd=REPO,
        )
        await wait_ready(router, url + "/ready", timeout_s=60)
        log(f"router pid {router.pid}, engine pid {engine.pid}, logs in {workdir}")
        return await _measure(args, url, engine_url, router, out, log)
    finally:
        if router is not None:
            log(f"gpupool serve exited {stop_gracefully(router, 30)}")
        engine.stop()
        with contextlib.suppress(OSError):
            if router is not None:
                bulk_path(out, "gpupool-serve.log").write_text(
                    router.log_path.read_text(errors="replace")
                )


async def _measure(
    args: argparse.Namespace,
    url: str,
    engine_url: str,
    router: Proc,
    out: Path,
    log: Any,
) -> int:
    n = args.connections
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hold this stream open please"}],
        "max_tokens": args.tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    points: list[Point] = []
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        # warm the code paths, then read the idle process
        for _ in range(3):
            rec = RequestRecord(class_name="normal", kind="chat", scheduled_s=0)
            await stream_chat(
                session,
                url + "/v1/chat/completions",
                {},
                {**body, "max_tokens": 2},
                rec,
                time.monotonic,
                0.0,
                60,
            )
            if not rec.ok:
                log(f"warm-up request failed: {rec.error_code} {rec.error}")
                return 1
        await asyncio.sleep(2)
        idle_rss, idle_fds = sample_process(router.pid)
        log(f"idle: rss {idle_rss:.1f} MiB, fds {idle_fds}")

        records = [RequestRecord(class_name="normal", kind="chat", scheduled_s=0) for _ in range(n)]
        first_token_at: list[float] = []
        done = asyncio.Event()
        start = time.monotonic()

        async def one(rec: RequestRecord) -> None:
            await stream_chat(
                session,
                url + "/v1/chat/completions",
                {},
                body,
                rec,
                time.monotonic,
                start,
                args.timeout_s,
            )
            if rec.ttft_ms is not None:
                first_token_at.append(rec.send_s + rec.ttft_ms / 1e3)

        async def sampler() -> None:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as probe:
                while not done.is_set():
                    rss, fds = sample_process(router.pid)
                    running = await read_gauge(
                        probe, engine_url + "/metrics", "vllm:num_requests_running"
                    )
                    t = time.monotonic() - start
                    points.append(Point(t, rss, fds, running))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(done.wait(), args.sample_s)

        sampling = asyncio.ensure_future(sampler())
        tasks = [asyncio.ensure_future(one(r)) for r in records]
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - start
        done.set()
        await sampling
        await asyncio.sleep(5)
        after_rss, after_fds = sample_process(router.pid)
        async with session.get(url + "/metrics") as resp:
            router_metrics = await resp.text()
    failed = [r for r in records if not r.ok or r.output_tokens != args.tokens]
    peak = max(points, key=lambda p: p.rss_mib)
    peak_running = max((p.engine_running or 0.0) for p in points)
    ttft = [r.ttft_ms / 1e3 for r in records if r.ttft_ms is not None]
    opened = sorted(first_token_at)
    summary: dict[str, Any] = {
        "connections": n,
        "errors": len(failed),
        "first_errors": [f"{r.status} {r.error_code}: {r.error}" for r in failed[:10]],
        "stream": {
            "tokens": args.tokens,
            "itl_ms": args.itl_ms,
            "ttft_ms": args.ttft_ms,
            "expected_s": (args.ttft_ms + args.itl_ms * (args.tokens - 1)) / 1e3,
        },
        "router_rss_mib": {
            "idle": round(idle_rss, 2),
            "peak": round(peak.rss_mib, 2),
            "after": round(after_rss, 2),
        },
        "memory_per_connection_kib": round((peak.rss_mib - idle_rss) * 1024 / n, 2),
        "router_fds": {
            "idle": idle_fds,
            "at_peak_rss": peak.fds,
            "max": max(p.fds for p in points),
            "after": after_fds,
        },
        "engine_running_max": peak_running,
        "time_to_open_all_s": round(opened[-1], 3) if len(opened) == n else None,
        "time_to_open_half_s": round(opened[n // 2], 3) if len(opened) > n // 2 else None,
        "ttft_s": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99), "max": max(ttft)}
        if ttft
        else None,
        "all_done_s": round(elapsed, 3),
        "router_requests_total": [
            line
            for line in router_metrics.splitlines()
            if line.startswith("gpupool_requests_total{")
        ],
        "how": f"fake engine --num-gpu-blocks {args.num_gpu_blocks} (block 16), one pool"
        f" serving both classes, operating point capped at --max-num-seqs {args.max_num_seqs},"
        " SLO targets loose, queue depth 8192, router.max_connections 4096, admission on",
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with bulk_path(out, "samples.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["t_s", "rss_mib", "fds", "engine_running"])
        for p in points:
            writer.writerow([round(p.t_s, 3), round(p.rss_mib, 3), p.fds, p.engine_running])
    _plot(points, bulk_path(out, "connections.png"), n)
    (out / "report.md").write_text(_report(summary))
    log(
        json.dumps(
            {
                k: summary[k]
                for k in (
                    "errors",
                    "router_rss_mib",
                    "memory_per_connection_kib",
                    "router_fds",
                    "engine_running_max",
                    "time_to_open_all_s",
                )
            }
        )
    )
    return 0 if not failed and peak_running >= n else 3


def _plot(points: list[Point], path: Path, n: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [p.t_s for p in points]
    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    axes[0].plot(t, [p.rss_mib for p in points])
    axes[0].set_ylabel("router RSS (MiB)")
    axes[1].plot(t, [p.fds for p in points])
    axes[1].set_ylabel("router open fds")
    axes[2].plot(t, [p.engine_running or 0 for p in points])
    axes[2].axhline(n, color="grey", linestyle=":")
    axes[2].set_ylabel("engine running")
    axes[2].set_xlabel("seconds since the first request")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"{n} concurrent streams through gpupool (fake engine)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _report(s: dict[str, Any]) -> str:
    rss = s["router_rss_mib"]
    fds = s["router_fds"]
    return "\n".join(
        [
            f"# {s['connections']} concurrent streaming connections through gpupool",
            "",
            f"Streams of {s['stream']['tokens']} tokens {s['stream']['itl_ms']} ms apart"
            f" (~{s['stream']['expected_s']:.0f} s each) from the fake engine. Set-up: {s['how']}.",
            "",
            "| | value |",
            "| --- | --- |",
            f"| errors | {s['errors']} |",
            f"| most sequences running on the engine at once | {s['engine_running_max']:.0f} |",
            f"| router RSS idle / peak / after (MiB) | {rss['idle']} / {rss['peak']} /"
            f" {rss['after']} |",
            f"| memory per connection, (peak - idle) / {s['connections']} |"
            f" {s['memory_per_connection_kib']} KiB |",
            f"| router open fds idle / at peak RSS / max / after | {fds['idle']} /"
            f" {fds['at_peak_rss']} / {fds['max']} / {fds['after']} |",
            f"| time until every stream had its first token | {s['time_to_open_all_s']} s |",
            f"| TTFT p50 / p99 / max | {json.dumps(s['ttft_s'])} |",
            f"| all streams done after | {s['all_done_s']} s |",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--port", type=int, default=8750)
    parser.add_argument("--engine-port", type=int, default=8751)
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--itl-ms", type=float, default=1000.0)
    parser.add_argument("--ttft-ms", type=float, default=200.0)
    parser.add_argument("--num-gpu-blocks", type=int, default=65536)
    parser.add_argument("--max-num-seqs", type=int, default=4096)
    parser.add_argument("--sample-s", type=float, default=0.5)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    soft, _ = raise_nofile(20000)
    if soft < 2 * args.connections + 256:
        print(f"open-file limit {soft} is too low for {args.connections} connections")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    args.workdir = Path(tempfile.mkdtemp(prefix="gpupool-connections-"))
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
