"""Soak: `gpupool up` on the default-like CPU config (three engines of the tiny model), a short
calibration of capacity, then an open-loop mix of chat and agent runs at ~70 % of it for
`--minutes`, sampling the router's RSS, open fds and asyncio tasks every 10 s.

    flock /tmp/gpupool-heavy.lock .venv/bin/python -m benchmarks.soak.run --minutes 30 \
        --out benchmarks/results/soak-YYYY-MM-DD

Capacity: the mix (two chat requests per agent step) is sent open-loop at rising total rates
(requests per second, agent steps counted as requests), `--step-s` each; the capacity is the
rate at which chat TTFT starts to climb: its p90 first exceeds twice the first step's (a step
with a failed request stops at the rate before it). The soak sends `--load-frac` (0.7) of it.

Writes to `--out`: `calibration.json`, `summary.json` (slopes per hour, start and end values,
requests sent and failed by class and error, the conservation check of `/admin/accounting` at
the end), `accounting.json`, `report.md`; to `benchmarks.outputs.bulk_dir(--out)`
(`benchmarks/out/...` for an `--out` under `benchmarks/results/`, not committed):
`samples.csv` (every 10 s: time, phase, RSS, fds, asyncio tasks, sent, failed), `soak.png`,
`gpupool-up.log`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import csv
import json
import math
import os
import random
import secrets
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from benchmarks.client import stream_chat
from benchmarks.outputs import bulk_path
from benchmarks.records import RequestRecord
from benchmarks.router_overhead.procs import Proc, StartFailed, start_proc, wait_ready
from benchmarks.router_overhead.stats import percentile
from benchmarks.soak.common import (
    Sample,
    fit_per_hour,
    plot_samples,
    raise_nofile,
    read_gauge,
    sample_process,
    stop_gracefully,
)
from pools.config import DEFAULT_CPU_CONFIG
from router.simulate.workload import make_tools

REPO = Path(__file__).resolve().parents[2]
SAMPLE_EVERY_S = 10.0
CHAT_PER_AGENT_STEP = 2.0  # the mix: two chat requests per agent step
AGENT_STEPS = 4
MAX_TOKENS = 24
_WORD_TEXT = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu river stone "
    "cloud paper engine router cache token window batch queue prefix"
)
_WORDS = _WORD_TEXT.split()


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def soak_config(workdir: Path, port: int, base_port: int) -> dict[str, Any]:
    """The embedded default (three CPU engines, agent:normal 1:2) on this benchmark's ports,
    run dir and ledger, with one tenant key and an operators' key."""
    cfg = copy.deepcopy(DEFAULT_CPU_CONFIG)
    cfg["engines"]["local"]["base_port"] = base_port
    cfg["engines"]["local"]["run_dir"] = str(workdir / "run")
    cfg["tenants"] = [{"name": "soak", "api_key_env": "GPUPOOL_SOAK_KEY"}]
    cfg["router"] = {
        "port": port,
        "ledger_path": str(workdir / "ledger.sqlite"),
        "state_path": str(workdir / "state.json"),
        "admin_api_key_env": "GPUPOOL_SOAK_ADMIN_KEY",
    }
    return cfg


