"""Day-night on 3 real CPU engines: a static pool ratio vs the rebalancer, on the same engines.

Three CPU vLLM engines (the local launcher's flags, 64 MiB KV each) are started once; one
`gpupool serve` router per mode fronts them, both from the same config (the built-in default
pools: agent 1 engine, normal 2; agent bounds 0.2 to 0.67, normal 0.33 to 0.8) except
`rebalancer.enabled`. The committed `day-night.yaml` scenario (four 60 s phases: day chat-heavy,
evening mixed, night agent-heavy, morning chat returns) runs against each in turn. While it
runs the router's `/admin/pools` is polled every second (the ratio over time, drains); after
it, its decision log (`/admin/decisions`) and moves are saved. Per phase: chat SLO attainment,
chat TTFT p95, agent step goodput (agent output tokens per second of steps that met the agent
SLO), queue waits, and failed requests.

    python -m benchmarks.rebalance.day_night --out benchmarks/results/rebalance-day-night-DATE
    python -m benchmarks.rebalance.day_night --out DIR --modes static     # one mode per run
    python -m benchmarks.rebalance.day_night --out DIR --render           # the summary only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml

from benchmarks.agent_flood_admission import Loop
from benchmarks.metrics import meets_slo, tpot_ms
from benchmarks.outputs import bulk_dir, bulk_path
from benchmarks.records import RequestRecord
from pools.config import DEFAULT_CPU_CONFIG, parse_config
from pools.launchers import InstanceSpec, LocalLauncher
from pools.testing.router_process import RouterProcess
from router.simulate.scenario import load_scenario

SCENARIO = "benchmarks/scenarios/day-night.yaml"
KEY_ENV = "GPUPOOL_BENCH_ENGINE_KEY"
ENGINE_BASE_PORT = 8421  # this benchmark's engines: 8421-8423; routers 8430-8431
ROUTER_PORTS = {"static": 8430, "rebalanced": 8431, "idle": 8432}
IDLE_S = 60.0  # chat only this long, then the first agent request
PHASES: tuple[tuple[str, float, float], ...] = (
    ("day", 0.0, 60.0),
    ("evening", 60.0, 120.0),
    ("night", 120.0, 180.0),
    ("morning", 180.0, 240.0),
)
REBALANCER = {
    "interval_s": 10,
    "cooldown_s": 20,
    "smoothing_window_s": 20,
    "hysteresis_frac": 0.3,
    "max_step_frac": 0.34,
    "drain_timeout_s": 30,
}


def router_config(mode: str, urls: list[str], state: Path) -> dict[str, Any]:
    pools = json.loads(json.dumps(DEFAULT_CPU_CONFIG["pools"]))
    return {
        "model": {"name": "tiny", "path": ".gpupool/models/tiny", "max_model_len_tokens": 4096},
        "engines": {"launcher": "static", "static": {"urls": urls, "api_key_env": KEY_ENV}},
        "pools": pools,
        "classes": DEFAULT_CPU_CONFIG["classes"],
        "router": {
            "ledger_path": str(state / f"ledger-{mode}.sqlite"),
            "state_path": str(state / f"state-{mode}.json"),
            "scrape_interval_s": 0.5,
        },
        "rebalancer": {
            "enabled": mode == "rebalanced",
            "decision_log_path": str(state / f"decisions-{mode}.sqlite"),
            **REBALANCER,
        },
    }


CALIBRATION_S = 40.0  # agent-only overload on the static router's one agent engine
CALIBRATION_RATE_PER_S = 4.0  # agent runs/s offered while calibrating (well past one engine)
CALIBRATION_STEADY_FROM_S = 15.0  # steps completed after this count toward the capacity
NIGHT = ("night", 120.0, 180.0)


def write_calibration_scenario(folder: Path) -> None:
    """The committed scenario's agent class alone, at a constant rate far past one engine."""
    data = yaml.safe_load(Path(SCENARIO).read_text())
    agent = data["classes"]["agent"]
    agent["arrivals"] = {"process": "constant", "rate_per_s": CALIBRATION_RATE_PER_S}
    data["classes"] = {"agent": agent}
    data["name"] = "day-night-agent-calibration"
    data["description"] = "The day-night agent class alone, overloading one agent engine."
    data["duration_s"] = CALIBRATION_S
    data["drain_timeout_s"] = 20
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "scenario.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def agent_capacity_steps_per_s(records: list[RequestRecord]) -> float:
    """One engine's agent capacity: steps completed (200, whole) per second after the
    overload has built up (sent from `CALIBRATION_STEADY_FROM_S` to the end of arrivals)."""
    window = CALIBRATION_S - CALIBRATION_STEADY_FROM_S
    done = [
        r
        for r in records
        if r.class_name == "agent"
        and r.ok
        and r.end_s is not None
        and CALIBRATION_STEADY_FROM_S <= r.end_s < CALIBRATION_S
    ]
    return len(done) / window


