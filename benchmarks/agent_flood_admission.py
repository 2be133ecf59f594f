"""agent-flood on 3 CPU engines, two or three routers side by side on the same engines.

Three real CPU vLLM engines (the local launcher's flags, 64 MiB KV each, publishing KV cache
events on socket files as the local launcher always starts them) are started once. Two
`gpupool serve` routers front them with gpupool's default pools (agent pool on one engine,
normal pool on two). `--compare admission` (the default): one with `router.admission: on`, one
with `off`. `--compare index`: both with admission on, one following the engines' KV events
(`engines.kv_events` on: the prefix-cache index places requests and predicts prefills,
docs/prefix_cache.md), one with it off. `--compare hold`: three routers, index-off, index-on,
and index-hold (index-on with `admission.tool_pause_hold`: the paused runs' context blocks held
on their home, docs/admission.md "Tool pauses"). `--compare gate`: index-off, index-on and
index-gate (index-on with the hold against new runs only, `tool_pause_hold_against:
new_runs`, up to half the engine). `--fresh-engines` restarts the engines before every run but
the first (runs on engines that served a run before came out slower). The committed
`agent-flood.yaml` workload (optionally scaled with `--rate-scale`) runs against each in turn,
for `--rounds` rounds in alternating order. Around each run the engines' own `/metrics` are
scraped (preemptions, prefix-cache hits) and sampled every 0.5 s (KV usage, running, waiting),
and the router's rejections by reason are read from its `/metrics`.
Before each run every engine's prefix cache is emptied (vLLM's dev-mode
`POST /reset_prefix_cache`), so no run finds the previous run's prompts cached.

The issue's targets: with admission, the agent engine never preempts, chat SLO attainment
stays >= 99 %, and 429s appear only where the queue limits say so; with the index, no
regression in agent run completion (p50, p90) or chat SLO attainment against it off.

    python -m benchmarks.agent_flood_admission --out benchmarks/results/agent-flood-admission-DATE
    python -m benchmarks.agent_flood_admission --compare index \
        --out benchmarks/results/agent-flood-index-DATE
    python -m benchmarks.agent_flood_admission --compare hold --rounds 1 \
        --out benchmarks/results/agent-flood-pause-hold-DATE
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil
import yaml

from benchmarks.outputs import bulk_path
from pools.config import parse_config
from pools.launchers import InstanceSpec, LocalLauncher
from pools.launchers.base import KvEventsSpec
from pools.testing.router_process import RouterProcess

SCENARIO = "benchmarks/scenarios/agent-flood.yaml"
KEY_ENV = "GPUPOOL_BENCH_ENGINE_KEY"
ENGINE_BASE_PORT = 8401
# the routers each comparison runs, in their default order
COMPARES = {
    "admission": ("admission-on", "admission-off"),
    "index": ("index-on", "index-off"),
    "hold": ("index-off", "index-on", "index-hold"),
    "gate": ("index-off", "index-on", "index-gate"),
}
ROUTER_PORTS = {
    "admission-on": 8410,
    "admission-off": 8411,
    "index-on": 8412,
    "index-off": 8413,
    "index-hold": 8414,
    "index-gate": 8415,
}
BASELINE_CONFIG = Path("benchmarks/results/agent-flood-2026-11-29/gpupool-pools.yaml")

T = TypeVar("T")


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name:
            total += float(value)
    return total


def _labelled(text: str, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and "{" in head:
            out[head[head.index("{") :]] = float(value)
    return out


def router_config(
    mode: str, specs: list[InstanceSpec], state: Path, base: dict[str, Any]
) -> dict[str, Any]:
    """The config of `mode`'s router over the running engines `specs`, on `base` (the
    baseline's pools and classes). admission-off: admission off; every other mode on.
    index-on: `engines.kv_events` on, each engine's KV events where the launcher says it
    publishes them (raises `ValueError` when one publishes none); index-off: off. The
    admission modes leave it unset (static engines with no kv_events entries: off).
    index-hold: index-on with `admission.tool_pause_hold` on; index-gate: that hold against
    new runs only, up to half the engine; every other mode sets it off."""
    if mode not in ROUTER_PORTS:
        raise ValueError(f"unknown mode {mode!r}; one of {sorted(ROUTER_PORTS)}")
    config = dict(base)
    static: dict[str, Any] = {"urls": [s.url for s in specs], "api_key_env": KEY_ENV}
    config["engines"] = {"launcher": "static", "static": static}
    if mode in ("index-on", "index-hold", "index-gate"):
        static["kv_events"] = [_static_kv_events(s.url, s.kv_events) for s in specs]
        config["engines"]["kv_events"] = True
    elif mode == "index-off":
        config["engines"]["kv_events"] = False
    config["router"] = {
        "ledger_path": str(state / f"ledger-{mode}.sqlite"),
        "state_path": str(state / f"state-{mode}.json"),
        "admission": "off" if mode == "admission-off" else "on",
    }
    config["admission"] = {
        **config.get("admission", {}),
        "tool_pause_hold": mode in ("index-hold", "index-gate"),
    }
    if mode == "index-gate":
        # the paused runs' contexts count only against new runs' first steps, up to half the
        # engine: the runs in progress keep their cache, new ones start when there is room
        config["admission"]["tool_pause_hold_against"] = "new_runs"
        config["admission"]["tool_pause_max_frac"] = 0.5
    return config


# --pin: each engine's CPUs, by engine index; gpupool's default plan gives the agent pool
# (a third of three engines) the last engine
PIN_CPUS: tuple[tuple[int, ...], ...] = ((0,), (0,), (1,))


@contextlib.contextmanager
def spawn_on_cpu0(pin: bool) -> Iterator[None]:
    """With --pin, what starts inside (a router, the load generator) runs on CPU 0, beside
    the normal engines, so the agent engine has CPU 1 to itself, as on its own device. The
    benchmark itself keeps both CPUs: the launcher it restarts engines with needs CPU 1."""
    if not pin:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def check_pinned(agent_engine: str, engines: list[str]) -> None:
    """Raise unless the router put the agent pool on the engine `PIN_CPUS` gives a CPU of its
    own (a plan that changed would otherwise pin a normal engine alone, silently)."""
    alone = [
        url
        for i, (url, cpus) in enumerate(zip(engines, PIN_CPUS, strict=True))
        if all(set(cpus).isdisjoint(other) for j, other in enumerate(PIN_CPUS) if j != i)
    ]
    if alone != [agent_engine]:
        raise RuntimeError(
            f"--pin: the agent pool's engine is {agent_engine}, but the engine pinned to a CPU"
            f" of its own is {alone}: change PIN_CPUS to the plan"
        )


def fresh_router_state(state: Path, mode: str) -> None:
    """Remove `mode`'s router's ledger (with SQLite's side files) and state file, so its
    router starts as on a new machine, not from an earlier run's runs, homes and settings."""
    for name in (f"ledger-{mode}.sqlite", f"state-{mode}.json"):
        for path in state.glob(name + "*"):
            path.unlink()


def _static_kv_events(url: str, events: KvEventsSpec | None) -> dict[str, Any]:
    if events is None:
        raise ValueError(f"engine {url} publishes no KV events (vLLM without the flags?)")
    return {
        "url": url,
        "endpoint": events.endpoint,
        "replay_endpoint": events.replay_endpoint,
        "hash_seed": events.hash_seed,
    }


def run_order(compare: str, first: str | None, rounds: int) -> list[str]:
    """The modes in run order: `compare`'s (`first` first, then the others in their order;
    default its own order), the order reversed every other round."""
    modes = list(COMPARES[compare])
    if first is not None and first not in modes:
        raise ValueError(f"--first {first!r} is not one of --compare {compare}'s {modes}")
    if first is not None:
        modes.remove(first)
        modes.insert(0, first)
    return [m for r in range(rounds) for m in (modes if r % 2 == 0 else modes[::-1])]


class Sampler:
    """Samples each engine's KV usage, running and waiting every 0.5 s (a thread), and the
    router's blocks held for paused runs (`gpupool_kv_pause_held_blocks`, all instances)."""

    def __init__(self, urls: list[str], router: str | None = None) -> None:
        self.urls = urls
        self.router = router
        self.peak: dict[str, dict[str, float]] = {u: {} for u in urls}
        self.held_blocks: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=2) as client:
            while not self._stop.wait(0.5):
                for url in self.urls:
                    try:
                        text = client.get(f"{url}/metrics").text
                    except httpx.HTTPError:
                        continue
                    peak = self.peak[url]
                    for key, name in (
                        ("kv", "vllm:kv_cache_usage_perc"),
                        ("running", "vllm:num_requests_running"),
                        ("waiting", "vllm:num_requests_waiting"),
                    ):
                        peak[key] = max(peak.get(key, 0.0), _metric(text, name))
                if self.router is not None:
                    try:
                        text = client.get(f"{self.router}/metrics").text
                    except httpx.HTTPError:
                        continue
                    self.held_blocks.append(_metric(text, "gpupool_kv_pause_held_blocks"))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class Loop:
    """An event loop in a thread, for the launcher (its supervisor runs there)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 900) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


def _engine_counters(urls: list[str], pids: list[int | None]) -> dict[str, dict[str, float]]:
    out = {}
    for url, pid in zip(urls, pids, strict=True):
        text = httpx.get(f"{url}/metrics", timeout=5).text
        out[url] = {
            "preemptions": _metric(text, "vllm:num_preemptions_total"),
            "prefix_hits": _metric(text, "vllm:prefix_cache_hits_total"),
            "prefix_queries": _metric(text, "vllm:prefix_cache_queries_total"),
            # on 2 cores shared by 3 engines and the routers, CPU is the currency: the API
            # server and its EngineCore child (vLLM's `process_cpu_seconds_total` is the API
            # server's alone; the model's steps run in EngineCore)
            "cpu_s": tree_cpu_s(pid) if pid is not None else float("nan"),
        }
    return out


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds a process and its living descendants have used so far (0.0
    for one that is gone)."""
    total = 0.0
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        for proc in (root, *root.children(recursive=True)):
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                total += times.user + times.system
    return total


