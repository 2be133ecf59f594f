"""Run-aware scheduling: `queue.order: fifo` vs `run_las` side by side, one saturated CPU engine.

One real CPU vLLM engine (the tiny dev model, `--max-num-seqs` small, so the router's queue and
not the engine decides which step goes next) serves the agent pool. Two gpupool routers run in
this process in front of it, one with `queue.order: fifo`, one with `run_las`. The workload
(`scenario.yaml`): short 2-step and long 20-step agent runs, 1:1 by count, arriving at random.

1. Calibration: long runs only, far more than the engine can take, through a fifo router for
   `--calibrate-s`; the engine's step throughput `C` (steps/s) is what it completed.
2. The offered load is sized from it: runs arrive at `--load` x C / (mean steps per run), half
   short, half long. The same drawn plan goes to each router in turn (alternating which goes
   first from round to round), with the same run indices, so runs are compared one to one.
3. Reported per mode: run completion p50/p95 for short and long runs, agent output tok/s, the
   longest router queue time of any run (ledger `queue_s`), and per run its completion under
   run_las over its completion under fifo. Targets (issue 13): short-run p50 >= 2x better,
   throughput within 5 %, no run worse than 1.5x its fifo completion.

    python -m benchmarks.run_las --out benchmarks/results/run-las-YYYY-MM-DD
"""

from __future__ import annotations

import argparse
import asyncio
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
from benchmarks.placement import hit_rate, prefix_counters
from benchmarks.prompts import find_tokenizer
from benchmarks.report import safe_name
from benchmarks.run_las.analysis import (
    DONE,
    ModeResult,
    compare_modes,
    load_runs,
    window_tokens_per_s,
)
from benchmarks.runner import Target
from benchmarks.scenario import Scenario, parse_scenario, scale_rates
from pools.config import Config
from pools.devmodel import is_dev_model, make_dev_model
from pools.launchers import InstanceSpec
from pools.testing.serve import serve_asgi
from router.app import Gateway, create_app

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


async def _with_gateways(
    engine: InstanceSpec, orders: list[str], args: argparse.Namespace, tmp: Path
) -> tuple[list[Gateway], list[Any]]:
    gateways, servers = [], []
    for order in orders:
        gw = create_app(
            router_config(
                engine.url,
                order,
                aging_s=args.aging_s,
                max_num_seqs=args.max_num_seqs,
                max_wait_s=args.max_wait_s,
                tmp=tmp,
                cap_gpu_s=args.cap_gpu_s,
                max_slowdown=args.max_slowdown,
            ),
            [engine],
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
    engine: InstanceSpec,
    orders: list[str],
    scenario: Scenario,
    out: Path,
    args: argparse.Namespace,
    tmp: Path,
) -> tuple[dict[str, Any], dict[str, LedgerFacts]]:
    """Run `scenario` against one router per order, in that order. Returns the harness report
    and, per order, what its ledger says."""
    gateways, servers = await _with_gateways(engine, orders, args, tmp)
    try:
        urls = [await s.__aenter__() for s in servers]
        targets = [Target(order, url, "tiny") for order, url in zip(orders, urls, strict=True)]
        summaries = []
        report: dict[str, Any] = {}
        async with aiohttp.ClientSession() as session:
            for i, target in enumerate(targets):
                if i:
                    await asyncio.sleep(args.pause_s)
                # each mode starts from an empty prefix cache: the same plan's prompts cached
                # by the mode before would otherwise favour the one that runs second
                reset = await reset_prefix_cache(session, engine.url, engine.api_key)
                before = await prefix_counters(session, [engine.url], engine.api_key)
                report = await run_compare(
                    scenario,
                    [target],
                    out,
                    tokenizer_path=find_tokenizer("tiny"),
                    progress=False,
                    notes=f"order {target.name}",
                )
                after = await prefix_counters(session, [engine.url], engine.api_key)
                summary = report["targets"][0]
                summary["prefix_cache_reset"] = reset
                summary["prefix_hit_frac"] = hit_rate(before, after)[0]
                summaries.append(summary)
        report["targets"] = summaries
        ledger = {}
        for order, gw in zip(orders, gateways, strict=True):
            runs = await gw.ledger.list_runs(None, limit=1_000_000)
            steps = sum(int(r["requests"]) for r in runs)
            ledger[order] = LedgerFacts(
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
    engine: InstanceSpec, args: argparse.Namespace, out: Path, tmp: Path
) -> dict[str, Any]:
    """Long runs at `--calibrate-rate` runs/s (far past the engine) for `--calibrate-s`: the
    steps the engine completed per second of the harness's wall time."""
    scenario = _scenario(args.calibrate_rate, args.calibrate_s, only_long=True)
    report, ledger = await _serve_and_run(engine, ["fifo"], scenario, out, args, tmp)
    target = report["targets"][0]
    steps_per_s = target["classes"]["long"]["throughput_rps"]
    queued = list(ledger["fifo"].queue_s_by_run.values())
    return {
        "steps_per_s": steps_per_s,
        "gpu_s_per_step": ledger["fifo"].gpu_s_per_step,
        "output_tokens_per_s": target["classes"]["long"]["output_tokens_per_s"],
        "wall_s": target["wall_s"],
        "runs": len(queued),
        "mean_run_queue_s": sum(queued) / len(queued) if queued else 0.0,
    }


