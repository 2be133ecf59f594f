"""KV pressure on one engine split between the pools (issue 9, the first "Show it").

    python -m benchmarks.admission.kv_pressure --out benchmarks/results/kv-pressure-YYYY-MM-DD

One real CPU vLLM engine (tiny dev model, a KV cache that six growing agent runs overflow),
started with gpupool's local launcher from `engine-fcfs.yaml`; a second one from
`engine-priority.yaml` that differs only by `--scheduling-policy priority`. Both pools (agent
and normal, `initial_frac: 0.5` each) live on the one engine: a split instance. The same
workload (`kv-pressure.yaml`: Poisson chat and waves of K=6 growing agent runs with tools and
`x-gpupool-run-id`) goes through a fresh `gpupool serve` router per configuration:

- `chat-alone`: the chat part only (no agent runs), admission on: the chat TTFT baseline;
- `admission-off`: `router.admission: off` (every request forwarded at once);
- `admission-on`: admission with its defaults;
- `admission-on-priority`: admission on, engine with `--scheduling-policy priority` and
  `pools.normal.engine_priority: -10` (agent requests carry no priority: vLLM's default 0);
- `admission-forecast`: admission on, `admission.reserve: forecast` (issue 26: the agent pool
  may use the normal pool's idle half, less chat's forecast need);
- `admission-forecast-hold`: the same, and `admission.prefill_hold_min_tokens: auto` (a new
  agent prefill of more tokens than the engine prefills, at its measured rate, in 2.5 % of
  chat's 800 ms TTFT target waits while a chat request is in its prefill, for at most 0.5 s);
- `admission-on-hold`: a fixed prefill hold alone (512 tokens, `reserve: share`);
- `chat-alone-slice`, `admission-forecast-slice`: `chat-alone` and `admission-forecast` on an
  engine from `engine-slice.yaml`, which differs only by `admission.prefill_slice_tokens: 256`
  (vLLM's `--long-prefill-token-threshold 256`): issue 26's prefill-slice lever;
- `admission-forecast-hold-slice`: `admission-forecast-hold` on that engine (the hold keeps
  new long agent prefills from starting while chat prefills, the slice cuts running ones);
- `admission-forecast-slice-serial`: `admission-forecast-hold-slice` and
  `admission.prefill_hold_serial: true` (one long agent prefill at a time while chat is
  allocated there, so each engine step carries at most one 256-token agent slice);
- `admission-forecast-slice-serial256`: the same with the hold's threshold fixed at the slice
  (256 tokens) instead of `auto` (~580 tokens at this engine's measured rate), so agent steps
  of 256-580 uncached tokens (two slices each) are serialized and held too;
- `chat-alone-slice128`, `admission-forecast-slice128-serial`: `chat-alone` and
  `admission-forecast-slice-serial` on an engine from `engine-slice128.yaml`
  (`prefill_slice_tokens: 128`): a smaller agent slice beside each chat step, at the cost of
  slicing more chat prompts (above 128 tokens) too;
- `chat-alone-slice512`, `admission-forecast-slice512-serial`: the same on an engine from
  `engine-slice512.yaml` (`prefill_slice_tokens: 512`): with the serial hold at most one long
  agent prefill runs beside chat, so the slice's size mostly decides how many steps chat's own
  prompts take beside the agents' decodes (at 512 only those above 512 tokens take two);
- `chat-alone-chunk512`, `admission-forecast-chunk512`: `chat-alone` and `admission-forecast`
  on an engine from `engine-chunk512.yaml`, which differs only by `--max-num-batched-tokens
  512` (vLLM's step budget; 2,048 otherwise): issue 26's chunk-size lever.

Configurations run interleaved in alternating order (ABCD DCBA ABCD ...), `--rounds` times.
Before each one the engine is drained (no request running or waiting) and its prefix cache is
reset (`POST /reset_prefix_cache`, the engines run with `VLLM_SERVER_DEV_MODE=1`), so every
configuration starts from an empty cache on an engine that stays up. The router is restarted
for every configuration (fresh ledger and state). During each run the engine's and the
router's `/metrics` are sampled every 0.5 s.

Writes into `--out`: `report.md` and `report.json` (per run and per configuration, the issue's
targets checked), `harness/` (the harness's own report with one column per run) and `configs/`
(the router and engine configs used). The bulky files go to the same folders under
`benchmarks.outputs.bulk_dir(--out)` (`benchmarks/out/...` for an `--out` under
`benchmarks/results/`, not committed): `harness/` (plots and `records-<run>.jsonl`),
`samples/<run>.jsonl` (the 0.5 s samples), `metrics/<run>.prom` (the router's gpupool_*
metrics at the end of the run) and `logs/` (warnings and errors from the routers' logs).

Run it from the repository root (the configs' paths are relative to it). The script raises
its own scheduling priority (`--nice`, default -5) after the engines have started, so the
routers and the harness run ahead of the engines, which stay at the default priority pinned
to the CPU in `engines.local.cpu_affinity`.

`--api-server-cpus 0` moves each engine's API server process (its HTTP server, prompt
rendering and tokenization, detokenization and streaming) to CPU 0 after the engine starts,
and leaves its EngineCore child (the model's steps) alone on the engine's pinned CPU, as a GPU
engine's steps do not share the device with its API server: what it measures is admission's
levers on the engine's steps alone (docs/admission.md section 9).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml

from benchmarks.compare import calibrate_prompts, check_target
from benchmarks.metrics import summarize_target
from benchmarks.outputs import bulk_dir, display_path
from benchmarks.plots import write_plots
from benchmarks.records import TargetResult
from benchmarks.report import build_report, describe_machine, write_records, write_report
from benchmarks.runner import Runner, Target
from pools.config import Config, load_config
from pools.launchers.local import LocalLauncher
from pools.launchers.prefill_slice import with_prefill_slice
from pools.testing.router_process import free_port
from router.simulate.prompts import PromptMaker, find_tokenizer
from router.simulate.scenario import Scenario, load_scenario
from router.simulate.workload import Plan, build_plan

__all__ = ["CONFIGS", "RunSpec", "main"]

log = logging.getLogger("kv_pressure")

HERE = Path(__file__).resolve().parent
SAMPLE_INTERVAL_S = 0.5
ENGINE_KEY_ENV = "KVP_ENGINE_KEY"  # the routers read the engine's key from this env var
ENGINE_FILES = {
    "fcfs": HERE / "engine-fcfs.yaml",
    "priority": HERE / "engine-priority.yaml",
    "chunk512": HERE / "engine-chunk512.yaml",  # --max-num-batched-tokens 512
    # admission.prefill_slice_tokens: 256 (vLLM's --long-prefill-token-threshold 256)
    "slice": HERE / "engine-slice.yaml",
    "slice128": HERE / "engine-slice128.yaml",  # the same with prefill_slice_tokens: 128
    "slice512": HERE / "engine-slice512.yaml",  # the same with prefill_slice_tokens: 512
}
CHAT_CLASS = "normal"
# the agents' output tok/s with admission against admission off: at least this (issue 26; it
# was 0.8 for issue 9's first run)
AGENT_TOK_S_FRAC = 0.95
AGENT_CLASS = "agent"

# Pool SLOs as the scenario's class SLOs (admission's TTFT check and operating point read them).
_POOL_SLO = {
    "agent": {"ttft_p95_ms": 3000, "tpot_p95_ms": 150},
    "normal": {"ttft_p95_ms": 800, "tpot_p95_ms": 80},
}


@dataclass(frozen=True)
class RunSpec:
    """One configuration: which engine, admission on or off, the normal pool's vLLM priority,
    and whether the agent runs are sent."""

    name: str
    engine: str  # key of ENGINE_FILES
    admission: str  # on | off
    normal_engine_priority: int | None
    agents: bool
    what: str
    # the router's `admission:` section (docs/admission.md): reserve, prefill hold
    admission_section: Mapping[str, Any] = dataclasses.field(default_factory=dict)


CONFIGS: dict[str, RunSpec] = {
    s.name: s
    for s in (
        RunSpec(
            "chat-alone", "fcfs", "off", None, False, "chat only (no agent runs), admission off"
        ),
        RunSpec(
            "chat-alone-on", "fcfs", "on", None, False, "chat only (no agent runs), admission on"
        ),
        RunSpec("admission-off", "fcfs", "off", None, True, "router.admission: off"),
        RunSpec("admission-on", "fcfs", "on", None, True, "router.admission: on (defaults)"),
        RunSpec(
            "admission-on-priority",
            "priority",
            "on",
            -10,
            True,
            "admission on; engine --scheduling-policy priority, pools.normal.engine_priority -10",
        ),
        RunSpec(
            "admission-forecast",
            "fcfs",
            "on",
            None,
            True,
            "admission on, admission.reserve: forecast",
            {"reserve": "forecast"},
        ),
        RunSpec(
            "admission-forecast-hold",
            "fcfs",
            "on",
            None,
            True,
            "admission on, reserve: forecast, prefill_hold_min_tokens: auto",
            {"reserve": "forecast", "prefill_hold_min_tokens": "auto"},
        ),
        RunSpec(
            "chat-alone-chunk512",
            "chunk512",
            "off",
            None,
            False,
            "chat only (no agent runs), admission off; engine --max-num-batched-tokens 512",
        ),
        RunSpec(
            "admission-forecast-chunk512",
            "chunk512",
            "on",
            None,
            True,
            "admission on, reserve: forecast; engine --max-num-batched-tokens 512",
            {"reserve": "forecast"},
        ),
        RunSpec(
            "chat-alone-slice",
            "slice",
            "off",
            None,
            False,
            "chat only (no agent runs), admission off; engine with prefill_slice_tokens: 256",
        ),
        RunSpec(
            "admission-forecast-slice",
            "slice",
            "on",
            None,
            True,
            "admission on, reserve: forecast; engine with prefill_slice_tokens: 256"
            " (--long-prefill-token-threshold 256)",
            {"reserve": "forecast"},
        ),
        RunSpec(
            "admission-forecast-hold-slice",
            "slice",
            "on",
            None,
            True,
            "admission on, reserve: forecast, prefill_hold_min_tokens: auto; engine with"
            " prefill_slice_tokens: 256",
            {"reserve": "forecast", "prefill_hold_min_tokens": "auto"},
        ),
        RunSpec(
            "admission-forecast-slice-serial",
            "slice",
            "on",
            None,
            True,
            "admission on, reserve: forecast, prefill_hold_min_tokens: auto,"
            " prefill_hold_serial: true; engine with prefill_slice_tokens: 256",
            {
                "reserve": "forecast",
                "prefill_hold_min_tokens": "auto",
                "prefill_hold_serial": True,
            },
        ),
        RunSpec(
            "admission-forecast-slice-serial256",
            "slice",
            "on",
            None,
            True,
            "admission on, reserve: forecast, prefill_hold_min_tokens: 256 (the slice),"
            " prefill_hold_serial: true; engine with prefill_slice_tokens: 256",
            {
                "reserve": "forecast",
                "prefill_hold_min_tokens": 256,
                "prefill_hold_serial": True,
            },
        ),
        RunSpec(
            "chat-alone-slice128",
            "slice128",
            "off",
            None,
            False,
            "chat only (no agent runs), admission off; engine with prefill_slice_tokens: 128",
        ),
        RunSpec(
            "admission-forecast-slice128-serial",
            "slice128",
            "on",
            None,
            True,
            "admission on, reserve: forecast, prefill_hold_min_tokens: auto,"
            " prefill_hold_serial: true; engine with prefill_slice_tokens: 128",
            {
                "reserve": "forecast",
                "prefill_hold_min_tokens": "auto",
                "prefill_hold_serial": True,
            },
        ),
        RunSpec(
            "chat-alone-slice512",
            "slice512",
            "off",
            None,
            False,
            "chat only (no agent runs), admission off; engine with prefill_slice_tokens: 512",
        ),
        RunSpec(
            "admission-forecast-slice512-serial",
            "slice512",
            "on",
            None,
            True,
            "admission on, reserve: forecast, prefill_hold_min_tokens: auto,"
            " prefill_hold_serial: true; engine with prefill_slice_tokens: 512",
            {
                "reserve": "forecast",
                "prefill_hold_min_tokens": "auto",
                "prefill_hold_serial": True,
            },
        ),
        RunSpec(
            "admission-on-hold",
            "fcfs",
            "on",
            None,
            True,
            "admission on (reserve: share), prefill_hold_min_tokens: 512",
            {"prefill_hold_min_tokens": 512},
        ),
    )
}

# --- Prometheus text, read cheaply (the sampler shares the harness's event loop) -------------


def pin_api_server(pid: int, cpus: set[int]) -> int:
    """Move every thread of vLLM's API server process `pid` to `cpus`, leaving its child
    processes (EngineCore, which runs the model's steps) where they are; threads the server
    starts later inherit the new set from the thread that starts them. Returns the number of
    threads moved. (`sched_setaffinity` on a pid moves one thread: each is set by its id.)"""
    moved = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task.name), cpus)
            moved += 1
    return moved


def parse_prom(text: str, prefixes: Sequence[str]) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample whose name starts with one of `prefixes`."""
    out: list[tuple[str, dict[str, str], float]] = []
    for line in text.splitlines():
        if not line or line[0] == "#" or not line.startswith(tuple(prefixes)):
            continue
        head, _, value = line.rpartition(" ")
        name, brace, rest = head.partition("{")
        labels: dict[str, str] = {}
        if brace:
            for part in rest.rstrip("}").split('",'):
                key, eq, val = part.partition("=")
                if eq:
                    labels[key.strip(",")] = val.strip('"')
        try:
            out.append((name, labels, float(value)))
        except ValueError:
            continue
    return out


def metric_sum(samples: list[tuple[str, dict[str, str], float]], name: str) -> float | None:
    values = [v for n, _, v in samples if n == name]
    return float(sum(values)) if values else None


ENGINE_COUNTERS = (
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
)
ENGINE_GAUGES = (
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
)
ROUTER_GAUGES = (
    "gpupool_kv_reserved_blocks",
    "gpupool_kv_measured_blocks",
    "gpupool_kv_capacity_blocks",
    "gpupool_operating_point_limit",
    "gpupool_queue_depth",
    "gpupool_instance_running_requests",
)


async def get_text(session: aiohttp.ClientSession, url: str, timeout_s: float = 5.0) -> str | None:
    try:
        async with asyncio.timeout(timeout_s), session.get(url) as resp:
            if resp.status != 200:
                return None
            return await resp.text()
    except (TimeoutError, aiohttp.ClientError):
        return None


async def engine_counters(session: aiohttp.ClientSession, engine_url: str) -> dict[str, float]:
    text = await get_text(session, f"{engine_url}/metrics")
    if text is None:
        raise RuntimeError(f"engine {engine_url} /metrics did not answer")
    samples = parse_prom(text, ("vllm:",))
    out: dict[str, float] = {}
    for name in (*ENGINE_COUNTERS, *ENGINE_GAUGES):
        value = metric_sum(samples, name)
        if value is not None:
            out[name] = value
    for n, labels, _ in samples:
        if n == "vllm:cache_config_info":
            for key in ("num_gpu_blocks", "block_size"):
                with contextlib.suppress(KeyError, ValueError):
                    out[f"cache_config_info.{key}"] = float(labels[key])
    return out


def admin_view(text: str) -> dict[str, Any]:
    """What admission saw, from the router's GET /admin/pools: per pool its queue depth, KV
    blocks reserved and sequences running on the (one) instance; the instance's used blocks
    (the router's view), operating-point limit and source, measured prefill rate."""
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    row: dict[str, Any] = {}
    for pool, view in (data.get("pools") or {}).items():
        row[f"admin.queue_depth.{pool}"] = _g(view, "queue", "depth")
    for inst in (data.get("instances") or {}).values():
        for pool, blocks in (inst.get("kv_reserved_blocks_by_pool") or {}).items():
            row[f"admin.reserved_blocks.{pool}"] = blocks
        for pool, running in (inst.get("running_by_pool") or {}).items():
            row[f"admin.running.{pool}"] = running
        for pool, cap in (inst.get("capacity_by_pool") or {}).items():
            row[f"admin.borrowed_blocks.{pool}"] = cap.get("borrowed_blocks")
            row[f"admin.reserve_blocks.{pool}"] = _g(cap, "reserve", "blocks")
        row["admin.kv_used_blocks"] = inst.get("kv_used_blocks")
        row["admin.kv_used_blocks_by_reservations"] = inst.get("kv_used_blocks_by_reservations")
        row["admin.num_gpu_blocks"] = inst.get("num_gpu_blocks")
        row["admin.op_limit"] = _g(inst, "operating_point", "limit")
        row["admin.op_source"] = _g(inst, "operating_point", "source")
        row["admin.prefill_tokens_per_s"] = inst.get("prefill_tokens_per_s")
        break
    return row


class Sampler:
    """Scrapes the engine's and the router's /metrics every SAMPLE_INTERVAL_S."""

    def __init__(self, engine_url: str, router_url: str) -> None:
        self.engine_url = engine_url
        self.router_url = router_url
        self.samples: list[dict[str, Any]] = []
        self._task: asyncio.Task[None] | None = None

    async def _loop(self, session: aiohttp.ClientSession, t0: float) -> None:
        while True:
            tick = time.perf_counter()
            engine, router, admin = await asyncio.gather(
                get_text(session, f"{self.engine_url}/metrics", 2.0),
                get_text(session, f"{self.router_url}/metrics", 2.0),
                get_text(session, f"{self.router_url}/admin/pools", 2.0),
            )
            row: dict[str, Any] = {"t_s": round(tick - t0, 3)}
            if engine is not None:
                es = parse_prom(engine, (*ENGINE_GAUGES, "vllm:num_preemptions_total"))
                for name in (*ENGINE_GAUGES, "vllm:num_preemptions_total"):
                    row[name] = metric_sum(es, name)
            if router is not None:
                rs = parse_prom(router, ROUTER_GAUGES)
                for name, labels, value in rs:
                    key = name + "".join(f"|{k}={v}" for k, v in sorted(labels.items()))
                    row[key] = value
            if admin is not None:
                row.update(admin_view(admin))
            self.samples.append(row)
            await asyncio.sleep(max(0.0, SAMPLE_INTERVAL_S - (time.perf_counter() - tick)))

    async def start(self, session: aiohttp.ClientSession, t0: float) -> None:
        self._task = asyncio.create_task(self._loop(session, t0))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def peak(self, key_prefix: str) -> float | None:
        values = [
            float(v)
            for row in self.samples
            for k, v in row.items()
            if (k == key_prefix or k.startswith(key_prefix + "|")) and v is not None
        ]
        return max(values) if values else None

    def low(self, key_prefix: str) -> float | None:
        values = [
            float(v)
            for row in self.samples
            for k, v in row.items()
            if (k == key_prefix or k.startswith(key_prefix + "|")) and v is not None
        ]
        return min(values) if values else None


# --- the router --------------------------------------------------------------------------------


def router_config(
    spec: RunSpec, engine: Config, engine_url: str, state_dir: Path, port: int = 0
) -> dict[str, Any]:
    """The router's config for `spec` in front of `engine_url` (`port` 0: any free one; the
    caller that starts it names one)."""
    pools: dict[str, Any] = {}
    for name, classes in (("agent", [AGENT_CLASS]), ("normal", [CHAT_CLASS])):
        pool: dict[str, Any] = {
            "classes": classes,
            "share": {"initial_frac": 0.5},
            "slo": dict(_POOL_SLO[name]),
        }
        if name == "normal" and spec.normal_engine_priority is not None:
            pool["engine_priority"] = spec.normal_engine_priority
        pools[name] = pool
    model = engine.model
    extra = {"admission": dict(spec.admission_section)} if spec.admission_section else {}
    return {
        **extra,
        "model": {
            "name": model.name,
            "path": str(model.path),
            "max_model_len_tokens": model.max_model_len_tokens,
        },
        "engines": {
            "launcher": "static",
            "static": {"urls": [engine_url], "api_key_env": ENGINE_KEY_ENV},
        },
        "pools": pools,
        "router": {
            "host": "127.0.0.1",
            "port": port,
            "admission": spec.admission,
            "ledger_path": str(state_dir / "ledger.sqlite"),
            "state_path": str(state_dir / "state.json"),
        },
    }


class Router:
    """`gpupool serve --config FILE` as a child process (inherits this process's priority)."""

    def __init__(
        self, config_path: Path, log_path: Path, engine_key: str | None, port: int
    ) -> None:
        self.engine_key = engine_key
        self.config_path = config_path
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"http://127.0.0.1:{port}"

    def start(self) -> None:
        gpupool = Path(sys.executable).parent / "gpupool"
        argv = [str(gpupool)] if gpupool.exists() else [sys.executable, "-m", "router.cli"]
        with self.log_path.open("wb") as logf:
            self.proc = subprocess.Popen(
                [*argv, "serve", "--config", str(self.config_path)],
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, ENGINE_KEY_ENV: self.engine_key or ""},
            )

    async def wait_ready(self, session: aiohttp.ClientSession, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"router exited with {self.proc.returncode}; see {self.log_path}"
                )
            text = await get_text(session, f"{self.url}/metrics", 2.0)
            if text is not None:
                cap = metric_sum(
                    parse_prom(text, ("gpupool_kv_capacity_blocks",)),
                    ("gpupool_kv_capacity_blocks"),
                )
                ready = await get_text(session, f"{self.url}/ready", 2.0)
                if ready is not None and cap:
                    return
            await asyncio.sleep(0.5)
        raise RuntimeError(f"router not ready within {timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


# --- one configuration -------------------------------------------------------------------------


async def wait_engine_idle(
    session: aiohttp.ClientSession, engine_url: str, timeout_s: float = 180.0
) -> float:
    """Wait until nothing runs or waits on the engine; returns the seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        c = await engine_counters(session, engine_url)
        if (
            c.get("vllm:num_requests_running", 0) == 0
            and c.get("vllm:num_requests_waiting", 0) == 0
        ):
            return time.monotonic() - start
        await asyncio.sleep(1.0)
    raise RuntimeError(f"engine {engine_url} still busy after {timeout_s:.0f} s")


async def reset_prefix_cache(
    session: aiohttp.ClientSession, engine_url: str, engine_key: str | None
) -> bool:
    headers = {"authorization": f"Bearer {engine_key}"} if engine_key else {}
    for _ in range(20):
        try:
            async with (
                asyncio.timeout(10),
                session.post(f"{engine_url}/reset_prefix_cache", headers=headers) as resp,
            ):
                if resp.status == 200:
                    body = await resp.json(content_type=None)
                    if not isinstance(body, dict) or body.get("success", True):
                        return True
        except (TimeoutError, aiohttp.ClientError):
            pass
        await asyncio.sleep(1.0)
    return False


def histogram(
    samples: list[tuple[str, dict[str, str], float]], name: str
) -> dict[str, dict[str, Any]]:
    """Per label set (less `le`) of a Prometheus histogram: count, sum, mean and p50/p95/p99
    interpolated within the buckets."""
    groups: dict[str, dict[str, Any]] = {}
    for n, labels, value in samples:
        if not n.startswith(name):
            continue
        key = ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "le")
        g = groups.setdefault(key, {"buckets": []})
        if n == name + "_bucket":
            le = labels.get("le", "+Inf")
            g["buckets"].append((float("inf") if le == "+Inf" else float(le), value))
        elif n == name + "_count":
            g["count"] = value
        elif n == name + "_sum":
            g["sum"] = value
    out: dict[str, dict[str, Any]] = {}
    for key, g in groups.items():
        count = float(g.get("count", 0.0))
        buckets = sorted(g["buckets"])
        row: dict[str, Any] = {"count": count, "sum_s": g.get("sum")}
        row["mean_s"] = (g.get("sum", 0.0) / count) if count else None
        for q in (0.5, 0.95, 0.99):
            row[f"p{int(q * 100)}_s"] = _bucket_quantile(buckets, count, q) if count else None
        out[key] = row
    return out


def _bucket_quantile(buckets: list[tuple[float, float]], count: float, q: float) -> float | None:
    rank = q * count
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if le == float("inf"):
                return prev_le  # beyond the last finite bucket: its bound, a lower bound
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return None


def admission_view(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """From the /admin/pools samples: per-pool reservation and running peaks, how often agents
    were queued and how full the engine's KV cache was meanwhile, the prefill rate admission
    measured, the operating point's source."""

    def peak(key: str) -> float | None:
        values = [float(r[key]) for r in samples if r.get(key) is not None]
        return max(values) if values else None

    queued = [r for r in samples if (r.get("admin.queue_depth.agent") or 0) > 0]
    usage = [float(u) for r in queued if (u := r.get("vllm:kv_cache_usage_perc")) is not None]
    rates = [float(v) for r in samples if (v := r.get("admin.prefill_tokens_per_s")) is not None]
    sources = [r["admin.op_source"] for r in samples if r.get("admin.op_source")]
    return {
        "agent_reserved_blocks_peak": peak("admin.reserved_blocks.agent"),
        "normal_reserved_blocks_peak": peak("admin.reserved_blocks.normal"),
        "agent_borrowed_blocks_peak": peak("admin.borrowed_blocks.agent"),
        "normal_reserve_blocks_peak": peak("admin.reserve_blocks.normal"),
        "agent_running_peak": peak("admin.running.agent"),
        "normal_running_peak": peak("admin.running.normal"),
        "agent_queued_frac_of_samples": len(queued) / len(samples) if samples else None,
        "kv_usage_mean_while_agents_queued": float(np.mean(usage)) if usage else None,
        "prefill_tokens_per_s_median": float(np.median(rates)) if rates else None,
        "operating_point_source_end": sources[-1] if sources else None,
    }


def agent_numbers(result: TargetResult) -> dict[str, Any]:
    """Agent output tokens / wall time of the agent part (first step sent to last step done)."""
    steps = [r for r in result.requests if r.class_name == AGENT_CLASS]
    ok = [r for r in steps if r.ok]
    if not steps or not ok:
        return {"steps_sent": len(steps), "steps_ok": len(ok), "output_tokens": 0}
    start = min(r.send_s for r in steps)
    end = max(r.end_s for r in ok if r.end_s is not None)
    tokens = sum(r.output_tokens or 0 for r in ok)
    return {
        "steps_sent": len(steps),
        "steps_ok": len(ok),
        "output_tokens": tokens,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "agent_wall_s": end - start,
        "output_tokens_per_s": tokens / (end - start) if end > start else None,
    }


async def run_one(
    *,
    spec: RunSpec,
    run_name: str,
    plan: Plan,
    scenario: Scenario,
    engine_cfg: Config,
    engine_url: str,
    engine_key: str | None,
    out: Path,
    work: Path,
    session: aiohttp.ClientSession,
) -> tuple[TargetResult, dict[str, Any]]:
    """Drain the engine, reset its prefix cache, start a router, run, scrape, stop the router."""
    waited_s = await wait_engine_idle(session, engine_url)
    reset_ok = await reset_prefix_cache(session, engine_url, engine_key)
    state_dir = work / "state" / run_name
    state_dir.mkdir(parents=True, exist_ok=True)
    for stale in state_dir.iterdir():
        stale.unlink()
    port = free_port()
    cfg = router_config(spec, engine_cfg, engine_url, state_dir, port)
    cfg_path = out / "configs" / f"router-{spec.name}.yaml"
    cfg_path.write_text(
        f"# router config of {spec.name}: {spec.what}\n"
        f"# (run with: gpupool serve --config {cfg_path.name}; state paths per run)\n"
        + yaml.safe_dump(cfg, sort_keys=False)
    )
    router = Router(cfg_path, work / "logs" / f"{run_name}-router.log", engine_key, port)
    router.start()
    try:
        await router.wait_ready(session)
        await asyncio.sleep(1.5)  # one more scrape: fresh telemetry before the first request
        before = await engine_counters(session, engine_url)
        load_before = os.getloadavg()[0]
        sampler = Sampler(engine_url, router.url)
        t0 = time.perf_counter()
        await sampler.start(session, t0)
        target = Target(run_name, router.url, scenario.model)
        the_plan = plan if spec.agents else dataclasses.replace(plan, runs=())
        stamp = int(time.time())
        result = await Runner(
            the_plan, target, run_id_prefix=f"kvp-{run_name}-{stamp}", progress=False
        ).run()
        await asyncio.sleep(1.0)
        await sampler.stop()
        after = await engine_counters(session, engine_url)
        router_text = await get_text(session, f"{router.url}/metrics") or ""
    finally:
        router.stop()
    load_after = os.getloadavg()[0]
    gp = [
        line
        for line in router_text.splitlines()
        if line.startswith("gpupool_") or line.startswith("# TYPE gpupool_")
    ]
    bulk = bulk_dir(out)
    (bulk / "metrics" / f"{run_name}.prom").write_text("\n".join(gp) + "\n")
    with (bulk / "samples" / f"{run_name}.jsonl").open("w") as f:
        for row in sampler.samples:
            f.write(json.dumps(row) + "\n")
    log_lines = [
        line
        for line in router.log_path.read_text(errors="replace").splitlines()
        if " WARNING " in line or " ERROR " in line or "Traceback" in line
    ]
    (bulk / "logs" / f"{run_name}-router-warnings.log").write_text(
        "\n".join(log_lines) + ("\n" if log_lines else "")
    )
    rs = parse_prom(router_text, ("gpupool_",))
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ENGINE_COUNTERS}
    queries = delta["vllm:prefix_cache_queries_total"]
    summary = summarize_target(result, scenario)
    chat = summary["classes"].get(CHAT_CLASS, {})
    runs = summary["runs"].get(AGENT_CLASS, {})
    rejections_by_reason = {
        f"{labels.get('pool')}/{labels.get('reason')}": v
        for n, labels, v in rs
        if n == "gpupool_rejections_total" and v
    }
    numbers: dict[str, Any] = {
        "run": run_name,
        "config": spec.name,
        "engine": spec.engine,
        "engine_url": engine_url,
        "engine_drain_wait_s": waited_s,
        "prefix_cache_reset": reset_ok,
        "engine_before": before,
        "engine_after": after,
        "preemptions": delta["vllm:num_preemptions_total"],
        "prefix_cache_hits": delta["vllm:prefix_cache_hits_total"],
        "prefix_cache_queries": queries,
        "prefix_cache_hit_rate": (delta["vllm:prefix_cache_hits_total"] / queries)
        if queries
        else None,
        "engine_prompt_tokens": delta["vllm:prompt_tokens_total"],
        "engine_generation_tokens": delta["vllm:generation_tokens_total"],
        "kv_usage_peak_frac": sampler.peak("vllm:kv_cache_usage_perc"),
        "engine_running_peak": sampler.peak("vllm:num_requests_running"),
        "engine_waiting_peak": sampler.peak("vllm:num_requests_waiting"),
        "samples": len(sampler.samples),
        "wall_s": result.wall_s,
        "chat": {
            "requests": chat.get("requests"),
            "ok": chat.get("ok"),
            "ttft_ms": chat.get("ttft_ms"),
            "tpot_ms": chat.get("tpot_ms"),
            "e2e_ms": chat.get("e2e_ms"),
            "slo_attainment_frac": chat.get("slo_attainment_frac"),
            "slo_attainment_by_metric": chat.get("slo_attainment_by_metric"),
            "rejections": chat.get("rejections"),
        },
        "agent": {
            **agent_numbers(result),
            "runs": runs.get("runs"),
            "outcomes": runs.get("outcomes"),
            "completion_s": runs.get("completion_s"),
            "ttft_ms": summary["classes"].get(AGENT_CLASS, {}).get("ttft_ms"),
            "rejections": summary["classes"].get(AGENT_CLASS, {}).get("rejections"),
            "gpu_seconds": runs.get("gpu_seconds"),
        },
        "http_failures": summary["rejections"],
        "http_429_by_code": {
            k.split(" ", 1)[1]: v for k, v in summary["rejections"].items() if k.startswith("429 ")
        },
        "router": {
            "rejections_total": rejections_by_reason,
            "queue_wait_seconds": histogram(rs, "gpupool_queue_wait_seconds"),
            "prefill_hold_seconds": histogram(rs, "gpupool_prefill_hold_seconds"),
            "kv_reserved_blocks_peak": sampler.peak("gpupool_kv_reserved_blocks"),
            "kv_reserved_blocks_end": metric_sum(rs, "gpupool_kv_reserved_blocks"),
            "kv_measured_blocks_peak": sampler.peak("gpupool_kv_measured_blocks"),
            "kv_capacity_blocks": metric_sum(rs, "gpupool_kv_capacity_blocks"),
            "operating_point_limit_min": sampler.low("gpupool_operating_point_limit"),
            "operating_point_limit_max": sampler.peak("gpupool_operating_point_limit"),
            "operating_point_limit_end": metric_sum(rs, "gpupool_operating_point_limit"),
            "queue_depth_peak": {
                pool: sampler.peak(f"gpupool_queue_depth|pool={pool}")
                for pool in ("agent", "normal")
            },
            "instance_preemptions_end": metric_sum(rs, "gpupool_instance_preemptions_total"),
            "router_log_warnings": len(log_lines),
            **admission_view(sampler.samples),
        },
        "harness": {
            "max_send_lag_ms": result.max_send_lag_ms,
            "send_lag_ms": summary.get("send_lag_ms"),
            "cancelled_at_drain": result.cancelled_at_drain,
        },
        "load_avg_1m": {"before": load_before, "after": load_after},
    }
    summary["load_avg_1m"] = {"before": load_before, "after": load_after}
    numbers["harness_summary"] = summary
    return result, numbers


