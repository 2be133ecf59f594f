"""Benchmark: how close the router's request estimate (`router.admission.estimate`) comes to
the prompt tokens a real vLLM engine counts, and what it costs per request.

One CPU vLLM engine serves the tiny dev model (started by `pools.launchers.LocalLauncher`, 64 MiB
of KV cache, max_model_len 4096). A seeded mix of requests goes to it, a few in flight at once:
single-turn chats, multi-turn chats, agent runs (tools, a growing history of tool calls and
tool results, the model's own text in the assistant turns) and /v1/completions requests with
`max_tokens` 1 (text, token ids, a batch). Two workloads, one after the other: `words` (random
words, the text the dev tokenizer was trained on) and `mixed` (half of the text windows of the
repository's own code and docs). Each request is estimated when it is sent and observed when
its usage comes back, as in the router, by four estimators: the tokenizer and the byte
heuristic, each online-corrected and frozen at its prior (the baseline the correction is
measured against).

    .venv/bin/python -m benchmarks.estimation --out benchmarks/results/estimation-YYYY-MM-DD
        [--requests 300] [--completions 40] [--concurrency 4] [--seed 7]
        [--workloads words mixed]

Writes `report.md` and `report.json` (summary, learned coefficients, one row per request).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import platform
import random
import shlex
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from pools.config import parse_config
from pools.devmodel import is_dev_model, make_dev_model
from pools.launchers import InstanceSpec, LocalLauncher
from router.admission.estimate import FEATURES, Estimate, TokenEstimator
from router.simulate.prompts import PromptMaker
from router.simulate.workload import make_tools

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / ".gpupool" / "models" / "tiny"
KV_CACHE_BYTES = 64 * 1024 * 1024
MAX_MODEL_LEN = 4096
CONTEXT_LIMIT_TOKENS = 3200  # agent runs stop before their history passes this
EXPECTED_OUTPUT = {"normal": 128, "agent": 256}
MODES = ("tokenizer", "heuristic", "tokenizer_frozen", "heuristic_frozen")
SYSTEM_PROMPTS = (
    "You are a helpful assistant. Answer briefly.",
    "You are a senior engineer reviewing code. Point out bugs first, then style, and quote the "
    "lines you mean. Keep the answer under two hundred words unless asked for more.",
    "",
)


@dataclass
class Row:
    """One request: what each estimator said, what the engine counted, what estimating cost."""

    index: int
    kind: str  # chat | multi_turn | agent | completion
    chars: int
    messages: int
    estimates: dict[str, int] = field(default_factory=dict)
    estimate_cpu_us: dict[str, float] = field(default_factory=dict)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    status: int = 0
    error: str = ""  # the start of a failed response's body
    sent_order: int = 0
    done_order: int = 0


class Texts:
    """Prompt text: random words cut at a token count, or windows of the repository's files."""

    def __init__(self, rng: random.Random, tokenizer_path: Path, mixed: bool) -> None:
        self.rng = rng
        self.mixed = mixed
        self.words = PromptMaker(str(tokenizer_path))
        self._np = np.random.default_rng(rng.randrange(2**32))
        self.code = "\n\n".join(p.read_text() for p in sorted((REPO / "router").glob("*.py"))[:12])
        self.docs = "\n\n".join(
            p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
        )
        self.system_prompts = (
            SYSTEM_PROMPTS if mixed else (self.random_words(10), self.random_words(40), "")
        )

    def random_words(self, tokens: int) -> str:
        return self.words.text(self._np, max(1, tokens))

    def window(self, source: str, tokens: int) -> str:
        chars = max(8, int(tokens * 3.5))
        start = self.rng.randrange(0, max(1, len(source) - chars))
        return source[start : start + chars]

    def any(self, tokens: int) -> str:
        r = self.rng.random()
        if r < 0.5 or not self.mixed:
            return self.random_words(tokens)
        return self.window(self.code if r < 0.75 else self.docs, tokens)

    def size(self, low: int, high: int) -> int:
        return int(math.exp(self.rng.uniform(math.log(low), math.log(high))))