def reset_prefix_caches(urls: list[str], key: str, *, tries: int = 20, wait_s: float = 1.0) -> None:
    """Empty every engine's prefix cache (vLLM's dev-mode `POST /reset_prefix_cache`) so that no
    run finds the previous run's prompts cached. vLLM refuses while blocks are in use (the last
    run's stragglers): retried, then an error."""
    for url in urls:
        for _ in range(tries):
            resp = httpx.post(
                f"{url}/reset_prefix_cache", headers={"authorization": f"Bearer {key}"}, timeout=30
            )
            body = resp.json() if resp.content else {}
            emptied = not isinstance(body, dict) or body.get("success", True)
            if resp.status_code == 200 and emptied:
                break
            time.sleep(wait_s)
        else:
            raise RuntimeError(f"{url} did not empty its prefix cache in {tries} tries")


def _quantiles(dist: dict[str, float] | None, keys: tuple[str, ...]) -> dict[str, float | None]:
    """`keys` of a report distribution; None each where it had no values (a short run)."""
    return {k: (dist or {}).get(k) for k in keys}


def process_cpu_s(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds each process (with its descendants, if any) has used so far."""
    return {name: tree_cpu_s(pid) for name, pid in pids.items()}


def _run_one(
    mode: str,
    url: str,
    engines: list[str],
    agent_engine: str,
    out: Path,
    args: argparse.Namespace,
    routers: dict[str, int],
    engine_pids: list[int | None],
) -> dict[str, Any]:
    before = _engine_counters(engines, engine_pids)
    routers_before = process_cpu_s(routers)
    router_before = httpx.get(f"{url}/metrics", timeout=5).text
    with Sampler(engines, url) as sampler:
        harness = [sys.executable, "-m", "benchmarks", "--scenario", SCENARIO]
        harness += ["--target", url, "--target-name", mode, "--rate-scale", str(args.rate_scale)]
        if args.duration_s is not None:
            harness += ["--duration-s", str(args.duration_s)]
        with spawn_on_cpu0(args.pin):
            subprocess.run([*harness, "--no-progress", "--out", str(out)], check=True)
    after = _engine_counters(engines, engine_pids)
    routers_after = process_cpu_s(routers)
    router_after = httpx.get(f"{url}/metrics", timeout=5).text
    report = json.loads((out / "report.json").read_text())
    target = report["targets"][0]
    normal, agent = target["classes"]["normal"], target["classes"]["agent"]
    rejections = {
        k: v - _labelled(router_before, "gpupool_rejections_total").get(k, 0.0)
        for k, v in _labelled(router_after, "gpupool_rejections_total").items()
    }
    per_engine = {}
    hits = queries_all = 0.0
    for engine in engines:
        b, a = before[engine], after[engine]
        queries = a["prefix_queries"] - b["prefix_queries"]
        hits += a["prefix_hits"] - b["prefix_hits"]
        queries_all += queries
        per_engine[engine] = {
            "role": "agent" if engine == agent_engine else "normal",
            "preemptions": a["preemptions"] - b["preemptions"],
            "cpu_s": a["cpu_s"] - b["cpu_s"],
            "prefix_hit_frac": (a["prefix_hits"] - b["prefix_hits"]) / queries if queries else None,
            **{f"peak_{k}": v for k, v in sampler.peak[engine].items()},
        }
    return {
        "mode": mode,
        "chat": {
            "requests": normal["requests"],
            "ok": normal["ok"],
            "rejected_429": normal["rejected_429"],
            "slo_attainment": normal["slo_attainment_frac"],
            "ttft_ms": _quantiles(normal["ttft_ms"], ("p50", "p95", "p99")),
            "tpot_ms": _quantiles(normal["tpot_ms"], ("p50", "p95", "p99")),
        },
        "agent_steps": {
            "requests": agent["requests"],
            "ok": agent["ok"],
            "rejected_429": agent["rejected_429"],
            "slo_attainment": agent["slo_attainment_frac"],
            "ttft_ms": _quantiles(agent["ttft_ms"], ("p50", "p95", "p99")),
            "output_tokens_per_s": agent["output_tokens_per_s"],
        },
        "agent_runs": {
            "runs": target["runs"]["agent"]["runs"],
            "outcomes": target["runs"]["agent"]["outcomes"],
            "completion_s": _quantiles(
                target["runs"]["agent"]["completion_s"], ("p50", "p90", "p95")
            ),
        },
        "rejections_by_reason": rejections,
        # why queued requests waited (the first dispatch pass finding each waiting per reason)
        "admission_waits": {
            k: v - _labelled(router_before, "gpupool_admission_waits_total").get(k, 0.0)
            for k, v in _labelled(router_after, "gpupool_admission_waits_total").items()
        },
        "router_queue_wait": {
            f"{series}{k}": v
            - _labelled(router_before, f"gpupool_queue_wait_seconds_{series}").get(k, 0)
            for series in ("count", "sum")
            for k, v in _labelled(router_after, f"gpupool_queue_wait_seconds_{series}").items()
        },
        "engines": per_engine,
        # every router's CPU over the run: the one serving it and the idle ones (which still
        # follow the engines' KV events when theirs are on)
        "router_cpu_s": {k: routers_after[k] - routers_before[k] for k in routers},
        "prefix_hit_frac": hits / queries_all if queries_all else None,
        "pause_held_blocks": {
            "peak": max(sampler.held_blocks, default=0.0),
            "mean": sum(sampler.held_blocks) / len(sampler.held_blocks)
            if sampler.held_blocks
            else 0.0,
        },
        "load_avg_1m": target.get("load_avg_1m"),
    }


def _cpu_cell(result: dict[str, Any]) -> str:
    """The run's CPU seconds: the agent engine, the chat engines together, the router that
    served the run, the other routers together ('-' for a result recorded before they were)."""
    engines = result["engines"].values()
    if "router_cpu_s" not in result or any("cpu_s" not in e for e in engines):
        return "-"
    agent = sum(e["cpu_s"] for e in engines if e["role"] == "agent")
    chat = sum(e["cpu_s"] for e in engines if e["role"] != "agent")
    routers = result["router_cpu_s"]
    serving = routers.get(result["mode"], 0.0)
    idle = sum(v for k, v in routers.items() if k != result["mode"])
    return " / ".join(f"{v:.0f}" for v in (agent, chat, serving, idle))


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _markdown(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    title = {
        "admission": "admission on vs off",
        "index": "prefix-cache index on vs off",
        "hold": "prefix-cache index off, on, and on with the tool-pause hold",
        "gate": "prefix-cache index off, on, and on with the tool-pause hold against new runs",
    }
    lines = [
        f"# agent-flood on 3 CPU engines: {title[args.compare]}",
        "",
        f"Command: `python -m benchmarks.agent_flood_admission {' '.join(sys.argv[1:])}`",
        "",
        f"Workload `{SCENARIO}` at rate scale {args.rate_scale:g}; the same three engines for"
        " every router (agent pool on one engine, normal pool on two"
        + ("; restarted before every run" if args.fresh_engines else "")
        + "); runs alternate.",
        "",
        "| run | mode | chat SLO | chat TTFT p50/p95/p99 ms | chat 429 | agent steps ok/sent"
        " | agent 429 | agent step TTFT p95 ms | agent out tok/s | run p50 / p90 s | agent-engine"
        " preemptions | all preemptions | agent-engine KV peak | prefix hit | 429 reasons |"
        " agent-engine hit | agent-engine running peak | paused runs' held blocks peak / mean |"
        " CPU s: agent engine / chat engines / serving router / idle routers |",
        "|" + " --- |" * 19,
    ]
    for i, r in enumerate(results, 1):
        chat, agent, runs = r["chat"], r["agent_steps"], r["agent_runs"]["completion_s"]
        agent_engine = next(e for e in r["engines"].values() if e["role"] == "agent")
        held = r.get("pause_held_blocks", {})
        lines.append(
            f"| {i} | {r['mode']} | {_num(chat['slo_attainment'], '.1%')} | "
            f"{' / '.join(_num(v, '.0f') for v in chat['ttft_ms'].values())} | "
            f"{chat['rejected_429']} | "
            f"{agent['ok']}/{agent['requests']} | {agent['rejected_429']} | "
            f"{_num(agent['ttft_ms']['p95'], '.0f')} | "
            f"{_num(agent['output_tokens_per_s'], '.0f')} | "
            f"{_num(runs['p50'], '.1f')} / {_num(runs['p90'], '.1f')} | "
            f"{agent_engine['preemptions']:.0f} | "
            f"{sum(e['preemptions'] for e in r['engines'].values()):.0f} | "
            f"{agent_engine.get('peak_kv', 0):.0%} | {_num(r['prefix_hit_frac'], '.1%')} | "
            f"{r['rejections_by_reason'] or '-'} | "
            f"{_num(agent_engine.get('prefix_hit_frac'), '.1%')} | "
            f"{agent_engine.get('peak_running', 0):.0f} | "
            f"{' / '.join(_num(v, '.0f') for v in held.values()) or '-'} | "
            f"{_cpu_cell(r)} |"
        )
    return "\n".join(lines) + "\n"


def _main(args: argparse.Namespace) -> int:
    order = run_order(args.compare, args.first, args.rounds)
    os.environ.setdefault(KEY_ENV, "bench-" + os.urandom(8).hex())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = COMPARES[args.compare]
    state = Path(".gpupool/bench-admission").resolve()  # absolute: the routers find the sockets
    state.mkdir(parents=True, exist_ok=True)
    config = parse_config(
        {
            "model": {"name": "tiny", "path": ".gpupool/models/tiny", "max_model_len_tokens": 4096},
            "engines": {
                "launcher": "local",
                "local": {
                    "count": 3,
                    "base_port": ENGINE_BASE_PORT,
                    "kv_cache_bytes": 64 * 1024 * 1024,
                    "api_key_env": KEY_ENV,
                    "run_dir": str(state / "run"),
                    "vllm_args": ["--max-num-seqs", "64"],
                    # the agent pool's engine on its own core (checked once a router names it)
                    "cpu_affinity": [list(c) for c in PIN_CPUS] if args.pin else None,
                },
            },
            "pools": {"normal": {"classes": ["normal", "agent"], "share": {"initial_frac": 1}}},
        }
    )

    def launcher_() -> LocalLauncher:
        return LocalLauncher(  # kv_events on (its default): index-on follows them
            config.engines.local,
            config.model,
            progress=lambda m: print(f"[engines] {m}"),
            gpu_count=0,
            kv_events=True,
            environ={**os.environ, "VLLM_SERVER_DEV_MODE": "1"},  # POST /reset_prefix_cache
        )

    launcher = launcher_()
    loop = Loop()
    specs: list[InstanceSpec] = loop.run(launcher.start())
    engines = [s.url for s in specs]
    routers: dict[str, RouterProcess] = {}
    results = []
    try:
        base: dict[str, Any] = yaml.safe_load(BASELINE_CONFIG.read_text())
        for mode in modes:
            path = out / f"router-{mode}.yaml"
            path.write_text(yaml.safe_dump(router_config(mode, specs, state, base)))
        for i, mode in enumerate(order):
            round_ = i // len(modes) + 1
            print(f"round {round_}: {mode}", flush=True)
            if args.fresh_engines and i > 0:
                # engines that served a run come out of it slower for the next (s40: the
                # first run of an invocation was the fastest in 4 of 5 invocations, whatever
                # its mode, though every prefix cache is emptied between runs)
                loop.run(launcher.aclose())
                launcher = launcher_()
                if [s.url for s in loop.run(launcher.start())] != engines:
                    raise RuntimeError("restarted engines came up on other URLs")
            # each run gets a router of its own, started on empty state just before it and
            # stopped after: a router left running beside another's run learns the engines'
            # operating point from load it did not send (the first run of an invocation was
            # the fastest whatever its mode while every router ran throughout)
            fresh_router_state(state, mode)
            log_path = bulk_path(out, f"router-r{round_}-{mode}.log")
            with spawn_on_cpu0(args.pin):
                router = RouterProcess(
                    out / f"router-{mode}.yaml", log_path, port=ROUTER_PORTS[mode]
                )
            routers[mode] = router
            router.wait_ready(60)
            url = f"http://127.0.0.1:{ROUTER_PORTS[mode]}"
            view = httpx.get(f"{url}/admin/pools").json()
            (agent_id,) = view["pools"]["agent"]["instances"]
            agent_engine = view["instances"][agent_id]["url"]
            if args.pin:
                check_pinned(agent_engine, engines)
            reset_prefix_caches(engines, os.environ[KEY_ENV])  # no run starts warm from another
            result = _run_one(
                mode,
                url,
                engines,
                agent_engine,
                out / f"r{round_}-{mode}",
                args,
                {mode: router.proc.pid},
                [engine.pid for engine in launcher.engines],
            )
            router.stop(30)
            del routers[mode]
            result["round"] = round_
            results.append(result)
            print(json.dumps(result), flush=True)
            time.sleep(args.pause_s)
    finally:
        for router in routers.values():
            router.stop(30)
        loop.run(launcher.aclose())
        loop.close()
    (out / "summary.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "summary.md").write_text(_markdown(results, args))
    print((out / "summary.md").read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rate-scale", type=float, default=1.0)
    parser.add_argument("--pause-s", type=float, default=10.0)
    parser.add_argument(
        "--fresh-engines",
        action="store_true",
        help="restart the three engines before every run but the first (~40 s each), so no"
        " run inherits engines another run has used",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="pin the agent engine to CPU 1 and both normal engines, the routers and the load"
        " generator to CPU 0 (the agent engine owns its core, as a GPU engine owns its device;"
        " Linux only)",
    )
    parser.add_argument(
        "--compare",
        choices=list(COMPARES),
        default="admission",
        help="admission: admission on vs off; index: both admission on, prefix-cache index"
        " (engines.kv_events) on vs off; hold: index off, on, and on with"
        " admission.tool_pause_hold",
    )
    parser.add_argument(
        "--first", choices=list(ROUTER_PORTS), default=None, help="mode run first (of --compare's)"
    )
    parser.add_argument(
        "--duration-s",
        type=float,
        default=None,
        help="override the scenario's arrival window (smoke runs only; default: its 180 s)",
    )
    return _main(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
