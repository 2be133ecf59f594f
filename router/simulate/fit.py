"""Engine latencies fitted from a real run's records (the harness's `records-*.jsonl`).

TPOT = a + b·n by least squares, where n is the number of the run's requests overlapping the
request on the same instance (mean over its lifetime, sampled at 5 points).

TTFT = c + prompt / R on the lower quartile (linear quantile regression): the harness's TTFT
includes the router's queue wait, which the simulator simulates itself, and the spikes of a
shared CPU box; the lower envelope is the engine's prefill. (Least squares, used before, put
the queue waits into R: 170,912 prompt tokens/s on the committed day-night run, where little
queued, 22,213 on agents ×3; the lower quartile gives 66,000 and 52,000. On a run whose router
queued most agent steps even the lower quartile is spoilt: fit on one that queued little.)
The residuals TTFT − prompt / R (c included) are kept per traffic class, and the simulator draws
each request's overhead from its class's (chat requests and agent steps see different tails).
Rough by design: the calibration says how rough.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from router.simulate.model import LatencyModel

__all__ = ["TTFT_QUANTILE", "fit_latency", "quantile_fit"]

TTFT_QUANTILE = 0.25


def quantile_fit(x: np.ndarray, y: np.ndarray, q: float, iterations: int = 100) -> np.ndarray:
    """Coefficients of the linear `q` quantile of y given the columns of x, by iteratively
    reweighted least squares (each residual weighted q or 1 − q over its size)."""
    coef: np.ndarray = np.linalg.lstsq(x, y, rcond=None)[0]
    for _ in range(iterations):
        r = y - x @ coef
        w = np.where(r >= 0, q, 1 - q) / np.maximum(np.abs(r), 1e-6)
        xw = x * w[:, None]
        coef = np.linalg.solve(x.T @ xw, xw.T @ y)
    return coef


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
                str(data.get("class_name") or ""),
            )
        )
    if len(rows) < 10:
        raise ValueError(f"{records_path}: too few completed requests to fit ({len(rows)})")
    ns, tpots, prompts, ttfts, classes = [], [], [], [], []
    for inst, start, end, ttft, e2e, out, prompt, class_name in rows:
        if out > 2:
            points = np.linspace(start + ttft, end, 5)
            load = [sum(1 for r in rows if r[0] == inst and r[1] <= t <= r[2]) for t in points]
            ns.append(float(np.mean(load)))
            tpots.append((e2e - ttft) / (out - 1))
        if prompt > 0:
            prompts.append(float(prompt))
            ttfts.append(ttft)
            classes.append(class_name)
    slope, intercept = np.polyfit(np.asarray(ns), np.asarray(tpots), 1)
    x = np.column_stack([np.asarray(prompts), np.ones(len(prompts))])
    per_token_s, fixed_s = quantile_fit(x, np.asarray(ttfts), TTFT_QUANTILE)
    per_token_s = max(float(per_token_s), 1e-6)
    residuals = [max(0.0, float(r)) for r in np.asarray(ttfts) - x[:, 0] * per_token_s]
    by_class: dict[str, list[float]] = {}
    for class_name, residual in zip(classes, residuals, strict=True):
        by_class.setdefault(class_name, []).append(residual)
    return LatencyModel(
        tpot_intercept_s=max(1e-4, float(intercept)),
        tpot_slope_s=max(0.0, float(slope)),
        prefill_tokens_per_s=1.0 / per_token_s,
        overhead_s=max(0.0, float(fixed_s)),
        overhead_samples_s=tuple(residuals),
        overhead_samples_by_class_s=tuple(
            (name, tuple(samples)) for name, samples in sorted(by_class.items()) if name
        ),
    )
