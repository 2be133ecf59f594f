"""Engine latencies fitted from a real run's records (the harness's `records-*.jsonl`).

TPOT = a + b·n by least squares, where n is the number of the run's requests overlapping the
request on the same instance (mean over its lifetime, sampled at 5 points); TTFT = c + prompt /
R by least squares gives the prefill rate R and an overhead c (HTTP, router, scheduling, and
on a busy CPU box the contention); the residuals are kept, and the simulator draws each
request's overhead from them (so TTFT keeps the measured tail). Rough by design: the
calibration says how rough.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from benchmarks.simulate.model import LatencyModel

__all__ = ["fit_latency"]


def fit_latency(records_path: Path) -> LatencyModel:
    rows = []
    for line in records_path.read_text().splitlines():
        data = json.loads(line)
        if data.get("type", "request") != "request" or data.get("status") != 200:
            continue
        if data.get("ttft_ms") is None or data.get("e2e_ms") is None:
            continue
        start = float(data["send_s"])
        rows.append(
            (
                data.get("instance"),
                start,
                start + data["e2e_ms"] / 1e3,
                data["ttft_ms"] / 1e3,
                data["e2e_ms"] / 1e3,
                int(data.get("output_tokens") or 0),
                int(data.get("prompt_tokens") or data.get("planned_prompt_tokens") or 0),
            )
        )
    if len(rows) < 10:
        raise ValueError(f"{records_path}: too few completed requests to fit ({len(rows)})")
    ns, tpots, prompts, ttfts = [], [], [], []
    for inst, start, end, ttft, e2e, out, prompt in rows:
        if out > 2:
            points = np.linspace(start + ttft, end, 5)
            load = [sum(1 for r in rows if r[0] == inst and r[1] <= t <= r[2]) for t in points]
            ns.append(float(np.mean(load)))
            tpots.append((e2e - ttft) / (out - 1))
        if prompt > 0:
            prompts.append(float(prompt))
            ttfts.append(ttft)
    slope, intercept = np.polyfit(np.asarray(ns), np.asarray(tpots), 1)
    per_token_s, overhead_s = np.polyfit(np.asarray(prompts), np.asarray(ttfts), 1)
    per_token_s = max(float(per_token_s), 1e-6)
    residuals = np.asarray(ttfts) - np.asarray(prompts) * per_token_s
    return LatencyModel(
        tpot_intercept_s=max(1e-4, float(intercept)),
        tpot_slope_s=max(0.0, float(slope)),
        prefill_tokens_per_s=1.0 / per_token_s,
        overhead_s=max(0.0, float(overhead_s)),
        overhead_samples_s=tuple(float(max(0.0, r)) for r in residuals),
    )