def _mode(
    report: dict[str, Any], out: Path, name: str, queue_s: dict[str, float], window_s: float
) -> ModeResult:
    target = next(t for t in report["targets"] if t["name"] == name)
    tok_s = sum(c["output_tokens_per_s"] for c in target["classes"].values())
    records = out / f"records-{safe_name(name)}.jsonl"
    window = window_tokens_per_s(records, window_s)
    return ModeResult(name, load_runs(records), tok_s, queue_s, window)


async def _main(args: argparse.Namespace, out: Path, tmp: Path) -> dict[str, Any]:
    launcher = cpu_engines(
        MODEL_DIR,
        count=1,
        port=args.engine_port,
        key_env=KEY_ENV,
        run_dir=tmp / "run",
        max_num_seqs=args.max_num_seqs,
        progress=_say,
        max_model_len_tokens=MAX_MODEL_LEN_TOKENS,
        # /reset_prefix_cache is served in vLLM's dev mode only
        environ={**os.environ, "VLLM_SERVER_DEV_MODE": "1"},
    )
    (engine,) = await launcher.start()
    rounds = []
    try:
        _say(f"calibrating for {args.calibrate_s:g} s ...")
        calibration = await _calibrate(engine, args, out / "calibration", tmp)
        mean_steps = (2 + 20) / 2
        runs_per_s = args.load * calibration["steps_per_s"] / mean_steps
        per_class = runs_per_s / 2
        args.cap_gpu_s = args.cap_steps * calibration["gpu_s_per_step"] or None
        _say(
            f"calibration: {calibration}; offering {runs_per_s:.3f} runs/s; run_las counts "
            f"service up to {args.cap_gpu_s} GPU-s"
        )
        scenario = _scenario(per_class, args.duration_s, only_long=False)
        for i in range(args.rounds):
            orders = ["fifo", "run_las"] if i % 2 == 0 else ["run_las", "fifo"]
            round_out = out / f"round-{i + 1}"
            _say(f"round {i + 1}: {orders[0]} then {orders[1]} ...")
            report, ledger = await _serve_and_run(engine, orders, scenario, round_out, args, tmp)
            result = compare_modes(
                _mode(report, round_out, "fifo", ledger["fifo"].queue_s_by_run, args.duration_s),
                _mode(
                    report, round_out, "run_las", ledger["run_las"].queue_s_by_run, args.duration_s
                ),
            )
            result["round"] = i + 1
            result["order_of_modes"] = orders
            result["load_avg_1m"] = {t["name"]: t["load_avg_1m"] for t in report["targets"]}
            result["max_send_lag_ms"] = {t["name"]: t["max_send_lag_ms"] for t in report["targets"]}
            result["prefix_hit_frac"] = {t["name"]: t["prefix_hit_frac"] for t in report["targets"]}
            result["prefix_cache_reset"] = {
                t["name"]: t["prefix_cache_reset"] for t in report["targets"]
            }
            _say(json.dumps(result["targets"]))
            rounds.append(result)
    finally:
        await launcher.aclose()
    full = {
        "benchmark": "run_las",
        "command": "python -m benchmarks.run_las " + " ".join(sys.argv[1:]),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
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
            "scenario": str(SCENARIO),
        },
        "rounds": rounds,
    }
    return full


def _f(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f}"