# --- the report ----------------------------------------------------------------------------------


def _g(d: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


METRICS: list[tuple[str, tuple[str, ...], str]] = [
    ("engine preemptions (Δ num_preemptions_total)", ("preemptions",), "int"),
    ("prefix-cache hit rate (Δ hits / Δ queries)", ("prefix_cache_hit_rate",), "pct"),
    ("KV usage peak (0.5 s samples)", ("kv_usage_peak_frac",), "pct"),
    ("engine running / waiting peak", ("engine_running_peak",), "int"),
    ("chat TTFT p50 (ms)", ("chat", "ttft_ms", "p50"), "ms"),
    ("chat TTFT p95 (ms)", ("chat", "ttft_ms", "p95"), "ms"),
    ("chat TTFT p99 (ms)", ("chat", "ttft_ms", "p99"), "ms"),
    ("chat TPOT p95 (ms)", ("chat", "tpot_ms", "p95"), "ms"),
    ("chat SLO attainment", ("chat", "slo_attainment_frac"), "pct"),
    ("agent output tok/s (agent part)", ("agent", "output_tokens_per_s"), "f1"),
    ("agent part wall (s)", ("agent", "agent_wall_s"), "f1"),
    ("agent output tokens", ("agent", "output_tokens"), "int"),
    ("agent steps ok / sent", ("agent", "steps_ok"), "int"),
    ("agent run completion p50 (s)", ("agent", "completion_s", "p50"), "f1"),
    ("agent step TTFT p95 (ms)", ("agent", "ttft_ms", "p95"), "ms"),
    ("router KV reserved blocks peak", ("router", "kv_reserved_blocks_peak"), "int"),
    ("agent pool reserved blocks peak", ("router", "agent_reserved_blocks_peak"), "int"),
    ("normal pool reserved blocks peak", ("router", "normal_reserved_blocks_peak"), "int"),
    ("agent blocks borrowed peak", ("router", "agent_borrowed_blocks_peak"), "int"),
    ("normal pool forecast reserve peak", ("router", "normal_reserve_blocks_peak"), "int"),
    ("time with agents queued (0.5 s samples)", ("router", "agent_queued_frac_of_samples"), "pct"),
    (
        "engine KV usage while agents queued (mean)",
        ("router", "kv_usage_mean_while_agents_queued"),
        "pct",
    ),
    ("prefill tok/s admission measured (median)", ("router", "prefill_tokens_per_s_median"), "int"),
    ("router operating-point limit min–max", ("router", "operating_point_limit_min"), "int"),
]


def _fmt(value: Any, kind: str) -> str:
    if value is None:
        return "–"
    if kind == "pct":
        return f"{100 * float(value):.1f} %"
    if kind == "int":
        return f"{float(value):.0f}"
    if kind == "ms":
        return f"{float(value):,.0f}" if float(value) >= 100 else f"{float(value):.1f}"
    return f"{float(value):.1f}"


def _cell(run: dict[str, Any], label: str, path: tuple[str, ...], kind: str) -> str:
    value = _g(run, *path)
    if label.startswith("engine running / waiting"):
        return f"{_fmt(value, kind)} / {_fmt(run.get('engine_waiting_peak'), kind)}"
    if label.startswith("agent steps ok / sent"):
        return f"{_fmt(value, kind)} / {_fmt(_g(run, 'agent', 'steps_sent'), kind)}"
    if label.startswith("router operating-point limit"):
        hi = _g(run, "router", "operating_point_limit_max")
        return f"{_fmt(value, kind)}–{_fmt(hi, kind)}"
    return _fmt(value, kind)


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def aggregate(runs: list[dict[str, Any]], configs: list[str]) -> dict[str, Any]:
    """Per configuration: each metric's values over the rounds, mean, min and max."""
    out: dict[str, Any] = {}
    for config in configs:
        rows = [r for r in runs if r["config"] == config]
        agg: dict[str, Any] = {"rounds": len(rows)}
        for label, path, _kind in METRICS:
            values = [float(v) for r in rows if (v := _g(r, *path)) is not None]
            agg[label] = {
                "values": values,
                "mean": _mean(values),
                "min": min(values) if values else None,
                "max": max(values) if values else None,
            }
        out[config] = agg
    return out


def check_targets(runs: list[dict[str, Any]], rounds: int) -> list[dict[str, Any]]:
    """The issue's targets, per round and on the means over rounds, for each admission config."""
    checks: list[dict[str, Any]] = []

    def get(config: str, rnd: int, *path: str) -> float | None:
        for r in runs:
            if r["config"] == config and r["round"] == rnd:
                v = _g(r, *path)
                return None if v is None else float(v)
        return None

    admitting = [c for c in CONFIGS if c.startswith("admission-") and c != "admission-off"]
    for config in admitting:
        if not any(r["config"] == config for r in runs):
            continue
        for rnd in [*range(1, rounds + 1), 0]:
            rnds = list(range(1, rounds + 1)) if rnd == 0 else [rnd]

            def mean(cfg: str, *path: str, _rnds: list[int] = rnds) -> float | None:
                vals = [v for k in _rnds if (v := get(cfg, k, *path)) is not None]
                return float(np.mean(vals)) if vals else None

            pre = mean(config, "preemptions")
            p99 = mean(config, "chat", "ttft_ms", "p99")
            base = mean("chat-alone", "chat", "ttft_ms", "p99")
            base_on = mean("chat-alone-on", "chat", "ttft_ms", "p99")
            tok = mean(config, "agent", "output_tokens_per_s")
            off = mean("admission-off", "agent", "output_tokens_per_s")
            where = "mean of rounds" if rnd == 0 else f"round {rnd}"
            checks.append(
                {
                    "config": config,
                    "where": where,
                    "zero_preemptions": {
                        "value": pre,
                        "met": pre == 0 if pre is not None else None,
                    },
                    "chat_ttft_p99_ratio_to_chat_alone": {
                        "value": (p99 / base) if p99 is not None and base else None,
                        "limit": 1.5,
                        "met": (p99 <= 1.5 * base) if p99 is not None and base else None,
                    },
                    "chat_ttft_p99_ratio_to_chat_alone_on": {
                        "value": (p99 / base_on) if p99 is not None and base_on else None,
                        "limit": 1.5,
                        "met": (p99 <= 1.5 * base_on) if p99 is not None and base_on else None,
                    },
                    "agent_tok_s_ratio_to_admission_off": {
                        "value": (tok / off) if tok is not None and off else None,
                        "limit": AGENT_TOK_S_FRAC,
                        "met": (tok >= AGENT_TOK_S_FRAC * off) if tok is not None and off else None,
                    },
                }
            )
    return checks


def render(report: dict[str, Any]) -> str:
    runs: list[dict[str, Any]] = report["runs"]
    configs: list[str] = report["configs"]
    lines = [
        "# KV pressure, one engine split between the pools",
        "",
        f"Run {report['created_at']}, {report['rounds']} round(s) of {', '.join(configs)}"
        " (interleaved, in that order in odd rounds and reversed in even ones). The write-up"
        " with setup and reading is README.md;"
        " this file is generated by `benchmarks/admission/kv_pressure.py`.",
        "",
        f"- command: `{report['command']}`",
        f"- machine: {report['machine'].get('cpu_model')}, {report['machine'].get('cpu_cores')}"
        f" cores, {report['machine'].get('memory_gib')} GiB; {report['machine'].get('os')}",
        f"- engine KV cache: {report['engine']['num_gpu_blocks']} blocks of"
        f" {report['engine']['block_size']} tokens"
        f" ({report['engine']['kv_cache_bytes']} bytes); git {report['git']}",
        "",
        "## Per configuration (mean over rounds; min–max in brackets)",
        "",
    ]
    agg = report["aggregate"]
    header = ["metric", *configs]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for label, _path, kind in METRICS:
        if label.startswith(("engine running", "agent steps ok", "router operating")):
            continue
        row = [label]
        for config in configs:
            a = agg[config][label]
            if a["mean"] is None:
                row.append("–")
            elif len(a["values"]) > 1:
                row.append(
                    f"{_fmt(a['mean'], kind)} [{_fmt(a['min'], kind)}–{_fmt(a['max'], kind)}]"
                )
            else:
                row.append(_fmt(a["mean"], kind))
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "## Per run", ""]
    header = ["metric", *[r["run"] for r in runs]]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for label, path, kind in METRICS:
        lines.append(
            "| " + " | ".join([label, *[_cell(r, label, path, kind) for r in runs]]) + " |"
        )
    extra: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("429s by code (harness)", lambda r: _dict_cell(r.get("http_429_by_code"))),
        (
            "other failures (harness)",
            lambda r: _dict_cell(
                {
                    k: v
                    for k, v in (r.get("http_failures") or {}).items()
                    if not k.startswith("429 ")
                }
            ),
        ),
        (
            "gpupool_rejections_total (pool/reason)",
            lambda r: _dict_cell(_g(r, "router", "rejections_total")),
        ),
        ("gpupool_queue_wait_seconds count / mean / p95 (pool, class)", _queue_cell),
        ("gpupool_prefill_hold_seconds count / mean / p95 (pool)", _hold_cell),
        (
            "router queue depth peak agent / normal",
            lambda r: "{} / {}".format(
                _fmt(_g(r, "router", "queue_depth_peak", "agent"), "int"),
                _fmt(_g(r, "router", "queue_depth_peak", "normal"), "int"),
            ),
        ),
        ("agent run outcomes", lambda r: _dict_cell(_g(r, "agent", "outcomes"))),
        (
            "load avg 1 min before / after",
            lambda r: "{:.1f} / {:.1f}".format(
                r["load_avg_1m"]["before"], r["load_avg_1m"]["after"]
            ),
        ),
        ("harness send lag max (ms)", lambda r: _fmt(_g(r, "harness", "max_send_lag_ms"), "ms")),
    ]
    for label, fn in extra:
        lines.append("| " + " | ".join([label, *[fn(r) for r in runs]]) + " |")
    lines += ["", "## The issue's targets", ""]
    lines.append(
        "| config | where | zero preemptions | chat TTFT p99 ≤ 1.5× chat alone (admission off) |"
        f" (vs chat alone, admission on) | agent tok/s ≥ {AGENT_TOK_S_FRAC}× admission off |"
    )
    lines.append("|---|---|---|---|---|---|")
    for c in report["targets"]:

        def cell(d: dict[str, Any], ratio: bool) -> str:
            if d["value"] is None:
                return "–"
            mark = "met" if d["met"] else "**missed**"
            val = f"{d['value']:.2f}×" if ratio else f"{d['value']:.0f}"
            return f"{mark} ({val})"

        lines.append(
            f"| {c['config']} | {c['where']} | {cell(c['zero_preemptions'], False)} | "
            f"{cell(c['chat_ttft_p99_ratio_to_chat_alone'], True)} | "
            f"{cell(c['chat_ttft_p99_ratio_to_chat_alone_on'], True)} | "
            f"{cell(c['agent_tok_s_ratio_to_admission_off'], True)} |"
        )
    lines.append("")
    return "\n".join(lines)