def mean_steps_per_run(scenario: Path) -> float:
    """E[steps] of the scenario's agent runs (its step distribution, rounded as the workload
    rounds it, from 200,000 draws)."""
    spec = next(c for c in load_scenario(scenario).classes if c.name == "agent")
    assert spec.steps is not None
    draws = spec.steps.sample(np.random.default_rng(0), 200_000)
    return float(np.mean(np.maximum(1, np.rint(draws))))


def write_night_scenario(out: Path, capacity_steps_per_s: float, demand_x: float) -> dict[str, Any]:
    """A copy of the scenario whose night agent arrival rate offers `demand_x` times one
    engine's measured agent capacity (in steps/s); every other rate unchanged."""
    data = yaml.safe_load(Path(SCENARIO).read_text())
    steps = mean_steps_per_run(Path(SCENARIO))
    rate = round(demand_x * capacity_steps_per_s / steps, 3)
    for segment in data["classes"]["agent"]["arrivals"]["segments"]:
        if segment["start_s"] == NIGHT[1]:
            before = segment["rate_per_s"]
            segment["rate_per_s"] = rate
    data["name"] = f"{data['name']}-night-{demand_x:g}x-one-engine"
    data["description"] += (
        f" Night agent arrivals {rate} runs/s ({demand_x:g}x one engine's measured agent"
        f" capacity of {capacity_steps_per_s:.2f} steps/s at {steps:.2f} steps per run)."
    )
    (out / "scenario.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return {
        "agent_capacity_steps_per_s": round(capacity_steps_per_s, 3),
        "mean_steps_per_run": round(steps, 3),
        "night_demand_x_one_engine": demand_x,
        "night_agent_rate_per_s": rate,
        "committed_night_agent_rate_per_s": before,
    }


