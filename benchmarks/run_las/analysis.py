"""The run_las benchmark's comparison, pure: per-run records of the same workload served with
`fifo` and with `run_las` in, the issue's numbers and targets out.

Runs are matched across the two modes by (class, index): the harness draws one plan and sends
it to each target with the same run indices (`...-<class>-<index>`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.records import RunRecord

__all__ = [
    "DONE",
    "SHORT_P50_GAIN_MIN",
    "THROUGHPUT_TOLERANCE_FRAC",
    "WORST_RUN_RATIO_MAX",
    "ModeResult",
    "compare_modes",
    "load_runs",
    "pool_rounds",
    "run_key",
    "spread",
    "window_tokens_per_s",
]

SHORT_P50_GAIN_MIN = 2.0  # short-run completion p50: fifo / run_las at least this
THROUGHPUT_TOLERANCE_FRAC = 0.05  # agent output tok/s within this of fifo's
WORST_RUN_RATIO_MAX = 1.5  # no run's completion above this times its fifo completion
# the harness's outcomes of a run that ran to its end (all steps, or its context cap)
DONE = ("completed", "context_limit")


def run_key(run: RunRecord) -> tuple[str, int]:
    """(class, index) of a harness run id `<prefix>-<class>-<index>`."""
    return run.class_name, int(run.run_id.rsplit("-", 1)[1])


def load_runs(records_path: Path) -> list[RunRecord]:
    """The `"type": "run"` lines of a harness records file."""
    runs = []
    for line in records_path.read_text().splitlines():
        data = json.loads(line)
        if data.pop("type") == "run":
            runs.append(RunRecord.from_json(data))
    return runs


def window_tokens_per_s(records_path: Path, window_s: float) -> float:
    """Output tokens of the requests that ended within the first `window_s` seconds, per
    second: throughput while arrivals last (the engine saturated), without the tail where the
    last runs finish at their own pace."""
    tokens = 0
    for line in records_path.read_text().splitlines():
        data = json.loads(line)
        if data["type"] != "request" or data.get("e2e_ms") is None:
            continue
        if data["send_s"] + data["e2e_ms"] / 1e3 <= window_s:
            tokens += data.get("output_tokens") or 0
    return tokens / window_s


@dataclass(frozen=True)
class ModeResult:
    """One mode's side of the comparison."""

    name: str  # fifo | run_las
    runs: Sequence[RunRecord]
    output_tokens_per_s: float  # agent output tokens over harness start to last completion
    queue_s_by_run: Mapping[str, float]  # run id -> router queue time (ledger totals.queue_s)
    window_tokens_per_s: float | None = None  # the same while arrivals last


def _pct(values: Iterable[float], q: float) -> float | None:
    arr = np.asarray(list(values), dtype=np.float64)
    return float(np.percentile(arr, q)) if arr.size else None


def _completions(runs: Iterable[RunRecord], cls: str) -> list[float]:
    return [
        r.completion_s
        for r in runs
        if r.class_name == cls and r.outcome in DONE and r.completion_s is not None
    ]


def _mode_numbers(mode: ModeResult, classes: Sequence[str]) -> dict[str, Any]:
    per_class = {}
    for cls in classes:
        done = _completions(mode.runs, cls)
        queued = [mode.queue_s_by_run.get(r.run_id, 0.0) for r in mode.runs if r.class_name == cls]
        per_class[cls] = {
            "runs": sum(1 for r in mode.runs if r.class_name == cls),
            "completed": len(done),
            "completion_s_p50": _pct(done, 50),
            "completion_s_p95": _pct(done, 95),
            "completion_s_max": max(done) if done else None,
            "queue_s_p50": _pct(queued, 50),
            "queue_s_max": max(queued) if queued else None,
        }
    longest = max(mode.queue_s_by_run.values(), default=None)
    return {
        "classes": per_class,
        "output_tokens_per_s": mode.output_tokens_per_s,
        "window_output_tokens_per_s": mode.window_tokens_per_s,
        "longest_run_queue_s": longest,
        "outcomes": dict(sorted(_count(r.outcome for r in mode.runs).items())),
    }


