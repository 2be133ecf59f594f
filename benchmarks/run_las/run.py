"""Run-aware scheduling: `queue.order: fifo` vs `run_las` at once, on two pinned CPU engines.

Two real CPU vLLM engines (the tiny dev model, `--max-num-seqs` small, so the router's queue
and not the engine decides which step goes next), each pinned to its own CPU
(`engines.local.cpu_affinity`). Two gpupool routers run in this process, one per engine, one
with `queue.order: fifo`, one with `run_las`. The workload (`scenario.yaml`): short 2-step and
long 20-step agent runs, 1:1 by count, arriving at random.

1. Calibration: long runs only, far more than an engine can take, to both engines at once
   (each through its own fifo router) for `--calibrate-s`; each engine's step throughput is
   what it completed, `C` their mean.
2. The offered load is sized from it: runs arrive at `--load` x C / (mean steps per run), half
   short, half long. One drawn plan goes to both routers AT THE SAME TIME (each arrival sent
   to both at once, same run indices), so a slow spell of the shared machine hits both modes
   alike and runs are compared one to one. Between rounds the engines swap modes (round 1:
   fifo on the first CPU, run_las on the second; round 2 the other way round), so over an
   even number of rounds the difference between the two cores cancels.
3. Reported per round and for both rounds pooled (each run's completion averaged over the
   rounds per mode): run completion p50/p95 for short and long runs, agent output tok/s (to
   the last completion, and while arrivals last), the longest router queue time of any run
   (ledger `queue_s`), and per run its completion under run_las over its completion under
   fifo; then per target the rounds' mean, min and max. Targets (issue 13): short-run p50
   >= 2x better, throughput within 5 %, no run worse than 1.5x its fifo completion.

    python -m benchmarks.run_las --out benchmarks/results/run-las-paired-YYYY-MM-DD
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from benchmarks.admission.kv_pressure import reset_prefix_cache
from benchmarks.compare import run_compare
from benchmarks.engines import agent_pool_router, cpu_engines
from benchmarks.outputs import bulk_dir
from benchmarks.placement import hit_rate, prefix_counters
from benchmarks.report import safe_name
from benchmarks.run_las.analysis import (
    DONE,
    ModeResult,
    compare_modes,
    load_runs,
    pool_rounds,
    spread,
    window_tokens_per_s,
)
from benchmarks.runner import Target
from pools.config import Config
from pools.devmodel import is_dev_model, make_dev_model
from pools.launchers import InstanceSpec
from pools.testing.serve import serve_asgi
from router.gateway.app import Gateway, create_app
from router.simulate.prompts import find_tokenizer
from router.simulate.scenario import Scenario, parse_scenario, scale_rates

MODEL_DIR = Path(".gpupool/models/tiny")
SCENARIO = Path(__file__).with_name("scenario.yaml")
KEY_ENV = "GPUPOOL_RUN_LAS_ENGINE_KEY"
MAX_MODEL_LEN_TOKENS = 4096

log = logging.getLogger("benchmarks.run_las")


@dataclass(frozen=True)
class LedgerFacts:
    """What one router's ledger says after a run of the workload."""

    queue_s_by_run: dict[str, float]  # run id -> totals.queue_s
    gpu_s_per_step: float  # mean GPU-seconds per request


def _say(message: str) -> None:
    print(f"[run_las] {message}", file=sys.stderr, flush=True)


def router_config(
    engine_url: str,
    order: str,
    *,
    aging_s: float,
    max_num_seqs: int,
    max_wait_s: float,
    tmp: Path,
    cap_gpu_s: float | None = None,
    max_slowdown: float | None = None,
) -> Config:
    """The whole engine in the agent pool; SLO targets out of the way (they are not what this
    measures), so the queue holds exactly what the engine's `--max-num-seqs` cannot run."""
    queue: dict[str, Any] = {"max_depth": 4096, "max_wait_s": max_wait_s, "order": order}
    if order == "run_las":
        queue["run_las_aging_s"] = aging_s
        if cap_gpu_s is not None:
            queue["run_las_max_attained_gpu_s"] = cap_gpu_s
        queue["run_las_max_slowdown"] = max_slowdown
    return agent_pool_router(
        MODEL_DIR,
        [engine_url],
        key_env=KEY_ENV,
        max_num_seqs=max_num_seqs,
        max_model_len_tokens=MAX_MODEL_LEN_TOKENS,
        agent_pool={"slo": {"ttft_p95_ms": 60_000, "tpot_p95_ms": 1_000}, "queue": queue},
        agent_class={"timeout_s": 900, "expected_output_tokens": 32},
        router={
            "scrape_interval_s": 0.25,
            "ledger_path": str(tmp / f"ledger-{order}-{os.urandom(3).hex()}.sqlite"),
            "state_path": str(tmp / "state.json"),
        },
    )