def _dict_cell(d: Any) -> str:
    if not d:
        return "none"
    return ", ".join(f"{k}: {v:.0f}" if isinstance(v, float) else f"{k}: {v}" for k, v in d.items())


def _queue_cell(r: dict[str, Any]) -> str:
    return _histogram_cell(r, "queue_wait_seconds")


def _hold_cell(r: dict[str, Any]) -> str:
    return _histogram_cell(r, "prefill_hold_seconds")


def _histogram_cell(r: dict[str, Any], key: str) -> str:
    q = _g(r, "router", key) or {}
    parts = []
    for key, row in sorted(q.items()):
        if not row.get("count"):
            continue
        mean = row.get("mean_s")
        p95 = row.get("p95_s")
        mean_s = "–" if mean is None else f"{mean:.2f} s"
        p95_s = "–" if p95 is None else f"{p95:.2f} s"
        name = key.replace("class=", "").replace("pool=", "")
        parts.append(f"{name}: {row['count']:.0f} / {mean_s} / {p95_s}")
    return "; ".join(parts) or "none"


# --- main ----------------------------------------------------------------------------------------


def _git_head() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "router", "pools"],
            capture_output=True,
            text=True,
            check=False,
        )
        return out.stdout.strip() + (" (router/pools modified)" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


async def amain(args: argparse.Namespace) -> int:
    out = Path(args.out)
    work = Path(args.work_dir)
    for sub in ("configs", "harness"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    for sub in ("samples", "metrics", "logs", "harness"):
        (bulk_dir(out) / sub).mkdir(parents=True, exist_ok=True)
    for sub in ("logs", "state"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        print(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    scenario = load_scenario(args.scenario)
    if args.duration_s is not None:
        scenario = dataclasses.replace(scenario, duration_s=args.duration_s)

    # Engines: gpupool's local launcher, one per engine config needed, at default priority.
    engines: dict[str, tuple[Config, LocalLauncher, str, str | None]] = {}
    needed = sorted({CONFIGS[c].engine for c in configs})
    try:
        for key in needed:
            cfg = load_config(ENGINE_FILES[key])
            # a free port, not the file's: nothing else on the machine may hold it
            local = dataclasses.replace(cfg.engines.local, base_port=free_port())
            if args.kv_cache_bytes:
                local = dataclasses.replace(local, kv_cache_bytes=args.kv_cache_bytes)
            if args.engine_args:
                extra = tuple(args.engine_args.split())
                local = dataclasses.replace(local, vllm_args=(*local.vllm_args, *extra))
            cfg = dataclasses.replace(cfg, engines=dataclasses.replace(cfg.engines, local=local))
            # admission.prefill_slice_tokens, as gpupool's launchers apply it (make_launcher)
            slice_tokens = cfg.admission.prefill_slice_tokens
            local = dataclasses.replace(
                local, vllm_args=with_prefill_slice(local.vllm_args, slice_tokens)
            )
            launcher = LocalLauncher(local, cfg.model, progress=lambda m: log.info("%s", m))
            specs = await launcher.start()
            if args.api_server_cpus:
                for engine in launcher.engines:
                    if engine.pid is not None:
                        moved = pin_api_server(engine.pid, args.api_server_cpus)
                        log.info(
                            "engine %s: API server threads %s on CPUs %s",
                            key,
                            moved,
                            sorted(args.api_server_cpus),
                        )
            engines[key] = (cfg, launcher, specs[0].url, specs[0].api_key)
            (out / "configs" / ENGINE_FILES[key].name).write_text(ENGINE_FILES[key].read_text())
        if args.nice:
            with contextlib.suppress(OSError):
                os.nice(args.nice)  # the routers (children from now on) and the harness
        log.info("engines up: %s", {k: v[2] for k, v in engines.items()})

        async with aiohttp.ClientSession() as session:
            _, _, first_url, first_key = engines[needed[0]]
            info = await engine_counters(session, first_url)
            direct = Target("engine", first_url, scenario.model, first_key)
            problem = await check_target(session, direct)
            if problem:
                raise RuntimeError(f"engine: {problem}")
            tokenizer = find_tokenizer(scenario.model, scenario.tokenizer_path)
            prompts = PromptMaker(tokenizer)
            await calibrate_prompts(session, direct, prompts)
            plan = build_plan(scenario, prompts, args.seed)
            log.info(
                "plan: %d chat requests, %d agent runs (%d steps at most) over %.0f s",
                len(plan.chat),
                len(plan.runs),
                plan.total_requests - len(plan.chat),
                scenario.duration_s,
            )
            results: list[TargetResult] = []
            numbers: list[dict[str, Any]] = []
            for rnd in range(1, args.rounds + 1):
                # alternating order (ABC CBA ABC ...): no configuration always runs first
                for config in configs if rnd % 2 else configs[::-1]:
                    spec = CONFIGS[config]
                    engine_cfg, _launcher, url, engine_key = engines[spec.engine]
                    name = f"r{rnd}-{config}"
                    log.info("%s: starting (%s)", name, spec.what)
                    result, nums = await run_one(
                        spec=spec,
                        run_name=name,
                        plan=plan,
                        scenario=scenario,
                        engine_cfg=engine_cfg,
                        engine_url=url,
                        engine_key=engine_key,
                        out=out,
                        work=work,
                        session=session,
                    )
                    nums["round"] = rnd
                    results.append(result)
                    numbers.append(nums)
                    write_records(out / "harness", result)
                    log.info(
                        "%s: preemptions %.0f, hit rate %s, KV peak %s, chat TTFT p99 %s ms,"
                        " agent %s tok/s, 429s %s",
                        name,
                        nums["preemptions"],
                        _fmt(nums["prefix_cache_hit_rate"], "pct"),
                        _fmt(nums["kv_usage_peak_frac"], "pct"),
                        _fmt(_g(nums, "chat", "ttft_ms", "p99"), "ms"),
                        _fmt(_g(nums, "agent", "output_tokens_per_s"), "f1"),
                        nums["http_429_by_code"] or "none",
                    )
                    _write(out, args, configs, numbers, info, scenario, plan, partial=True)
                    await asyncio.sleep(args.pause_s)
    finally:
        for _cfg, launcher, _url, _key in engines.values():
            await launcher.aclose()

    # The harness's own report over every run (one column per run) and its plots.
    created = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    harness = build_report(
        scenario,
        [n["harness_summary"] for n in numbers],
        seed=args.seed if args.seed is not None else scenario.seed,
        machine=describe_machine(),
        created_at=created,
        notes="kv_pressure runs; the configurations are described in ../report.md",
    )
    harness["plots"] = write_plots(out / "harness", scenario, results)
    harness["plots_dir"] = display_path(bulk_dir(out / "harness"))
    write_report(out / "harness", harness)
    _write(out, args, configs, numbers, info, scenario, plan, partial=False)
    print(f"report: {out / 'report.md'} ({out / 'report.json'})")
    return 0


def _write(
    out: Path,
    args: argparse.Namespace,
    configs: list[str],
    numbers: list[dict[str, Any]],
    info: dict[str, float],
    scenario: Scenario,
    plan: Plan,
    *,
    partial: bool,
) -> None:
    kv_bytes = args.kv_cache_bytes or load_config(ENGINE_FILES["fcfs"]).engines.local.kv_cache_bytes
    report: dict[str, Any] = {
        "created_at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "partial": partial,
        "command": " ".join(["python -m benchmarks.admission.kv_pressure", *sys.argv[1:]]),
        "git": _git_head(),
        "git_modified_at_start": args.git_modified,
        "machine": describe_machine(),
        "rounds": args.rounds,
        "configs": configs,
        "config_descriptions": {c: CONFIGS[c].what for c in configs},
        "engine": {
            "kv_cache_bytes": kv_bytes,
            "num_gpu_blocks": info.get("cache_config_info.num_gpu_blocks"),
            "block_size": info.get("cache_config_info.block_size"),
            "extra_vllm_args": args.engine_args,
            "api_server_cpus": sorted(args.api_server_cpus or ()),
        },
        "scenario": {
            "source": scenario.source,
            "seed": args.seed if args.seed is not None else scenario.seed,
            "duration_s": scenario.duration_s,
            "chat_requests": len(plan.chat),
            "agent_runs": len(plan.runs),
            "agent_steps_planned": plan.total_requests - len(plan.chat),
            "definition": scenario.raw,
        },
        "runs": [{k: v for k, v in n.items() if k != "harness_summary"} for n in numbers],
        "aggregate": aggregate(numbers, configs),
        "targets": check_targets(numbers, max((n["round"] for n in numbers), default=0)),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2, default=float) + "\n")
    (out / "report.md").write_text(render(report))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.admission.kv_pressure", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", required=True, help="results folder")
    p.add_argument("--scenario", default=str(HERE / "kv-pressure.yaml"))
    p.add_argument("--rounds", type=int, default=2, help="repeat the set of configs (default 2)")
    p.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated, run in this order each round (default {','.join(CONFIGS)})",
    )
    p.add_argument("--seed", type=int, default=None, help="override the scenario's seed")
    p.add_argument("--duration-s", type=float, default=None, help="override the arrival window")
    p.add_argument(
        "--kv-cache-bytes", type=int, default=None, help="override the engines' KV cache size"
    )
    p.add_argument(
        "--engine-args",
        default="",
        help="extra vLLM arguments for every engine, e.g. '--max-num-batched-tokens 512'",
    )
    p.add_argument("--pause-s", type=float, default=3.0, help="pause after each run")
    p.add_argument(
        "--api-server-cpus",
        type=lambda v: {int(c) for c in v.split(",")},
        default=None,
        help="move each engine's API server process to these CPUs (e.g. 0), leaving its"
        " EngineCore on the engine's pinned CPU (Linux)",
    )
    p.add_argument(
        "--nice", type=int, default=-5, help="niceness increment for routers and harness (0: none)"
    )
    p.add_argument(
        "--work-dir",
        default=".gpupool/bench-kv-pressure",
        help="router logs, ledgers and state (not results)",
    )
    args = p.parse_args(argv)
    # the routers run the working tree: note which product files differ from HEAD right now
    status = subprocess.run(
        ["git", "status", "--porcelain", "--", "router", "pools", "kvcache_model", "gpu_probe"],
        capture_output=True,
        text=True,
        check=False,
    )
    args.git_modified = [line[3:] for line in status.stdout.splitlines() if line.strip()]
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