@dataclass
class Load:
    """Counters and latencies of every request sent; `phase` tags what is being sent now."""

    url: str
    headers: dict[str, str]
    session: aiohttp.ClientSession
    start: float
    seed: int = 0
    phase: str = "warmup"
    sent: Counter[str] = field(default_factory=Counter)  # by phase
    failed: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)  # phase/class/code
    ttft: dict[tuple[str, str], list[float]] = field(default_factory=dict)  # (phase, class)
    ttft_series: list[tuple[float, str, float]] = field(default_factory=list)  # soak: t, cls
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    first_errors: list[str] = field(default_factory=list)

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def one(
        self, cls: str, messages: list[dict[str, Any]], extra: dict[str, Any], hdrs: dict[str, str]
    ) -> RequestRecord:
        phase = self.phase
        body: dict[str, Any] = {
            "model": "tiny",
            "messages": messages,
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **extra,
        }
        record = RequestRecord(
            class_name=cls,
            kind="agent" if cls == "agent" else "chat",
            scheduled_s=time.monotonic() - self.start,
        )
        self.sent[phase] += 1
        await stream_chat(
            self.session,
            self.url + "/v1/chat/completions",
            {**self.headers, **hdrs},
            body,
            record,
            time.monotonic,
            self.start,
            timeout_s=300,
        )
        if record.ok and record.ttft_ms is not None:
            self.ttft.setdefault((phase, cls), []).append(record.ttft_ms / 1e3)
            if phase == "soak":
                self.ttft_series.append((record.send_s, cls, record.ttft_ms / 1e3))
        else:
            self.failed[phase] += 1
            code = record.error_code or f"http_{record.status}"
            self.errors[f"{phase}/{cls}/{code}"] += 1
            if len(self.first_errors) < 10:
                self.first_errors.append(f"{phase} {cls} {code}: {record.error}")
        return record

    async def chat(self, rng: random.Random) -> None:
        messages = [{"role": "user", "content": _words(rng, rng.randint(30, 90))}]
        await self.one("normal", messages, {}, {})

    async def agent_run(self, rng: random.Random) -> None:
        run_id = f"soak-{uuid.uuid4().hex[:12]}"
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are an agent. " + _words(rng, 120)},
            {"role": "user", "content": _words(rng, 40)},
        ]
        tools = list(make_tools(4))
        for step in range(AGENT_STEPS):
            record = await self.one(
                "agent", messages, {"tools": tools}, {"x-gpupool-run-id": run_id}
            )
            if not record.ok:
                return
            messages.append({"role": "assistant", "content": _words(rng, MAX_TOKENS)})
            if step < AGENT_STEPS - 1:
                messages.append({"role": "user", "content": "tool result: " + _words(rng, 40)})

    async def open_loop(self, total_rate: float, duration_s: float, rng: random.Random) -> None:
        """Poisson arrivals for `duration_s`: chat at 2/3 of `total_rate` req/s, agent runs at
        the rate whose steps make the other third."""
        chat_rate = total_rate * CHAT_PER_AGENT_STEP / (CHAT_PER_AGENT_STEP + 1)
        run_rate = total_rate / (CHAT_PER_AGENT_STEP + 1) / AGENT_STEPS
        end = time.monotonic() + duration_s
        next_chat = time.monotonic() + rng.expovariate(chat_rate)
        next_run = time.monotonic() + rng.expovariate(run_rate)
        while True:
            nxt = min(next_chat, next_run)
            if nxt >= end:
                return
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))
            if next_chat <= next_run:
                self.spawn(self.chat(random.Random(rng.random())))
                next_chat += rng.expovariate(chat_rate)
            else:
                self.spawn(self.agent_run(random.Random(rng.random())))
                next_run += rng.expovariate(run_rate)

    async def drain(self, timeout_s: float) -> None:
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=timeout_s)


async def calibrate(
    load: Load, step_s: float, first_rate: float, factor: float, max_steps: int, log: Any
) -> dict[str, Any]:
    steps: list[dict[str, Any]] = []
    base: float | None = None
    capacity: float | None = None
    rate = first_rate
    rng = random.Random(load.seed + 1)
    for i in range(max_steps):
        load.phase = f"cal{i}"
        await load.open_loop(rate, step_s, rng)
        await load.drain(120)
        chat = load.ttft.get((load.phase, "normal"), [])
        agent = load.ttft.get((load.phase, "agent"), [])
        p90 = percentile(chat, 90) if chat else math.nan
        step = {
            "rate_req_per_s": round(rate, 3),
            "sent": load.sent[load.phase],
            "failed": load.failed[load.phase],
            "chat_ttft_p50_s": percentile(chat, 50) if chat else None,
            "chat_ttft_p90_s": None if math.isnan(p90) else p90,
            "agent_ttft_p90_s": percentile(agent, 90) if agent else None,
        }
        if base is None and not math.isnan(p90):
            base = p90
        bound = None if base is None else 2 * base
        failed = load.failed[load.phase] > 0
        climbed = bound is not None and p90 > bound
        step["bound_s"] = bound
        step["climbed"] = climbed
        steps.append(step)
        log(f"calibration {json.dumps(step)}")
        if failed:  # past capacity: keep the rate before
            break
        capacity = rate
        if climbed:
            break
        rate *= factor
    return {
        "steps": steps,
        "capacity_req_per_s": capacity,
        "climbed": any(st["climbed"] for st in steps),
        "rule": "the total rate (chat + agent steps, 2:1) at which chat TTFT p90 first exceeds"
        " 2 x the first step's p90 (TTFT starts to climb); a step with a failed request stops"
        " the calibration at the rate before it; with neither within --max-steps, the last"
        " rate tried (climbed: false)",
    }