def chat_body(texts: Texts, multi_turn: bool) -> dict[str, Any]:
    rng = texts.rng
    messages: list[dict[str, Any]] = []
    system = rng.choice(texts.system_prompts)
    if system:
        messages.append({"role": "system", "content": system})
    for _ in range(rng.randint(1, 4) if multi_turn else 0):
        messages.append({"role": "user", "content": texts.any(texts.size(5, 300))})
        messages.append({"role": "assistant", "content": texts.random_words(texts.size(5, 200))})
    content: Any = texts.any(texts.size(3, 1500 if not multi_turn else 600))
    if rng.random() < 0.25:
        content = [{"type": "text", "text": "Look at this:"}, {"type": "text", "text": content}]
    messages.append({"role": "user", "content": content})
    return {
        "model": "tiny",
        "messages": messages,
        "max_tokens": rng.randint(1, 24),
        "ignore_eos": True,
    }


def completion_body(texts: Texts, k: int) -> dict[str, Any]:
    rng = texts.rng
    prompt: Any
    if k % 8 == 3:
        prompt = [rng.randrange(10, 4000) for _ in range(texts.size(5, 800))]
    elif k % 8 == 5:
        prompt = [texts.any(texts.size(5, 300)) for _ in range(rng.randint(2, 3))]
    else:
        prompt = texts.any(texts.size(3, 2000))
    return {"model": "tiny", "prompt": prompt, "max_tokens": 1}


@dataclass
class AgentRun:
    tools: list[dict[str, Any]]
    messages: list[dict[str, Any]]
    steps_left: int


def new_agent_run(texts: Texts) -> AgentRun:
    rng = texts.rng
    task = texts.any(texts.size(20, 400))
    return AgentRun(
        tools=list(make_tools(rng.randint(2, 8))),
        messages=[
            {"role": "system", "content": "You are a careful agent. Use the tools to finish."},
            {"role": "user", "content": f"Task: {task}"},
        ],
        steps_left=rng.randint(3, 12),
    )


def advance_agent_run(texts: Texts, run: AgentRun, answer: str, step: int) -> None:
    """Append this step's tool call (the model's text as its content) and the tool's result."""
    rng = texts.rng
    tool = rng.choice(run.tools)["function"]["name"]
    arg = texts.window(texts.code, 12) if texts.mixed else texts.random_words(rng.randint(2, 12))
    arguments = {"arg": arg.strip()[:60]}
    if rng.random() < 0.5:
        arguments["path"] = f"router/file_{rng.randint(0, 99)}.py"
    call_id = f"call_{step}"
    run.messages.append(
        {
            "role": "assistant",
            "content": answer or None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": tool, "arguments": json.dumps(arguments)},
                }
            ],
        }
    )
    result = texts.any(texts.size(20, 500))
    run.messages.append({"role": "tool", "tool_call_id": call_id, "content": result})