def _scenario(load_runs_per_s: float | None, duration_s: float, *, only_long: bool) -> Scenario:
    data = yaml.safe_load(SCENARIO.read_text())
    data["duration_s"] = duration_s
    if only_long:
        del data["classes"]["short"]
        data["name"] = "run-las-calibration"
        data["drain_timeout_s"] = 1
    scenario = parse_scenario(data, str(SCENARIO), SCENARIO.parent)
    # the template's rates are 1 run/s per class
    return scale_rates(scenario, load_runs_per_s) if load_runs_per_s else scenario


@dataclass(frozen=True)
class Lane:
    """One router in front of one engine for one harness target: `name` (the target's and
    records' name), its `queue.order`, and the engine (pinned to `cpu`) it alone serves."""

    name: str
    order: str
    engine: InstanceSpec
    cpu: int | None


async def _with_gateways(
    lanes: list[Lane], args: argparse.Namespace, tmp: Path
) -> tuple[list[Gateway], list[Any]]:
    gateways, servers = [], []
    for lane in lanes:
        gw = create_app(
            router_config(
                lane.engine.url,
                lane.order,
                aging_s=args.aging_s,
                max_num_seqs=args.max_num_seqs,
                max_wait_s=args.max_wait_s,
                tmp=tmp,
                cap_gpu_s=args.cap_gpu_s,
                max_slowdown=args.max_slowdown,
            ),
            [lane.engine],
        )
        await gw.start()
        gateways.append(gw)
        servers.append(serve_asgi(gw))
    for gw in gateways:  # the first scrape makes the engine healthy and sizes its KV
        for _ in range(300):
            if all(st.healthy and st.capacity_blocks for st in gw.fleet):
                break
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError("the router never saw the engine healthy")
    return gateways, servers


async def _serve_and_run(
    lanes: list[Lane],
    scenario: Scenario,
    out: Path,
    args: argparse.Namespace,
    tmp: Path,
) -> tuple[dict[str, Any], dict[str, LedgerFacts]]:
    """Run `scenario` through every lane at the same time (one drawn plan, each arrival sent
    to every lane at once), each lane's engine starting from an emptied prefix cache. Returns
    the harness report (one target per lane, with its engine's prefix-cache hit rate) and,
    per lane, what its router's ledger says."""
    gateways, servers = await _with_gateways(lanes, args, tmp)
    try:
        urls = [await s.__aenter__() for s in servers]
        targets = [Target(lane.name, url, "tiny") for lane, url in zip(lanes, urls, strict=True)]
        engine_urls = [lane.engine.url for lane in lanes]
        key = lanes[0].engine.api_key
        async with aiohttp.ClientSession() as session:
            resets = [await reset_prefix_cache(session, u, key) for u in engine_urls]
            before = await prefix_counters(session, engine_urls, key)
            report = await run_compare(
                scenario,
                targets,
                out,
                tokenizer_path=find_tokenizer("tiny"),
                progress=False,
                notes=", ".join(
                    f"{lane.name}: order {lane.order}, cpu {lane.cpu}" for lane in lanes
                ),
                together=True,
            )
            after = await prefix_counters(session, engine_urls, key)
        per_engine = hit_rate(before, after)[1]
        for summary, lane, reset in zip(report["targets"], lanes, resets, strict=True):
            summary["prefix_cache_reset"] = reset
            summary["prefix_hit_frac"] = per_engine[lane.engine.url]
            summary["cpu"] = lane.cpu
            summary["engine"] = lane.engine.instance_id
        ledger = {}
        for lane, gw in zip(lanes, gateways, strict=True):
            runs = await gw.ledger.list_runs(None, limit=1_000_000)
            steps = sum(int(r["requests"]) for r in runs)
            ledger[lane.name] = LedgerFacts(
                {r["run_id"]: float(r["queue_s"]) for r in runs},
                sum(float(r["gpu_seconds"]) for r in runs) / steps if steps else 0.0,
            )
    finally:
        for s in reversed(servers):
            await s.__aexit__(None, None, None)
        for gw in gateways:
            await gw.aclose()
    return report, ledger