async def soak(args: argparse.Namespace) -> int:
    out: Path = args.out
    workdir: Path = args.workdir
    t0 = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:7.1f}s] {msg}", flush=True)

    raise_nofile(8192)
    key, admin_key = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    cfg_path = workdir / "soak.yaml"
    cfg = soak_config(workdir, args.port, args.engine_base_port)
    fake: Proc | None = None
    if args.fake_engine:  # a check of this harness in a minute, no vLLM
        engine_url = f"http://127.0.0.1:{args.engine_base_port}"
        fake = start_proc(
            "fake-engine",
            [
                sys.executable,
                "-m",
                "pools.testing.fake_engine",
                "--port",
                str(args.engine_base_port),
                "--ttft-ms",
                "30",
                "--itl-ms",
                "20",
            ],
            log_dir=workdir,
            cpus=None,
            cwd=REPO,
        )
        await wait_ready(fake, engine_url + "/health", timeout_s=30)
        cfg["engines"] = {"launcher": "static", "static": {"urls": [engine_url]}}
    cfg_path.write_text(yaml.safe_dump(cfg))
    url = f"http://127.0.0.1:{args.port}"
    exe = Path(sys.executable).parent / "gpupool"
    proc: Proc = start_proc(
        "gpupool-up",
        [str(exe), "up", "--config", str(cfg_path)],
        log_dir=workdir,
        cpus=None,
        env={"GPUPOOL_SOAK_KEY": key, "GPUPOOL_SOAK_ADMIN_KEY": admin_key},
        cwd=REPO,
    )
    log(f"gpupool up (pid {proc.pid}), config and logs in {workdir}")
    samples: list[Sample] = []
    admin = {"Authorization": f"Bearer {admin_key}"}
    code = 1
    try:
        try:
            waited = await wait_ready(proc, url + "/ready", timeout_s=900)
        except StartFailed as err:
            log(f"gpupool did not start: {err}")
            return 1
        log(f"ready after {waited:.0f} s")
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            load = Load(url, {"Authorization": f"Bearer {key}"}, session, time.monotonic())
            load.seed = args.seed
            stop_sampling = asyncio.Event()

            async def sampler() -> None:
                while not stop_sampling.is_set():
                    rss, fds = sample_process(proc.pid)
                    tasks = await read_gauge(
                        session, url + "/metrics", "gpupool_asyncio_tasks", admin
                    )
                    sent = sum(load.sent.values())
                    failed = sum(load.failed.values())
                    t = time.monotonic() - load.start
                    phase = load.phase if not load.phase.startswith("cal") else "calibration"
                    samples.append(Sample(t, phase, rss, fds, tasks, sent, failed))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop_sampling.wait(), SAMPLE_EVERY_S)

            sampling = asyncio.ensure_future(sampler())
            rng = random.Random(args.seed)
            for _ in range(3):  # warm the engines (first requests compile and allocate)
                await asyncio.gather(load.chat(rng), load.agent_run(rng))
            if args.rate is not None:
                cal: dict[str, Any] = {"capacity_req_per_s": None, "given_rate": args.rate}
                rate = args.rate
            else:
                cal = await calibrate(
                    load, args.step_s, args.first_rate, args.factor, args.max_steps, log
                )
                if cal["capacity_req_per_s"] is None:
                    log("the first calibration step already climbed; lower --first-rate")
                    cal["capacity_req_per_s"] = args.first_rate
                rate = args.load_frac * cal["capacity_req_per_s"]
            (out / "calibration.json").write_text(json.dumps(cal, indent=2) + "\n")
            log(f"soak at {rate:.3f} req/s for {args.minutes} min")
            load.phase = "cooldown"
            await asyncio.sleep(20)  # let the calibration's last queue empty before measuring
            load.phase = "soak"
            soak_start = time.monotonic() - load.start
            progress = asyncio.ensure_future(_progress(load, samples, log))
            await load.open_loop(rate, args.minutes * 60, random.Random(args.seed + 2))
            load.phase = "drain"
            await load.drain(300)
            progress.cancel()
            soak_end = time.monotonic() - load.start
            load.phase = "after"
            await asyncio.sleep(SAMPLE_EVERY_S + 1)
            stop_sampling.set()
            await sampling
            async with session.get(url + "/admin/accounting?top=5", headers=admin) as resp:
                accounting = await resp.json()
            (out / "accounting.json").write_text(json.dumps(accounting, indent=2) + "\n")
        summary = _summarize(args, load, samples, cal, rate, soak_start, soak_end, accounting)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        _write_csv(bulk_path(out, "samples.csv"), samples)
        plot_samples(
            samples,
            bulk_path(out, "soak.png"),
            f"gpupool soak: {args.minutes:g} min at {rate:.2f} req/s"
            f" ({args.load_frac:.0%} of {cal.get('capacity_req_per_s') or 0:.2f})",
        )
        (out / "report.md").write_text(_report(summary))
        log(json.dumps(summary["slopes_per_hour"]))
        log(f"sent {summary['requests']['soak_sent']}, failed {summary['requests']['soak_failed']}")
        code = 0 if summary["requests"]["soak_failed"] == 0 else 3
    finally:
        rc = stop_gracefully(proc)
        log(f"gpupool up exited {rc}")
        if fake is not None:
            fake.stop()
        with contextlib.suppress(OSError):
            bulk_path(out, "gpupool-up.log").write_text(proc.log_path.read_text(errors="replace"))
    return code