class Bench:
    def __init__(
        self,
        args: argparse.Namespace,
        engine: InstanceSpec,
        tokenizer_path: Path,
        workload: str,
    ) -> None:
        self.args = args
        self.url = engine.url
        self.api_key = engine.api_key
        self.workload = workload
        self.rng = random.Random(f"{args.seed}-{workload}")
        self.texts = Texts(self.rng, tokenizer_path, mixed=workload == "mixed")
        self.rows: list[Row] = []
        self.estimators = {
            mode: TokenEstimator(
                tokenizer_path=tokenizer_path if mode.startswith("tokenizer") else None,
                expected_output_tokens=EXPECTED_OUTPUT,
                max_model_len_tokens=MAX_MODEL_LEN,
            )
            for mode in MODES
        }
        self.bodies: list[tuple[dict[str, Any], bool, str]] = []  # for the quiet replay
        self._sent = 0
        self._done = 0
        self.lock = asyncio.Lock()

    def _estimate(self, row: Row, body: dict[str, Any], chat: bool, cls: str) -> dict[str, Any]:
        made = {}
        for mode, est in self.estimators.items():
            t0 = time.thread_time_ns()
            made[mode] = est.estimate(body, chat=chat, class_name=cls)
            row.estimate_cpu_us[mode] = (time.thread_time_ns() - t0) / 1e3
            row.estimates[mode] = made[mode].prompt_tokens
        return made

    async def send(
        self, client: httpx.AsyncClient, kind: str, body: dict[str, Any], cls: str
    ) -> tuple[Row, str]:
        chat = "messages" in body
        row = Row(
            index=len(self.rows),
            kind=kind,
            chars=_text_chars(body),
            messages=len(body.get("messages", [])),
        )
        self.rows.append(row)
        self.bodies.append((json.loads(json.dumps(body)), chat, cls))
        made = self._estimate(row, body, chat, cls)
        row.sent_order, self._sent = self._sent, self._sent + 1
        path = "/v1/chat/completions" if chat else "/v1/completions"
        response = await client.post(self.url + path, json=body)
        row.status = response.status_code
        row.done_order, self._done = self._done, self._done + 1
        if response.status_code != 200:
            row.error = response.text[:300]
            return row, ""
        data = response.json()
        usage = data.get("usage") or {}
        row.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        row.completion_tokens = int(usage.get("completion_tokens") or 0)
        for mode, est in self.estimators.items():
            if not mode.endswith("_frozen"):
                est.observe(
                    made[mode],
                    class_name=cls,
                    prompt_tokens=row.prompt_tokens,
                    completion_tokens=row.completion_tokens,
                )
        choice = (data.get("choices") or [{}])[0]
        text = choice.get("message", {}).get("content") if chat else choice.get("text")
        return row, text if isinstance(text, str) else ""

    async def agent_run(self, client: httpx.AsyncClient) -> None:
        run = new_agent_run(self.texts)
        for step in range(1, run.steps_left + 1):
            body = {
                "model": "tiny",
                "messages": run.messages,
                "tools": run.tools,
                "max_tokens": self.rng.randint(4, 32),
                "ignore_eos": True,
            }
            row, answer = await self.send(client, "agent", body, "agent")
            if row.status != 200 or step == run.steps_left:
                return
            advance_agent_run(self.texts, run, answer, step)
            if row.prompt_tokens + 600 > CONTEXT_LIMIT_TOKENS:
                return

    async def worker(self, client: httpx.AsyncClient, jobs: asyncio.Queue[tuple[str, int]]) -> None:
        while True:
            try:
                kind, k = jobs.get_nowait()
            except asyncio.QueueEmpty:
                return
            if kind == "agent":
                await self.agent_run(client)
            elif kind == "completion":
                await self.send(client, kind, completion_body(self.texts, k), "normal")
            else:
                await self.send(client, kind, chat_body(self.texts, kind == "multi_turn"), "normal")

    async def run(self) -> None:
        args = self.args
        chat_requests = args.requests
        agent_runs = max(1, round(chat_requests * 0.4 / 6))  # ~6 steps a run: ~40 % agent steps
        jobs_list = (
            [("chat", k) for k in range(round(chat_requests * 0.4))]
            + [("multi_turn", k) for k in range(round(chat_requests * 0.2))]
            + [("agent", k) for k in range(agent_runs)]
            + [("completion", k) for k in range(args.completions)]
        )
        self.rng.shuffle(jobs_list)
        jobs: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
        for job in jobs_list:
            jobs.put_nowait(job)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with httpx.AsyncClient(timeout=300, headers=headers) as client:
            await asyncio.gather(*(self.worker(client, jobs) for _ in range(args.concurrency)))


def _text_chars(body: dict[str, Any]) -> int:
    def walk(value: Any) -> int:
        if isinstance(value, str):
            return len(value)
        if isinstance(value, list):
            return sum(walk(v) for v in value)
        if isinstance(value, dict):
            return sum(walk(v) for k, v in value.items() if k not in ("model", "role", "type"))
        return 0

    return walk(body.get("messages")) + walk(body.get("prompt")) + walk(body.get("tools"))


async def replay_us(
    bodies: Sequence[tuple[dict[str, Any], bool, str]], rows: Sequence[Row], tokenizer_path: Path
) -> dict[str, list[float]]:
    """With the engine stopped, in send order, each observed at once, µs per request: the wall
    time of `estimate` (keys `tokenizer`, `heuristic`), and the event-loop thread's CPU time in
    `estimate_async` (`tokenizer_async_loop`), which leaves big never-seen text to a thread."""
    out: dict[str, list[float]] = {}
    for key in ("tokenizer", "heuristic", "tokenizer_async_loop"):
        est = TokenEstimator(
            tokenizer_path=tokenizer_path if key.startswith("tokenizer") else None,
            expected_output_tokens=EXPECTED_OUTPUT,
            max_model_len_tokens=MAX_MODEL_LEN,
        )
        times = []
        gc.collect()
        for (body, chat, cls), row in zip(bodies, rows, strict=True):
            made: Estimate
            if key.endswith("_async_loop"):
                t0 = time.thread_time_ns()
                made = await est.estimate_async(body, chat=chat, class_name=cls)
                times.append((time.thread_time_ns() - t0) / 1e3)
            else:
                t0 = time.perf_counter_ns()
                made = est.estimate(body, chat=chat, class_name=cls)
                times.append((time.perf_counter_ns() - t0) / 1e3)
            if row.prompt_tokens:
                est.observe(
                    made,
                    class_name=cls,
                    prompt_tokens=row.prompt_tokens,
                    completion_tokens=row.completion_tokens,
                )
        out[key] = times
    return out


