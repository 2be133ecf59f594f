"""The side-by-side run over the fake engine: start the engine and every proxy, then drive each
phase in rounds that visit every target in turn (the order rotates each round), reading the
proxy's and the engine's CPU right before and right at the end of each target's window.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.router_overhead.load import ClosedLoopResult, LoadClient, chat_body
from benchmarks.router_overhead.meter import Meter, summarize_phase
from benchmarks.router_overhead.plan import PORTS, Plan
from benchmarks.router_overhead.procs import Proc, StartFailed, start_proc, wait_ready
from benchmarks.router_overhead.targets import PeerPaths, TargetSpec, make_targets

__all__ = [
    "Live",
    "Placement",
    "close_all",
    "ready",
    "record_window",
    "run_phases",
    "run_rounds",
    "solo",
    "start_engine",
    "start_targets",
    "target_results",
]

log = logging.getLogger(__name__)

PHASES = ("c1", "hi", "stream")


@dataclass(frozen=True)
class Placement:
    """CPU sets: the load generator and the engine share one, the proxy under test gets the
    other (None: no pinning). Niceness: the load generator above everything, the engine and the
    proxies above the machine's other jobs (a shared machine: their CPU-hungry threads would
    otherwise decide the throughput figures)."""

    loadgen: frozenset[int] | None
    proxy: frozenset[int] | None
    loadgen_nice: int = -10
    served_nice: int = -5


@dataclass
class Live:
    """A target in this run: its process (None for `direct`), client and meters per phase."""

    spec: TargetSpec
    proc: Proc | None = None
    client: LoadClient | None = None
    status: str = "ok"  # ok | unavailable | failed
    reason: str = ""
    start_s: float = 0.0
    meters: dict[str, Meter] = field(default_factory=lambda: {p: Meter() for p in PHASES})
    # (schedstat, psutil ticks) CPU-seconds of the proxy tree at the start and end of the phases
    cpu_marks: list[tuple[float, float]] = field(default_factory=list)
    idle_cpu_s_per_s: float = 0.0  # background work (health checks, scrapes, flushes) at rest

    def mark_cpu(self) -> None:
        if self.proc is not None:
            self.cpu_marks.append((self.proc.cpu_s(), self.proc.cpu_ticks_s()))

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.spec.port}"

    def cpu_s(self) -> float:
        return self.proc.cpu_s() if self.proc is not None else 0.0


async def start_engine(
    paths: PeerPaths, workdir: Path, placement: Placement, itl_ms: float, port: int | None = None
) -> Proc:
    """The fast fake engine every target sits in front of, on the load generator's CPUs
    (on `port`, default PORTS["engine"])."""
    port = PORTS["engine"] if port is None else port
    python = str(paths.gpupool_venv / "bin" / "python")
    argv = [
        python,
        "-m",
        "pools.testing.fake_engine",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--ttft-ms",
        "0",
        "--itl-ms",
        str(itl_ms),
    ]
    proc = start_proc(
        "fake-engine",
        argv,
        log_dir=workdir,
        cpus=placement.loadgen,
        nice=placement.served_nice,
        cwd=paths.repo,
    )
    await wait_ready(proc, f"http://127.0.0.1:{port}/health", timeout_s=30)
    return proc


async def start_targets(
    paths: PeerPaths, workdir: Path, placement: Placement, names: list[str]
) -> list[Live]:
    """Start every selected proxy at once, then wait for each to serve a chat request."""
    engine_url = f"http://127.0.0.1:{PORTS['engine']}"
    specs = [s for s in make_targets(engine_url, PORTS, paths, workdir) if s.name in names]
    lives = [Live(spec) for spec in specs]
    for live in lives:
        spec = live.spec
        if spec.argv is None:
            continue
        if (why := spec.missing()) is not None:
            live.status, live.reason = "unavailable", why
            continue
        live.proc = start_proc(
            spec.name,
            spec.argv,
            log_dir=workdir,
            cpus=placement.proxy,
            nice=placement.served_nice,
            env=spec.env,
            cwd=spec.cwd,
        )
    await asyncio.gather(*(ready(live) for live in lives))
    for live in lives:
        if live.status == "ok":
            live.client = LoadClient(live.base_url)
    return lives


async def ready(live: Live) -> None:
    if live.proc is None:
        return
    probe = chat_body(4, stream=False)
    try:
        waited = await wait_ready(
            live.proc, live.base_url + live.spec.ready_path, timeout_s=live.spec.start_timeout_s
        )
        waited += await wait_ready(
            live.proc, live.base_url + "/v1/chat/completions", timeout_s=30, probe=probe
        )
        live.start_s = waited
        log.info("%s ready in %.1f s", live.spec.name, waited)
    except StartFailed as err:
        live.status, live.reason = "failed", f"did not start: {err}"
        live.proc.stop()
        live.proc = None


Window = Callable[[LoadClient, Meter, Callable[[], None]], Awaitable[None]]


@contextlib.contextmanager
def solo(lives: list[Live], measured: Live) -> Iterator[None]:
    """Pause (SIGSTOP) every other proxy while `measured` is driven, so their background work
    (health checks, scrapes, flushes) does not take the measured proxy's CPU; resume after."""
    others = [lv.proc for lv in lives if lv is not measured and lv.proc is not None]
    for proc in others:
        proc.signal_tree(signal.SIGSTOP)
    try:
        yield
    finally:
        for proc in others:
            proc.signal_tree(signal.SIGCONT)


