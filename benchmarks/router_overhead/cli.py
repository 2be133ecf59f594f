"""`python -m benchmarks.router_overhead [--quick] --out DIR`: run every target side by side and
write DIR/router_overhead.md and DIR/router_overhead.json."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.router_overhead import flame, profile
from benchmarks.router_overhead.load import chat_body
from benchmarks.router_overhead.machine import describe, load_average, versions
from benchmarks.router_overhead.otlp_sink import otlp_sink
from benchmarks.router_overhead.plan import PORTS, Plan
from benchmarks.router_overhead.procs import Proc, pin_self
from benchmarks.router_overhead.real_vllm import run_real_vllm
from benchmarks.router_overhead.report import (
    RUST_CPU_RATIO_LIMIT,
    against_rust,
    check_gpupool,
    render,
)
from benchmarks.router_overhead.runner import (
    Live,
    Placement,
    close_all,
    run_phases,
    solo,
    start_engine,
    start_targets,
    target_results,
)
from benchmarks.router_overhead.targets import PeerPaths

__all__ = ["main"]

log = logging.getLogger("benchmarks.router_overhead")

ALL_TARGETS = (
    "direct",
    "gpupool",
    "gpupool-admission-off",
    "gpupool-ledger-batched",
    "vllm-router",
    "production-stack",
    "litellm",
)
# not run unless named: `--targets direct,gpupool,gpupool-trace-0,gpupool-trace-0.01,...`
TRACE_TARGETS = ("gpupool-trace-1", "gpupool-trace-0.01", "gpupool-trace-0")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.router_overhead",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument("--out", required=True, type=Path, help="folder for the .md and .json")
    p.add_argument("--quick", action="store_true", help="a ~1-minute smoke run")
    p.add_argument(
        "--rounds",
        type=int,
        help="rounds of each phase (c=1, c=64, streaming) instead of the plan's, for a finer "
        "A/B on a noisy machine",
    )
    p.add_argument(
        "--targets",
        default=",".join(ALL_TARGETS),
        help="comma-separated subset of " + ",".join(ALL_TARGETS + TRACE_TARGETS),
    )
    p.add_argument("--no-real-vllm", action="store_true", help="skip the real-engine phase")
    p.add_argument(
        "--check",
        action="store_true",
        help=f"exit 1 when gpupool's CPU per request at c=64 is over {RUST_CPU_RATIO_LIMIT:g}x "
        "vllm-router's in this run (exit 2 when either did not run); adds both if --targets "
        "left them out",
    )
    p.add_argument("--no-profile", action="store_true", help="skip py-spy on gpupool")
    p.add_argument(
        "--profile-rate", type=int, help="py-spy's samples per second (the plan's 250 otherwise)"
    )
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    p.add_argument(
        "--loadgen-cpu",
        type=int,
        default=0,
        help="CPU for the load generator and the engine (default 0)",
    )
    p.add_argument("--proxy-cpu", type=int, default=1, help="CPU for the proxy under test")
    p.add_argument("--notes", type=Path, help="Markdown file appended under the profile")
    p.add_argument("--repo", type=Path, default=Path.cwd(), help="gpupool checkout")
    p.add_argument(
        "--baseline",
        type=Path,
        help="another gpupool checkout (a `git worktree` at an earlier commit) measured beside "
        "--repo's as target gpupool-baseline: a before/after in one run",
    )
    p.add_argument(
        "--render-only",
        action="store_true",
        help="re-render DIR/router_overhead.md from DIR/router_overhead.json (and --notes)",
    )
    return p


def _placement(args: argparse.Namespace) -> tuple[Placement, str]:
    if args.no_pin or (os.cpu_count() or 1) < 2:
        return Placement(None, None), "not pinned"
    lg, px = frozenset({args.loadgen_cpu}), frozenset({args.proxy_cpu})
    return Placement(lg, px), (
        f"load generator and fake engine on CPU {args.loadgen_cpu}, the proxy under test on CPU "
        f"{args.proxy_cpu} (sched_setaffinity); engine and proxies at nice "
        f"{Placement(lg, px).served_nice}, the load generator at nice "
        f"{Placement(lg, px).loadgen_nice}, the machine's other jobs at 0"
    )


async def _profile_gpupool(
    lives: list[Live], plan: Plan, paths: PeerPaths, workdir: Path
) -> dict[str, Any]:
    """py-spy on gpupool: one non-streaming and one streaming window."""
    pyspy = paths.repo / ".venv-peers" / "pyspy" / "bin" / "py-spy"
    gp = next((lv for lv in lives if lv.spec.name == "gpupool" and lv.status == "ok"), None)
    if gp is None or gp.proc is None or gp.client is None:
        return {}
    if (skipped := profile.missing(pyspy)) is not None:
        return {"c1": skipped, "hi": skipped, "stream": skipped}
    with solo(lives, gp):
        return await _profile_one(gp, plan, pyspy, workdir)


async def _profile_one(gp: Live, plan: Plan, pyspy: Path, workdir: Path) -> dict[str, Any]:
    """py-spy over a non-streaming window at c=1, one at c=64 and a streaming one of `gp`."""
    assert gp.proc is not None and gp.client is not None
    name, pid, window_s = gp.spec.name, _python_pid(gp.proc), plan.profile_window_s
    hz = plan.profile_rate_hz
    c1 = gp.client.closed_loop(chat_body(plan.max_tokens, stream=False), 1, window_s)
    prof_c1 = await profile.record(pyspy, pid, window_s, workdir / f"pyspy-{name}-c1.txt", c1, hz)
    hi = gp.client.closed_loop(
        chat_body(plan.max_tokens, stream=False), plan.hi_concurrency, window_s
    )
    prof_hi = await profile.record(pyspy, pid, window_s, workdir / f"pyspy-{name}-hi.txt", hi, hz)
    st = gp.client.stream_window(
        chat_body(plan.stream_tokens, stream=True), plan.stream_concurrency, window_s
    )
    prof_st = await profile.record(pyspy, pid, window_s, workdir / f"pyspy-{name}-st.txt", st, hz)
    return {"c1": prof_c1, "hi": prof_hi, "stream": prof_st}


def _python_pid(proc: Proc) -> int:
    return proc.pid  # `gpupool serve` is one process: the router itself


def _clean(obj: Any) -> Any:
    """NaN -> None, so the JSON is standard."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    plan = Plan.quick() if args.quick else Plan()
    if args.rounds is not None:
        plan = dataclasses.replace(
            plan, c1_rounds=args.rounds, hi_rounds=args.rounds, stream_rounds=args.rounds
        )
    if args.profile_rate is not None:
        plan = dataclasses.replace(plan, profile_rate_hz=args.profile_rate)
    repo = args.repo.resolve()
    paths = PeerPaths.default(repo, args.baseline.resolve() if args.baseline else None)
    workdir = Path(tempfile.mkdtemp(prefix="router-overhead-", dir="/tmp"))
    log.info("logs and configs in %s", workdir)
    names = [n.strip() for n in args.targets.split(",") if n.strip()]
    if "direct" not in names:
        names.insert(0, "direct")
    if args.baseline is not None and "gpupool-baseline" not in names:
        names.append("gpupool-baseline")
    if args.check:
        names += [n for n in ("gpupool", "vllm-router") if n not in names]
    placement, placed = _placement(args)
    machine = describe()
    result: dict[str, Any] = {
        "command": "python -m benchmarks.router_overhead " + shlex.join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": machine,
        "versions": versions(paths),
        "plan": plan.__dict__,
        "ports": PORTS,
        "placement": placed,
        "workdir": str(workdir),
    }
    engine = await start_engine(paths, workdir, placement, plan.engine_itl_ms)
    lives: list[Live] = []
    sink = contextlib.AsyncExitStack()
    if any(n.startswith("gpupool-trace") for n in names):  # their collector
        result["otlp_sink"] = await sink.enter_async_context(
            otlp_sink(PORTS["otlp-sink"], cpus=placement.loadgen, nice=placement.served_nice)
        )
    try:
        lives = await start_targets(paths, workdir, placement, names)
        result["placement"] += "; " + pin_self(placement.loadgen, placement.loadgen_nice)
        await run_phases(lives, engine, plan)
        result["targets"] = target_results(lives)
        if not args.no_profile:
            log.info("profiling gpupool")
            result["profile"] = await _profile_gpupool(lives, plan, paths, workdir)
    finally:
        await close_all(lives, engine)
        await sink.aclose()
    if "otlp_sink" in result:
        result["otlp_sink"] = dataclasses.asdict(result["otlp_sink"])
    if plan.real_vllm and not args.no_real_vllm:
        log.info("real vLLM phase (engine start takes a minute)")
        result["real_vllm"] = await run_real_vllm(paths, workdir, placement, plan)
    result["gpupool_targets"] = check_gpupool(result["targets"])
    result["against_rust"] = against_rust(result["targets"])
    result["load_average_at_end"] = load_average()
    result["elapsed_s"] = time.monotonic() - started
    if args.notes is not None and args.notes.exists():
        result["analysis"] = args.notes.read_text().strip()
    return result


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.render_only:
        result = json.loads((args.out / "router_overhead.json").read_text())
        if args.notes is not None and args.notes.exists():
            result["analysis"] = args.notes.read_text().strip()
        (args.out / "router_overhead.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "router_overhead.md").write_text(render(result))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        import uvloop

        result = uvloop.run(_run(args))
    except ImportError:
        result = asyncio.run(_run(args))
    result = _clean(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "router_overhead.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "router_overhead.md").write_text(render(result))
    _flame_graphs(Path(result["workdir"]), args.out)
    print(render(result))
    return _check(result) if args.check else 0


def _flame_graphs(workdir: Path, out: Path) -> None:
    """gpupool's py-spy samples as small SVG flame graphs beside the report."""
    for phase, title in (
        ("c1", "non-streaming, c=1"),
        ("hi", "non-streaming, c=64"),
        ("st", "streaming, c=16"),
    ):
        raw = workdir / f"pyspy-gpupool-{phase}.txt"
        if raw.exists():
            svg = flame.render_svg(raw.read_text(), f"gpupool, {title}")
            (out / f"flame-gpupool-{phase}.svg").write_text(svg)


def _check(result: dict[str, Any]) -> int:
    """`--check`: 0 when gpupool's CPU per request at c=64 is within the limit of the Rust
    router's, 1 when over, 2 when the two could not be compared (one did not run)."""
    rows = {r["bar"]: r for r in result.get("against_rust") or []}
    row = rows.get("CPU per non-streaming request at c=64")
    if row is None or row["ratio"] is None or math.isnan(row["ratio"]):
        bad = {t["name"]: t.get("reason", "") for t in result["targets"] if t["status"] != "ok"}
        print(f"check: cannot compare gpupool with vllm-router: {bad or 'no CPU figures'}")
        return 2
    verdict = "ok" if row["met"] else "FAILED"
    print(
        f"check {verdict}: gpupool {row['gpupool']:.0f} µs CPU per request at c=64, "
        f"vllm-router {row['vllm_router']:.0f} µs: {row['ratio']:.2f}x (limit "
        f"{row['limit']:g}x)"
    )
    return 0 if row["met"] else 1
