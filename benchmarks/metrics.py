"""Metrics from records, in `vllm bench serve`'s definitions. Pure functions, no I/O.

- TTFT: send to the first chunk carrying `choices`.
- TPOT (per request) = (E2EL − TTFT) / (output tokens − 1), for requests with > 1 output token;
  in a goodput check a 1-token request's TPOT counts as 0, as vLLM does.
- ITL: every gap between consecutive token chunks, pooled over requests.
- E2EL: send to the last token chunk.
- Percentiles: numpy's linear interpolation, over completed (`ok`) requests only.
- Goodput: requests meeting every SLO of their class, per second of benchmark wall time;
  rejected, failed and cancelled requests are misses. SLO attainment: that count over all
  requests sent.
- Rejections: failed requests counted by "<status> <error code>" (status `none` when no
  response came back).
- Runs: completion time (first send to the last token of the last step, tool waits included),
  steps, outcome, and GPU-seconds where the target reported them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from benchmarks.records import RequestRecord, RunRecord, TargetResult
from router.simulate.scenario import Scenario, Slo

__all__ = [
    "PERCENTILES",
    "class_summary",
    "distribution",
    "meets_slo",
    "rejection_reasons",
    "run_summary",
    "summarize_target",
    "tpot_ms",
]

PERCENTILES = (50, 90, 95, 99)


def distribution(values: Sequence[float] | Iterable[float]) -> dict[str, float] | None:
    """mean and p50/p90/p95/p99 (numpy linear interpolation); None when there are no values."""
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        return None
    out = {"mean": float(arr.mean())}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(arr, p))
    out["max"] = float(arr.max())
    out["n"] = float(arr.size)
    return out


def tpot_ms(record: RequestRecord) -> float | None:
    """(E2EL − TTFT) / (output tokens − 1); None when it is undefined (≤ 1 token, not ok)."""
    if not record.ok or record.e2e_ms is None or record.ttft_ms is None:
        return None
    tokens = record.output_tokens
    if tokens is None:  # no usage chunk: count the token chunks, as vLLM does
        tokens = len(record.itl_ms) + 1
    if tokens <= 1:
        return None
    return (record.e2e_ms - record.ttft_ms) / (tokens - 1)


def meets_slo(record: RequestRecord, slo: Slo) -> bool:
    """True when the request completed and met every target its class sets."""
    if not record.ok:
        return False
    assert record.ttft_ms is not None and record.e2e_ms is not None
    if slo.ttft_ms is not None and record.ttft_ms > slo.ttft_ms:
        return False
    if slo.tpot_ms is not None and (tpot_ms(record) or 0.0) > slo.tpot_ms:
        return False
    return not (slo.e2e_ms is not None and record.e2e_ms > slo.e2e_ms)


def rejection_reasons(records: Iterable[RequestRecord]) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for r in records:
        if not r.ok:
            status = "none" if r.status is None else str(r.status)
            counts[f"{status} {r.error_code or 'unknown'}"] += 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _attainment(records: Sequence[RequestRecord], slo: Slo) -> dict[str, float]:
    """Per SLO: the fraction of requests sent that met it (failed requests miss all)."""
    if not records:
        return {}
    out = {}
    for name, target in slo.as_dict().items():
        met = 0
        for r in records:
            if not r.ok:
                continue
            value = {"ttft_ms": r.ttft_ms, "tpot_ms": tpot_ms(r) or 0.0, "e2e_ms": r.e2e_ms}[name]
            if value is not None and value <= target:
                met += 1
        out[name] = met / len(records)
    return out


def class_summary(records: Sequence[RequestRecord], slo: Slo, wall_s: float) -> dict[str, Any]:
    """Counts, latency distributions, goodput and SLO attainment of one class on one target."""
    ok = [r for r in records if r.ok]
    good = sum(1 for r in records if meets_slo(r, slo))
    output_tokens = sum(r.output_tokens or 0 for r in ok)
    tpots = [t for r in ok if (t := tpot_ms(r)) is not None]
    return {
        "requests": len(records),
        "ok": len(ok),
        "rejected_429": sum(1 for r in records if r.status == 429),
        "failed": len(records) - len(ok),
        "good": good,
        "goodput_rps": good / wall_s if wall_s > 0 else 0.0,
        "slo_attainment_frac": good / len(records) if records else None,
        "slo_attainment_by_metric": _attainment(records, slo),
        "throughput_rps": len(ok) / wall_s if wall_s > 0 else 0.0,
        "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else 0.0,
        "prompt_tokens_mean": (
            float(np.mean([r.prompt_tokens for r in ok if r.prompt_tokens]))
            if any(r.prompt_tokens for r in ok)
            else None
        ),
        "output_tokens_mean": (output_tokens / len(ok)) if ok else None,
        "ttft_ms": distribution(r.ttft_ms for r in ok if r.ttft_ms is not None),
        "tpot_ms": distribution(tpots),
        "itl_ms": distribution(g for r in ok for g in r.itl_ms),
        "e2e_ms": distribution(r.e2e_ms for r in ok if r.e2e_ms is not None),
        "rejections": rejection_reasons(records),
    }


def run_summary(runs: Sequence[RunRecord]) -> dict[str, Any]:
    """Agent runs of one class: outcomes, completion time, steps and GPU-seconds."""
    completed = [r for r in runs if r.outcome in ("completed", "context_limit")]
    gpu = [r.gpu_seconds for r in runs if r.gpu_seconds is not None]
    return {
        "runs": len(runs),
        "outcomes": dict(sorted(Counter(r.outcome for r in runs).items())),
        "completed": len(completed),
        "completion_s": distribution(
            r.completion_s for r in completed if r.completion_s is not None
        ),
        "steps_ok_mean": float(np.mean([r.steps_ok for r in runs])) if runs else None,
        "steps_planned_mean": float(np.mean([r.planned_steps for r in runs])) if runs else None,
        "gpu_seconds": distribution(gpu),
        "gpu_seconds_total": float(sum(gpu)) if gpu else None,
        "gpu_seconds_reported": len(gpu),
    }


def summarize_target(result: TargetResult, scenario: Scenario) -> dict[str, Any]:
    """Everything the report says about one target."""
    classes: dict[str, Any] = {}
    runs: dict[str, Any] = {}
    for spec in scenario.classes:
        records = [r for r in result.requests if r.class_name == spec.name]
        classes[spec.name] = class_summary(records, spec.slo, result.wall_s)
        if spec.kind == "agent":
            runs[spec.name] = run_summary([r for r in result.runs if r.class_name == spec.name])
    good = sum(c["good"] for c in classes.values())
    sent = len(result.requests)
    return {
        "name": result.name,
        "url": result.url,
        "wall_s": result.wall_s,
        "requests": sent,
        "cancelled_at_drain": result.cancelled_at_drain,
        "max_send_lag_ms": result.max_send_lag_ms,
        "send_lag_ms": distribution(
            max(0.0, (r.send_s - r.scheduled_s) * 1e3) for r in result.requests
        ),
        "goodput_rps": good / result.wall_s if result.wall_s > 0 else 0.0,
        "slo_attainment_frac": good / sent if sent else None,
        "classes": classes,
        "runs": runs,
        "rejections": rejection_reasons(result.requests),
        "pools_seen": dict(sorted(Counter(r.pool for r in result.requests if r.pool).items())),
    }