async def _calibrate(
    engines: list[InstanceSpec],
    cpus: list[int | None],
    args: argparse.Namespace,
    out: Path,
    tmp: Path,
) -> dict[str, Any]:
    """Long runs at `--calibrate-rate` runs/s (far past an engine) for `--calibrate-s`, to
    every engine at once, each through its own fifo router: per engine the steps it completed
    per second of the harness's wall time, and their mean."""
    scenario = _scenario(args.calibrate_rate, args.calibrate_s, only_long=True)
    lanes = [
        Lane(f"engine-{i}", "fifo", engine, cpu)
        for i, (engine, cpu) in enumerate(zip(engines, cpus, strict=True))
    ]
    report, ledger = await _serve_and_run(lanes, scenario, out, args, tmp)
    per_engine = []
    for lane in lanes:
        target = next(t for t in report["targets"] if t["name"] == lane.name)
        queued = list(ledger[lane.name].queue_s_by_run.values())
        per_engine.append(
            {
                "engine": lane.name,
                "cpu": lane.cpu,
                "steps_per_s": target["classes"]["long"]["throughput_rps"],
                "gpu_s_per_step": ledger[lane.name].gpu_s_per_step,
                "output_tokens_per_s": target["classes"]["long"]["output_tokens_per_s"],
                "wall_s": target["wall_s"],
                "runs": len(queued),
                "mean_run_queue_s": sum(queued) / len(queued) if queued else 0.0,
            }
        )
    rates = [e["steps_per_s"] for e in per_engine]
    return {
        "engines": per_engine,
        "steps_per_s": sum(rates) / len(rates),
        "slower_over_faster": min(rates) / max(rates) if max(rates) > 0 else None,
        "gpu_s_per_step": sum(e["gpu_s_per_step"] for e in per_engine) / len(per_engine),
        "output_tokens_per_s": sum(e["output_tokens_per_s"] for e in per_engine) / len(per_engine),
        "wall_s": max(e["wall_s"] for e in per_engine),
    }


def _mode(
    report: dict[str, Any], out: Path, name: str, queue_s: dict[str, float], window_s: float
) -> ModeResult:
    target = next(t for t in report["targets"] if t["name"] == name)
    tok_s = sum(c["output_tokens_per_s"] for c in target["classes"].values())
    records = bulk_dir(out) / f"records-{safe_name(name)}.jsonl"
    window = window_tokens_per_s(records, window_s)
    return ModeResult(name, load_runs(records), tok_s, queue_s, window)


def lanes_of_round(
    round_index: int, engines: list[InstanceSpec], cpus: list[int | None]
) -> list[Lane]:
    """Round 0, 2, ...: fifo on the first engine, run_las on the second; round 1, 3, ...: the
    other way round, so over an even number of rounds each mode has had each engine (and
    core) alike."""
    first, second = (0, 1) if round_index % 2 == 0 else (1, 0)
    return [
        Lane("fifo", "fifo", engines[first], cpus[first]),
        Lane("run_las", "run_las", engines[second], cpus[second]),
    ]