def exact_encode_us(
    bodies: Sequence[tuple[dict[str, Any], bool, str]], tokenizer_path: Path
) -> list[float]:
    """Reference: one plain `Tokenizer.encode` of each body's text joined (no memoisation)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    times = []
    for body, _, _ in bodies:
        text = json.dumps(body, ensure_ascii=False)
        t0 = time.perf_counter_ns()
        tok.encode(text, add_special_tokens=False)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return times


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else float("nan")


def error_summary(rows: Sequence[Row], mode: str) -> dict[str, Any]:
    ok = [r for r in rows if r.status == 200 and r.prompt_tokens > 0]
    ok.sort(key=lambda r: r.sent_order)

    def stats(part: Sequence[Row]) -> dict[str, float]:
        errs = [(r.estimates[mode] - r.prompt_tokens) / r.prompt_tokens for r in part]
        absolute = [abs(e) for e in errs]
        return {
            "n": len(part),
            "p50": pct(absolute, 50),
            "p95": pct(absolute, 95),
            "max": max(absolute) if absolute else float("nan"),
            "mean_signed": statistics.fmean(errs) if errs else float("nan"),
        }

    summary: dict[str, Any] = {
        "all": stats(ok),
        "first_20": stats(ok[:20]),
        "after_20": stats(ok[20:]),
    }
    for kind in ("chat", "multi_turn", "agent", "completion"):
        summary[kind] = stats([r for r in ok if r.kind == kind])
    return summary


def timing_summary(values: Sequence[float]) -> dict[str, float]:
    return {"p50_us": pct(values, 50), "p99_us": pct(values, 99), "max_us": max(values)}


def _fmt_err(s: dict[str, float]) -> str:
    return f"{s['p50'] * 100:.2f} / {s['p95'] * 100:.2f} / {s['max'] * 100:.1f}"


KINDS = ("chat", "multi_turn", "agent", "completion")


def summarize(bench: Bench, replay: dict[str, list[float]], exact: list[float]) -> dict[str, Any]:
    rows = bench.rows
    ok = [r for r in rows if r.status == 200 and r.prompt_tokens > 0]

    def kind_timing(mode: str, kind: str) -> dict[str, float]:
        return timing_summary(
            [t for t, r in zip(replay[mode], rows, strict=True) if r.kind == kind]
        )

    return {
        "workload": bench.workload,
        "requests": len(rows),
        "ok": len(ok),
        "kinds": {k: sum(1 for r in ok if r.kind == k) for k in KINDS},
        "errors": {mode: error_summary(rows, mode) for mode in MODES},
        "online_estimate_cpu": {
            mode: timing_summary([r.estimate_cpu_us[mode] for r in rows]) for mode in MODES[:2]
        },
        "quiet_replay_us": {m: timing_summary(v) for m, v in replay.items()},
        "quiet_replay_us_by_kind": {m: {k: kind_timing(m, k) for k in KINDS} for m in replay},
        "plain_encode_wall": timing_summary(exact),
        "coefficients": {m: bench.estimators[m].coefficients for m in MODES[:2]},
        "output_p95": {c: bench.estimators["tokenizer"].output_p95(c) for c in EXPECTED_OUTPUT},
        "rows": [asdict(r) for r in rows],
    }


WORKLOAD_TEXT = {
    "words": "random words from the benchmark vocabulary (`router.simulate.prompts.PromptMaker`), "
    "system prompts included: the text the dev tokenizer was trained on (~3.6 bytes a token)",
    "mixed": "half random words, half windows of the repository's own code and docs, which the "
    "dev tokenizer (a 4k vocabulary trained on ~180 words) splits almost byte by byte (~1.5 "
    "bytes a token): a harsh case for one bytes-per-token ratio",
}


def workload_section(w: dict[str, Any]) -> list[str]:
    errors = w["errors"]
    kinds = w["kinds"]
    lines = [
        f"## Workload `{w['workload']}`: {WORKLOAD_TEXT[w['workload']]}",
        "",
        f"{w['requests']} requests, {w['ok']} answered with usage: {kinds['chat']} single-turn "
        f"chats, {kinds['multi_turn']} multi-turn chats, {kinds['agent']} agent steps (tools, "
        f"tool-call histories), {kinds['completion']} /v1/completions with `max_tokens` 1 "
        "(text, token ids, batches).",
        "",
        "Prompt-token error |estimate - actual| / actual in %, p50 / p95 / max:",
        "",
        "| estimator | all | first 20 | after 20 | chat | multi-turn | agent | completions |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode in MODES:
        e = errors[mode]
        cells = [_fmt_err(e[k]) for k in ("all", "first_20", "after_20", *KINDS)]
        lines.append(f"| {mode.replace('_', ' ')} | " + " | ".join(cells) + " |")
    online = w["online_estimate_cpu"]
    quiet = w["quiet_replay_us"]
    by_kind = w["quiet_replay_us_by_kind"]
    plain = w["plain_encode_wall"]
    lines += [
        "",
        "Cost of one `estimate` in µs, p50 / p99:",
        "",
        "| measure | tokenizer | heuristic |",
        "| --- | --- | --- |",
        "| online, thread CPU time (the engine busy on the same cores) | "
        + " | ".join(f"{online[m]['p50_us']:.1f} / {online[m]['p99_us']:.1f}" for m in MODES[:2])
        + " |",
        "| quiet replay (engine stopped), wall, all requests | "
        + " | ".join(f"{quiet[m]['p50_us']:.1f} / {quiet[m]['p99_us']:.1f}" for m in MODES[:2])
        + " |",
        "| quiet replay, `estimate_async`: event-loop thread CPU, all requests | "
        f"{quiet['tokenizer_async_loop']['p50_us']:.1f} / "
        f"{quiet['tokenizer_async_loop']['p99_us']:.1f} | as `estimate` (never a thread) |",
        *(
            f"| quiet replay, {kind.replace('_', '-')} | "
            + " | ".join(
                f"{by_kind[m][kind]['p50_us']:.1f} / {by_kind[m][kind]['p99_us']:.1f}"
                for m in MODES[:2]
            )
            + " |"
            for kind in KINDS
        ),
        f"| reference: one plain `Tokenizer.encode` of the body's JSON | "
        f"{plain['p50_us']:.1f} / {plain['p99_us']:.1f} | — |",
        "",
        "Learned coefficients, tokens per unit (text and JSON: per token, or per UTF-8 byte):",
        "",
        "| estimator | " + " | ".join(name.replace("_", " ") for name in FEATURES) + " |",
        "| --- |" + " --- |" * len(FEATURES),
    ]
    for mode in MODES[:2]:
        coefs = w["coefficients"][mode].values()
        lines.append(f"| {mode} | " + " | ".join(f"{c:.3f}" for c in coefs) + " |")
    heuristic = w["coefficients"]["heuristic"]
    lines += [
        "",
        f"The heuristic learned {1 / heuristic['text']:.2f} bytes a token for message text and "
        f"{1 / heuristic['json']:.2f} for JSON (tool schemas, tool-call arguments), from 4.0.",
        "",
    ]
    return lines


def write_report(
    out: Path, args: argparse.Namespace, workloads: list[dict[str, Any]], wall_s: float
) -> dict[str, Any]:
    command = "python -m benchmarks.estimation " + shlex.join(sys.argv[1:])
    machine = (
        f"{platform.machine()}, {platform.python_implementation()} "
        f"{platform.python_version()}, {platform.system()}, {os.cpu_count()} cores shared with "
        f"other jobs (1-minute load average {os.getloadavg()[0]:.1f} at the end)"
    )
    result: dict[str, Any] = {
        "command": command,
        "machine": machine,
        "wall_s": wall_s,
        "target_tokenizer_p95": 0.10,
        "workloads": {w["workload"]: w for w in workloads},
    }
    (out / "report.json").write_text(json.dumps(result, indent=1) + "\n")
    worst = max(w["errors"]["tokenizer"]["all"]["p95"] for w in workloads)
    lines = [
        "# Request estimate against vLLM's prompt token counts",
        "",
        f"Command: `{command.strip()}`  ",
        f"Machine: {machine}; one CPU vLLM engine (tiny dev model, 64 MiB KV "
        f"cache, max_model_len {MAX_MODEL_LEN}); {wall_s:.0f} s in all.",
        "",
        f"Two workloads, each with fresh estimators; {args.concurrency} requests in flight. Each "
        "request is estimated when sent and observed when its usage returns, in that order, as "
        "in the router, by four estimators: the tokenizer and the byte heuristic, online-"
        "corrected, and the same two frozen at their priors (4.0 bytes a token, a Llama-3-style "
        "template), the baseline the correction is measured against.",
        "",
        f"Target: p95 <= 10 % with the tokenizer: worst workload **{worst * 100:.2f} %** "
        f"({'met' if worst <= 0.10 else 'missed'}).",
        "",
    ]
    for w in workloads:
        lines += workload_section(w)
    lines += [
        "## Reading",
        "",
        "- The estimator memoises token counts per space-separated chunk and per piece of text "
        "of 64 characters or more, so it encodes only text it has not seen; the plain-encode "
        "row is what counting every request from scratch costs on this machine (~1 µs a token, "
        "nearly all in the byte-level pre-tokenizer's regex). The p99s are requests with much "
        "new text (and the machine's load); `estimate_async` (what the router calls) encodes "
        "more than 1 KiB of new text in a worker thread, so the event loop pays the lookups "
        "only.",
        "- With the tokenizer, what is left is the chat template's tokens before they are "
        "learned (the first requests: priors of 5 a request and a message against the dev "
        "template's 6), and, with other tokenizers than this one, runs of spaces (counted at "
        "a rate measured once on the tokenizer).",
        "- The heuristic's error is mostly the dev tokenizer's: trained on ~180 words, it "
        "splits anything else (English outside that list, code, docs, JSON) nearly byte by "
        "byte, so no single ratio fits a mix; on short prompts a few tokens are many per cent. "
        "Tokenizers of real models are far more even across text kinds.",
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))
    return result


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model_dir: Path = args.model_dir
    if not is_dev_model(model_dir):
        make_dev_model(model_dir, "tiny")
    tokenizer_path = model_dir / "tokenizer.json"
    args.out.mkdir(parents=True, exist_ok=True)
    benches: list[Bench] = []
    with tempfile.TemporaryDirectory() as run_dir:
        config = parse_config(
            {
                "model": {
                    "name": "tiny",
                    "path": str(model_dir),
                    "max_model_len_tokens": MAX_MODEL_LEN,
                },
                "engines": {
                    "launcher": "local",
                    "local": {
                        "count": 1,
                        "base_port": args.port or _free_port(),
                        "kv_cache_bytes": KV_CACHE_BYTES,
                        "run_dir": run_dir,
                        "startup_timeout_s": 600,
                        "vllm_args": ["--max-num-seqs", "16"],
                    },
                },
                "pools": {
                    "normal": {"classes": ["normal", "agent"], "share": {"initial_frac": 1.0}}
                },
            }
        )
        launcher = LocalLauncher(
            config.engines.local,
            config.model,
            progress=lambda m: print(f"[engine] {m}", file=sys.stderr, flush=True),
            gpu_count=0,
        )
        instances = await launcher.start()
        t0 = time.perf_counter()
        try:
            for workload in args.workloads:
                bench = Bench(args, instances[0], tokenizer_path, workload)
                await bench.run()
                benches.append(bench)
        finally:
            await launcher.aclose()
        wall_s = time.perf_counter() - t0
    summaries = []
    for bench in benches:
        replay = await replay_us(bench.bodies, bench.rows, tokenizer_path)
        exact = exact_encode_us(bench.bodies, tokenizer_path)
        summaries.append(summarize(bench, replay, exact))
    return write_report(args.out, args, summaries, wall_s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=300, help="chat requests (approx.)")
    parser.add_argument("--completions", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--port", type=int, default=0, help="engine port (0: a free one)")
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    parser.add_argument(
        "--workloads", nargs="+", choices=("words", "mixed"), default=["words", "mixed"]
    )
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    print((args.out / "report.md").read_text())
    for w in result["workloads"].values():
        failed = [r for r in w["rows"] if r["status"] != 200]
        if failed:
            print(
                f"{len(failed)} requests failed, e.g. {failed[0]['status']}: {failed[0]['error']}"
            )
        if (
            len(failed) > 0.05 * len(w["rows"])
            or not w["errors"]["tokenizer"]["all"]["p95"] <= 0.10
        ):
            sys.exit(1)


if __name__ == "__main__":
    main()
