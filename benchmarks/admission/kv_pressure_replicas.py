"""KV pressure through N router replicas on one PostgreSQL store (issue 25, item 3): with the
replicas' KV and batch reservations shared (`store.admission_interval_s: 0.1`) and not shared
(`0`), side by side in one run.

    flock /tmp/gpupool-engines.lock .venv/bin/python -m benchmarks.admission.kv_pressure_replicas \\
        --out benchmarks/results/kv-pressure-replicas-YYYY-MM-DD [--replicas 3] [--rounds 2]

The workload, engine and router settings are `benchmarks.admission.kv_pressure`'s
`admission-on` configuration (one CPU vLLM engine whose KV cache six growing agent runs
overflow, split between the agent and normal pools; Poisson chat and two waves of six agent
runs), sent to `gpupool serve --replicas N`: N router processes on one port (SO_REUSEPORT, the
kernel spreads the harness's connections over them) sharing one PostgreSQL database (tests/
postgres.py's server, started here; a fresh database per run). Modes, interleaved (AB BA AB ...):

- `shared`: `store.admission_interval_s: 0.1`, each replica subtracts the others' reservations;
- `unshared`: `store.admission_interval_s: 0`, each replica admits by its own reservations and
  the engine's measured use (the state before issue 25's item 3).

Per run: the engine's preemptions (`vllm:num_preemptions_total`), its KV usage and running
peaks, and, every 0.5 s through one keep-alive connection pinned to each router, each router's
reserved blocks on the engine (`/admin/pools`): their sum is what the routers together
promised the engine, against its blocks. Chat TTFT, agent output tok/s, refusals, the requests
each router served, load average. Writes `report.md`, `report.json` and the router config into
`--out`; router logs and per-sample rows under `--work-dir`. Nothing it starts outlives it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import json
import logging
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from benchmarks.admission.kv_pressure import (
    AGENT_CLASS,
    CHAT_CLASS,
    CONFIGS,
    ENGINE_COUNTERS,
    ENGINE_FILES,
    ENGINE_KEY_ENV,
    HERE,
    Sampler,
    _dict_cell,
    _fmt,
    _g,
    agent_numbers,
    engine_counters,
    get_text,
    metric_sum,
    parse_prom,
    reset_prefix_cache,
    router_config,
    wait_engine_idle,
)
from benchmarks.compare import calibrate_prompts, check_target
from benchmarks.metrics import summarize_target
from benchmarks.report import describe_machine
from benchmarks.runner import Runner, Target
from pools.config import Config, load_config
from pools.launchers.local import LocalLauncher
from pools.testing.router_process import RouterProcess, free_port
from router.simulate.prompts import PromptMaker, find_tokenizer
from router.simulate.scenario import Scenario, load_scenario
from router.simulate.workload import Plan, build_plan

__all__ = ["MODES", "main"]

log = logging.getLogger("kv_pressure_replicas")

PASSWORD_ENV = "KVPR_STORE_PASSWORD"
MODES = {"shared": 0.1, "unshared": 0.0}  # store.admission_interval_s
SAMPLE_S = 0.5


def _postgres() -> Any:
    """tests/postgres.py, the tests' real server (test support, not the product)."""
    return importlib.import_module("tests.postgres")


def replicas_config(
    engine: Config, engine_url: str, state_dir: Path, port: int, store_url: str, interval_s: float
) -> dict[str, Any]:
    """kv_pressure's `admission-on` router config on a shared store."""
    cfg = router_config(CONFIGS["admission-on"], engine, engine_url, state_dir)
    cfg["router"] = {
        **{k: v for k, v in cfg["router"].items() if k != "ledger_path"},  # in the store
        "port": port,
    }
    cfg["store"] = {
        "url": store_url,
        "password_env": PASSWORD_ENV,
        "admission_interval_s": interval_s,
    }
    return cfg