def _pick_cpus() -> list[int | None]:
    """Two distinct CPUs this process may use, one per engine; on a one-CPU machine both
    engines share it (and the benchmark says so in its report)."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(allowed) >= 2:
        return [allowed[0], allowed[1]]
    return [allowed[0], allowed[0]] if allowed else [None, None]


def _summary(rounds: list[dict[str, Any]], pooled: dict[str, Any]) -> dict[str, Any]:
    """Per target: each round's value, their mean/min/max, and the pooled comparison's."""
    out: dict[str, Any] = {}
    for key in (
        "short_p50_gain",
        "throughput_change_frac",
        "saturated_throughput_change_frac",
        "worst_run_ratio",
    ):
        out[key] = {
            **spread([r["targets"][key]["value"] for r in rounds]),
            "held_in_rounds": sum(1 for r in rounds if r["targets"][key]["held"]),
            "pooled": pooled["targets"][key]["value"],
            "pooled_held": pooled["targets"][key]["held"],
        }
    return out


async def _main(args: argparse.Namespace, out: Path, tmp: Path) -> dict[str, Any]:
    cpus = _pick_cpus()
    launcher = cpu_engines(
        MODEL_DIR,
        count=2,
        port=args.engine_port,
        key_env=KEY_ENV,
        run_dir=tmp / "run",
        max_num_seqs=args.max_num_seqs,
        progress=_say,
        max_model_len_tokens=MAX_MODEL_LEN_TOKENS,
        # /reset_prefix_cache is served in vLLM's dev mode only
        environ={**os.environ, "VLLM_SERVER_DEV_MODE": "1"},
        cpu_affinity=None if None in cpus else [[c] for c in cpus if c is not None],
    )
    engines = await launcher.start()
    rounds = []
    fifo_rounds, las_rounds = [], []
    niced = False
    try:
        if args.nice:
            # the routers and the harness (this process) ahead of the engines, which started
            # before at the default priority: router lag would otherwise blur both modes'
            # queues (a negative increment needs the privilege; without it, left as is)
            with contextlib.suppress(OSError):
                os.nice(args.nice)
                niced = True
        _say(f"calibrating both engines (cpus {cpus}) for {args.calibrate_s:g} s ...")
        calibration = await _calibrate(engines, cpus, args, out / "calibration", tmp)
        mean_steps = (2 + 20) / 2
        runs_per_s = args.load * calibration["steps_per_s"] / mean_steps
        per_class = runs_per_s / 2
        args.cap_gpu_s = args.cap_steps * calibration["gpu_s_per_step"] or None
        _say(
            f"calibration: {calibration}; offering {runs_per_s:.3f} runs/s to each engine; "
            f"run_las counts service up to {args.cap_gpu_s} GPU-s"
        )
        scenario = _scenario(per_class, args.duration_s, only_long=False)
        for i in range(args.rounds):
            lanes = lanes_of_round(i, engines, cpus)
            round_out = out / f"round-{i + 1}"
            _say(
                f"round {i + 1}: "
                + ", ".join(f"{lane.order} on cpu {lane.cpu}" for lane in lanes)
                + " at the same time ..."
            )
            if i:
                await asyncio.sleep(args.pause_s)
            report, ledger = await _serve_and_run(lanes, scenario, round_out, args, tmp)
            fifo = _mode(report, round_out, "fifo", ledger["fifo"].queue_s_by_run, args.duration_s)
            las = _mode(
                report, round_out, "run_las", ledger["run_las"].queue_s_by_run, args.duration_s
            )
            fifo_rounds.append(fifo)
            las_rounds.append(las)
            result = compare_modes(fifo, las)
            result["round"] = i + 1
            by_name = {t["name"]: t for t in report["targets"]}
            result["cpu"] = {lane.order: lane.cpu for lane in lanes}
            result["engine"] = {lane.order: lane.engine.instance_id for lane in lanes}
            for key in ("load_avg_1m", "max_send_lag_ms", "prefix_hit_frac", "prefix_cache_reset"):
                result[key] = {name: t[key] for name, t in by_name.items()}
            result["wall_s"] = {name: t["wall_s"] for name, t in by_name.items()}
            result["output_tokens"] = {
                name: round(
                    sum(c["output_tokens_per_s"] for c in t["classes"].values()) * t["wall_s"]
                )
                for name, t in by_name.items()
            }
            _say(json.dumps(result["targets"]))
            rounds.append(result)
    finally:
        await launcher.aclose()
    pooled = compare_modes(pool_rounds(fifo_rounds), pool_rounds(las_rounds))
    return {
        "benchmark": "run_las",
        "command": "python -m benchmarks.run_las " + " ".join(sys.argv[1:]),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "engine_cpus": cpus,
        },
        "setup": {
            "engine_max_num_seqs": args.max_num_seqs,
            "load": args.load,
            "calibration": calibration,
            "offered_runs_per_s": runs_per_s,
            "duration_s": args.duration_s,
            "run_las_aging_s": args.aging_s,
            "run_las_max_attained_gpu_s": args.cap_gpu_s,
            "cap_steps": args.cap_steps,
            "run_las_max_slowdown": args.max_slowdown,
            "max_wait_s": args.max_wait_s,
            "nice": args.nice,
            "nice_applied": niced,
            "scenario": str(SCENARIO),
        },
        "rounds": rounds,
        "pooled": pooled,
        "summary": _summary(rounds, pooled),
    }


def _f(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f}"


def _pc(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:+.1f} %"


def _held(held: bool) -> str:
    return "held" if held else "MISSED"


def _mode_rows(label: str, r: dict[str, Any], cpu: dict[str, Any]) -> list[str]:
    rows = []
    for mode in ("fifo", "run_las"):
        m = r[mode]
        s, lg = m["classes"]["short"], m["classes"]["long"]
        not_done = sum(v for k, v in m["outcomes"].items() if k not in DONE)
        rows.append(
            f"| {label} | {mode} | {cpu.get(mode, '–')} | {_f(s['completion_s_p50'])} | "
            f"{_f(s['completion_s_p95'])} | {_f(lg['completion_s_p50'])} | "
            f"{_f(lg['completion_s_p95'])} | {_f(m['output_tokens_per_s'])} | "
            f"{_f(m.get('window_output_tokens_per_s'))} | "
            f"{_f(m['longest_run_queue_s'])} | {not_done} | "
            f"{_f(r.get('prefix_hit_frac', {}).get(mode), 3)} |"
        )
    return rows


def _target_row(label: str, r: dict[str, Any]) -> str:
    t = r["targets"]
    gain, tput, worst = t["short_p50_gain"], t["throughput_change_frac"], t["worst_run_ratio"]
    sat = t["saturated_throughput_change_frac"]
    ratio_long = r["per_run_ratio"].get("long", {})
    worst_run = r["worst_run"]["run"] if r["worst_run"] else "–"
    return (
        f"| {label} | {_f(gain['value'], 2)}x {_held(gain['held'])} | "
        f"{_pc(tput['value'])} {_held(tput['held'])} | {_pc(sat['value'])} {_held(sat['held'])} | "
        f"{_f(worst['value'], 2)}x ({worst_run}) {_held(worst['held'])} "
        f"({worst['runs_compared']} compared, {worst['runs_not_completed']} not completed) | "
        f"{_f(ratio_long.get('p50'), 2)} / {_f(ratio_long.get('p95'), 2)} |"
    )


def render_markdown(report: dict[str, Any]) -> str:
    setup = report["setup"]
    cal = setup["calibration"]
    engines = ", ".join(
        f"engine on cpu {e['cpu']}: {e['steps_per_s']:.2f} steps/s ({e['output_tokens_per_s']:.0f}"
        " output tok/s)"
        for e in cal["engines"]
    )
    lines = [
        "# Run-aware scheduling: fifo vs run_las at the same time, two saturated agent engines",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Two real CPU vLLM engines (tiny dev model, `--max-num-seqs "
        f"{setup['engine_max_num_seqs']}`), each pinned to its own CPU "
        f"({report['machine']['engine_cpus']}); two gpupool routers in the benchmark's process, "
        "one per engine, `queue.order: fifo` and `queue.order: run_las` "
        f"(`run_las_aging_s: {setup['run_las_aging_s']:g}`, `run_las_max_attained_gpu_s: "
        f"{setup['run_las_max_attained_gpu_s']:.3g}`, i.e. {setup['cap_steps']:g} steps' worth "
        "at the calibration's GPU-seconds per step, `run_las_max_slowdown: "
        f"{setup.get('run_las_max_slowdown')}`). Every arrival of one drawn plan goes to both "
        "routers at the same moment, so the machine's time-varying speed hits both modes alike; "
        "the engines swap modes from round to round (odd rounds fifo on the first CPU, even "
        "rounds on the second), so the difference between the two cores cancels over an even "
        "number of rounds. Workload: `benchmarks/run_las/scenario.yaml` (2-step and 20-step "
        "runs, 1:1 by count, 32-token answers, ~64-token tool results, ~0.4 s tool calls).",
        "",
        f"Calibration: long runs far past capacity to both engines at once for "
        f"{cal['wall_s']:.0f} s: {engines}; slower / faster "
        f"{_f(cal['slower_over_faster'], 3)}. Offered load: {setup['load']:g} x their mean "
        f"({cal['steps_per_s']:.2f} steps/s) = {setup['offered_runs_per_s']:.3f} runs/s for "
        f"{setup['duration_s']:g} s, to each engine.",
        "",
        "Agent out tok/s, to the last completion: all agent output tokens over the time from the "
        "harness's start (first arrival) to the last run's last token (with every run completed "
        "both modes produce the same tokens, so its change is the makespan's). While arrivals "
        "last: output tokens of the steps that ended in the arrival window, over the window. "
        "The throughput target is judged on the first.",
        "",
        "| round | mode | cpu | short p50 s | short p95 s | long p50 s | long p95 s | agent out"
        " tok/s (to the last completion) | agent out tok/s (while arrivals last) | longest run"
        " queue s | runs not completed | engine prefix-cache hit rate |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["rounds"]:
        lines += _mode_rows(str(r["round"]), r, r.get("cpu", {}))
    pooled = report.get("pooled")
    if pooled:
        lines += _mode_rows("both (per run mean)", pooled, {"fifo": "both", "run_las": "both"})
    lines += [
        "",
        "Targets: short-run p50 gain (fifo / run_las) >= 2x; tok/s change within 5 %; worst run"
        ' (run_las / fifo completion of the same run) <= 1.5x. "both": each run\'s completion'
        " averaged over the rounds per mode (each run saw each core once in each mode), tok/s"
        " the mean of the rounds'.",
        "",
        "| round | short p50 gain | tok/s change, to the last completion | tok/s change while"
        " arrivals last | worst run ratio | long runs' ratio p50 / p95 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["rounds"]:
        lines.append(_target_row(str(r["round"]), r))
    if pooled:
        lines.append(_target_row("both", pooled))
    summary = report.get("summary")
    if summary:
        names = {
            "short_p50_gain": ("short p50 gain", "x", 1.0),
            "throughput_change_frac": ("tok/s change, to the last completion", " %", 100.0),
            "saturated_throughput_change_frac": ("tok/s change while arrivals last", " %", 100.0),
            "worst_run_ratio": ("worst run ratio", "x", 1.0),
        }
        lines += [
            "",
            "| figure | mean of rounds | min | max | rounds held | both rounds pooled |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for key, (label, unit, scale) in names.items():
            s = summary[key]

            def fmt(v: float | None, scale: float = scale, unit: str = unit) -> str:
                return "–" if v is None else f"{scale * v:.2f}{unit}"

            lines.append(
                f"| {label} | {fmt(s['mean'])} | {fmt(s['min'])} | {fmt(s['max'])} | "
                f"{s['held_in_rounds']} of {len(s['values'])} | {fmt(s['pooled'])} "
                f"{_held(s['pooled_held'])} |"
            )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--rounds", type=int, default=2, help="rounds; the engines swap modes between rounds"
    )
    parser.add_argument("--load", type=float, default=1.5, help="offered / calibrated steps")
    parser.add_argument("--duration-s", type=float, default=60.0, help="arrival window")
    parser.add_argument("--calibrate-s", type=float, default=25.0)
    parser.add_argument("--calibrate-rate", type=float, default=3.0, help="long runs/s")
    parser.add_argument("--aging-s", type=float, default=20.0, help="run_las_aging_s")
    parser.add_argument(
        "--cap-steps",
        type=float,
        default=1.5,
        help="run_las_max_attained_gpu_s in steps' worth of calibrated GPU-seconds",
    )
    parser.add_argument("--max-wait-s", type=float, default=300.0, help="queue.max_wait_s")
    parser.add_argument(
        "--max-slowdown",
        type=lambda v: None if v == "none" else float(v),
        default=1.3,
        help="run_las_max_slowdown (the bound relative to FIFO; 'none': off)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--pause-s", type=float, default=5.0, help="pause between rounds")
    parser.add_argument(
        "--engine-port", type=int, default=8500, help="the two engines' ports: this and the next"
    )
    parser.add_argument(
        "--nice",
        type=int,
        default=-5,
        help="niceness increment for this process (routers, harness) once the engines run",
    )
    args = parser.parse_args(argv)
    args.cap_gpu_s = None  # run_las_max_attained_gpu_s: set from the calibration
    logging.basicConfig(level=logging.WARNING)
    if not is_dev_model(MODEL_DIR):
        make_dev_model(MODEL_DIR, "tiny")
    os.environ.setdefault(KEY_ENV, "run-las-" + os.urandom(6).hex())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="gpupool-run-las-"))
    report = asyncio.run(_main(args, out, tmp))
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(render_markdown(report))
    print((out / "report.md").read_text())
    return 0
