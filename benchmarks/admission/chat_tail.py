"""Where a kv_pressure run's chat TTFT tail comes from (issue 26): per chat request, what the
agents were doing on the engine while it waited for its first token, from the harness's
per-request records alone (`records-<run>.jsonl` in the run's bulk `harness/` folder).

    python -m benchmarks.admission.chat_tail benchmarks/out/kv-pressure-.../harness [--top 8]

For each chat request, over its TTFT window [sent, first token]:
- `agent_firsts`: agent steps whose first token came inside the window: their prefill (or its
  last slice) shared an engine step with the chat prompt;
- `agents_decoding`: agent steps between their first and last token when the chat request was
  sent: the decode batch its prompt joined;
- `agents_waiting`: agent steps sent but without a first token when it was sent (queued in
  the router or prefilling on the engine; the records cannot tell which);
- `steps` and `step_max_ms`: the agent token times inside the window, from the decoding agent
  with the most of them: how many engine steps the chat request waited through (a decode
  step emits one token per running sequence) and the longest gap between two of them.

Prints the slowest chat requests of each run, then chat TTFT percentiles grouped by prompt
size, by agent prefills ending inside the window and by agents decoding, over all the runs
given; and the engine's step times by what ended in them (`step_gaps`): every agent
inter-token gap (one engine step as one decoding agent saw it), classed by whether another
agent's or a chat request's first token (the end of its prefill) came inside it.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ChatWindow", "chat_windows", "main", "step_gaps"]


@dataclass(frozen=True, slots=True)
class ChatWindow:
    """One chat request's TTFT and the agents' state over its window (see the module doc)."""

    send_s: float
    ttft_ms: float
    prompt_tokens: int
    agent_firsts: int
    agents_decoding: int
    agents_waiting: int
    steps: int
    step_max_ms: float


@dataclass(frozen=True, slots=True)
class _Agent:
    send_s: float
    first_s: float
    end_s: float
    token_s: tuple[float, ...]  # first token, then one per inter-token gap


def _agent(row: dict[str, object]) -> _Agent | None:
    send, ttft, e2e = row.get("send_s"), row.get("ttft_ms"), row.get("e2e_ms")
    if not isinstance(send, float | int) or not isinstance(ttft, float | int):
        return None
    first = send + ttft / 1e3
    times = [first]
    for gap_ms in row.get("itl_ms") or []:  # type: ignore[attr-defined]
        times.append(times[-1] + float(gap_ms) / 1e3)
    end = send + e2e / 1e3 if isinstance(e2e, float | int) else times[-1]
    return _Agent(float(send), first, end, tuple(times))


def chat_windows(rows: Iterable[dict[str, object]]) -> list[ChatWindow]:
    """One `ChatWindow` per chat request with a first token, in send order; `rows`: the
    `"type": "request"` lines of a records file (others are skipped)."""
    requests = [r for r in rows if r.get("type", "request") == "request"]
    agents = [a for r in requests if r.get("kind") == "agent" and (a := _agent(r)) is not None]
    out = []
    for r in requests:
        send, ttft = r.get("send_s"), r.get("ttft_ms")
        if r.get("kind") != "chat" or not isinstance(send, float | int):
            continue
        if not isinstance(ttft, float | int):
            continue
        t0, t1 = float(send), float(send) + ttft / 1e3
        prompt = r.get("prompt_tokens") or r.get("planned_prompt_tokens") or 0
        steps, step_max_s = 0, 0.0
        for a in agents:
            lo = bisect.bisect_right(a.token_s, t0)
            hi = bisect.bisect_right(a.token_s, t1)
            if hi - lo > steps:
                steps = hi - lo
                # gaps between the tokens inside the window and the one before it
                inside = a.token_s[max(lo - 1, 0) : hi]
                step_max_s = max((b - x for x, b in itertools.pairwise(inside)), default=0.0)
        out.append(
            ChatWindow(
                send_s=t0,
                ttft_ms=float(ttft),
                prompt_tokens=int(prompt),  # type: ignore[call-overload]
                agent_firsts=sum(1 for a in agents if t0 < a.first_s <= t1),
                agents_decoding=sum(1 for a in agents if a.first_s <= t0 < a.end_s),
                agents_waiting=sum(1 for a in agents if a.send_s <= t0 < a.first_s),
                steps=steps,
                step_max_ms=step_max_s * 1e3,
            )
        )
    return out


# (an agent's prefill ended in the gap, a chat request's did) -> the gap's class
_GAP_KINDS = {
    (False, False): "decode only",
    (True, False): "agent prefill",
    (False, True): "chat prefill",
    (True, True): "both",
}


def step_gaps(rows: Iterable[dict[str, object]]) -> dict[str, list[float]]:
    """Every agent inter-token gap (ms) of `rows` (a records file's lines), by what ended
    inside it: "agent prefill", "chat prefill", "both" or "decode only" (nothing did)."""
    requests = [r for r in rows if r.get("type", "request") == "request"]
    agents = [a for r in requests if r.get("kind") == "agent" and (a := _agent(r)) is not None]
    chat_firsts = sorted(
        float(r["send_s"]) + float(r["ttft_ms"]) / 1e3  # type: ignore[arg-type]
        for r in requests
        if r.get("kind") == "chat" and isinstance(r.get("ttft_ms"), float | int)
    )
    agent_firsts = sorted(a.first_s for a in agents)

    def ended(firsts: list[float], lo: float, hi: float) -> bool:
        return bisect.bisect_right(firsts, hi) > bisect.bisect_right(firsts, lo)

    gaps: dict[str, list[float]] = {}
    for a in agents:
        for lo, hi in itertools.pairwise(a.token_s):
            kind = _GAP_KINDS[ended(agent_firsts, lo, hi), ended(chat_firsts, lo, hi)]
            gaps.setdefault(kind, []).append((hi - lo) * 1e3)
    return gaps


def _pct(values: Sequence[float], q: float) -> float:
    """The q-quantile by linear interpolation (numpy's default); nan when empty."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _grouped(
    windows: Sequence[ChatWindow], key: Callable[[ChatWindow], str], order: Sequence[str]
) -> list[str]:
    lines = ["| group | n | TTFT p50 | p90 | p99 | max (ms) |", "|---|---|---|---|---|---|"]
    for name in order:
        ttfts = [w.ttft_ms for w in windows if key(w) == name]
        if ttfts:
            p50, p90, p99 = (_pct(ttfts, q) for q in (0.5, 0.9, 0.99))
            lines.append(
                f"| {name} | {len(ttfts)} | {p50:.0f} | {p90:.0f} | {p99:.0f} | {max(ttfts):.0f} |"
            )
    return lines


def _size(w: ChatWindow) -> str:
    return (
        "<=256 tok" if w.prompt_tokens <= 256 else "257-512" if w.prompt_tokens <= 512 else ">512"
    )


def _firsts(w: ChatWindow) -> str:
    return "2+" if w.agent_firsts >= 2 else str(w.agent_firsts)


def _decoding(w: ChatWindow) -> str:
    return "0" if w.agents_decoding == 0 else "1-3" if w.agents_decoding <= 3 else "4+"


def report(runs: dict[str, list[ChatWindow]], gaps: dict[str, list[float]], top: int) -> str:
    lines = []
    for name, windows in runs.items():
        lines += [
            f"## {name}: the {top} slowest chat requests",
            "",
            "| sent (s) | TTFT ms | prompt tok | agent firsts | decoding | waiting | steps "
            "| step max ms |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for w in sorted(windows, key=lambda w: -w.ttft_ms)[:top]:
            lines.append(
                f"| {w.send_s:.2f} | {w.ttft_ms:.0f} | {w.prompt_tokens} | {w.agent_firsts} "
                f"| {w.agents_decoding} | {w.agents_waiting} | {w.steps} "
                f"| {w.step_max_ms:.0f} |"
            )
        lines.append("")
    every = [w for ws in runs.values() for w in ws]
    lines += ["## All runs: chat TTFT by prompt size", ""]
    lines += _grouped(every, _size, ["<=256 tok", "257-512", ">512"])
    lines += ["", "## By agent prefills ending inside the window", ""]
    lines += _grouped(every, _firsts, ["0", "1", "2+"])
    lines += ["", "## By agents decoding when sent", ""]
    lines += _grouped(every, _decoding, ["0", "1-3", "4+"])
    lines += [
        "",
        "## Engine steps (agent inter-token gaps) by what ended in them",
        "",
        "| ended | n | p50 | p90 | p99 (ms) |",
        "|---|---|---|---|---|",
    ]
    for kind in ("decode only", "agent prefill", "chat prefill", "both"):
        if ms := gaps.get(kind):
            p50, p90, p99 = (_pct(ms, q) for q in (0.5, 0.9, 0.99))
            lines.append(f"| {kind} | {len(ms)} | {p50:.1f} | {p90:.1f} | {p99:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("harness_dir", type=Path, help="a run's bulk harness/ folder")
    parser.add_argument("--runs", default="", help="substring a run's name must contain")
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args(argv)
    runs: dict[str, list[ChatWindow]] = {}
    gaps: dict[str, list[float]] = {}
    for path in sorted(args.harness_dir.glob("records-*.jsonl")):
        name = path.stem.removeprefix("records-")
        if args.runs in name:
            with path.open() as f:
                rows = [json.loads(line) for line in f if line.strip()]
            runs[name] = chat_windows(rows)
            for kind, ms in step_gaps(rows).items():
                gaps.setdefault(kind, []).extend(ms)
    if not runs:
        print(f"no records-*.jsonl matching {args.runs!r} in {args.harness_dir}", file=sys.stderr)
        return 1
    sys.stdout.write(report(runs, gaps, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