async def run_rounds(
    lives: list[Live], engine: Proc, phase: str, rounds: int, window: Window, settle_s: float
) -> None:
    """Run `window` once per target per round, rotating the order; CPU is read before each
    window and when the window calls its `at_deadline`."""
    active = [lv for lv in lives if lv.status == "ok"]
    for r in range(rounds):
        order = active[r % len(active) :] + active[: r % len(active)] if active else []
        for live in order:
            meter = live.meters[phase]
            assert live.client is not None
            marks: list[tuple[float, float]] = []

            def at_deadline(live: Live = live, marks: list[tuple[float, float]] = marks) -> None:
                marks.append((live.cpu_s(), engine.cpu_s()))

            with solo(lives, live):
                await asyncio.sleep(settle_s)  # a resumed proxy catches up on its timers first
                cpu0, eng0 = live.cpu_s(), engine.cpu_s()
                await window(live.client, meter, at_deadline)
            if not marks:
                at_deadline()
            meter.cpu_s += marks[0][0] - cpu0
            meter.engine_cpu_s += marks[0][1] - eng0
        log.info("%s round %d/%d done", phase, r + 1, rounds)


async def run_phases(lives: list[Live], engine: Proc, plan: Plan) -> None:
    body = chat_body(plan.max_tokens, stream=False)
    stream_body = chat_body(plan.stream_tokens, stream=True)
    for live in lives:
        if live.status == "ok" and live.client is not None:
            warm = await live.client.sequential(body, plan.warmup_requests)
            await live.client.stream_window(stream_body, 2, 0.5)
            if warm.errors == plan.warmup_requests:
                live.status = "failed"
                live.reason = f"every warm-up request failed: {warm.first_error}"

    async def c1(client: LoadClient, meter: Meter, at_deadline: Callable[[], None]) -> None:
        res = await client.sequential(body, plan.c1_requests)
        at_deadline()
        record_window(meter, res)

    async def hi(client: LoadClient, meter: Meter, at_deadline: Callable[[], None]) -> None:
        res = await client.closed_loop(
            body, plan.hi_concurrency, plan.hi_window_s, on_deadline=at_deadline
        )
        record_window(meter, res)

    async def stream(client: LoadClient, meter: Meter, at_deadline: Callable[[], None]) -> None:
        res = await client.stream_window(
            stream_body, plan.stream_concurrency, plan.stream_window_s, on_deadline=at_deadline
        )
        meter.units += res.events
        meter.window_s += res.window_s
        meter.rates.append(res.events / res.window_s)
        meter.completed_streams += res.completed
        meter.add_errors(res.errors, res.first_error)

    await measure_idle(lives, plan.idle_window_s)
    for live in lives:
        live.mark_cpu()
    await run_rounds(lives, engine, "c1", plan.c1_rounds, c1, plan.settle_s)
    await run_rounds(lives, engine, "hi", plan.hi_rounds, hi, plan.settle_s)
    await run_rounds(lives, engine, "stream", plan.stream_rounds, stream, plan.settle_s)
    for live in lives:
        live.mark_cpu()


async def measure_idle(lives: list[Live], window_s: float) -> None:
    """Every proxy's CPU with no traffic at all, all at once: the background cost that the
    per-request figures would otherwise charge to requests."""
    ok = [lv for lv in lives if lv.status == "ok" and lv.proc is not None]
    before = [lv.cpu_s() for lv in ok]
    t0 = time.perf_counter()
    await asyncio.sleep(window_s)
    elapsed = time.perf_counter() - t0
    for live, cpu0 in zip(ok, before, strict=True):
        live.idle_cpu_s_per_s = (live.cpu_s() - cpu0) / elapsed


def record_window(meter: Meter, res: ClosedLoopResult) -> None:
    meter.rounds.append(res.latencies_s)
    meter.units += res.in_window
    meter.window_s += res.window_s
    meter.rates.append(res.in_window / res.window_s if res.window_s > 0 else 0.0)
    meter.add_errors(res.errors, res.first_error)


def target_results(lives: list[Live]) -> list[dict[str, Any]]:
    """Per-target figures, each phase against the direct engine's meter of the same phase."""
    direct = next((lv for lv in lives if lv.spec.name == "direct"), None)
    out = []
    for live in lives:
        entry: dict[str, Any] = {
            "name": live.spec.name,
            "status": live.status,
            "reason": live.reason,
            "note": live.spec.note,
            "port": live.spec.port,
            "start_s": round(live.start_s, 1),
        }
        if live.status == "ok":
            is_direct = live is direct
            for phase in PHASES:
                ref = None if is_direct or direct is None else direct.meters[phase]
                entry[phase] = summarize_phase(
                    live.meters[phase], ref, proxy=not is_direct, idle_s_per_s=live.idle_cpu_s_per_s
                )
            if not is_direct:
                entry["idle_cpu_ms_per_s"] = round(live.idle_cpu_s_per_s * 1e3, 3)
            if len(live.cpu_marks) == 2:
                (s0, t0), (s1, t1) = live.cpu_marks
                entry["cpu_cross_check"] = {
                    "schedstat_s": round(s1 - s0, 3),
                    "psutil_ticks_s": round(t1 - t0, 3),
                    "span": "all phases, idle gaps included",
                }
        out.append(entry)
    return out


async def close_all(lives: list[Live], engine: Proc | None) -> None:
    for live in lives:
        if live.client is not None:
            with contextlib.suppress(Exception):
                await live.client.aclose()
        if live.proc is not None:
            live.proc.stop()
    if engine is not None:
        engine.stop()