def render_markdown(report: dict[str, Any]) -> str:
    setup = report["setup"]
    cal = setup["calibration"]
    lines = [
        "# Run-aware scheduling: fifo vs run_las, one saturated agent engine",
        "",
        f"Command: `{report['command']}`",
        "",
        f"One real CPU vLLM engine (tiny dev model, `--max-num-seqs "
        f"{setup['engine_max_num_seqs']}`), all of it in the agent pool; two gpupool routers in "
        "the benchmark's process, `queue.order: fifo` and `queue.order: run_las` "
        f"(`run_las_aging_s: {setup['run_las_aging_s']:g}`, `run_las_max_attained_gpu_s: "
        f"{setup['run_las_max_attained_gpu_s']:.3g}`, i.e. {setup['cap_steps']:g} steps' worth "
        "at the calibration's GPU-seconds per step, `run_las_max_slowdown: "
        f"{setup.get('run_las_max_slowdown')}`), served the same drawn plan in turn. "
        "Workload: `benchmarks/run_las/scenario.yaml` (2-step and 20-step runs, 1:1 by count, "
        "32-token answers, ~64-token tool results, ~0.4 s tool calls).",
        "",
        f"Calibration: long runs far past capacity for {cal['wall_s']:.0f} s: the engine "
        f"completed {cal['steps_per_s']:.2f} steps/s ({cal['output_tokens_per_s']:.0f} output "
        f"tok/s). Offered load: {setup['load']:g} x that = "
        f"{setup['offered_runs_per_s']:.3f} runs/s for {setup['duration_s']:g} s.",
        "",
        "| round | mode | short p50 s | short p95 s | long p50 s | long p95 s | agent out tok/s"
        " (whole run) | agent out tok/s (while arrivals last) | longest run queue s"
        " | runs not completed | engine prefix-cache hit rate |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["rounds"]:
        for mode in ("fifo", "run_las"):
            m = r[mode]
            s, lg = m["classes"]["short"], m["classes"]["long"]
            not_done = sum(v for k, v in m["outcomes"].items() if k not in DONE)
            lines.append(
                f"| {r['round']} | {mode} | {_f(s['completion_s_p50'])} | "
                f"{_f(s['completion_s_p95'])} | {_f(lg['completion_s_p50'])} | "
                f"{_f(lg['completion_s_p95'])} | {_f(m['output_tokens_per_s'])} | "
                f"{_f(m.get('window_output_tokens_per_s'))} | "
                f"{_f(m['longest_run_queue_s'])} | {not_done} | "
                f"{_f(r.get('prefix_hit_frac', {}).get(mode), 3)} |"
            )
    lines += [
        "",
        "| round | short p50 gain (>= 2x) | tok/s change, whole run (within 5 %) | tok/s change"
        " while arrivals last | worst run ratio (<= 1.5x) | long runs' ratio p50 / p95 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["rounds"]:
        t = r["targets"]
        gain, tput, worst = t["short_p50_gain"], t["throughput_change_frac"], t["worst_run_ratio"]
        sat = t.get("saturated_throughput_change_frac", {"value": None, "held": False})
        ratio_long = r["per_run_ratio"].get("long", {})
        lines.append(
            f"| {r['round']} | {_f(gain['value'], 2)}x {'held' if gain['held'] else 'MISSED'} | "
            f"{_f(100 * tput['value'] if tput['value'] is not None else None)} % "
            f"{'held' if tput['held'] else 'MISSED'} | "
            f"{_f(100 * sat['value'] if sat['value'] is not None else None)} % "
            f"{'held' if sat['held'] else 'MISSED'} | {_f(worst['value'], 2)}x "
            f"({r['worst_run']['run'] if r['worst_run'] else '–'}) "
            f"{'held' if worst['held'] else 'MISSED'} | {_f(ratio_long.get('p50'), 2)} / "
            f"{_f(ratio_long.get('p95'), 2)} |"
        )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--load", type=float, default=1.5, help="offered / calibrated steps")
    parser.add_argument("--duration-s", type=float, default=90.0, help="arrival window")
    parser.add_argument("--calibrate-s", type=float, default=25.0)
    parser.add_argument("--calibrate-rate", type=float, default=3.0, help="long runs/s")
    parser.add_argument("--aging-s", type=float, default=20.0, help="run_las_aging_s")
    parser.add_argument(
        "--cap-steps",
        type=float,
        default=3.0,
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
    parser.add_argument("--pause-s", type=float, default=5.0)
    parser.add_argument("--engine-port", type=int, default=8500)
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