def calibrate(engines: list[str], out: Path, state: Path, demand_x: float) -> None:
    """Measure one engine's agent capacity behind the static router, then size the night."""
    folder = out / "calibration"
    write_calibration_scenario(folder)
    run_mode("static", engines, folder, state)
    capacity = agent_capacity_steps_per_s(_records(folder / "static"))
    result = write_night_scenario(out, capacity, demand_x)
    (out / "capacity.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result), flush=True)


def scenario_path(out: Path) -> Path:
    """The scenario this run used: the committed one, or its copy with agent rates scaled."""
    scaled = out / "scenario.yaml"
    return scaled if scaled.exists() else Path(SCENARIO)


def write_scaled_scenario(out: Path, agent_rate_scale: float) -> None:
    """A copy of the scenario with every agent arrival rate multiplied (chat unchanged)."""
    data = yaml.safe_load(Path(SCENARIO).read_text())
    for segment in data["classes"]["agent"]["arrivals"]["segments"]:
        segment["rate_per_s"] = round(segment["rate_per_s"] * agent_rate_scale, 4)
    data["name"] = f"{data['name']}-agents-x{agent_rate_scale:g}"
    data["description"] += f" Agent arrival rates x{agent_rate_scale:g}."
    (out / "scenario.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def _scale_note(out: Path) -> str:
    scaled = out / "scenario.yaml"
    if not scaled.exists():
        return ""
    name = yaml.safe_load(scaled.read_text())["name"]
    return f" (as `{name}`: agent arrival rates scaled, chat unchanged)"


class Timeline:
    """Polls the router's /admin/pools every second (a thread): shares, target, drains."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.rows: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.wait(1.0):
                try:
                    view = client.get(f"{self.url}/admin/pools").json()
                except (httpx.HTTPError, ValueError):
                    continue
                r = view["rebalancer"]
                self.rows.append(
                    {
                        "unix_s": time.time(),
                        "placed": r["placed_shares"],
                        "target": r["target_shares"],
                        "draining": len(r["draining"]),
                        "queue": {p: v["queue"]["depth"] for p, v in view["pools"].items()},
                        "pressure": r["smoothed_pressure"],
                    }
                )

    def __enter__(self) -> Timeline:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def run_mode(mode: str, engines: list[str], out: Path, state: Path) -> None:
    port = ROUTER_PORTS[mode]
    url = f"http://127.0.0.1:{port}"
    _forget_state(state, mode)
    config_path = out / f"router-{mode}.yaml"
    config_path.write_text(yaml.safe_dump(router_config(mode, engines, state)))
    router = RouterProcess(config_path, bulk_path(out, f"router-{mode}.log"), port=port)
    try:
        router.wait_ready(60)
        with Timeline(url) as timeline:
            harness = [sys.executable, "-m", "benchmarks", "--scenario", str(scenario_path(out))]
            harness += ["--target", url, "--target-name", mode, "--no-progress"]
            subprocess.run([*harness, "--out", str(out / mode)], check=True)
        decisions = httpx.get(f"{url}/admin/decisions?limit=1000", timeout=10).json()["data"]
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    finally:
        router.stop(30)
    (out / mode / "timeline.json").write_text(json.dumps(timeline.rows) + "\n")
    (out / mode / "decisions.json").write_text(json.dumps(decisions, indent=1) + "\n")
    moves = [line for line in metrics.splitlines() if line.startswith("gpupool_rebalance_moves")]
    (out / mode / "moves.txt").write_text("\n".join(moves) + "\n")
    with sqlite3.connect(state / f"ledger-{mode}.sqlite") as conn:
        first = conn.execute("SELECT MIN(started_at_s) FROM requests").fetchone()[0]
    (out / mode / "t0.json").write_text(json.dumps({"first_request_unix_s": first}) + "\n")


def _stream_ttft_ms(client: httpx.Client, url: str, body: dict[str, Any], headers: Any) -> float:
    start = time.monotonic()
    first: float | None = None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: ") and '"content"' in line:
                first = time.monotonic()
    assert first is not None, "no token came back"
    return (first - start) * 1e3


def _forget_state(state: Path, mode: str) -> None:
    """A mode starts from nothing: no saved ratio, decisions, ledger or governance state (a
    run id left in the governance store from an earlier invocation hours ago is past its
    run guard's max_duration_s, and its first step gets 403)."""
    names = (
        f"state-{mode}.json",
        f"decisions-{mode}.sqlite",
        f"ledger-{mode}.sqlite",
        f"ledger-{mode}.governance.sqlite",
    )
    for name in names:
        for suffix in ("", "-wal", "-shm"):
            (state / f"{name}{suffix}").unlink(missing_ok=True)


def run_idle(engines: list[str], out: Path, state: Path) -> None:
    """Chat only for IDLE_S: the agent pool should sit at its floor; then one agent request,
    whose TTFT should be within the agent target (3000 ms)."""
    mode = "idle"
    port = ROUTER_PORTS[mode]
    url = f"http://127.0.0.1:{port}"
    _forget_state(state, mode)
    config_path = out / f"router-{mode}.yaml"
    config = router_config("rebalanced", engines, state)
    config["router"]["state_path"] = str(state / f"state-{mode}.json")
    config["router"]["ledger_path"] = str(state / f"ledger-{mode}.sqlite")
    config["rebalancer"]["decision_log_path"] = str(state / f"decisions-{mode}.sqlite")
    config_path.write_text(yaml.safe_dump(config))
    router = RouterProcess(config_path, bulk_path(out, f"router-{mode}.log"), port=port)
    stop = threading.Event()
    chat_status: list[int] = []

    def chat(w: int) -> None:
        with httpx.Client(timeout=60) as client:
            n = 0
            while not stop.is_set():
                n += 1
                words = " ".join(f"c{w}x{n}y{i}" for i in range(100))
                body: dict[str, Any] = {"model": "tiny", "max_tokens": 64, "stream": True}
                body["messages"] = [{"role": "user", "content": words}]
                try:
                    _stream_ttft_ms(client, url, body, {})
                    chat_status.append(200)
                except (httpx.HTTPError, AssertionError):
                    chat_status.append(0)

    try:
        router.wait_ready(60)
        workers = [threading.Thread(target=chat, args=(w,), daemon=True) for w in range(3)]
        with Timeline(url) as timeline:
            started = time.time()
            for t in workers:
                t.start()
            time.sleep(IDLE_S)
            words = " ".join(f"agent{i}" for i in range(600))
            body: dict[str, Any] = {"model": "tiny", "max_tokens": 32, "stream": True}
            body["messages"] = [{"role": "user", "content": words}]
            with httpx.Client(timeout=60) as client:
                ttft_ms = _stream_ttft_ms(client, url, body, {"x-gpupool-run-id": "idle-first"})
            time.sleep(15)
            stop.set()
            for t in workers:
                t.join(timeout=60)
    finally:
        router.stop(30)
    shares = [(round(r["unix_s"] - started, 1), r["placed"]["agent"]) for r in timeline.rows]
    before = [v for t, v in shares if 30 <= t <= IDLE_S]
    result = {
        "idle_s": IDLE_S,
        "agent_floor_frac": DEFAULT_CPU_CONFIG["pools"]["agent"]["share"]["floor_frac"],
        "agent_share_last_30s_of_idle": [min(before, default=None), max(before, default=None)],
        "first_agent_ttft_ms": round(ttft_ms, 1),
        "agent_ttft_target_ms": DEFAULT_CPU_CONFIG["pools"]["agent"]["slo"]["ttft_p95_ms"],
        "chat_requests": len(chat_status),
        "chat_failed": sum(1 for s in chat_status if s != 200),
        "agent_share_over_time": shares,
    }
    (out / "idle.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "agent_share_over_time"}))


def _records(folder: Path) -> list[RequestRecord]:
    path = next(bulk_dir(folder).glob("records-*.jsonl"))
    out = []
    for line in path.read_text().splitlines():
        data = json.loads(line)
        if data.pop("type", "request") == "request":
            out.append(RequestRecord.from_json(data))
    return out


def _p(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(out: Path, mode: str) -> dict[str, Any]:
    folder = out / mode
    scenario = load_scenario(scenario_path(out))
    slo = {c.name: c.slo for c in scenario.classes}
    records = _records(folder)
    phases = {}
    for name, start, end in PHASES:
        rs = [r for r in records if start <= r.scheduled_s < end]
        chat = [r for r in rs if r.class_name == "normal"]
        agent = [r for r in rs if r.class_name == "agent"]
        good_agent_tokens = sum((r.output_tokens or 0) for r in agent if meets_slo(r, slo["agent"]))
        phases[name] = {
            "chat_requests": len(chat),
            "chat_slo_attainment": (
                sum(meets_slo(r, slo["normal"]) for r in chat) / len(chat) if chat else None
            ),
            "chat_ttft_p95_ms": _p([r.ttft_ms for r in chat if r.ttft_ms is not None], 95),
            "chat_tpot_p95_ms": _p([t for r in chat if (t := tpot_ms(r)) is not None], 95),
            "agent_steps": len(agent),
            "agent_goodput_tokens_per_s": good_agent_tokens / (end - start),
            "agent_step_ttft_p95_ms": _p([r.ttft_ms for r in agent if r.ttft_ms is not None], 95),
            "failed": sum(1 for r in rs if not r.ok),
            "failed_codes": sorted({f"{r.status} {r.error_code}" for r in rs if not r.ok}),
        }
    t0 = json.loads((folder / "t0.json").read_text())["first_request_unix_s"]
    timeline = json.loads((folder / "timeline.json").read_text())
    trajectory = [
        {
            "t_s": round(row["unix_s"] - t0, 1),
            "agent_placed": row["placed"]["agent"],
            "agent_target": row["target"]["agent"],
            "draining": row["draining"],
            "queue": row["queue"],
        }
        for row in timeline
    ]
    decisions = json.loads((folder / "decisions.json").read_text())
    moves = [
        {
            "t_s": round(d["at_unix_s"] - t0, 1),
            "kind": d["kind"],
            "move": d["move"],
            "smoothed": d.get("smoothed_pressure"),
        }
        for d in reversed(decisions)
        if d.get("move")
    ]
    drains = [
        {"t_s": round(d["at_unix_s"] - t0, 1), "drain_s": d["drain_s"], "ended_by": d["ended_by"]}
        for d in reversed(decisions)
        if d["reason"] == "drain_done"
    ]
    night_start = NIGHT[1]
    rose = next(
        (m for m in moves if m["t_s"] >= night_start and m["move"]["to_pool"] == "agent"), None
    )
    fell = next(
        (
            m
            for m in moves
            if rose is not None and m["t_s"] > rose["t_s"] and m["move"]["to_pool"] == "normal"
        ),
        None,
    )
    return {
        "mode": mode,
        "requests": len(records),
        # the first move to the agent pool after the night surge began, in seconds after it
        # and in rebalancer intervals (a decision at surge + k intervals is "within k")
        "agent_share_rose_after_surge_s": None
        if rose is None
        else round(rose["t_s"] - night_start, 1),
        "agent_share_rose_within_intervals": None
        if rose is None
        else math.ceil((rose["t_s"] - night_start) / REBALANCER["interval_s"] - 1e-9),
        "agent_share_fell_back_at_s": None if fell is None else fell["t_s"],
        "failed": sum(1 for r in records if not r.ok),
        "phases": phases,
        "moves": moves,
        "drains": drains,
        "agent_share_min_max": [
            min((t["agent_placed"] for t in trajectory), default=None),
            max((t["agent_placed"] for t in trajectory), default=None),
        ],
        "trajectory": trajectory,
    }


def _capacity(out: Path) -> dict[str, Any] | None:
    path = out / "capacity.json"
    return json.loads(path.read_text()) if path.exists() else None


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def render(out: Path, modes: list[str]) -> str:
    results = {m: summarize(out, m) for m in modes if (out / m / "t0.json").exists()}
    idle = json.loads((out / "idle.json").read_text()) if (out / "idle.json").exists() else None
    (out / "summary.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [
        "# day-night on 3 CPU engines: static ratio vs rebalancer",
        "",
        f"Scenario `{SCENARIO}`{_scale_note(out)}; pools: the built-in default (agent 1 of 3"
        " engines, bounds 0.2-0.67; normal 2 of 3, bounds 0.33-0.8). Rebalancer: "
        + ", ".join(f"{k} {v}" for k, v in REBALANCER.items())
        + ".",
        "",
        *(
            [
                "Night sized from a calibration on this machine (`capacity.json`): one agent"
                f" engine completed {cap['agent_capacity_steps_per_s']} agent steps/s under"
                f" overload; the night offers {cap['night_demand_x_one_engine']}x that"
                f" ({cap['night_agent_rate_per_s']} runs/s at {cap['mean_steps_per_run']} steps"
                f" per run; the committed scenario has {cap['committed_night_agent_rate_per_s']}).",
                "",
            ]
            if (cap := _capacity(out)) is not None
            else []
        ),
        "Agent goodput: output tokens per second of the agent steps sent in the phase that"
        " met the agent SLO (TTFT, TPOT and e2e targets of the scenario).",
        "",
        "| mode | phase | chat SLO | chat TTFT p95 ms | chat TPOT p95 ms | agent steps |"
        " agent goodput tok/s | agent step TTFT p95 ms | failed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, r in results.items():
        for phase, p in r["phases"].items():
            lines.append(
                f"| {mode} | {phase} | {_fmt(p['chat_slo_attainment'], '.1%')} |"
                f" {_fmt(p['chat_ttft_p95_ms'], '.0f')} | {_fmt(p['chat_tpot_p95_ms'], '.0f')} |"
                f" {p['agent_steps']} | {p['agent_goodput_tokens_per_s']:.1f} |"
                f" {_fmt(p['agent_step_ttft_p95_ms'], '.0f')} | {p['failed']} |"
            )
    for mode, r in results.items():
        lines += ["", f"## {mode}: the agent share over time", ""]
        lines.append(
            f"requests {r['requests']}, failed {r['failed']}; agent share (placed) min/max"
            f" {r['agent_share_min_max']}; first move to agent after the night surge (t="
            f"{NIGHT[1]:g} s): {_fmt(r['agent_share_rose_after_surge_s'], 'g')} s after it"
            f" (within {_fmt(r['agent_share_rose_within_intervals'], 'd')} intervals); back to"
            f" normal at t={_fmt(r['agent_share_fell_back_at_s'], 'g')} s"
        )
        for m in r["moves"]:
            mv = m["move"]
            lines.append(
                f"- t={m['t_s']} s: {m['kind']} move {mv['from_pool']} -> {mv['to_pool']}"
                f" {mv['share_frac']:.2f} (smoothed pressure {m['smoothed']})"
            )
        for d in r["drains"]:
            lines.append(f"- t={d['t_s']} s: drain done after {d['drain_s']} s ({d['ended_by']})")
        samples = [t for t in r["trajectory"] if int(t["t_s"]) % 10 == 0]
        lines.append("")
        lines.append(
            "t_s: agent placed share: "
            + ", ".join(f"{t['t_s']:.0f}:{t['agent_placed']:.2f}" for t in samples)
        )
    if idle is not None:
        lines += [
            "",
            "## Idle agent pool",
            "",
            f"Chat only for {idle['idle_s']:g} s (3 streaming clients): agent share over the last"
            f" 30 s of it {idle['agent_share_last_30s_of_idle']} (floor"
            f" {idle['agent_floor_frac']}); the first agent request after it: TTFT"
            f" {idle['first_agent_ttft_ms']} ms (target {idle['agent_ttft_target_ms']} ms);"
            f" chat requests {idle['chat_requests']}, failed {idle['chat_failed']}.",
        ]
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--modes", nargs="+", choices=list(ROUTER_PORTS), default=list(ROUTER_PORTS)
    )
    parser.add_argument("--render", action="store_true", help="only rebuild the summary")
    parser.add_argument(
        "--night-demand-x",
        type=float,
        default=None,
        help="first measure one engine's agent capacity (agent-only overload on the static"
        " router), then offer this many times it in the night phase (other rates unchanged)",
    )
    parser.add_argument(
        "--agent-rate-scale",
        type=float,
        default=1.0,
        help="multiply the scenario's agent arrival rates (chat unchanged)",
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.render:
        if args.agent_rate_scale != 1.0:
            write_scaled_scenario(out, args.agent_rate_scale)
        os.environ.setdefault(KEY_ENV, "bench-" + os.urandom(8).hex())
        state = Path(".gpupool/bench-rebalance")
        state.mkdir(parents=True, exist_ok=True)
        config = parse_config(
            {
                "model": {"name": "tiny", "path": ".gpupool/models/tiny"},
                "engines": {
                    "launcher": "local",
                    "local": {
                        "count": 3,
                        "base_port": ENGINE_BASE_PORT,
                        "kv_cache_bytes": 64 * 1024 * 1024,
                        "api_key_env": KEY_ENV,
                        "run_dir": str(state / "run"),
                        "vllm_args": ["--max-num-seqs", "64"],
                    },
                },
                "pools": {"normal": {"classes": ["normal", "agent"], "share": {"initial_frac": 1}}},
            }
        )
        launcher = LocalLauncher(
            config.engines.local,
            config.model,
            progress=lambda m: print(f"[engines] {m}"),
            gpu_count=0,
        )
        loop = Loop()
        specs: list[InstanceSpec] = loop.run(launcher.start())
        try:
            if args.night_demand_x is not None:
                print("calibrating one engine's agent capacity", flush=True)
                calibrate([s.url for s in specs], out, state, args.night_demand_x)
            for mode in args.modes:
                print(f"mode {mode}", flush=True)
                if mode == "idle":
                    run_idle([s.url for s in specs], out, state)
                else:
                    run_mode(mode, [s.url for s in specs], out, state)
        finally:
            loop.run(launcher.aclose())
            loop.close()
    print(render(out, list(ROUTER_PORTS)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