class PinnedRouters:
    """One keep-alive connection per router (new connections until each replica was reached),
    sampled every SAMPLE_S: each router's reserved blocks and sequences on the engine, and its
    requests, keyed by its replica id."""

    def __init__(self, url: str, replicas: int) -> None:
        self.url, self.replicas = url, replicas
        self.sessions: dict[str, aiohttp.ClientSession] = {}
        self.rows: list[dict[str, Any]] = []
        self._task: asyncio.Task[None] | None = None

    async def _view(self, session: aiohttp.ClientSession) -> dict[str, Any] | None:
        with contextlib.suppress(TimeoutError, aiohttp.ClientError, ValueError):
            async with asyncio.timeout(2.0), session.get(f"{self.url}/admin/pools") as r:
                data: dict[str, Any] = await r.json()
                return data
        return None

    async def pin(self, tries: int = 60) -> None:
        for _ in range(tries):
            if len(self.sessions) >= self.replicas:
                return
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
            view = await self._view(session)
            replica = _replica(view)
            if replica is None or replica in self.sessions:
                await session.close()
                continue
            self.sessions[replica] = session
        raise RuntimeError(f"reached {len(self.sessions)} of {self.replicas} routers")

    async def _loop(self, t0: float) -> None:
        while True:
            tick = time.perf_counter()
            views = await asyncio.gather(*(self._view(s) for s in self.sessions.values()))
            row: dict[str, Any] = {"t_s": round(tick - t0, 3)}
            total_blocks, total_seqs = 0.0, 0.0
            for view in views:
                replica = _replica(view)
                if view is None or replica is None:
                    continue
                blocks = seqs = 0.0
                for inst in (view.get("instances") or {}).values():
                    blocks += sum((inst.get("kv_reserved_blocks_by_pool") or {}).values())
                    seqs += sum((inst.get("running_by_pool") or {}).values())
                    row["num_gpu_blocks"] = inst.get("num_gpu_blocks")
                row[f"blocks|{replica}"], row[f"seqs|{replica}"] = blocks, seqs
                total_blocks += blocks
                total_seqs += seqs
            row["blocks_total"], row["seqs_total"] = total_blocks, total_seqs
            self.rows.append(row)
            await asyncio.sleep(max(0.0, SAMPLE_S - (time.perf_counter() - tick)))

    def start(self, t0: float) -> None:
        self._task = asyncio.create_task(self._loop(t0))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def requests_by_router(self) -> dict[str, float]:
        """Each router's gpupool_requests_total (every label) at the end."""
        out: dict[str, float] = {}
        for replica, session in self.sessions.items():
            text = await get_text(session, f"{self.url}/metrics")
            if text is not None:
                total = metric_sum(
                    parse_prom(text, ("gpupool_requests_total",)), "gpupool_requests_total"
                )
                out[replica] = total or 0.0
        return out

    async def aclose(self) -> None:
        await self.stop()
        for session in self.sessions.values():
            await session.close()


def _replica(view: dict[str, Any] | None) -> str | None:
    with contextlib.suppress(KeyError, TypeError):
        return str(view["rebalancer"]["leader"]["replica"])  # type: ignore[index]
    return None