async def _progress(load: Load, samples: list[Sample], log: Any) -> None:
    while True:
        await asyncio.sleep(60)
        s = samples[-1] if samples else None
        log(
            f"soak: sent {load.sent['soak']} failed {load.failed['soak']} in flight"
            f" {len(load.tasks)}"
            + (f" rss {s.rss_mib:.1f} MiB fds {s.fds} tasks {s.asyncio_tasks}" if s else "")
        )


def _conservation(accounting: dict[str, Any]) -> Any:
    """The conservation part of the /admin/accounting answer, wherever it sits."""
    found: dict[str, Any] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if "conservation" in k or k in ("abs_error_gpu_seconds", "rel_error"):
                    found[f"{path}{k}"] = v
                else:
                    walk(v, f"{path}{k}.")

    walk(accounting, "")
    ledger = accounting.get("ledger") or {}
    with contextlib.suppress(KeyError, TypeError):
        total = ledger["gpu_seconds"] + ledger["idle_gpu_seconds"]
        found["ledger.capacity_gpu_seconds"] = ledger["capacity_gpu_seconds"]
        found["ledger.abs_error_gpu_seconds"] = abs(total - ledger["capacity_gpu_seconds"])
    return found


def _summarize(
    args: argparse.Namespace,
    load: Load,
    samples: list[Sample],
    cal: dict[str, Any],
    rate: float,
    soak_start: float,
    soak_end: float,
    accounting: dict[str, Any],
) -> dict[str, Any]:
    window = [s for s in samples if soak_start <= s.t_s <= soak_end]
    slopes: dict[str, Any] = {}
    for name, unit in (("rss_mib", "MiB"), ("fds", "fds"), ("asyncio_tasks", "tasks")):
        pts = [(s.t_s, getattr(s, name)) for s in window if getattr(s, name) is not None]
        ts = [p[0] for p in pts]
        vs = [float(p[1]) for p in pts]
        half = [i for i, t in enumerate(ts) if t >= (soak_start + soak_end) / 2]
        slopes[name] = {
            "slope_per_hour": fit_per_hour(ts, vs),
            # growth that is warm-up (caches filling) flattens: the second half tells
            "second_half_slope_per_hour": fit_per_hour(
                [ts[i] for i in half], [vs[i] for i in half]
            ),
            "unit": unit,
            "start": vs[0] if vs else None,
            "end": vs[-1] if vs else None,
            "min": min(vs) if vs else None,
            "max": max(vs) if vs else None,
            "points": len(vs),
        }
    ttft = {
        cls: {
            "p50_s": percentile(v, 50),
            "p90_s": percentile(v, 90),
            "p99_s": percentile(v, 99),
            "n": len(v),
        }
        for (phase, cls), v in load.ttft.items()
        if phase == "soak" and v
    }
    return {
        "minutes": args.minutes,
        "soak_window_s": [round(soak_start, 1), round(soak_end, 1)],
        "rate_req_per_s": rate,
        "load_frac": args.load_frac,
        "capacity_req_per_s": cal.get("capacity_req_per_s"),
        "mix": f"chat:agent-step = {CHAT_PER_AGENT_STEP:g}:1, agent runs of {AGENT_STEPS}"
        f" steps with 4 tools, max_tokens {MAX_TOKENS} (ignore_eos), all streaming",
        "slopes_per_hour": slopes,
        "requests": {
            "soak_sent": load.sent["soak"],
            "soak_failed": load.failed["soak"],
            "all_sent": sum(load.sent.values()),
            "all_failed": sum(load.failed.values()),
            "errors": dict(load.errors),
            "first_errors": load.first_errors,
        },
        "soak_ttft": ttft,
        "accounting_conservation": _conservation(accounting),
        "machine": {"cpus": os.cpu_count()},
    }


