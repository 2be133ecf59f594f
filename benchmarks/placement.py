"""Where a run's next step goes: `affinity_or_move` vs `always_affinity` vs `least_loaded`,
side by side on the same three CPU engines, on the agent-flood scenario's agent runs.

Three real CPU vLLM engines (the tiny dev model, 64 MiB of KV cache each, as in the
agent-flood benchmarks) form one agent pool. Three gpupool routers run in this process in
front of them, identical but for `pools.agent.placement`. The agent class of
`benchmarks/scenarios/agent-flood.yaml` (runs of ~8 steps on contexts growing to ~4k tokens,
tool calls of ~0.8 s) arrives at its surge rate scaled by `--rate-scale` for `--duration-s`;
the same drawn plan goes to each router in turn (the order rotates from round to round, and
`--rotate` starts the rotation elsewhere, so separate runs put each rule first in turn), and
every engine's prefix cache is emptied (`POST /reset_prefix_cache`, engines started with
`VLLM_SERVER_DEV_MODE=1`) before each, so no placement finds another's prefixes cached.

Reported per placement: the engines' prefix-cache hit rate over the run (vLLM's
`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`, both counted in prompt
tokens, summed over the three engines), run completion p50/p95, agent output tok/s, and how
often a run's step ran elsewhere than its previous step (from the router's ledger).

    python -m benchmarks.placement --out benchmarks/results/placement-YYYY-MM-DD
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import sqlite3
import sys
import tempfile
from contextlib import closing
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from benchmarks.admission.kv_pressure import reset_prefix_cache
from benchmarks.compare import run_compare
from benchmarks.engines import agent_pool_router, cpu_engines
from benchmarks.runner import Target
from pools.config import Config
from pools.devmodel import is_dev_model, make_dev_model
from pools.launchers import InstanceSpec
from pools.telemetry import parse_vllm_metrics
from pools.testing.serve import serve_asgi
from router.admission.picking import PLACEMENTS
from router.gateway.app import create_app
from router.simulate.prompts import find_tokenizer
from router.simulate.scenario import Scenario, parse_scenario

MODEL_DIR = Path(".gpupool/models/tiny")
SCENARIO = Path("benchmarks/scenarios/agent-flood.yaml")
KEY_ENV = "GPUPOOL_PLACEMENT_ENGINE_KEY"
MAX_NUM_SEQS = 64
SURGE_RUNS_PER_S = 1.2  # agent-flood's agent arrivals during its surge

log = logging.getLogger("benchmarks.placement")


def _say(message: str) -> None:
    print(f"[placement] {message}", file=sys.stderr, flush=True)


def router_config(
    urls: list[str], placement: str, tmp: Path, max_num_seqs: int = MAX_NUM_SEQS
) -> Config:
    """All three engines in one agent pool, placed by `placement`; admission on (it is what
    finds a run's home full)."""
    return agent_pool_router(
        MODEL_DIR,
        urls,
        key_env=KEY_ENV,
        max_num_seqs=max_num_seqs,
        agent_pool={
            "slo": {"ttft_p95_ms": 3000, "tpot_p95_ms": 300},
            "queue": {"max_depth": 4096, "max_wait_s": 120},
            "placement": placement,
        },
        agent_class={"timeout_s": 300, "expected_output_tokens": 96},
        router={
            "scrape_interval_s": 0.25,
            "ledger_path": str(tmp / f"ledger-{placement}.sqlite"),
            "state_path": str(tmp / f"state-{placement}.json"),
        },
    )


def scenario(rate_scale: float, duration_s: float) -> Scenario:
    """agent-flood's agent runs only, arriving at its surge rate (x `rate_scale`) throughout."""
    data = yaml.safe_load(SCENARIO.read_text())
    del data["classes"]["normal"]
    agent = data["classes"]["agent"]
    surge = max(s["rate_per_s"] for s in agent["arrivals"]["segments"])
    if surge != SURGE_RUNS_PER_S:
        raise ValueError(f"{SCENARIO}: surge {surge} runs/s, expected {SURGE_RUNS_PER_S}")
    agent["arrivals"] = {"process": "poisson", "rate_per_s": surge * rate_scale}
    data["name"] = "agent-flood-runs"
    data["duration_s"] = duration_s
    data["drain_timeout_s"] = 240
    data["request_timeout_s"] = 300
    return parse_scenario(data, str(SCENARIO), SCENARIO.parent)


async def prefix_counters(
    session: aiohttp.ClientSession, urls: list[str], key: str | None
) -> dict[str, tuple[float, float]]:
    """Per engine (hits, queries) in prompt tokens, from its /metrics."""
    out = {}
    for url in urls:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        async with session.get(f"{url}/metrics", headers=headers) as resp:
            reading = parse_vllm_metrics(await resp.text(), 0.0)
        out[url] = (reading.prefix_cache_hits_total, reading.prefix_cache_queries_total)
    return out


def hit_rate(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> tuple[float | None, dict[str, float | None]]:
    """The prefix-cache hit rate over all engines and per engine, between two scrapes."""
    per: dict[str, float | None] = {}
    hits = queries = 0.0
    for url, (h1, q1) in after.items():
        h0, q0 = before[url]
        per[url] = (h1 - h0) / (q1 - q0) if q1 > q0 else None
        hits += h1 - h0
        queries += q1 - q0
    return (hits / queries if queries else None), per


def _steps(ledger_path: Path) -> list[tuple[str, str]]:
    """(run id, instance) of every run's steps in the ledger, in the order they started."""
    with closing(sqlite3.connect(ledger_path)) as conn:
        rows = conn.execute(
            "SELECT run_id, instance FROM requests WHERE run_id IS NOT NULL"
            " AND instance IS NOT NULL ORDER BY started_at_s"
        ).fetchall()
    return [(str(r), str(i)) for r, i in rows]


class DecisionLog(logging.Handler):
    """Collects `router.admission.picking`'s structured debug records of `affinity_or_move`'s
    choices (one each time a step whose home is full is weighed; a step that waits is weighed again
    on every dispatch pass)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.decisions: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        decision = getattr(record, "placement_decision", None)
        if isinstance(decision, dict):
            self.decisions.append(decision)


def _quantiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)

    def q(frac: float) -> float:
        return ordered[min(len(ordered) - 1, int(frac * len(ordered)))]

    return {"p5": q(0.05), "p50": q(0.5), "p95": q(0.95), "max": ordered[-1]}


def stayed_waits(decisions: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(expected wait at home, waited after it) for each step that stayed home, weighed at
    least twice: the estimate at the step's first weighing, and its time waited at its last
    weighing less at its first, a lower bound of the wait that followed the estimate (the
    step went home at a pass after its last weighing). A run's steps come one at a time, so
    a new step of a run starts where its time waited falls back."""
    open_steps: dict[Any, tuple[float | None, float, float, int]] = {}
    done: list[tuple[float | None, float, float, int]] = []
    for d in decisions:
        run = d.get("run")
        step = open_steps.pop(run, None)
        if step is not None and d["waited_s"] < step[2]:
            done.append(step)
            step = None
        if d["moves"]:
            continue  # this step moved: no wait at home to compare with
        if step is None:
            open_steps[run] = (d["home_wait_s"], d["waited_s"], d["waited_s"], 1)
        else:
            open_steps[run] = (step[0], step[1], d["waited_s"], step[3] + 1)
    done.extend(open_steps.values())
    return [(est, last - first) for est, first, last, n in done if est is not None and n > 1]


def summarize_decisions(decisions: list[dict[str, Any]]) -> dict[str, Any]:
    """How often a step with a full home was weighed, moved, the wait estimates seen, and for
    steps that stayed, the estimate beside the wait that followed (`stayed_waits`)."""
    waits = [d["home_wait_s"] for d in decisions if d["home_wait_s"] is not None]
    stayed = stayed_waits(decisions)
    return {
        "stayed_steps": len(stayed),
        "stayed_expected_wait_s": _quantiles([e for e, _ in stayed]),
        "stayed_waited_after_s": _quantiles([w for _, w in stayed]),
        "weighed": len(decisions),
        "moves": sum(1 for d in decisions if d["moves"]),
        "home_wait_unknown": len(decisions) - len(waits),
        "home_wait_s": _quantiles(waits),
        "waited_s": _quantiles([d["waited_s"] for d in decisions]),
        "context_tokens": _quantiles([float(d["context_tokens"]) for d in decisions]),
    }


def moved_steps(steps: list[tuple[str, str]]) -> tuple[int, int]:
    """(later steps that ran elsewhere than the run's previous step, later steps), given each
    step's (run, instance) in the order they started."""
    last: dict[str, str] = {}
    moved = later = 0
    for run, instance in steps:
        if run in last:
            later += 1
            moved += last[run] != instance
        last[run] = instance
    return moved, later


async def _one(
    placement: str,
    specs: list[InstanceSpec],
    plan: Scenario,
    out: Path,
    tmp: Path,
    key: str,
    max_num_seqs: int,
) -> dict[str, Any]:
    urls = [s.url for s in specs]
    config = router_config(urls, placement, tmp, max_num_seqs)
    gw = create_app(config, specs)  # the launcher's specs carry the engines' key
    await gw.start()
    server = serve_asgi(gw)
    picking_log = logging.getLogger("router.admission.picking")
    decisions = DecisionLog()
    picking_log.addHandler(decisions)
    picking_log.setLevel(logging.DEBUG)
    picking_log.propagate = False  # collected, not printed
    try:
        for _ in range(300):
            if all(st.healthy and st.capacity_blocks for st in gw.fleet):
                break
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError("the router never saw the engines healthy")
        url = await server.__aenter__()
        async with aiohttp.ClientSession() as session:
            reset = [await reset_prefix_cache(session, u, key) for u in urls]
            before = await prefix_counters(session, urls, key)
            report = await run_compare(
                plan,
                [Target(placement, url, "tiny")],
                out / placement,
                tokenizer_path=find_tokenizer("tiny"),
                progress=False,
                notes=f"placement {placement}",
            )
            after = await prefix_counters(session, urls, key)
    finally:
        picking_log.removeHandler(decisions)
        picking_log.setLevel(logging.NOTSET)
        picking_log.propagate = True
        await server.__aexit__(None, None, None)
        await gw.aclose()  # flushes the ledger
    overall, per_engine = hit_rate(before, after)
    moved, later = moved_steps(await asyncio.to_thread(_steps, config.router.ledger_path))
    target = report["targets"][0]
    runs = target["runs"]["agent"]
    return {
        "placement": placement,
        "prefix_cache_reset": all(reset),
        "prefix_hit_frac": overall,
        "prefix_hit_frac_per_engine": per_engine,
        "prefix_tokens": {
            "hits": sum(a[0] - before[u][0] for u, a in after.items()),
            "queries": sum(a[1] - before[u][1] for u, a in after.items()),
        },
        "runs": runs["runs"],
        "outcomes": runs["outcomes"],
        "completion_s": {k: runs["completion_s"][k] for k in ("p50", "p95", "max")},
        "agent_output_tokens_per_s": target["classes"]["agent"]["output_tokens_per_s"],
        "step_ttft_ms_p95": target["classes"]["agent"]["ttft_ms"]["p95"],
        "later_steps": later,
        "moved_steps": moved,
        "home_full_decisions": summarize_decisions(decisions.decisions),
        "wall_s": target["wall_s"],
    }


async def _main(args: argparse.Namespace, out: Path, tmp: Path) -> dict[str, Any]:
    key = os.environ[KEY_ENV]
    launcher = cpu_engines(
        MODEL_DIR,
        count=3,
        port=args.engine_port,
        key_env=KEY_ENV,
        run_dir=tmp / "run",
        max_num_seqs=args.max_num_seqs,
        progress=_say,
        # /reset_prefix_cache is served in vLLM's dev mode only
        environ={**os.environ, "VLLM_SERVER_DEV_MODE": "1"},
    )
    specs = await launcher.start()
    plan = scenario(args.rate_scale, args.duration_s)
    rounds = []
    try:
        for i in range(args.rounds):
            k = (i + args.rotate) % len(PLACEMENTS)
            order = list(PLACEMENTS[k:] + PLACEMENTS[:k])
            results = []
            for placement in order:
                _say(f"round {i + 1}: {placement} ...")
                result = await _one(
                    placement, specs, plan, out / f"round-{i + 1}", tmp, key, args.max_num_seqs
                )
                _say(json.dumps(result))
                results.append(result)
                await asyncio.sleep(args.pause_s)
            rounds.append({"round": i + 1, "order": order, "results": results})
    finally:
        await launcher.aclose()
    return {
        "benchmark": "placement",
        "command": "python -m benchmarks.placement " + " ".join(sys.argv[1:]),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "setup": {
            "engines": 3,
            "engine_kv_cache_bytes": 64 * 1024 * 1024,
            "engine_max_num_seqs": args.max_num_seqs,
            "scenario": str(SCENARIO),
            "agent_runs_per_s": args.rate_scale * SURGE_RUNS_PER_S,
            "duration_s": args.duration_s,
        },
        "rounds": rounds,
    }


def _f(value: Any, fmt: str = ".1f") -> str:
    return "–" if value is None else format(value, fmt)


def render_markdown(report: dict[str, Any]) -> str:
    setup = report["setup"]
    lines = [
        "# Placement of a run's steps: affinity_or_move vs always_affinity vs least_loaded",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Three real CPU vLLM engines (tiny dev model, 64 MiB KV cache, `--max-num-seqs "
        f"{setup['engine_max_num_seqs']}`) in one agent pool; three gpupool routers, identical "
        "but for `pools.agent.placement`, served the same drawn plan in turn, each after every "
        f"engine's prefix cache was emptied. Workload: the agent runs of `{setup['scenario']}` "
        f"at {setup['agent_runs_per_s']:.2f} runs/s for {setup['duration_s']:g} s.",
        "",
        "| round | placement | prefix-cache hit rate (tokens) | run completion p50 s | p95 s |"
        " max s | agent out tok/s | step TTFT p95 ms | steps moved / later steps | runs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["rounds"]:
        for res in r["results"]:
            c = res["completion_s"]
            lines.append(
                f"| {r['round']} | {res['placement']} | {_f(res['prefix_hit_frac'], '.1%')} | "
                f"{_f(c['p50'])} | {_f(c['p95'])} | {_f(c['max'])} | "
                f"{_f(res['agent_output_tokens_per_s'], '.0f')} | "
                f"{_f(res['step_ttft_ms_p95'], '.0f')} | "
                f"{res['moved_steps']} / {res['later_steps']} | {res['outcomes']} |"
            )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--rate-scale", type=float, default=0.5, help="x the surge's runs/s")
    parser.add_argument("--duration-s", type=float, default=60.0, help="arrival window")
    parser.add_argument("--pause-s", type=float, default=5.0)
    parser.add_argument(
        "--rotate",
        type=int,
        default=0,
        help="start the rules' order this many places on (round r uses r - 1 + this), so"
        " separate one-round runs can each put another rule first",
    )
    parser.add_argument("--engine-port", type=int, default=8510)
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=MAX_NUM_SEQS,
        help="per engine (vLLM --max-num-seqs and the router's operating-point cap); a small"
        " value fills runs' homes, so affinity_or_move has to weigh waiting against moving",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if not is_dev_model(MODEL_DIR):
        make_dev_model(MODEL_DIR, "tiny")
    os.environ.setdefault(KEY_ENV, "placement-" + os.urandom(6).hex())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="gpupool-placement-"))
    report = asyncio.run(_main(args, out, tmp))
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(render_markdown(report))
    print((out / "report.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