def _peak(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    return max(values) if values else None


async def run_one(
    *,
    mode: str,
    run_name: str,
    args: argparse.Namespace,
    pg: Any,
    plan: Plan,
    scenario: Scenario,
    engine_cfg: Config,
    engine_url: str,
    engine_key: str | None,
    out: Path,
    work: Path,
    session: aiohttp.ClientSession,
) -> dict[str, Any]:
    waited_s = await wait_engine_idle(session, engine_url)
    reset_ok = await reset_prefix_cache(session, engine_url, engine_key)
    state_dir = work / "state" / run_name
    state_dir.mkdir(parents=True, exist_ok=True)
    store_url = pg.create_database(f"kvpr_{run_name.replace('-', '_')}")
    port = free_port()
    cfg = replicas_config(engine_cfg, engine_url, state_dir, port, store_url, MODES[mode])
    if not engine_key:  # an engine without a key: the router sends none
        cfg["engines"]["static"].pop("api_key_env", None)
    cfg_path = work / "configs" / f"router-{run_name}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    (out / "configs").mkdir(parents=True, exist_ok=True)
    shown = {**cfg, "store": {**cfg["store"], "url": "postgresql://gpupool@/kvpr_<run>?host=..."}}
    (out / "configs" / f"router-{mode}.yaml").write_text(
        f"# {mode}: gpupool serve --replicas {args.replicas} --config <this>; state paths and"
        " the store URL per run\n" + yaml.safe_dump(shown, sort_keys=False)
    )
    env = {
        **os.environ,
        ENGINE_KEY_ENV: engine_key or "",
        PASSWORD_ENV: _postgres().PASSWORD,
    }
    router = RouterProcess(
        cfg_path,
        work / "logs" / f"{run_name}-routers.log",
        port=port,
        args=["--replicas", str(args.replicas)],
        env=env,
    )
    pinned = PinnedRouters(router.url, args.replicas)
    try:
        await router.wait_ready_async(timeout_s=120)
        await _wait_capacity(session, router.url)
        await pinned.pin()
        await asyncio.sleep(1.5)  # one more scrape on every router
        before = await engine_counters(session, engine_url)
        load_before = os.getloadavg()[0]
        sampler = Sampler(engine_url, router.url)
        t0 = time.perf_counter()
        await sampler.start(session, t0)
        pinned.start(t0)
        target = Target(run_name, router.url, scenario.model)
        result = await Runner(
            plan, target, run_id_prefix=f"kvpr-{run_name}-{int(time.time())}", progress=False
        ).run()
        await asyncio.sleep(1.0)
        await sampler.stop()
        await pinned.stop()
        after = await engine_counters(session, engine_url)
        by_router = await pinned.requests_by_router()
    finally:
        await pinned.aclose()
        await router.stop_async()
    load_after = os.getloadavg()[0]
    with (work / "samples" / f"{run_name}.jsonl").open("w") as f:
        for row in pinned.rows:
            f.write(json.dumps(row) + "\n")
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ENGINE_COUNTERS}
    summary = summarize_target(result, scenario)
    chat = summary["classes"].get(CHAT_CLASS, {})
    capacity = before.get("cache_config_info.num_gpu_blocks")
    blocks_peak = _peak(pinned.rows, "blocks_total")
    return {
        "run": run_name,
        "mode": mode,
        "admission_interval_s": MODES[mode],
        "engine_drain_wait_s": waited_s,
        "prefix_cache_reset": reset_ok,
        "preemptions": delta["vllm:num_preemptions_total"],
        "kv_usage_peak_frac": sampler.peak("vllm:kv_cache_usage_perc"),
        "engine_running_peak": sampler.peak("vllm:num_requests_running"),
        "engine_waiting_peak": sampler.peak("vllm:num_requests_waiting"),
        "engine_generation_tokens": delta["vllm:generation_tokens_total"],
        "engine_blocks": capacity,
        "routers_reserved_blocks_peak": blocks_peak,
        "routers_reserved_over_engine_blocks_peak": (blocks_peak / (capacity - 1))
        if blocks_peak is not None and capacity
        else None,
        "routers_sequences_peak": _peak(pinned.rows, "seqs_total"),
        "routers_sampled": len(pinned.sessions),
        "requests_by_router": by_router,
        "chat": {
            "requests": chat.get("requests"),
            "ok": chat.get("ok"),
            "ttft_ms": chat.get("ttft_ms"),
            "slo_attainment_frac": chat.get("slo_attainment_frac"),
        },
        "agent": agent_numbers(result),
        "agent_runs": summary["runs"].get(AGENT_CLASS, {}).get("outcomes"),
        "http_failures": summary["rejections"],
        "wall_s": result.wall_s,
        "load_avg_1m": {"before": load_before, "after": load_after},
    }


