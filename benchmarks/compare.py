"""Compare mode: one scenario, one seed, several targets in turn, one report.

`run_compare` checks every target answers `GET /v1/models`, sizes prompts (the model's
tokenizer when one is found, else tokens per word; the chat template's tokens per message
either way, both calibrated once from the first target's `usage.prompt_tokens`), draws the
plan once, runs it against each target with a pause between, and writes `report.json` and
`report.md` into `out_dir`, the plots and the per-target records into
`benchmarks.outputs.bulk_dir(out_dir)` (`benchmarks/out/...` for a folder under
`benchmarks/results/`, so they are not committed).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from benchmarks.metrics import summarize_target
from benchmarks.outputs import bulk_dir, display_path
from benchmarks.plots import write_plots
from benchmarks.records import TargetResult
from benchmarks.report import (
    build_report,
    describe_machine,
    safe_name,
    write_records,
    write_report,
)
from benchmarks.runner import Runner, Target
from router.simulate.prompts import VOCABULARY, PromptMaker
from router.simulate.scenario import Scenario
from router.simulate.workload import build_plan

__all__ = ["BenchError", "calibrate_prompts", "check_target", "run_compare"]

log = logging.getLogger(__name__)

_CHECK_TIMEOUT_S = 15.0


class BenchError(Exception):
    """The benchmark cannot run (a target is unreachable, a calibration failed)."""


async def check_target(session: aiohttp.ClientSession, target: Target) -> str | None:
    """None when the target lists models; otherwise a one-line problem."""
    try:
        async with (
            asyncio.timeout(_CHECK_TIMEOUT_S),
            session.get(f"{target.base_url}/v1/models", headers=target.request_headers()) as resp,
        ):
            if resp.status != 200:
                return f"GET /v1/models answered {resp.status}"
            data = orjson.loads(await resp.read())
    except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError) as err:
        return f"GET /v1/models failed: {type(err).__name__}: {err}"
    models = [m.get("id") for m in data.get("data", []) if isinstance(m, dict)]
    if models and target.model not in models:
        return f"model {target.model!r} not served (it serves {', '.join(map(str, models))})"
    return None


async def _prompt_tokens_of(session: aiohttp.ClientSession, target: Target, text: str) -> int:
    body = {
        "model": target.model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 1,
    }
    async with (
        asyncio.timeout(60),
        session.post(
            target.chat_url, data=orjson.dumps(body), headers=target.request_headers()
        ) as resp,
    ):
        if resp.status != 200:
            raise BenchError(f"{target.name}: calibration request answered {resp.status}")
        data = orjson.loads(await resp.read())
    return int(data["usage"]["prompt_tokens"])


async def calibrate_prompts(
    session: aiohttp.ClientSession, target: Target, prompts: PromptMaker
) -> None:
    """Measure the chat template's tokens per message (and, without a tokenizer, tokens per
    word) from two one-message prompts' `usage.prompt_tokens`, and set them on `prompts`."""
    short = " ".join(VOCABULARY[(i * 7919) % len(VOCABULARY)] for i in range(100))
    long = " ".join(VOCABULARY[(i * 104729) % len(VOCABULARY)] for i in range(300))
    t_short = await _prompt_tokens_of(session, target, short)
    if prompts.exact:
        overhead = t_short - prompts.count_tokens(short)
    else:
        t_long = await _prompt_tokens_of(session, target, long)
        prompts.tokens_per_word = max(0.1, (t_long - t_short) / 200.0)
        overhead = round(t_short - 100 * prompts.tokens_per_word)
    prompts.message_overhead_tokens = max(0, overhead - 1)  # the BOS is counted once


async def _prepare(targets: Sequence[Target], tokenizer_path: str | None) -> PromptMaker:
    async with aiohttp.ClientSession() as session:
        problems = [(t, p) for t in targets if (p := await check_target(session, t))]
        if problems:
            raise BenchError("; ".join(f"{t.name} ({t.url}): {p}" for t, p in problems))
        prompts = (
            await asyncio.to_thread(PromptMaker, tokenizer_path)
            if tokenizer_path
            else PromptMaker(None)
        )
        await calibrate_prompts(session, targets[0], prompts)
        log.info(
            "prompt sizing against %s: %s, %d template tokens per message",
            targets[0].name,
            f"tokenizer {tokenizer_path}"
            if tokenizer_path
            else f"{prompts.tokens_per_word:.3f} tokens/word",
            prompts.message_overhead_tokens,
        )
        return prompts


async def run_compare(
    scenario: Scenario,
    targets: Sequence[Target],
    out_dir: Path,
    *,
    seed: int | None = None,
    tokenizer_path: str | None = None,
    progress: bool = True,
    pause_s: float = 0.0,
    wall_clock: Callable[[], float] = time.time,
    notes: str = "",
    together: bool = False,
) -> dict[str, Any]:
    """Run `scenario` against each target in turn (`together`: against all of them at once,
    each arrival sent to every target at the same moment; `pause_s` unused); write and return
    the report."""
    if not targets:
        raise BenchError("no targets")
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        raise BenchError(f"target names must be unique: {names}")
    seed = scenario.seed if seed is None else seed
    prompts = await _prepare(targets, tokenizer_path)
    plan = await asyncio.to_thread(build_plan, scenario, prompts, seed)
    log.info(
        "plan: %d chat requests, %d agent runs (%d steps at most), over %.0f s",
        len(plan.chat),
        len(plan.runs),
        plan.total_requests - len(plan.chat),
        scenario.duration_s,
    )
    await asyncio.to_thread(out_dir.mkdir, parents=True, exist_ok=True)
    stamp = int(wall_clock())

    async def run_one(target: Target) -> tuple[TargetResult, dict[str, Any]]:
        prefix = f"bench-{safe_name(scenario.name)}-{seed}-{safe_name(target.name)}-{stamp}"
        load_before = os.getloadavg()[0]
        result = await Runner(plan, target, run_id_prefix=prefix, progress=progress).run()
        await asyncio.to_thread(write_records, out_dir, result)
        summary = summarize_target(result, scenario)
        summary["load_avg_1m"] = {"before": load_before, "after": os.getloadavg()[0]}
        return result, summary

    done: list[tuple[TargetResult, dict[str, Any]]] = []
    if together:
        done = list(await asyncio.gather(*(run_one(t) for t in targets)))
    else:
        for i, target in enumerate(targets):
            if i and pause_s > 0:
                await asyncio.sleep(pause_s)
            done.append(await run_one(target))
    results = [result for result, _ in done]
    summaries = [summary for _, summary in done]
    for target, summary in zip(targets, summaries, strict=True):
        log.info(
            "%s: %d requests, goodput %.2f req/s, SLO attainment %s",
            target.name,
            summary["requests"],
            summary["goodput_rps"],
            "–"
            if summary["slo_attainment_frac"] is None
            else f"{100 * summary['slo_attainment_frac']:.1f} %",
        )
    created = datetime.fromtimestamp(wall_clock(), UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    report = build_report(
        scenario, summaries, seed=seed, machine=describe_machine(), created_at=created, notes=notes
    )
    report["plots"] = await asyncio.to_thread(write_plots, out_dir, scenario, results)
    report["plots_dir"] = display_path(bulk_dir(out_dir))
    report["prompt_sizing"] = {
        "tokenizer": tokenizer_path,
        "tokens_per_word": prompts.tokens_per_word,
        "message_overhead_tokens": prompts.message_overhead_tokens,
    }
    await asyncio.to_thread(write_report, out_dir, report)
    return report