def _count(items: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def compare_modes(
    fifo: ModeResult, las: ModeResult, short: str = "short", long: str = "long"
) -> dict[str, Any]:
    """The issue's numbers for both modes, the per-run ratios and whether each target held:
    short-run p50 at least `SHORT_P50_GAIN_MIN` x better, agent tok/s within
    `THROUGHPUT_TOLERANCE_FRAC`, no run above `WORST_RUN_RATIO_MAX` x its fifo completion."""
    classes = (short, long)
    out: dict[str, Any] = {
        "fifo": _mode_numbers(fifo, classes),
        "run_las": _mode_numbers(las, classes),
    }
    fifo_done = {run_key(r): r.completion_s for r in fifo.runs if r.outcome in DONE}
    ratios: dict[str, list[float]] = {short: [], long: []}
    worst: tuple[float, str] | None = None
    for r in las.runs:
        base = fifo_done.get(run_key(r))
        if base is None or r.outcome not in DONE or r.completion_s is None or base <= 0:
            continue
        ratio = r.completion_s / base
        ratios.setdefault(r.class_name, []).append(ratio)
        if worst is None or ratio > worst[0]:
            worst = (ratio, f"{r.class_name}-{run_key(r)[1]}")
    matched = sum(len(v) for v in ratios.values())
    unmatched = sum(1 for r in las.runs if r.outcome not in DONE) + sum(
        1 for r in fifo.runs if r.outcome not in DONE
    )
    out["per_run_ratio"] = {
        cls: {
            "runs": len(v),
            "p50": _pct(v, 50),
            "p95": _pct(v, 95),
            "max": max(v) if v else None,
            "above_limit": sum(1 for x in v if x > WORST_RUN_RATIO_MAX),
        }
        for cls, v in ratios.items()
    }
    out["worst_run"] = None if worst is None else {"run": worst[1], "ratio": worst[0]}
    short_fifo = out["fifo"]["classes"][short]["completion_s_p50"]
    short_las = out["run_las"]["classes"][short]["completion_s_p50"]
    gain = short_fifo / short_las if short_fifo and short_las else None
    tput_change = (
        las.output_tokens_per_s / fifo.output_tokens_per_s - 1.0
        if fifo.output_tokens_per_s > 0
        else None
    )
    window_change = (
        las.window_tokens_per_s / fifo.window_tokens_per_s - 1.0
        if las.window_tokens_per_s is not None and fifo.window_tokens_per_s
        else None
    )
    worst_ratio = worst[0] if worst is not None else None
    out["targets"] = {
        "short_p50_gain": {
            "value": gain,
            "target": f">= {SHORT_P50_GAIN_MIN:g}x",
            "held": gain is not None and gain >= SHORT_P50_GAIN_MIN,
        },
        "throughput_change_frac": {
            "value": tput_change,
            "target": f"within +-{THROUGHPUT_TOLERANCE_FRAC:.0%} (to the last completion)",
            "held": tput_change is not None and abs(tput_change) <= THROUGHPUT_TOLERANCE_FRAC,
        },
        "saturated_throughput_change_frac": {
            "value": window_change,
            "target": f"within +-{THROUGHPUT_TOLERANCE_FRAC:.0%} (while arrivals last)",
            "held": window_change is not None and abs(window_change) <= THROUGHPUT_TOLERANCE_FRAC,
        },
        "worst_run_ratio": {
            "value": worst_ratio,
            "target": f"<= {WORST_RUN_RATIO_MAX:g}x its fifo completion",
            "held": worst_ratio is not None
            and worst_ratio <= WORST_RUN_RATIO_MAX
            and unmatched == 0
            and matched > 0,
            "runs_compared": matched,
            "runs_not_completed": unmatched,
        },
    }
    return out


def pool_rounds(rounds: Sequence[ModeResult]) -> ModeResult:
    """One mode over several rounds of the same plan, as one result: each run's completion
    and router queue time averaged over the rounds (with the engines swapped between rounds,
    every run has then seen each engine alike), agent tok/s the mean of the rounds'. A run
    counts as done only when it was done in every round; otherwise it carries the first
    round's outcome that was not. Runs are matched by `run_key`; the first round's records
    give the run ids and start offsets."""
    if not rounds:
        raise ValueError("no rounds to pool")
    by_key: dict[tuple[str, int], list[tuple[RunRecord, float]]] = {}
    for mode in rounds:
        for r in mode.runs:
            by_key.setdefault(run_key(r), []).append((r, mode.queue_s_by_run.get(r.run_id, 0.0)))
    runs, queue_s = [], {}
    for seen in by_key.values():
        first = seen[0][0]
        queue_s[first.run_id] = sum(q for _, q in seen) / len(seen)
        not_done = [r for r, _ in seen if r.outcome not in DONE or r.completion_s is None]
        if len(seen) < len(rounds) or not_done:
            outcome = not_done[0].outcome if not_done else "missing"
            runs.append(dataclasses.replace(first, end_s=None, outcome=outcome))
            continue
        mean_s = sum(r.completion_s or 0.0 for r, _ in seen) / len(seen)
        runs.append(dataclasses.replace(first, end_s=first.start_s + mean_s))
    windows = [m.window_tokens_per_s for m in rounds]
    return ModeResult(
        rounds[0].name,
        runs,
        sum(m.output_tokens_per_s for m in rounds) / len(rounds),
        queue_s,
        None if None in windows else sum(w or 0.0 for w in windows) / len(windows),
    )


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    """Mean, min and max of the rounds' values of one figure (None where a round had none:
    then the mean is over the others and `missing` counts them)."""
    have = [v for v in values if v is not None]
    return {
        "values": list(values),
        "mean": sum(have) / len(have) if have else None,
        "min": min(have) if have else None,
        "max": max(have) if have else None,
        "missing": len(values) - len(have),
    }
