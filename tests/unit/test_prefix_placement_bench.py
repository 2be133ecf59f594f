"""benchmarks/prefix_placement.py's pure parts: several load levels in one report (the p90
ratios per level) and the engines' measured CPU use."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from benchmarks.prefix_placement import Result, engine_cpu_s, render_markdown, summarize


def _row(target: str, load: float, p90: float) -> dict[str, Any]:
    return {
        "target": target,
        "load_frac": load,
        "ok": 10,
        "requests": 10,
        "ttft_s": {"p50": p90 / 2, "p90": p90, "p99": p90 * 2},
        "engine_hit_frac": 0.5,
        "oracle_hit_frac": 0.9,
        "engine_cpu_frac": 0.62,
        "load_avg_1m": [0.4, 2.0],
    }


def test_the_report_gives_each_load_levels_p90_ratios() -> None:
    rows = [
        _row("gpupool-prefix", 0.4, 0.1),
        _row("vllm-router-round_robin", 0.4, 0.25),
        _row("gpupool-prefix", 0.8, 0.2),
        _row("vllm-router-round_robin", 0.8, 0.7),
    ]
    levels = [{"load_frac": 0.4}, {"load_frac": 0.8}]
    text = render_markdown({"setup": {"levels": levels}, "targets": rows})
    assert "- load 0.4: vllm-router-round_robin 2.50x" in text
    assert "- load 0.8: vllm-router-round_robin 3.50x" in text
    row = "| 0.8 | vllm-router-round_robin | 10/10 | 0.35 | 0.70 | 1.40 | -: - / - / - | - / - |"
    assert row in text
    assert "| 62% |" in text


def test_a_run_that_queues_up_shows_in_its_halves() -> None:
    results = [Result(i, 0, float(i), [], status=200, ttft_s=0.1 + i / 10) for i in range(20)]
    row = summarize("t", results, None, None, (0, 0, 0))
    first, second = row["ttft_p90_by_half_s"]
    assert first < 1.1 < second


def test_engine_cpu_seconds_come_from_the_pid_files(tmp_path: Path) -> None:
    (tmp_path / "engine-0.pid").write_text(f"{os.getpid()} 8100\n")
    (tmp_path / "engine-1.pid").write_text("999999999 8101\n")  # gone: counted as nothing
    before = engine_cpu_s(tmp_path)
    end = time.process_time() + 0.2
    while time.process_time() < end:  # burn some CPU in this "engine"
        pass
    # /proc counts user and system time in 10 ms ticks, each rounded down: up to 20 ms short
    # (0.05 s burnt once read 42.12 - 42.08, under 0.04 in floating point)
    assert engine_cpu_s(tmp_path) - before >= 0.15
    assert engine_cpu_s(tmp_path / "none") == 0.0


def test_the_steady_figures_leave_the_warm_up_out() -> None:
    # ten cold first prompts (1 s each) in the first 10 s, then 40 cached ones (0.1 s)
    cold = [Result(i, 0, float(i), [], status=200, ttft_s=1.0) for i in range(10)]
    warm = [Result(10 + i, 0, 10.0 + i, [], status=200, ttft_s=0.1) for i in range(40)]
    row = summarize("t", cold + warm, None, None, (0, 0, 0), warmup_s=10.0)
    assert row["steady_requests"] == 40
    assert row["ttft_steady_s"]["p90"] == 0.1
    assert row["ttft_s"]["p90"] == 1.0  # the whole run keeps them
    # the halves split the steady part (10-30 s, 30-50 s), not the whole run
    assert row["ttft_p90_by_half_s"] == [0.1, 0.1]
    rows = [
        {**_row("gpupool-prefix", 0.5, 1.0), "ttft_steady_s": {"p90": 0.1}},
        {**_row("vllm-router-round_robin", 0.5, 1.2), "ttft_steady_s": {"p90": 0.35}},
    ]
    text = render_markdown({"setup": {"levels": [{"load_frac": 0.5}]}, "targets": rows})
    whole, steady = text.split("after the warm-up")
    assert "vllm-router-round_robin 1.20x" in whole
    assert "vllm-router-round_robin 3.50x" in steady