async def _wait_capacity(session: aiohttp.ClientSession, url: str, timeout_s: float = 60) -> None:
    """Until the router a new connection reaches knows the engine's KV blocks."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = await get_text(session, f"{url}/metrics", 2.0)
        if text and metric_sum(
            parse_prom(text, ("gpupool_kv_capacity_blocks",)), "gpupool_kv_capacity_blocks"
        ):
            return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"{url}: no KV capacity known after {timeout_s:.0f} s")


ROWS: list[tuple[str, tuple[str, ...], str]] = [
    ("engine preemptions (Δ vllm:num_preemptions_total)", ("preemptions",), "int"),
    ("engine KV usage peak (0.5 s samples)", ("kv_usage_peak_frac",), "pct"),
    ("engine running peak", ("engine_running_peak",), "int"),
    ("engine waiting peak", ("engine_waiting_peak",), "int"),
    ("routers' reserved blocks together, peak", ("routers_reserved_blocks_peak",), "int"),
    ("  as a share of the engine's blocks", ("routers_reserved_over_engine_blocks_peak",), "pct"),
    ("routers' sequences together, peak", ("routers_sequences_peak",), "int"),
    ("chat TTFT p50 (ms)", ("chat", "ttft_ms", "p50"), "int"),
    ("chat TTFT p99 (ms)", ("chat", "ttft_ms", "p99"), "int"),
    ("chat SLO attainment", ("chat", "slo_attainment_frac"), "pct"),
    ("agent output tok/s (agent part)", ("agent", "output_tokens_per_s"), "f1"),
    ("agent steps ok", ("agent", "steps_ok"), "int"),
    ("agent steps sent", ("agent", "steps_sent"), "int"),
]


def render(report: dict[str, Any]) -> str:
    runs = report["runs"]
    lines = [
        f"# KV pressure through {report['replicas']} router replicas: reservations shared or not",
        "",
        f"Run {report['created_at']}; generated by"
        " `benchmarks/admission/kv_pressure_replicas.py` (README.md beside it: the reading).",
        "",
        f"- command: `{report['command']}`",
        f"- machine: {report['machine'].get('cpu_model')}, {report['machine'].get('cpu_cores')}"
        f" cores; git {report['git']}"
        + (
            f" (modified at the start: {', '.join(report['git_modified_at_start'])})"
            if report["git_modified_at_start"]
            else ""
        ),
        f"- engine: {report['engine_blocks']} KV blocks (one is vLLM's null block); workload"
        f" {report['scenario']}: {report['chat_requests']} chat requests, {report['agent_runs']}"
        " agent runs",
        "",
        "| metric | " + " | ".join(r["run"] for r in runs) + " |",
        "|---|" + "---|" * len(runs),
    ]
    for label, path, kind in ROWS:
        lines.append(f"| {label} | " + " | ".join(_fmt(_g(r, *path), kind) for r in runs) + " |")
    extra: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("refusals / failures (harness)", lambda r: _dict_cell(r["http_failures"])),
        ("agent run outcomes", lambda r: _dict_cell(r["agent_runs"])),
        (
            "requests per router",
            lambda r: ", ".join(f"{v:.0f}" for v in sorted(r["requests_by_router"].values())),
        ),
        (
            "load avg 1 min before / after",
            lambda r: "{:.1f} / {:.1f}".format(
                r["load_avg_1m"]["before"], r["load_avg_1m"]["after"]
            ),
        ),
    ]
    for label, fn in extra:
        lines.append(f"| {label} | " + " | ".join(fn(r) for r in runs) + " |")
    lines.append("")
    return "\n".join(lines)


async def amain(args: argparse.Namespace, pg: Any) -> int:
    out, work = Path(args.out), Path(args.work_dir)
    scenario = load_scenario(args.scenario)
    if args.duration_s is not None:
        scenario = dataclasses.replace(scenario, duration_s=args.duration_s)
    cfg = load_config(ENGINE_FILES["fcfs"])
    local = dataclasses.replace(cfg.engines.local, base_port=free_port(), run_dir=work / "engine")
    if args.kv_cache_bytes:
        local = dataclasses.replace(local, kv_cache_bytes=args.kv_cache_bytes)
    cfg = dataclasses.replace(cfg, engines=dataclasses.replace(cfg.engines, local=local))
    launcher = LocalLauncher(local, cfg.model, progress=lambda m: log.info("%s", m))
    numbers: list[dict[str, Any]] = []
    try:
        specs = await launcher.start()
        url, key = specs[0].url, specs[0].api_key
        if args.nice:
            with contextlib.suppress(OSError):
                os.nice(args.nice)  # the routers (children from now on) and the harness
        async with aiohttp.ClientSession() as session:
            info = await engine_counters(session, url)
            direct = Target("engine", url, scenario.model, key)
            problem = await check_target(session, direct)
            if problem:
                raise RuntimeError(f"engine: {problem}")
            prompts = PromptMaker(find_tokenizer(scenario.model, scenario.tokenizer_path))
            await calibrate_prompts(session, direct, prompts)
            plan = build_plan(scenario, prompts, args.seed)
            modes = list(MODES)
            for rnd in range(1, args.rounds + 1):
                for mode in modes if rnd % 2 else modes[::-1]:
                    name = f"r{rnd}-{mode}"
                    if _past(args.end_by, args.run_s):
                        log.warning("%s: not started, it would end after %s UTC", name, args.end_by)
                        return 0
                    log.info("%s: starting", name)
                    nums = await run_one(
                        mode=mode,
                        run_name=name,
                        args=args,
                        pg=pg,
                        plan=plan,
                        scenario=scenario,
                        engine_cfg=cfg,
                        engine_url=url,
                        engine_key=key,
                        out=out,
                        work=work,
                        session=session,
                    )
                    numbers.append(nums)
                    log.info(
                        "%s: preemptions %.0f, KV peak %s, routers' blocks peak %s of %s",
                        name,
                        nums["preemptions"],
                        _fmt(nums["kv_usage_peak_frac"], "pct"),
                        _fmt(nums["routers_reserved_blocks_peak"], "int"),
                        _fmt(nums["engine_blocks"], "int"),
                    )
                    _write(out, args, numbers, info, scenario, plan)
                    await asyncio.sleep(args.pause_s)
    finally:
        await launcher.aclose()
    print(f"report: {out / 'report.md'}")
    return 0


def _write(
    out: Path,
    args: argparse.Namespace,
    numbers: list[dict[str, Any]],
    info: dict[str, float],
    scenario: Scenario,
    plan: Plan,
) -> None:
    git = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    report = {
        "created_at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": " ".join(["python -m benchmarks.admission.kv_pressure_replicas", *sys.argv[1:]]),
        "git": git,
        "git_modified_at_start": args.git_modified,
        "machine": describe_machine(),
        "replicas": args.replicas,
        "rounds": args.rounds,
        "engine_blocks": info.get("cache_config_info.num_gpu_blocks"),
        "scenario": scenario.source,
        "chat_requests": len(plan.chat),
        "agent_runs": len(plan.runs),
        "runs": numbers,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2, default=float) + "\n")
    (out / "report.md").write_text(render(report))


def _past(end_by: str | None, ahead_s: float) -> bool:
    """Whether now + `ahead_s` is past `end_by` (HH:MM UTC, today)."""
    if end_by is None:
        return False
    hour, minute = (int(x) for x in end_by.split(":"))
    now = datetime.now(UTC)
    end = now.replace(hour=hour, minute=minute, second=0, microsecond=0)
    return now.timestamp() + ahead_s > end.timestamp()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.admission.kv_pressure_replicas",
        description=(__doc__ or "").split("\n\n")[0],
    )
    p.add_argument("--out", required=True, help="results folder")
    p.add_argument("--replicas", type=int, default=3, help="router processes (default 3)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of shared + unshared")
    p.add_argument("--scenario", default=str(HERE / "kv-pressure.yaml"))
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--duration-s", type=float, default=None)
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument("--pause-s", type=float, default=3.0)
    p.add_argument("--nice", type=int, default=-5, help="niceness increment (0: none)")
    p.add_argument("--work-dir", default=f".gpupool/bench-kvpr-{secrets.token_hex(3)}")
    p.add_argument(
        "--end-by",
        default=None,
        help="HH:MM UTC: start no run that would end after it (a shared machine's time box)",
    )
    p.add_argument("--run-s", type=float, default=180.0, help="one run's expected seconds")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if _past(args.end_by, args.run_s * 2):
        print(f"not started: it would end after {args.end_by} UTC", file=sys.stderr)
        return 0
    # the routers run the working tree: which product files differ from HEAD at the start
    status = subprocess.run(
        ["git", "status", "--porcelain", "--", "router", "pools", "kvcache_model", "gpu_probe"],
        capture_output=True,
        text=True,
        check=False,
    )
    args.git_modified = [line[3:] for line in status.stdout.splitlines() if line.strip()]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for sub in ("configs", "logs", "state", "samples"):
        (Path(args.work_dir) / sub).mkdir(parents=True, exist_ok=True)
    with _postgres().start_postgres() as pg:
        return asyncio.run(amain(args, pg))


if __name__ == "__main__":
    sys.exit(main())