def _write_csv(path: Path, samples: list[Sample]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(samples[0].to_json()) if samples else ["t_s"])
        writer.writeheader()
        for s in samples:
            writer.writerow(s.to_json())


def _report(summary: dict[str, Any]) -> str:
    lines = [
        f"# Soak: {summary['minutes']} min at {summary['rate_req_per_s']:.2f} req/s",
        "",
        f"Capacity {summary['capacity_req_per_s']} req/s (see calibration.json);"
        f" load {summary['load_frac']:.0%} of it. Mix: {summary['mix']}.",
        "",
        "| router reading | start | end | min | max | slope per hour | second half's slope |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, s in summary["slopes_per_hour"].items():
        lines.append(
            f"| {name} | {s['start']} | {s['end']} | {s['min']} | {s['max']} |"
            f" {s['slope_per_hour']:+.3f} {s['unit']}/h |"
            f" {s['second_half_slope_per_hour']:+.3f} {s['unit']}/h |"
        )
    r = summary["requests"]
    lines += [
        "",
        f"Requests in the soak: {r['soak_sent']} sent, {r['soak_failed']} failed"
        f" (whole run incl. calibration: {r['all_sent']} sent, {r['all_failed']} failed).",
        f"Errors: {r['errors'] or 'none'}",
        "",
        f"Soak TTFT: {json.dumps(summary['soak_ttft'])}",
        "",
        f"Accounting conservation at the end: {json.dumps(summary['accounting_conservation'])}",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--port", type=int, default=8700)
    parser.add_argument("--engine-base-port", type=int, default=8710)
    parser.add_argument("--load-frac", type=float, default=0.7)
    parser.add_argument("--rate", type=float, default=None, help="skip calibration: req/s")
    parser.add_argument("--first-rate", type=float, default=0.5, help="calibration start req/s")
    parser.add_argument("--factor", type=float, default=1.3, help="calibration rate step")
    parser.add_argument("--step-s", type=float, default=20.0, help="calibration step length")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--fake-engine",
        action="store_true",
        help="one fake engine behind a static config instead of three CPU engines (to check"
        " this harness quickly; not a soak of the real stack)",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.workdir = Path(tempfile.mkdtemp(prefix="gpupool-soak-"))
    return asyncio.run(soak(args))


if __name__ == "__main__":
    sys.exit(main())
